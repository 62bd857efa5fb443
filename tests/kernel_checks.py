"""Helpers the kernel-versus-reference tests share: RoPE tables, dtype-aware closeness, seeded inputs,
tree-step masks, GEMM inputs and the one-bf16-rounding check."""

from __future__ import annotations

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rope_tables(hd: int, n: int):
    """cos, sin [n, hd] (the two halves repeated) for positions 0..n-1, on ``DEV``."""
    inv = 1 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    emb = torch.cat([torch.outer(torch.arange(n, dtype=torch.float64), inv)] * 2, -1).float()
    return emb.cos().to(DEV), emb.sin().to(DEV)


def gemm_inputs(m: int, k: int, n: int, dt=torch.bfloat16, seed: int = 0, device="cpu"):
    """x ``[m, k]`` (standard normal) and w ``[n, k]`` (std 0.05), seeded, in ``dt`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dt).to(device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dt).to(device)
    return x, w


def within_bf16_rounding(got, want) -> bool:
    """Within one bf16 rounding of the fp32 reference (the sums' order differs)."""
    ref = want.float()
    tol = ref.abs().clamp_min(1e-3) * 2 ** -7 + 1e-3
    return bool(((got.float() - ref).abs() <= tol).all())


def tree_mask(parents: list[int], prefix: int, ctx: int) -> torch.Tensor:
    """bool [len(parents), ctx] on the CPU: each tree row sees the committed ``prefix`` slots and, from
    slot ``prefix`` on, itself and its ancestors (``parents[i]`` < i, -1 for a root)."""
    mask = torch.zeros(len(parents), ctx, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, prefix + j] = True
            j = parents[j]
    return mask


def closeness(tol: dict):
    """``close(a, b, dt)``: same shape and dtype, equal within ``tol[dt]`` (absolute and relative)."""

    def close(a, b, dt):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol[dt], rtol=tol[dt])

    return close


def row_inputs(dt, T: int, K: int = 80, seed: int = 0):
    """(generator, rnd(*shape, scale=1) in ``dt`` on ``DEV``, x [T, K], RMSNorm gamma [K])."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt).to(DEV)

    gamma = (torch.rand(K, generator=g) + 0.5).to(dt).to(DEV)
    return g, rnd, rnd(T, K), gamma
