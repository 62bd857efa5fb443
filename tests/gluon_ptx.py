"""Tests' helper: compile a Gluon kernel for sm_90 on any machine (no GPU needed) and return the
PTX of its main loop, for assertions on the instructions it issues.

The compile runs in a child process with ``TRITON_INTERPRET=0``: in a process where the interpreter
is on, Triton's standard library is replaced by interpreter stand-ins that Gluon cannot compile.
One child per test process imports Triton once and forks a fresh copy of itself for every compile
(importing torch and Triton costs about 3 s, most of a small compile), so no compile sees what an
earlier one changed.
``setup`` is Python source, run in the child after the imports below, that defines ``k`` (the
kernel), ``ptrs`` (pointer argument -> Triton type), ``const`` (constexpr argument -> value),
``div`` (arguments declared divisible by 16) and ``warps``, and may define ``opts`` (more compile
options, e.g. ``{"maxnreg": 96}``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

_HEAD = r"""
import json, os, re
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
"""

_COMPILE = r"""
for p in k.params:   # constexprs left out take their defaults
    if p.is_constexpr and p.has_default and p.name not in const:
        const[p.name] = p.default
names = k.arg_names
sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
src = GluonASTSource(k, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()},
                     attrs={(names.index(p),): [["tt.divisibility", 16]] for p in div})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": warps, **globals().get("opts", {})}).asm["ptx"]
"""


def loop_ptx(ptx: str, header: str = "Loop Header") -> str:
    """The basic blocks of the first loop in ``ptx`` whose header comment contains ``header``: the
    header and the blocks tagged ``in Loop: Header=<it>``."""
    blocks = re.split(r"^(?=\$L__BB\d+_\d+:)", ptx, flags=re.M)
    # (the header comment is on the label's line, or on the next when the label names the block)
    head = next(b for b in blocks if b.startswith("$L__BB") and header in "".join(b.splitlines()[:2]))
    name = head.split(":")[0][4:]
    return "".join(b for b in blocks if b is head or "Header=" + name + " " in b.splitlines()[0])


def main_loop_ptx(setup: str, header: str = "Loop Header") -> str:
    """The PTX of the first loop whose header comment contains ``header`` (skips the test when this
    Triton build has no sm_90 toolchain)."""
    return loop_ptx(_child(setup + _COMPILE + "\nprint(json.dumps(ptx))\n"), header)


_FORK_SERVER = r"""
import json, os, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import torch   # the kernels' modules import it; no CUDA is touched before the forks
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
for line in sys.stdin:
    code = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:   # the job, in a copy of this process: its own globals, its output in the files
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            rc = 0
            try:
                exec(compile(code, "<compile job>", "exec"), {"__name__": "__main__"})
            except BaseException:
                import traceback
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(errors="replace"),
                          "stderr": err.read().decode(errors="replace")}), flush=True)
"""
_server: subprocess.Popen | None = None


def _compile_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, TRITON_INTERPRET="0")
        _server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
    return _server


def _child(code: str):
    """Run ``code`` after the imports in a child process; its last printed line, as JSON."""
    server = _compile_server()
    server.stdin.write(json.dumps(_HEAD + code) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()
    assert line, "the compile server exited"
    r = json.loads(line)
    if r["rc"] and "ptxas" in r["stderr"] and "not found" in r["stderr"].lower():   # pragma: no cover
        pytest.skip("no sm_90 toolchain in this Triton build")
    assert r["rc"] == 0, r["stderr"][-3000:]
    return json.loads(r["stdout"].strip().splitlines()[-1])


_PTXAS_TAIL = _COMPILE + r"""
import subprocess, tempfile
try:   # the ptxas Triton itself uses for sm_90 (newer Triton: a separate binary)
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
except Exception:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
args = [[n, sig[n]] for n in names if n not in const]
if not os.path.exists(ptxas):
    print(json.dumps({"ptx": ptx, "log": "", "rc": None, "args": args}))
