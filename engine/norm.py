"""RMSNorm as the engine's layers compute it: the row normalised in fp32, rounded back to its
dtype, then multiplied by the weight. Shared by the attention blocks and the final norm
(:mod:`specpilot.engine.model`) and the Gated DeltaNet layer's gated norm
(:mod:`specpilot.engine.gated_deltanet`); the fused kernels round where it rounds."""

from __future__ import annotations

import torch


def rms_norm(x, weight, eps):
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dt)
