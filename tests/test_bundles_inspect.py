"""Static inspection rules (AST only) on small source trees, and on the real wheel."""

from __future__ import annotations

import pytest

from specpilot.bundles.inspect_sglang import SGLangSource, check_hook, check_symbol, check_targets
from specpilot.bundles.memory import Hook, Symbol, load_memory
from sglang_support import SKIP_REASON, sglang_dir

SRC = '''
import os
from .other import imported_name
if os.environ.get("X"):
    def maybe(a, b):
        pass
else:
    def maybe(a, b, c=1):
        pass

def f(a, b, *, c, d=2, **kw):
    pass

def g(a, /, b, *args, e=None):
    pass

TABLE = {}

class C:
    ATTR: int = 3

    def m(self, x, y=None):
        def inner():
            return 1
        if x:
            return x, y
        return x, y

    def n(self):
        if self:
            return 1, 2
        return 3

    @classmethod
    def k(cls, z):
        pass

    class Inner:
        def deep(self):
            pass
'''


@pytest.fixture
def src(tmp_path):
    pkg = tmp_path / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(SRC)
    return SGLangSource(tmp_path)


@pytest.mark.parametrize("target, params, match, ok", [
    ("sglang.srt.mod.f", ("a", "b", "*", "c", "d", "**kw"), "exact", True),
    ("sglang.srt.mod.f", ("a", "b", "*", "c"), "prefix", True),       # the rest is defaulted
    ("sglang.srt.mod.f", ("a", "b"), "prefix", False),                # c is keyword-only, required
    ("sglang.srt.mod.f", ("a", "c"), "prefix", False),
    ("sglang.srt.mod.g", ("a", "/", "b", "*args", "e"), "exact", True),
    ("sglang.srt.mod.C.m", ("self", "x"), "prefix", True),
    ("sglang.srt.mod.C.m", ("self", "x"), "exact", False),
    ("sglang.srt.mod.C.k", ("cls", "z"), "exact", True),
    ("sglang.srt.mod.C.Inner.deep", ("self",), "exact", True),
    ("sglang.srt.mod.maybe", ("a", "b", "c"), "exact", False),        # the if-branch (a, b) may run
    ("sglang.srt.mod.maybe", ("a", "b"), "prefix", True),             # both definitions accept it
])
def test_signature_rules(src, target, params, match, ok):
    res = check_hook(src, Hook(target, "around", "x:y", params, match))
    assert res.ok is ok, res.problem


@pytest.mark.parametrize("target, problem", [
    ("sglang.srt.nope.f", "nope not defined in module sglang.srt (no such name or submodule)"),
    ("other.mod.f", "module not found"),
    ("sglang.srt.mod.missing", "missing not defined in module sglang.srt.mod"),
    ("sglang.srt.mod.C.missing", "missing not defined in class C"),
    ("sglang.srt.mod.f.inner", "is a function, not a class"),
    ("sglang.srt.mod.TABLE", "is a name"),
    ("sglang.srt.mod.C", "is a class"),
    ("sglang.srt.mod.imported_name", "is a import"),
])
def test_bad_targets(src, target, problem):
    res = check_hook(src, Hook(target, "replace", "x:y"))
    assert not res.ok and problem in res.problem


def test_return_shapes(src):
    assert check_hook(src, Hook("sglang.srt.mod.C.m", "after", "x:y", returns=("x", "y"))).ok
    res = check_hook(src, Hook("sglang.srt.mod.C.m", "after", "x:y", returns=("y", "x")))
    assert not res.ok and "returns (x, y); the hook expects (y, x)" in res.problem
    res = check_hook(src, Hook("sglang.srt.mod.C.n", "after", "x:y", returns=("a", "b")))
    assert not res.ok and "returns" in res.problem
    res = check_hook(src, Hook("sglang.srt.mod.f", "after", "x:y", returns=("a",)))
    assert not res.ok and "returns nothing" in res.problem


def test_symbols(src):
    assert check_symbol(src, Symbol("sglang.srt.mod.TABLE")).ok
    assert check_symbol(src, Symbol("sglang.srt.mod.C.ATTR")).ok
    assert check_symbol(src, Symbol("sglang.srt.mod.C", kind="class")).ok
    assert not check_symbol(src, Symbol("sglang.srt.mod.TABLE", kind="class")).ok
    assert check_symbol(src, Symbol("sglang.srt.mod.imported_name")).ok


@pytest.mark.skipif(sglang_dir() is None, reason=SKIP_REASON)
def test_every_bundle_target_resolves_in_the_real_wheel():
    entries = load_memory()
    for e in entries.values():
        if e.status == "library":
            continue
        checks = check_targets(sglang_dir(), e.hooks, e.symbols)
        assert checks and all(c.ok for c in checks), [(c.target, c.problem) for c in checks if not c.ok]
        assert all(c.file_sha256.startswith("sha256:") for c in checks)


@pytest.mark.parametrize("tail, problem", [
    (b"def broken(:\n", "does not parse (invalid syntax, line"),
    (b"\xff\xfe\x00", "does not parse (source code string cannot contain null bytes)"),
])
def test_a_target_file_that_does_not_parse_is_a_problem(src, tail, problem):
    path = src.root / "sglang" / "srt" / "mod.py"
    path.write_bytes(path.read_bytes() + tail)
    for res in (check_hook(src, Hook("sglang.srt.mod.f", "replace", "x:y")), check_symbol(src, Symbol("sglang.srt.mod.C"))):
        assert not res.ok and res.problem.startswith(f"target {path} ") and problem in res.problem


def test_a_file_is_parsed_once_per_content_across_checks(src, monkeypatch):
    """Checks in one process (a round applies bundles for each SGLang candidate) parse a file once
    for each content it has had: the same bytes again are not parsed again, changed bytes are."""
    import ast

    from specpilot.bundles import inspect_sglang

    parsed, real = [], ast.parse

    def parse(*a, **kw):
        if str(kw.get("filename", "")).endswith("mod.py"):
            parsed.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(inspect_sglang.ast, "parse", parse)
    hook = Hook("sglang.srt.mod.C.m", "replace", "x:y")
    sym = Symbol("sglang.srt.mod.f", "function", ("a", "b", "*", "c", "d", "**kw"), "exact")
    assert all(c.ok for c in check_targets(src.root, [hook], [sym])) and len(parsed) == 1
    assert all(c.ok for c in check_targets(src.root, [hook], [sym])) and len(parsed) == 1
    path = src.root / "sglang" / "srt" / "mod.py"
    path.write_text(SRC.replace("def f(a, b, *, c, d=2, **kw):", "def f(a, b, *, c, d=3, **kw):"))
    assert check_targets(src.root, [hook], [sym])[1].ok and len(parsed) == 2   # same signature, new bytes
    path.write_text(SRC.replace("def f(a, b, *, c, d=2, **kw):", "def f(a, *, c, d=2, **kw):"))
    got = check_targets(src.root, [hook], [sym])
    assert len(parsed) == 3 and not got[1].ok and got[1].signature.startswith("(a, *, c")
