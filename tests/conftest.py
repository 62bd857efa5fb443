"""Shared test setup: markers, CLI runner helper, paths to the shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The repository root holds the package's folders (kernels/, engine/, ...) under their installed
# names specpilot.*; on sys.path (``python -m pytest`` puts the working directory there) its
# kernels/ would shadow Hugging Face's ``kernels`` package, which transformers imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
SHARED = Path(os.environ.get("SPECPILOT_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"
LOCAL_FIXTURES = REPO / "tests" / "fixtures"


def _device_calls_skip_the_language_patch() -> None:
    """Under Triton's interpreter every call of a ``@triton.jit`` function inside a kernel (our
    helpers, and ``tl.sum``/``tl.max``, themselves jit functions) re-patches the language modules
    its source sees (``inspect.getmembers`` over them, about 0.3 ms), although the patch is already
    in force: the kernel's launch patched ``triton.language`` for the whole grid, and a helper's
    patch (of ``triton.language.core``, say) is never undone. In the GDN kernels' loops that is most
    of the CPU suite's interpreter time. Here a call patches only modules not yet patched during its
    launch; anything outside a launch takes Triton's own path."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # no triton, or not the interpreter this targets
        return
    if not all(hasattr(ti, n) for n in ("InterpretedFunction", "GridExecutor", "InterpreterError", "tl", "_patch_lang")):
        return
    import inspect
    import threading

    call, run = ti.InterpretedFunction.__call__, ti.GridExecutor.__call__
    src = inspect.getsource(call)
    if "_patch_lang(self.fn)" not in src or "restore" in src:   # a Triton that undoes a helper's patch
        return
    launch = threading.local()
    seen: dict = {}

    def langs(fn):
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                 if inspect.ismodule(v) and v in (ti.tl, ti.tl.core))
        return seen[fn]

    def grid_call(self, *args, **kwargs):
        outer = getattr(launch, "langs", None)
        launch.langs = set(langs(self.fn))
        try:
            return run(self, *args, **kwargs)
        finally:
            launch.langs = outer

    def device_call(self, *args, **kwargs):
        patched = getattr(launch, "langs", None)
        if patched is None:
            return call(self, *args, **kwargs)
        need = langs(self.fn)
        if not need <= patched:
            ti._patch_lang(self.fn)   # what Triton's own call does first
            patched |= need
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = grid_call, device_call


def _element_dtypes_looked_up_once() -> None:
    """Triton's interpreter finds a value's numpy dtype (``_get_np_dtype``, several times in every
    interpreted operation) by building its table of element types anew on every call: about a tenth
    of the GDN kernels' interpreter time. Here each element type is looked up in it once (pointers,
    its first case, take its own path); a block type's dtype is its element type's, as there."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        return
    import inspect

    find = getattr(ti, "_get_np_dtype", None)
    if find is None or "np_types = {" not in inspect.getsource(find) or not hasattr(ti.tl, "block_type"):
        return
    found: dict = {}
    block, pointer = ti.tl.block_type, ti.tl.pointer_type

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):   # the table's first case, before it is built
            return find(tt_dtype)
        try:
            return found[tt_dtype]
        except KeyError:
            found[tt_dtype] = got = find(tt_dtype)
            return got

    ti._get_np_dtype = np_dtype


def _no_overflow_checks_whose_assert_is_off() -> None:
    """Triton's interpreter checks every 32-bit integer ``+``, ``-`` and ``*`` for overflow (the
    operation again in 64 bits, two comparisons) and hands the result to ``device_assert``, which
    does nothing unless the interpreter runs with ``debug`` (it does not here): a fifth to a half of
    the kernels' interpreter time for a check that cannot fail. Here the check is left out while its
    assert is off, and runs as before when it is on."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        return
    import inspect

    sem = getattr(ti, "interpreter_semantic", None)
    check, assert_ = (getattr(type(sem), n, None) for n in ("binary_op_sanitize_overflow_impl", "device_assert"))
    if check is None or assert_ is None:
        return
    if "self.device_assert(" not in inspect.getsource(check) or \
            "if not self.builder.options.debug:\n            return" not in inspect.getsource(assert_):
        return   # another Triton: keep its checks

    def overflow_check(lhs, rhs, binary_op):
        if sem.builder.options.debug:
            check(sem, lhs, rhs, binary_op)

    sem.binary_op_sanitize_overflow_impl = overflow_check


