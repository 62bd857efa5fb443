"""Plain torch references of the FP8 Q-pass arithmetic (:mod:`.rows`, :mod:`.linear`).

Scales are powers of two, ``2^(floor(log2 amax) - 7)``: every scaled value is at most 256 in
magnitude (under e4m3's 448, so nothing saturates) and scaling is exact, so the kernels and these
references agree bit for bit (the kernels round to e4m3 in float32 arithmetic, to nearest even, as
torch's conversion does).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) for each float32 ``amax``: ``2^(floor(log2 amax) - 7)`` and its inverse,
    both exact; 1 where ``amax`` is zero or below 2^-119 (its values quantize to zero)."""
    e = (amax.float().contiguous().view(torch.int32) >> 23) & 0xFF
    ok = e >= 8
    s = torch.where(ok, (e - 7) << 23, 127 << 23).view(torch.float32)
    inv = torch.where(ok, (261 - e) << 23, 127 << 23).view(torch.float32)
    return s, inv


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [M, K] as [2M, K] e4m3 (row m: the high part, row M + m: what the high part
    missed) and their [2M] float32 scales: ``x[m] ~= q[m] * s[m] + q[M + m] * s[M + m]``."""
    xf = x.float()
    s_hi, inv_hi = pow2_scale(xf.abs().amax(-1))
    hi = (xf * inv_hi[:, None]).to(E4M3)
    r = xf - hi.float() * s_hi[:, None]
    s_lo, inv_lo = pow2_scale(r.abs().amax(-1))
    lo = (r * inv_lo[:, None]).to(E4M3)
    return torch.cat([hi, lo]), torch.cat([s_hi, s_lo])


def combine_rows(y: torch.Tensor, s: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Split rows ``y`` [2M, N] with scales ``s`` [2M] back to [M, N]: ``y[m] s[m] + y[M+m] s[M+m]``
    in float32, rounded once to ``dtype``."""
    m = y.shape[0] // 2
    yf = y.float()
    return (yf[:m] * s[:m, None] + yf[m:] * s[m:, None]).to(dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as e4m3 and its one float32 scale (a 0-dim tensor)."""
    s, inv = pow2_scale(w.float().abs().amax())
    return (w.float() * inv).to(E4M3), s


def dequantize_weight(q: torch.Tensor, s: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The weight an e4m3 copy stands for, in ``dtype`` (the Q pass's view on the CPU)."""
    return (q.float() * s).to(dtype)


def linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The FP8 Q pass's product ``x @ W.T`` for rows ``x`` [M, K]: the rows quantized, multiplied by
    the e4m3 weight in float32, each part rounded to bf16 with the weight's scale, recombined."""
    q2, s2 = quantize_rows(x)
    y = ((q2.float() @ q.float().T) * s).to(torch.bfloat16)
    return combine_rows(y, s2, x.dtype)
