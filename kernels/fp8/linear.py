"""The FP8 Q pass's projection: ``fp8_linear(h, w)`` for an e4m3 copy of a weight.

The step's rows come split (:class:`SplitRows`, from a row kernel that quantized them in passing)
or are split here (:func:`~.rows.quantize_rows`); one ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM on
Hopper) multiplies both parts by the weight read once, the weight's scale applied in its epilogue;
the product stays split for a row kernel that recombines it in passing, or is recombined here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import naive
from .rows import SplitRows, combine_rows, quantize_rows


@dataclass
class Fp8Weight:
    """A projection's e4m3 copy: ``q`` [N, K] and its power-of-two float32 ``scale`` (0-dim)."""

    q: torch.Tensor
    scale: torch.Tensor
    one: torch.Tensor   # the activations' GEMM scale (theirs is applied per row, outside the GEMM)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size()


def supported(w: torch.Tensor) -> bool:
    """Whether an e4m3 copy of ``w`` [N, K] can be multiplied by cuBLASLt (both sides multiples of 16)."""
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


@torch.no_grad()
def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """``w`` [N, K] (any float dtype, rounded to e4m3 to nearest) on its device."""
    if not supported(w):
        raise ValueError(f"an FP8 weight needs both sides multiples of 16, got {tuple(w.shape)}")
    q, s = naive.quantize_weight(w)
    return Fp8Weight(q.contiguous(), s.to(w.device), torch.ones((), dtype=torch.float32, device=w.device))


def fp8_linear(h, w: Fp8Weight, split_out: bool = False):
    """``h @ W.T`` through the e4m3 copy ``w``: ``h`` rows [M, K] or :class:`SplitRows`; returns
    [M, N] in the rows' dtype, or the product still split (``split_out``) for a row kernel to recombine."""
    x = h if isinstance(h, SplitRows) else quantize_rows(h)
    if x.data.shape[1] != w.q.shape[1]:
        raise ValueError(f"rows of {x.data.shape[1]} columns for an FP8 weight of {w.q.shape[1]}")
    y = SplitRows(torch._scaled_mm(x.data, w.q.t(), scale_a=w.one, scale_b=w.scale, out_dtype=torch.bfloat16),
                  x.scale, x.dtype)
    return y if split_out else combine_rows(y)