else:
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    print(json.dumps({"ptx": ptx, "log": r.stdout + r.stderr, "rc": r.returncode, "args": args}))
"""


def ptxas_report(setup: str) -> dict:
    """Compile like :func:`main_loop_ptx`, then run Triton's bundled ``ptxas -v`` on the whole PTX:
    ``{"ptx", "log", "rc", "args"}`` (the log has registers, spills and performance warnings such as
    C7513; ``args``: the kernel's runtime arguments in order, ``[name, type]``)."""
    out = _child(setup + _PTXAS_TAIL)
    if out["rc"] is None:   # pragma: no cover
        pytest.skip("no ptxas binary in this Triton build")
    return out


_SASS_TAIL = _COMPILE.replace('.asm["ptx"]', '.asm["cubin"]') + r"""
import base64, glob, subprocess, tempfile
tools = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))
if not tools:
    print(json.dumps(None))
else:
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.cubin"), "wb").write(ptx)
        r = subprocess.run([tools[0], "-c", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    print(json.dumps(r.stdout))
"""


def sass(setup: str) -> str:
    """Compile like :func:`main_loop_ptx` and disassemble the cubin with Triton's bundled ``nvdisasm``."""
    out = _child(setup + _SASS_TAIL)
    if out is None:   # pragma: no cover
        pytest.skip("no nvdisasm binary in this Triton build")
    return out


_NOT_A_WRITE = ("ST", "BAR", "SYNCS", "HGMMA", "WARPGROUP", "BRA", "BRX", "RED", "MEMBAR", "FENCE", "EXIT",
                "WARPSYNC", "NOP", "DEPBAR", "ISETP", "FSETP", "PLOP3", "R2UR", "UMOV", "ULDC")


def _written(ins: str) -> set[int]:
    """Registers an instruction writes (its first operand, widened for 64/128-bit forms)."""
    m = re.match(r"(@!?U?P\d+\s+)?([A-Z][A-Z0-9_.]*)\s+R(\d+)\b", ins)
    if not m or m.group(2).startswith(_NOT_A_WRITE):
        return set()
    op, base = m.group(2), int(m.group(3))
    n = 4 if (".128" in op or ".x4" in op.lower()) else 2 if (".64" in op or ".WIDE" in op or ".x2" in op.lower()) else 1
    return set(range(base, base + n))


def inflight_a_writes(sass_text: str) -> list[str]:
    """Instructions that write a register of an in-flight ``wgmma``'s A operand (register A
    ``HGMMA`` not yet retired by a ``WARPGROUP.DEPBAR``), inside each loop of ``sass_text`` taken
    twice (so a wgmma left in flight at the end of one iteration meets the next's writes)."""
    lines = sass_text.splitlines()
    ins = [(i, m.group(1).strip()) for i, l in enumerate(lines)
           for m in [re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", l)] if m]
    labels = {l.split(":")[0]: i for i, l in enumerate(lines) if re.match(r"\.L_x_\d+:", l)}
    bad = []
    for k, (li, t) in enumerate(ins):
        m = re.search(r"BRA\s+`?\((\.L_x_\d+)\)", t)
        if not m or labels.get(m.group(1), li) >= li:
            continue
        body = [x for x in ins if labels[m.group(1)] < x[0] <= li]
        groups: list[set[int]] = []   # A registers per committed or open wgmma group, oldest first
        cur: set[int] = set()
        for _, t2 in body + body:
            if "HGMMA" in t2:
                a = re.match(r"(?:@!?U?P\d+\s+)?HGMMA\S*\s+R\d+,\s*R(\d+)", t2)
                if a:
                    cur |= set(range(int(a.group(1)), int(a.group(1)) + 4))
                if "gsb0" in t2:
                    groups.append(cur)
                    cur = set()
                continue
            d = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x(\d+)", t2)
            if d:
                keep = int(d.group(1), 16)
                groups = groups[len(groups) - keep:] if keep else []
                continue
            hit = _written(t2) & set().union(*groups, cur)
            if hit:
                bad.append(t2)
    return bad


def _param_names(args: list) -> list[str | None]:
    """The pointer or tensor-descriptor argument each PTX kernel parameter belongs to, in parameter
    order (None: a scalar): a descriptor is its 128-byte map then its shape (i32) and strides
    (i64), one each per dimension."""
    out: list[str | None] = []
    for name, sig in args:
        if sig.startswith("tensordesc"):
            out += [name] * (1 + 2 * (sig.split("[", 1)[1].split("]")[0].count(",") + 1))
        else:
            out.append(name if sig.startswith("*") else None)
    return out


_ACCESS = re.compile(r"\b(ld\.global|ld\.volatile\.global|st\.global|atom\.global|red\.global|prefetch\.global|"
                     r"cp\.async\.(?:ca|cg)\.shared|cp\.async\.bulk\.(?:tensor|prefetch|shared))")
_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+([^;]*);", re.M)


def global_accesses(setup: str) -> tuple[list, list[int], bool]:
    """Compiled ``setup``: every global-memory access of the PTX as ``(offset, instruction, {pointer
    and descriptor arguments its address derives from})``, the offsets of ``griddepcontrol.wait``,
    and whether the kernel lets its dependents launch early (``griddepcontrol.launch_dependents``).
    Registers are traced through their definitions (all of them, to a fixed point) back to the
    kernel's parameters; a value loaded from memory derives from nothing."""
    rep = ptxas_report(setup)
    ptx, names = rep["ptx"], _param_names(rep["args"])
    param = re.compile(r"_param_(\d+)\b")
    defs: dict[str, set] = {}
    instrs = [(m.start(), m.group(1), m.group(2)) for m in _INSTR.finditer(ptx)]
    changed = True
    while changed:
        changed = False
        for _, op, rest in instrs:
            dst = re.match(r"\s*(%\w+)\s*,", rest)
            if not dst or _ACCESS.match(op) or op.startswith(("ld.shared", "mbarrier", "setp", "st.")):
                continue
            src = rest[dst.end():]
            got = {int(i) for i in param.findall(src)} if op.startswith(("ld.param", "mov", "cvta")) else set()
            if not op.startswith("ld.") or op.startswith("ld.param"):
                for r in re.findall(r"%\w+", src):
                    got |= defs.get(r, set())
            if not got <= defs.get(dst.group(1), set()):
                defs[dst.group(1)] = defs.get(dst.group(1), set()) | got
                changed = True
    accesses = []
    for off, op, rest in instrs:
        if _ACCESS.match(op):
            regs = [r for b in re.findall(r"\[([^\]]*)\]", rest) for r in re.findall(r"%\w+", b)]
            accesses.append((off, f"{op} {rest}", {names[i] for r in regs for i in defs.get(r, ()) if names[i]}))
    return (accesses, [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)],
            "griddepcontrol.launch_dependents" in ptx)


def waits_before_any_global_access(setup: str) -> bool:
    """Compiled ``setup`` (with the kernel's ``PDL=True``): ``griddepcontrol.wait`` comes before its
    first global-memory access, and the kernel does not trigger its dependents."""
    accesses, waits, triggers = global_accesses(setup)
    return bool(waits) and all(off > waits[0] for off, _, _ in accesses) and not triggers
