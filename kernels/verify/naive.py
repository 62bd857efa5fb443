"""Plain torch references of the multi-row step kernels (:mod:`.rows`): the engine's layer code
(``engine/model.py``) for the step's rows, rounding where it rounds.

Rows are the step's tokens ``x`` [T, K]; ``pos`` and ``slots`` are [T] device tensors (each row
its own RoPE position and cache slot).
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


def rope_store(qkv, cos, sin, pos, slots, k_cache, v_cache, nh: int, nkv: int, req=None) -> torch.Tensor:
    """q/k/v rows [T, (nh + 2 nkv) hd]: RoPE of q and k, K and V written to the caches [nkv, S, hd]
    at ``slots`` (with ``req``: caches [requests, nkv, S, hd], row t in request ``req[t]``'s);
    returns q [T, nh * hd]."""
    hd = k_cache.shape[-1]
    T = qkv.shape[0]
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    store_kv(k_cache, v_cache, slots, rope(k.reshape(T, nkv, hd), cos, sin, pos), v.reshape(T, nkv, hd), req)
    return rope(q.reshape(T, nh, hd), cos, sin, pos).reshape(T, nh * hd)


def store_kv(k_cache, v_cache, slots, k, v, req=None) -> None:
    """Rows ``k``/``v`` [T, nkv, hd] into the caches [nkv, S, hd] at ``slots`` (with ``req``: caches
    [requests, nkv, S, hd], row t into request ``req[t]``'s)."""
    if req is None:
        k_cache[:, slots] = k.transpose(0, 1)
        v_cache[:, slots] = v.transpose(0, 1)
    else:
        k_cache[req, :, slots] = k
        v_cache[req, :, slots] = v


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of gate/up rows [T, 2 inter] (gate first)."""
    gate, up = gu.split([inter, inter], -1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` accumulated in fp32 and rounded once to x's dtype (the skinny GEMM's arithmetic,
    up to the order of the fp32 sums)."""
    return (x.float() @ w.float().T).to(x.dtype)
