"""Plain torch references of the fused multi-row step kernels (:mod:`.gemm`, :mod:`.rows`).

Rows are the step's tokens ``x`` [T, K]; ``pos`` and ``slots`` are [T] device tensors (each row
its own RoPE position and cache slot). :mod:`.rows`' kernels round like the engine's layers
(``engine/model.py``); the fused projections of :mod:`.gemm` apply RMSNorm's ``1/RMS`` after the
product (``rstd * (W @ bf16(gamma * x))``, one rounding fewer than the layer, the same
mathematics), and these references do exactly that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """The layer's ``rms_norm`` per row: ``gamma * bf16(x * rsqrt(mean(x^2) + eps))``."""
    xf = x.float()
    return gamma * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, gamma: torch.Tensor, eps: float):
    """``x + y`` (the residual add after a projection) and ``rms_norm`` of the sum: (sum, normed)."""
    s = x + y
    return s, rms_norm(s, gamma, eps)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``t`` [T, heads, hd] at each row's position (``apply_rope``'s roundings)."""
    hd = t.shape[-1]
    c, s = cos[pos][:, None, :].to(t.dtype), sin[pos][:, None, :].to(t.dtype)
    t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
    return t * c + torch.cat([-t2, t1], -1) * s


def rope_store(qkv, cos, sin, pos, slots, k_cache, v_cache, nh: int, nkv: int) -> torch.Tensor:
    """q/k/v rows [T, (nh + 2 nkv) hd]: RoPE of q and k, K and V written to the caches [nkv, S, hd]
    at ``slots``; returns q [T, nh * hd]."""
    hd = k_cache.shape[-1]
    T = qkv.shape[0]
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    k_cache[:, slots] = rope(k.reshape(T, nkv, hd), cos, sin, pos).transpose(0, 1)
    v_cache[:, slots] = v.reshape(T, nkv, hd).transpose(0, 1)
    return rope(q.reshape(T, nh, hd), cos, sin, pos).reshape(T, nh * hd)


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of gate/up rows [T, 2 inter] (gate first)."""
    gate, up = gu.split([inter, inter], -1)
    return F.silu(gate) * up


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
