"""lab/verify/gemm.py's kernels alone against cuBLAS ``F.linear`` at verify sizes (H200).

For each Llama-3.1-8B layer (q/k/v + RMSNorm + RoPE + KV store, o + residual, gate/up + RMSNorm +
SiLU, down + residual) and row tile (16, 32, 64 rows), a few configs, each in a CUDA graph with
L2 flushed by reading 256 MB before each replay (CUDA events, median), beside cuBLAS's GEMM of
the same weight and rows. The kernels compile in parallel processes first (Triton's cache).

    python lab/verify/sweep.py [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, capture_and_time, print_table, write_results  # noqa: E402

LAYERS = {"rope": (6144, 4096), "resid_o": (4096, 4096), "silu": (28672, 4096), "resid_down": (4096, 14336)}
SWEEP = {16: [(8, 512, 4, 3), (8, 256, 4, 4), (16, 512, 8, 3), (16, 256, 4, 3), (8, 1024, 8, 2), (32, 256, 8, 3)],
         32: [(8, 256, 4, 3), (8, 512, 8, 3), (16, 256, 8, 3), (16, 128, 4, 4), (8, 128, 4, 4), (32, 128, 8, 3)],
         64: [(8, 128, 4, 3), (8, 256, 8, 2), (16, 128, 8, 3), (16, 64, 4, 4), (8, 64, 4, 4), (32, 128, 8, 2)]}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _kernel_call(epi, n, k, T, cfg, dev="cuda"):
    import torch

    from lab.verify import gemm

    g = torch.Generator(device=dev).manual_seed(n + k + T)
    x = torch.randn(T, k, device=dev, generator=g).to(torch.bfloat16)
    gamma = torch.rand(k, device=dev, generator=g).to(torch.bfloat16) + 0.5
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    if epi == "resid":
        res = torch.randn(T, n, device=dev, generator=g).to(torch.bfloat16)
        return (lambda: gemm.gemm_residual(x, w, res, cfg)), x, w
    if epi == "silu":
        return (lambda: gemm.norm_gate_up_silu(x, gamma, 1e-5, w, n // 2, cfg)), x, w
    cos = torch.randn(4096, 128, device=dev)
    sin = torch.randn(4096, 128, device=dev)
    pos = torch.arange(T, device=dev) + 1000
    kc = torch.zeros(8, 2048, 128, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    return (lambda: gemm.norm_qkv_rope_store(x, gamma, 1e-5, w, cos, sin, pos, pos, kc, vc, 32, 8, cfg)), x, w


def _precompile(job):
    """One worker's share of the sweep's kernels: compile them into Triton's cache."""
    import torch

    from lab.verify import gemm

    done = 0
    for epi, (n, k), T, c in job:
        try:
            fn, _, _ = _kernel_call(epi, n, k, T, gemm.RowsConfig(*c))
            fn()
            torch.cuda.synchronize()
            done += 1
        except Exception as e:  # reported again when the main process runs it
            print(f"precompile {epi} {c}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return done


def sweep(reps):
    import multiprocessing as mp

    import torch
    import torch.nn.functional as F

    from lab.verify import gemm

    jobs = [(name.split("_")[0], shape, T, c) for name, shape in LAYERS.items() for T, cs in SWEEP.items() for c in cs]
    # the configs' compile keys do not depend on the layer: compile one layer per epilogue in parallel
    keys, seen = [], set()
    for j in jobs:
        key = (j[0], j[2], j[3])
        if key not in seen:
            seen.add(key)
            keys.append(j)
    workers = min(14, len(keys))
    ctx = mp.get_context("spawn")
    t = time.perf_counter()
    with ctx.Pool(workers) as pool:
        n_ok = sum(pool.map(_precompile, [keys[i::workers] for i in range(workers)]))
    log(f"precompiled {n_ok}/{len(keys)} kernels in {time.perf_counter() - t:.1f} s ({workers} processes)")
    flush = L2Flusher()
    rows, best = [], {}
    for name, (n, k) in LAYERS.items():
        epi = name.split("_")[0]
        for T, cs in SWEEP.items():
            fn0, x, w = _kernel_call(epi, n, k, T, None)
            base_us = capture_and_time(lambda: F.linear(x, w), reps=reps, flush=flush)[0]
            for c in cs:
                cfg = gemm.RowsConfig(*c)
                try:
                    fn, _, _ = _kernel_call(epi, n, k, T, cfg)
                    us = capture_and_time(fn, reps=reps, flush=flush)[0]
                except Exception as e:
                    log(f"sweep {name} T={T} {cfg.key()}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append({"layer": name, "epilogue": epi, "n": n, "k": k, "rows": T, "config": cfg.key(),
                             "us": us, "cublas_us": base_us, "speedup": base_us / us})
                b = best.get((epi, n, k, T))
                if b is None or us < b[0]:
                    best[(epi, n, k, T)] = (us, cfg, base_us)
    return rows, [{"epilogue": e, "n": n, "k": k, "rows": T, "config": c.key(), "us": us, "cublas_us": base,
                   "speedup": base / us} for (e, n, k, T), (us, c, base) in sorted(best.items())]



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import torch

    torch.set_grad_enabled(False)
    rows, best = sweep(args.reps)
    print_table(best, ["epilogue", "n", "k", "rows", "config", "us", "cublas_us", "speedup"])
    write_results("verify_gemm_sweep", rows, {"best": best})
    return 0


if __name__ == "__main__":
    sys.exit(main())
