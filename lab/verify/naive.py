"""Plain torch references of :mod:`lab.verify.gemm`: the normalised projections apply RMSNorm's
``1/RMS`` after the product (``rstd * (W @ bf16(gamma * x))``, one rounding fewer than the layer's
``rms_norm``, the same mathematics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.kernels.verify.naive import rope_store, silu_mul


def norm_linear(x: torch.Tensor, gamma: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
    """:mod:`.gemm`'s normalised projection: ``rstd * (W @ bf16(gamma * x))`` in fp32, then rounded."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xg = (gamma.float() * xf).to(x.dtype)
    return (F.linear(xg.float(), w.float()) * rstd).to(x.dtype)


def norm_qkv_rope_store(x, gamma, eps, w_qkv, cos, sin, pos, slots, k_cache, v_cache, nh: int, nkv: int):
    """RMSNorm + q/k/v projection (:func:`norm_linear`), RoPE, K/V into the caches; returns q."""
    return rope_store(norm_linear(x, gamma, eps, w_qkv), cos, sin, pos, slots, k_cache, v_cache, nh, nkv)


def gemm_residual(x, w, res):
    """``res + bf16(x @ w.T)`` per row (the product rounded before the add, as ``x + wo(o)``)."""
    return res + F.linear(x.float(), w.float()).to(x.dtype)


def norm_gate_up_silu(x, gamma, eps, w13, inter: int):
    """RMSNorm + gate/up projection (:func:`norm_linear`) + ``silu(gate) * up``: [T, inter]."""
    return silu_mul(norm_linear(x, gamma, eps, w13), inter)
