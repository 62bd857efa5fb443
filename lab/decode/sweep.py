"""The fused one-row decode kernels (kernels/decode/gemv.py) against cuBLAS, per Llama-3.1-8B layer.

For each of a layer's four fused kernels (q/k/v + RMSNorm + RoPE + KV store, o + residual, gate/up +
RMSNorm + SiLU, down + residual) at one row, bf16: every candidate config and cuBLAS ``F.linear``
of the same weight (the GEMM alone, without the norm, RoPE, store, residual or SiLU kernels the
fused kernel also replaces), both in CUDA graphs with L2 flushed by reading 256 MB, CUDA events,
median. Checks each fused result against the plain reference (kernels/decode/naive.py) first.
Prints the fastest config per kernel, the entries of kernels/decode/tuned/<arch>.json.

    python lab/decode/sweep.py [--reps 50] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, print_table, time_cuda_graph, write_results  # noqa: E402

# (kernel, N rows of the weight, K): Llama-3.1-8B, 32 heads, 8 KV heads, head_dim 128
LAYERS = [("rope", 6144, 4096), ("resid", 4096, 4096), ("silu", 28672, 4096), ("resid", 4096, 14336)]
NH, NKV, HD = 32, 8, 128


def configs(kind: str, n: int, quick: bool):
    from specpilot.kernels.decode.gemv import GemvConfig

    pairs = (4, 8) if quick else (2, 4, 8, 16)
    for p, bk, w, s in itertools.product(pairs, (256, 512, 1024), (4, 8), (1, 3)):
        if quick and (w, s) not in ((4, 3), (8, 1)):
            continue
        if kind == "rope" and (HD // 2) % p:
            continue
        rows = n // 2 if kind == "silu" else n
        if rows % (p if kind == "silu" else 2 * p):
            continue
        if p * bk * 2 // (32 * w) > 64:   # two [p, bk] fp32 accumulators: <= 64 registers a thread
            continue
        yield GemvConfig(p, bk, w, s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="a few configs per kernel")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.decode import gemv as G
    from specpilot.kernels.decode import naive as R

    dev = "cuda"
    torch.manual_seed(0)
    flush = L2Flusher()
    rows, tuned, t0 = [], {}, time.time()
    S = 1344
    cos, sin = (t.to(dev) for t in (torch.randn(S, HD).cos(), torch.randn(S, HD).sin()))
    pos, slot = torch.tensor([1000], device=dev), torch.tensor([1000], device=dev)
    for kind, n, k in LAYERS:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        gamma = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
        res = torch.randn(1, n, device=dev).to(torch.bfloat16)
        kc = torch.zeros(NKV, S, HD, device=dev, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)

        def fused(cfg):
            if kind == "rope":
                return G.norm_qkv_rope_store(x, gamma, 1e-5, w, cos, sin, pos, slot, kc, vc, NH, NKV, cfg)
            if kind == "silu":
                return G.norm_gate_up_silu(x, gamma, 1e-5, w, n // 2, cfg)
            return G.gemv_residual(x, w, res, cfg)

        def reference():
            if kind == "rope":
                return R.norm_qkv_rope_store(x, gamma, 1e-5, w, cos, sin, pos, slot, kc.clone(), vc.clone(), NH, NKV)
            if kind == "silu":
                return R.norm_gate_up_silu(x, gamma, 1e-5, w, n // 2)
            return R.gemv_residual(x, w, res)

        ref = reference().float()
        cublas_us = time_cuda_graph(lambda: F.linear(x, w), reps=args.reps, flush=flush)
        best = None
        for cfg in configs(kind, n, args.quick):
            got = fused(cfg).float()
            err = (got - ref).abs().max().item()
            scale = ref.abs().max().item()
            ok = err <= 0.02 * scale + 1e-3
            us = time_cuda_graph(lambda: fused(cfg), reps=args.reps, flush=flush) if ok else math.inf
            row = {"kernel": kind, "n": n, "k": k, "m": 1, "config": cfg.key(), "fused_us": round(us, 2),
                   "cublas_us": round(cublas_us, 2), "speedup": round(cublas_us / us, 3),
                   "weight_TBps": round(n * k * 2 / us / 1e6, 3), "max_abs_err": err, "correct": ok}
            rows.append(row)
            if ok and (best is None or us < best[1]):
                best = (cfg, us)
        if best is None:
            print(f"{kind} {n}x{k}: no correct config", file=sys.stderr)
            return 1
        tuned[(kind, n, k)] = best[0]
        print(f"{kind} {n}x{k}: best {best[0].key()} {best[1]:.2f} us, cuBLAS GEMM alone {cublas_us:.2f} us "
              f"({cublas_us / best[1]:.3f}x)  [{time.time() - t0:.0f} s]", flush=True)
    best_rows = [min((r for r in rows if r["kernel"] == kd and r["n"] == n and r["k"] == k and r["correct"]),
                     key=lambda r: r["fused_us"]) for kd, n, k in LAYERS]
    print_table(best_rows, ["kernel", "n", "k", "config", "fused_us", "cublas_us", "speedup", "weight_TBps"])
    total_f = sum(r["fused_us"] for r in best_rows)
    total_c = sum(r["cublas_us"] for r in best_rows)
    print(f"layer: fused kernels {total_f:.1f} us vs cuBLAS GEMMs alone {total_c:.1f} us")
    for (kd, n, k), c in tuned.items():   # entries of kernels/decode/tuned/<arch>.json
        print(json.dumps({"kernel": "gemv", "epilogue": kd, "n": n, "k": k, "config": c.__dict__}))
    write_results("decode_sweep", rows, {"best": best_rows, "layer_fused_us": round(total_f, 2),
                                        "layer_cublas_gemm_us": round(total_c, 2),
                                        "method": "cuda graph, L2 flushed by reading 256 MB, CUDA events, median"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