def _broadcasts_without_new_blocks() -> None:
    """Triton's ``broadcast_impl_value`` compares a block's shape (a tuple) with the shape it built
    (a list), which are never equal, so every operation on two blocks of one shape broadcasts both
    to that shape first (two more interpreted operations), and a scalar meeting a block is splatted
    through two new block types. Here two blocks of one shape go on as they are (a broadcast to a
    block's own shape is the block itself), a scalar is splatted through one block type per shape,
    and everything else takes Triton's path: the mixed-bucket, GDN-row and fused-decode tests took
    32 s instead of 38."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        return
    import inspect

    sem = getattr(ti, "interpreter_semantic", None)
    impl = getattr(type(sem), "broadcast_impl_value", None)
    if impl is None or "if lhs_shape != ret_shape:" not in inspect.getsource(impl):
        return

    types: dict = {}

    def splat(x, shape):
        scalar = x.type.scalar
        if scalar.is_ptr():   # unhashable: a type of its own each time, as in Triton
            ty = ti.tl.block_type(scalar, list(shape))
        else:
            ty = types.get((scalar, shape))
            if ty is None:
                ty = types[scalar, shape] = ti.tl.block_type(scalar, list(shape))
        return sem.make_tensor(sem.builder.create_splat(ty, x.handle), ty)

    def broadcast(lhs, rhs):
        lb, rb = lhs.type.is_block(), rhs.type.is_block()
        if lb and rb and lhs.type.shape == rhs.type.shape:
            return lhs, rhs
        if lb and not rb:
            return lhs, splat(rhs, lhs.type.shape)
        if rb and not lb:
            return splat(lhs, rhs.type.shape), rhs
        return impl(sem, lhs, rhs)

    sem.broadcast_impl_value = broadcast


def _tensor_shapes_made_once() -> None:
    """Every interpreted operation makes its result through ``tl.tensor.__init__``, which wraps each
    dimension of the shape, and the element count, in a new ``constexpr``: about a tenth of the
    mixed-bucket test's interpreter time. Here the interpreter's tensors take those wrappers (never
    changed) from one made per shape; the attributes are the ones ``__init__`` sets."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        return
    import inspect
    import math

    sem, tl = getattr(ti, "interpreter_semantic", None), ti.tl
    init = inspect.getsource(tl.tensor.__init__)
    body = [ln.strip() for ln in init.split('"""')[-1].splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if getattr(sem, "tensor", None) is not tl.tensor or body != [
            "super().__init__()", "self.handle = handle", "self.shape = type.shape if type.is_block() else ()",
            "self.numel = constexpr(math.prod(self.shape))", "self.type = type  # Tensor type (can be block_type)",
            "self.dtype = type.scalar", "self.shape = tuple([constexpr(s) for s in self.shape])"]:
        return
    shapes: dict = {}
    new = object.__new__

    def make_tensor(handle, type):
        dims = tuple(type.shape) if type.is_block() else ()
        made = shapes.get(dims)
        if made is None:   # (in Triton's core module ``tuple`` is its own tl.tuple)
            made = shapes[dims] = (tl.core.tuple([tl.constexpr(d) for d in dims]), tl.constexpr(math.prod(dims)))
        t = new(tl.tensor)
        t.handle, t.type, t.dtype = handle, type, type.scalar
        t.shape, t.numel = made
        return t

    sem.make_tensor = make_tensor


def _sigint_delivered() -> None:
    """A shell starts a background job (``pytest ... &``) with SIGINT ignored, and every process the
    tests start inherits that, so the tests that send SIGINT would see it do nothing. The tests
    run with SIGINT delivered, as from a terminal."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_sigint_delivered()


def _one_torch_thread_per_worker() -> None:
    """Under pytest-xdist every worker is a process of its own: torch's default of a thread per core
    in each of them oversubscribes the cores, and OpenMP's spinning threads made small engine steps
    20x slower than alone (a batch decoder's warm-up: 14 s against 0.5 s). A test that needs more
    threads sets them itself."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


_one_torch_thread_per_worker()

import specpilot.kernels.triton_env  # noqa: E402,F401  (chooses the interpreter before triton loads)

_device_calls_skip_the_language_patch()
_element_dtypes_looked_up_once()
_no_overflow_checks_whose_assert_is_off()
_broadcasts_without_new_blocks()
_tensor_shapes_made_once()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def own_folder(tmp_path, monkeypatch):
    """The test's working folder is its own: ``compare`` keeps its partial file there by default,
    and tests running at once in other workers must never find one another's."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def run_cli():
    """Run ``specpilot ARGS`` in-process the way a user does; returns (exit_code, stdout, stderr)."""
    from specpilot.cli import main

    def _run(*args, input=None):
        import io
        import sys

        out, err = io.StringIO(), io.StringIO()
        old = sys.stdout, sys.stderr, sys.stdin
        sys.stdout, sys.stderr = out, err
        if input is not None:
            sys.stdin = io.StringIO(input)
        code = 0
        try:
            main(list(map(str, args)))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.stdout, sys.stderr, sys.stdin = old
        return code, out.getvalue(), err.getvalue()

    return _run


NO_SHARED = "shared fixtures not found at"


@pytest.fixture(scope="module")
def loadgen():
    """``benchmarks/loadgen.py`` as a module (it is a script beside the package, not in it)."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import loadgen as mod
    finally:
        sys.path.remove(bench)
    return mod


@pytest.fixture
def fixtures_dir():
    """``../shared/fixtures``: real traces of other projects, which this repository does not keep."""
    if not FIXTURES.is_dir():
        pytest.skip(f"{NO_SHARED} {FIXTURES}")
    return FIXTURES


def pytest_terminal_summary(terminalreporter):
    """Say it aloud when the real-trace tests did not run: -q shows only a skip count."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if NO_SHARED in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests of real traces skipped: {NO_SHARED} {FIXTURES} "
                                    "(set SPECPILOT_SHARED to the folder holding fixtures/)", yellow=True)


def one_error(err: str) -> str:
    """The one ``specpilot: error:`` line of a failed run's stderr (status lines such as
    ``specpilot: loading model ...`` may come before it; nothing else may)."""
    lines = err.splitlines()
    errors = [ln for ln in lines if ln.startswith("specpilot: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert all(ln.startswith("specpilot: ") for ln in lines) and "Traceback" not in err, err
    return errors[0]


def refused(code: int, err: str, *parts: str) -> str:
    """A refusal: exit 2 and one ``specpilot: error:`` line (:func:`one_error`) holding each of
    ``parts``; returns the line."""
    assert code == 2, err
    line = one_error(err)
    for p in parts:
        assert p in line, err
    return line


_IMPORTED = ("import sys\nfrom specpilot.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    code = e.code\nelse:\n    code = 0\nprint('\\n' + repr((code, sorted(m for m in ('torch', 'transformers') "
             "if m in sys.modules))))\n")


def cli_imports(*args, cwd=None) -> tuple[int, str, str, list[str]]:
    """``specpilot ARGS`` in a fresh process: (exit code, stdout, stderr, which of torch and
    transformers it imported). Bad input a command can see without them is refused before them
    (each costs seconds)."""
    import ast
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _IMPORTED, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    out, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    code, imported = ast.literal_eval(last)
    return code, out, proc.stderr, imported
