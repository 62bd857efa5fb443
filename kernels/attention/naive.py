"""Masked grouped-query attention in plain torch (the engine's reference path).

``q`` [T, nh, hd] (RoPE applied), ``k``/``v`` [nkv, S, hd] (one request's cache), ``mask`` bool
[T, S] (True = may attend). The group's query rows share their KV head (no repeated K/V). Scores
in the cache dtype, softmax in float32, probabilities back in the cache dtype: the numerics the
engine's CPU tests hold lossless.
"""

from __future__ import annotations

import torch


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Output [T, nh * hd] in ``v``'s dtype."""
    T, nh, hd = q.shape
    nkv = k.shape[0]
    grp = nh // nkv
    qg = q.view(T, nkv, grp, hd).permute(1, 2, 0, 3).reshape(nkv, grp * T, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    probs = torch.softmax(scores.masked_fill(~mask.repeat(grp, 1), float("-inf")), -1).to(v.dtype)
    return torch.matmul(probs, v).view(nkv, grp, T, hd).permute(2, 0, 1, 3).reshape(T, nh * hd)


def batched_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          segs: torch.Tensor) -> torch.Tensor:
    """Several requests' rows (continuous batching): segment (first row, rows, slot) of ``segs``
    [n, 3] attends over ``k[slot]``/``v[slot]`` ([slots, nkv, S, hd]); output [T, nh * hd]."""
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2], dtype=v.dtype)
    for t0, n, slot in segs.tolist():
        out[t0:t0 + n] = masked_gqa_attention(q[t0:t0 + n], k[slot], v[slot], mask[t0:t0 + n], scale)
    return out
