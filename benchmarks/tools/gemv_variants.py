"""Quick A/B of one-row W12 GEMV variants against the tuned one and cuBLAS (same run, H200).

    python benchmarks/tools/gemv_variants.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import L2Flusher, bootstrap, time_cuda_graph  # noqa: E402

bootstrap()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12.gemm import KernelPack  # noqa: E402
from specpilot.kernels.w12.gemv import TUNED, w12_gemv  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (5120, 7168), (5120, 34816), (17408, 5120)]
flush = L2Flusher()
for k, n in SHAPES:
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(1, k, device="cuda").bfloat16()
    ref = x.float() @ w.float().T
    base = TUNED[(n, k)]
    variants = {"tuned": base, "evict_first": dataclasses.replace(base, evict_first=True),
                "bn128-w4-r2": dataclasses.replace(base, block_n=128, num_warps=4),
                "bn128-w4-r2-ef": dataclasses.replace(base, block_n=128, num_warps=4, evict_first=True),
                "r4-ef": dataclasses.replace(base, recs=4, evict_first=True)}
    res = {"cublas": time_cuda_graph(lambda: F.linear(x, w), reps=40, flush=flush)}
    for name, cfg in variants.items():
        y = w12_gemv(x, kp, config=cfg)
        ok = bool(((y.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all())
        res[name] = time_cuda_graph(lambda: w12_gemv(x, kp, config=cfg), reps=40, flush=flush) if ok else float("nan")
    res["cublas2"] = time_cuda_graph(lambda: F.linear(x, w), reps=40, flush=flush)
    c = (res["cublas"] + res["cublas2"]) / 2
    print(f"{k:6d}->{n:6d} cublas {c:6.1f} | " + " | ".join(f"{kk} {v:6.1f} ({c / v:.3f}x)" for kk, v in res.items() if not kk.startswith("cublas")), flush=True)
