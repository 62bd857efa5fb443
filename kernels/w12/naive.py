"""Plain torch references for the W12 GEMM (fla-style ``naive`` beside the fast kernel)."""

from __future__ import annotations

import torch

from .format import W12Tensor, decode


def w12_linear_ref(x: torch.Tensor, packed: W12Tensor, qpass: bool = False,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` with W restored from W12, fp32 accumulation, output in x's dtype."""
    w = decode(packed, qpass=qpass).to(x.device)
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
