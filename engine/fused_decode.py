"""One-row steps through the fused decode kernels (``engine:...,decode=fused``, ``--decode fused``).

A dense layer's AR step (one row) becomes four GEMV kernels plus the two of attention
(:mod:`specpilot.kernels.decode.gemv`):

1. RMSNorm + q/k/v projection + RoPE of q and k + K/V written into the cache at the step's slot;
2. the split-KV attention (``kernels/attention/decode``: two kernels);
3. output projection + residual add;
4. RMSNorm + gate/up projection + SiLU(gate) * up;
5. down projection + residual add;

and the model's final RMSNorm is one more kernel; with the linear head, the argmax of the logits
is two small kernels (``kernels/decode/argmax.py``) instead of torch's one-block reduction. On CUDA the kernels are chained with
programmatic dependent launch (``kernels.decode.gemv.USE_PDL``): each one starts while the
previous one drains and streams its first weights before waiting for the previous one's output.

Steps of more than one row (prefill, chain and tree verification) keep the layer modules
(compiled or eager), so ``decode=fused`` changes the AR step and one-row draft steps only. The
arithmetic is the layer's own, rounding for rounding; only the fp32 summation order of the
projections differs from cuBLAS's, as between any two GEMM kernels.

With ``w12=1`` (on CUDA the projections are ``W12Projection``s) the same four kernels read the W12
records instead: 12 bits per weight, decoded in registers, the same prologues and epilogues
(:mod:`specpilot.kernels.decode.gemv_w12_gluon` where Gluon runs, else the Triton variants of
:mod:`specpilot.kernels.decode.gemv_w12`).

Eligible models: dense Llama-family attention layers with ``nn.Linear`` or W12 projections and no
projection bias, no q/k norm, no attention output gate, RoPE over the whole head dimension
(a power of two), on CUDA (the kernels run in Triton's interpreter on the CPU, for tests only).
"""

from __future__ import annotations

import torch
from torch import nn

from specpilot.engine.spec import DECODES, check_choice
from specpilot.errors import InputError


def ineligible(model) -> str | None:
    """Why ``model`` cannot take the fused one-row path (None when it can)."""
    from specpilot.engine.model import Attention
    from specpilot.engine.w12_loader import W12Projection
    from specpilot.kernels.decode.gemv import DEFAULT

    spec = model.spec
    if spec.is_hybrid:
        return "it has Gated DeltaNet layers"
    if model.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {model.dtype} is not supported"
    for i, blk in enumerate(model.layers):
        m = blk.mixer
        if not isinstance(m, Attention):
            return f"layer {i} is not an attention layer"
        for name, lin in (("q/k/v", m.wqkv), ("o", m.wo), ("gate/up", blk.w13), ("down", blk.w2)):
            if type(lin) is not nn.Linear and type(lin) is not W12Projection:
                return f"layer {i}'s {name} projection is a {type(lin).__name__}, not nn.Linear or W12"
            if lin.bias is not None:
                return f"the {name} projection has a bias"
        if m.qk_norm or m.gate:
            return "q/k norms or an attention output gate are not fused"
        if m.hd & (m.hd - 1) or (m.hd // 2) % DEFAULT.pairs or m.nh % m.nkv:
            return f"head_dim {m.hd} must be a power of two >= {2 * DEFAULT.pairs}"
        if blk.inter % DEFAULT.pairs or spec.hidden_size % (2 * DEFAULT.pairs):
            return "hidden and intermediate sizes must be multiples of the kernel's row blocks"
    if model.cos.shape[-1] != model.layers[0].mixer.hd:
        return "partial rotary embeddings are not fused"
    return None


def set_decode(model, kind: str) -> str:
    """``layers``, ``fused`` or ``auto`` (fused on CUDA when the model is eligible and its attention
    is the fused kernel, else layers) for the model's one-row steps; returns the choice made."""
    check_choice("decode", kind, DECODES)
    if kind == "auto":
        attn_fused = all(getattr(b.mixer, "fused", False) for b in model.layers)
        kind = "fused" if model.device.type == "cuda" and attn_fused and ineligible(model) is None else "layers"
    if kind == "fused":
        why = ineligible(model)
        if why:
            raise InputError(f"decode=fused: {model.spec.name}: {why}; use decode=layers")
    model.fused_decode = kind == "fused"
    return kind


def block_step(blk, x: torch.Tensor, inp, cos: torch.Tensor, sin: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One layer for one row ``x`` [1, hidden] (the whole RoPE tables ``cos``/``sin``; the step's
    position and slot stay on the device, so a CUDA graph replays it for any position)."""
    from specpilot.kernels.attention.decode import masked_gqa_attention
    from specpilot.kernels.decode import gemv

    m = blk.mixer
    q = gemv.norm_qkv_rope_store(x, blk.attn_norm, blk.eps, _weight(m.wqkv), cos, sin, inp.pos, inp.slots,
                                 m.k_cache[0], m.v_cache[0], m.nh, m.nkv)
    o = masked_gqa_attention(q.view(1, m.nh, m.hd), m.k_cache[0, :, :kv_len], m.v_cache[0, :, :kv_len],
                             inp.mask[:, :kv_len], m.hd ** -0.5, pdl=gemv.USE_PDL)
    x = gemv.gemv_residual(o, _weight(m.wo), x)
    a = gemv.norm_gate_up_silu(x, blk.mlp_norm, blk.eps, _weight(blk.w13), blk.inter)
    return gemv.gemv_residual(a, _weight(blk.w2), x)


def _weight(lin):
    """What the kernels take: the dense weight, or a W12 projection's records (``KernelPack``)."""
    kp = getattr(lin, "kp", None)
    return kp if kp is not None else lin.weight
