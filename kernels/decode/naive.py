"""Plain torch references of the fused one-row decode kernels (:mod:`.gemv`).

Each function is the engine's own layer code (``engine/norm.py``: ``rms_norm``; ``engine/model.py``:
``apply_rope``, the cache write, ``x + wo(o)``, ``F.silu(gate) * up``) for one row, written out step
by step so the fused kernels can be checked against the same roundings: every intermediate the layer
rounds to the model's dtype is rounded here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.kernels.verify.naive import store_kv


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``gamma * (x * rsqrt(mean(x^2) + eps))`` with the normalised row rounded to x's dtype first."""
    xf = x.float()
    return gamma * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_qkv_rope_store(x, gamma, eps, w_qkv, cos, sin, pos, slot, k_cache, v_cache, nh: int, nkv: int):
    """RMSNorm, the fused q/k/v projection, rotate-half RoPE of q and k (all ``head_dim`` dims) at
    ``pos``, K and V written to ``k_cache``/``v_cache`` [nkv, S, hd] at ``slot``; returns q [1, nh * hd]."""
    hd = k_cache.shape[-1]
    qkv = F.linear(rms_norm(x, gamma, eps), w_qkv)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    c, s = cos[pos].to(x.dtype), sin[pos].to(x.dtype)     # [1, hd]

    def rope(t):
        t = t.view(-1, hd)
        t1, t2 = t[:, : hd // 2], t[:, hd // 2:]
        return t * c + torch.cat([-t2, t1], -1) * s

    k_cache[:, slot] = rope(k).view(nkv, 1, hd)
    v_cache[:, slot] = v.view(nkv, 1, hd)
    return rope(q).reshape(1, nh * hd)


def norm_proj(x, gamma, eps, w):
    """RMSNorm, then the projection (a hybrid layer's input projection): [1, N]."""
    return F.linear(rms_norm(x, gamma, eps), w)


def gemv_residual(x, w, res):
    """``res + x @ w.T``, the product rounded to the dtype before the add (as ``x + wo(o)``)."""
    return res + F.linear(x, w)


def norm_gate_up_silu(x, gamma, eps, w13, inter: int):
    """RMSNorm, the fused gate/up projection (gate rows first), ``silu(gate) * up``: [1, inter]."""
    gate, up = F.linear(rms_norm(x, gamma, eps), w13).split([inter, inter], -1)
    return F.silu(gate) * up


def qk_norm_rope_store(proj, q_norm, k_norm, eps, cos, sin, pos, slot, k_cache, v_cache, nh: int, nkv: int,
                       gated: bool, req=None):
    """The gated-attention layer's q/k path for projected rows [T, width] (:mod:`.gated_attention`):
    per-head RMSNorm of q and k, rotate-half RoPE of the first ``cos.shape[-1]`` dims at each row's
    ``pos``, K/V into the caches at each row's ``slot`` (with ``req``: caches [requests, nkv, S, hd],
    row t in request ``req[t]``'s); returns q [T, nh * hd]."""
    hd = k_cache.shape[-1]
    rot = cos.shape[-1]
    T = proj.shape[0]
    qw = nh * hd * (2 if gated else 1)
    q, k, v = proj.split([qw, nkv * hd, nkv * hd], -1)
    q = q.reshape(T, nh, 2 * hd)[..., :hd] if gated else q.reshape(T, nh, hd)
    c, s = cos[pos].to(proj.dtype)[:, None], sin[pos].to(proj.dtype)[:, None]     # [T, 1, rot]

    def rope(t):
        tr, tp = t[..., :rot], t[..., rot:]
        t1, t2 = tr[..., : rot // 2], tr[..., rot // 2:]
        return torch.cat([tr * c + torch.cat([-t2, t1], -1) * s, tp], -1)

    store_kv(k_cache, v_cache, slot, rope(rms_norm(k.reshape(T, nkv, hd), k_norm, eps)), v.reshape(T, nkv, hd), req)
    return rope(rms_norm(q, q_norm, eps)).reshape(T, nh * hd)


def sigmoid_gate(o, proj, nh: int):
    """``o * sigmoid(gate)`` for rows o [T, nh * hd], the gate being each head's second half of the q projection."""
    T = o.shape[0]
    hd = o.shape[-1] // nh
    g = proj[:, : 2 * nh * hd].reshape(T, nh, 2 * hd)[..., hd:].reshape(T, nh * hd)
    return o * torch.sigmoid(g)
