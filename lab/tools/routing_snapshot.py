"""Snapshot of what the routed kernels launch, taken on the CPU (no GPU): for every layer shape and
row count, the kernel ``w12_linear`` (no config) launches on a pretend sm_90 / sm_80 / sm_75 device
with its constexprs, compile options, specialization and grid; the same for the fused one-row decode
kernels and the certified LM head's tile. Optionally the PTX of every distinct launch.

    python lab/tools/routing_snapshot.py --out /tmp/routing.json [--ptx /tmp/ptx_dir]

Two snapshots of the same code are identical; a reorganization of ``kernels/`` must leave the file
(and the PTX, debug lines aside) unchanged. How it works: ``TRITON_INTERPRET=0``, a stand-in Triton
driver that reports the chosen GPU target, CPU tensors that say they are CUDA tensors, and
``JITFunction.run`` turned into a warm-up whose compile step records its inputs instead of compiling.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

ARCHS = (90, 80, 75)
ROWS = list(range(1, 65)) + [96, 128, 256]

# the layers of the tuning tables, the models of tests/model_configs.py and the benchmarks, SmolLM2
# and a grid of other sizes (the heuristics)
TABLE_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (7168, 5120), (34816, 5120),
                (5120, 17408), (1024, 4096), (14336, 4096)]
MODEL_SHAPES = [(8192, 2048), (4096, 2048), (2048, 4096), (12288, 2048), (512, 2048), (2048, 512),
                (1024, 2048), (64, 2048), (960, 576), (576, 576), (3072, 576), (576, 1536)]
GRID_N = (64, 192, 1000, 1536, 3072, 8192, 16384, 20000)
GRID_K = (64, 1536, 2048, 8192)
SHAPES = TABLE_SHAPES + MODEL_SHAPES + [(n, k) for n in GRID_N for k in GRID_K]

# fused decode: (epilogue, N, K, extra) for Llama-3.1-8B, a 2048-wide model and SmolLM2-135M
DECODE = [("rope", 32, 8, 128, 4096), ("resid", 4096, 4096), ("silu", 14336, 4096), ("resid", 4096, 14336),
          ("rope", 16, 4, 128, 2048), ("resid", 2048, 2048), ("silu", 5632, 2048), ("resid", 2048, 5632),
          ("rope", 9, 3, 64, 576), ("resid", 576, 576), ("silu", 1536, 576), ("resid", 576, 1536)]


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is a CUDA tensor (the launchers only look)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


def fake(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(FakeCuda, t)


def _patch_factories():
    """torch.empty/zeros/full/... with a CUDA device allocate on the CPU and return a FakeCuda."""
    for name in ("empty", "zeros", "full", "ones", "empty_strided"):
        real = getattr(torch, name)

        def wrap(*a, _real=real, **kw):
            dev = kw.get("device")
            if dev is not None and torch.device(dev).type == "cuda":
                kw["device"] = "cpu"
                return fake(_real(*a, **kw))
            return _real(*a, **kw)

        setattr(torch, name, wrap)


class Driver:
    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.arch      # a device id per arch: the binders are cached per device

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


STATE = {"arch": 90, "launches": [], "grid": None}
KEEP: dict = {}   # launch key -> (jit function, signature, constexprs, options, attrs, target)
LAUNCHES: dict = {}   # launch key -> what was launched (kernel, constexprs, signature, options)


def _norm(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return repr(v)


def _install():
    import triton
    from triton.runtime import jit as J

    real_run = J.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        STATE["grid"] = grid
        return real_run(self, *args, grid=grid, warmup=True, **kwargs)

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        opts = {k: _norm(v) for k, v in sorted(options.__dict__.items()) if k not in ("extern_libs",)}
        rec = {"kernel": self.fn.__name__, "arch": STATE["arch"],
               "constexprs": {str(self.arg_names[p[0]]) + ("" if len(p) == 1 else str(p[1:])): _norm(v)
                              for p, v in sorted(constexprs.items())},
               "signature": {k: _norm(v) for k, v in signature.items()},
               "attrs": {str(self.arg_names[p[0]]): _norm(v) for p, v in sorted(attrs.items())},
               "options": opts}
        lkey = hashlib.sha1(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16]
        KEEP.setdefault(lkey, (self, signature, constexprs, options, attrs, self.device_caches[device][2]))
        grid = STATE["grid"]
        LAUNCHES.setdefault(lkey, rec)
        STATE["launches"].append({"launch": lkey, "kernel": rec["kernel"], "grid": list(grid) if grid else None})
        return object()

    J.JITFunction.run = run
    J.JITFunction._do_compile = do_compile
    STATE["triton"] = triton


def set_arch(arch: int):
    from triton.runtime.driver import driver

    STATE["arch"] = arch
    driver.set_active(Driver(arch))
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)

    class Props:
        multi_processor_count = 132 if arch == 90 else 108 if arch == 80 else 40
        name = f"pretend sm_{arch}"

    torch.cuda.get_device_properties = lambda *a, **k: Props()
    torch.cuda.current_device = lambda: 0
    for name, mod in list(sys.modules.items()):   # caches of the previous arch (capabilities, tables)
        if name.startswith("specpilot.kernels") and mod is not None:
            for v in list(vars(mod).values()):
                if hasattr(v, "cache_clear") and callable(v):
                    v.cache_clear()


def _import(*paths):
    """The first importable ``module:attr`` of ``paths`` (the layout before and after a move)."""
    import importlib

    for p in paths:
        mod, _, attr = p.partition(":")
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, attr):
            return getattr(m, attr)
    raise ImportError(f"none of {paths}")


def fake_pack(n: int, k: int):
    KernelPack = _import("specpilot.kernels.w12.pack:KernelPack", "specpilot.kernels.w12.gemm:KernelPack")
    rec = torch.zeros(4 * 3072, dtype=torch.int32)
    kp = KernelPack((n, k), ((n + 127) // 128) * 128, fake(rec.view(torch.int64)), fake(rec),
                    fake(torch.zeros(n, dtype=torch.uint8)), fake(torch.zeros(n + 1, dtype=torch.int32)),
                    fake(torch.zeros(8, dtype=torch.int32)), fake(torch.zeros(8, dtype=torch.int32)),
                    fake(torch.zeros(8, dtype=torch.float32)), fake(torch.zeros(8, dtype=torch.float32)), 1)
    return kp


def take() -> list:
    out = STATE["launches"]
    STATE["launches"] = []
    return out


def snapshot_linear(arch: int) -> dict:
    w12_linear = _import("specpilot.kernels.w12.routing:w12_linear", "specpilot.kernels.w12.gemm:w12_linear")
    res = {}
    for n, k in SHAPES:
        kp = fake_pack(n, k)
        for m in ROWS:
            x = fake(torch.zeros(m, k, dtype=torch.bfloat16))
            try:
                w12_linear(x, kp)
                res[f"{n}x{k}@{m}"] = take()
            except Exception as e:   # recorded: a failure must stay a failure
                take()
                res[f"{n}x{k}@{m}"] = {"error": f"{type(e).__name__}: {e}"}
    return res


def snapshot_decode(arch: int) -> dict:
    import importlib

    G = importlib.import_module("specpilot.kernels.decode.gemv")
    res = {}
    for case in DECODE:
        epi = case[0]
        for w12 in (False, True):
            if epi == "rope":
                nh, nkv, hd, k = case[1:]
                n = (nh + 2 * nkv) * hd
            elif epi == "silu":
                inter, k = case[1:]
                n = 2 * inter
            else:
                n, k = case[1:]
            w = fake_pack(n, k) if w12 else fake(torch.zeros(n, k, dtype=torch.bfloat16))
            x = fake(torch.zeros(1, k, dtype=torch.bfloat16))
            g = fake(torch.zeros(k, dtype=torch.bfloat16))
            try:
                if epi == "resid":
                    G.gemv_residual(x, w, fake(torch.zeros(1, n, dtype=torch.bfloat16)))
                elif epi == "silu":
                    G.norm_gate_up_silu(x, g, 1e-5, w, inter)
                else:
                    pos = fake(torch.zeros(1, dtype=torch.int32))
                    cos = fake(torch.zeros(64, hd, dtype=torch.float32))
                    kc = fake(torch.zeros(nkv, 64, hd, dtype=torch.bfloat16))
                    G.norm_qkv_rope_store(x, g, 1e-5, w, cos, fake(torch.zeros(64, hd, dtype=torch.float32)), pos,
                                          pos, kc, fake(torch.zeros(nkv, 64, hd, dtype=torch.bfloat16)), nh, nkv)
                res[f"{epi}-{n}x{k}-{'w12' if w12 else 'bf16'}"] = take()
            except Exception as e:
                take()
                res[f"{epi}-{n}x{k}-{'w12' if w12 else 'bf16'}"] = {"error": f"{type(e).__name__}: {e}"}
    return res


def snapshot_lm_head() -> dict:
    CertifiedHead = _import("specpilot.kernels.lm_head.certified:CertifiedHead")
    head = object.__new__(CertifiedHead)
    head.fixed = None
    head.arch = None
    return {str(m): list(head.tile(m)) for m in ROWS}


def strip_debug(ptx: str) -> str:
    """PTX without debug and line information (``.loc``, ``.file``, the ``.debug_*`` sections)."""
    ptx = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    keep = [ln for ln in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file)\b", ln)
            and not re.match(r"\s*\$L__(tmp|func_begin|func_end)\d+:", ln)]
    return "\n".join(keep) + "\n"


def compile_ptx(out_dir: Path) -> dict:
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for i, (lkey, (fn, signature, constexprs, options, attrs, target)) in enumerate(sorted(KEEP.items())):
        path = out_dir / f"{lkey}.ptx"
        if path.exists():
            done[lkey] = path.name
            continue
        pid = os.fork()   # a child per compile: an LLVM error aborts the process
        if pid == 0:
            code = 0
            try:
                src = fn.ASTSource(fn, signature, constexprs, attrs)
                ptx = triton.compile(src, target=target, options=options.__dict__).asm["ptx"]
                path.write_text(strip_debug(ptx))
            except Exception as e:
                (out_dir / f"{lkey}.error").write_text(f"{type(e).__name__}: {str(e)[:2000]}")
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if path.exists():
            done[lkey] = path.name
        else:
            err = out_dir / f"{lkey}.error"
            if not err.exists():
                err.write_text(f"compiler process died (status {status})")
            done[lkey] = "error: " + err.read_text().splitlines()[0][:200]
        print(f"[{i + 1}/{len(KEEP)}] {fn.fn.__name__} {lkey}: {done[lkey][:80]}", file=sys.stderr, flush=True)
    return done


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ptx", default=None, help="directory for the PTX of every distinct launch")
    ap.add_argument("--ptx-arch", default="90", help="comma list of the archs whose launches are compiled")
    ap.add_argument("--ptx-keys", default=None,
                    help="a JSON list of launch keys to compile instead (routing_compare.py --keymap writes it)")
    ap.add_argument("--kernels-root", default=None,
                    help="import specpilot.kernels from this folder (e.g. an export of an earlier commit)")
    args = ap.parse_args()
    if args.kernels_root:
        import importlib.util

        import specpilot

        spec = importlib.util.spec_from_file_location(
            "specpilot.kernels", Path(args.kernels_root) / "__init__.py",
            submodule_search_locations=[str(Path(args.kernels_root).resolve())])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["specpilot.kernels"] = mod
        spec.loader.exec_module(mod)
        specpilot.kernels = mod
    _patch_factories()
    _install()
    snap = {}
    for arch in ARCHS:
        set_arch(arch)
        snap[f"sm{arch}"] = s = {"linear": snapshot_linear(arch), "decode": snapshot_decode(arch)}
        s["launch_keys"] = sorted({ln["launch"] for part in ("linear", "decode") for v in s[part].values()
                                   if isinstance(v, list) for ln in v})
    snap["lm_head"] = snapshot_lm_head()
    snap["launches"] = LAUNCHES
    Path(args.out).write_text(json.dumps(snap, indent=1, sort_keys=True))
    n = sum(len(v) for a in ARCHS for v in snap[f"sm{a}"]["linear"].values() if isinstance(v, list))
    print(f"{n} launches recorded, {len(KEEP)} distinct", file=sys.stderr)
    if args.ptx:
        archs = {int(a) for a in args.ptx_arch.split(",")}
        wanted = set()
        for a in archs:   # one launch per distinct kernel config (constexprs and options): the first one met
            first = {}
            for part in ("linear", "decode"):
                for key in sorted(snap[f"sm{a}"][part]):
                    v = snap[f"sm{a}"][part][key]
                    for ln in (v if isinstance(v, list) else []):
                        r = LAUNCHES[ln["launch"]]
                        first.setdefault(json.dumps([r["kernel"], r["constexprs"], r["options"]], sort_keys=True),
                                         ln["launch"])
            wanted |= set(first.values())
        if args.ptx_keys:
            wanted = set(json.loads(Path(args.ptx_keys).read_text()))
        for key in list(KEEP):
            if key not in wanted:
                del KEEP[key]
        compile_ptx(Path(args.ptx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
