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

With ``w12=1`` (on CUDA the projections are ``W12Projection``s) the same kernels (a hybrid's
too) read the W12 records instead: 12 bits per weight, decoded in registers, the same prologues and epilogues
(:mod:`specpilot.kernels.decode.gemv_w12_gluon` where Gluon runs, else the Triton variants of
:mod:`specpilot.kernels.decode.gemv_w12`).

Hybrid models (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers and gated full-attention layers) take
the same chain with two more layer shapes. A GDN layer is RMSNorm + its input projection (one GEMV,
``gemv.norm_proj``), the causal conv with the conv state advanced, the gated delta rule with the
state written, the gated RMSNorm (:mod:`specpilot.kernels.gdn.rows`), then ``x + out_proj(o)``. A
gated attention layer is ``norm_proj``, per-head q/k RMSNorm + partial RoPE + the cache write
(:mod:`specpilot.kernels.decode.gated_attention`), the attention, ``sigmoid(gate)`` and
``x + wo(o)``. So a hybrid's whole AR step is one PDL-chained sequence of kernels, one CUDA graph.

Eligible models: Llama-family attention layers (q/k norms, output gate and partial RoPE only in
hybrid-style gated layers) and GDN layers, with ``nn.Linear`` or W12 projections without bias,
power-of-two head dimensions, on CUDA (the kernels run in Triton's
interpreter on the CPU, for tests only).
"""

from __future__ import annotations

import torch
from torch import nn

from specpilot.engine.spec import DECODES, check_choice
from specpilot.errors import InputError


def ineligible(model) -> str | None:
    """Why ``model`` cannot take the fused one-row path (None when it can)."""
    from specpilot.engine.gated_deltanet import GatedDeltaNet
    from specpilot.engine.w12_loader import W12Projection
    from specpilot.kernels.decode.gemv import DEFAULT

    spec = model.spec
    if model.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {model.dtype} is not supported"
    if spec.hidden_size % (2 * DEFAULT.pairs):
        return "hidden and intermediate sizes must be multiples of the kernel's row blocks"
    for i, blk in enumerate(model.layers):
        m = blk.mixer
        if isinstance(m, GatedDeltaNet):
            if m.impl == "torch":
                return "its GDN layers run the torch reference (gdn=naive), the fused step runs the row kernels"
            lins = (("in", m.in_proj), ("out", m.out_proj))
            if m.dk & (m.dk - 1) or m.dv & (m.dv - 1) or m.in_proj.out_features % 2:
                return f"layer {i}: GDN head dims must be powers of two"
        else:
            lins = (("q/k/v", m.wqkv), ("o", m.wo))
        for name, lin in lins + (("gate/up", blk.w13), ("down", blk.w2)):
            if type(lin) is not nn.Linear and type(lin) is not W12Projection:
                return f"layer {i}'s {name} projection is a {type(lin).__name__}, not nn.Linear or W12"
            if lin.bias is not None:
                return f"the {name} projection has a bias"
        if blk.inter % DEFAULT.pairs:
            return "hidden and intermediate sizes must be multiples of the kernel's row blocks"
        if isinstance(m, GatedDeltaNet):
            continue
        if m.hd & (m.hd - 1) or (m.hd // 2) % DEFAULT.pairs or m.nh % m.nkv:
            return f"head_dim {m.hd} must be a power of two >= {2 * DEFAULT.pairs}"
        rot = model.cos.shape[-1]
        if rot != m.hd and not (m.qk_norm or m.gate):
            return "partial rotary embeddings are fused for gated/q-k-normed attention layers only"
        if rot & (rot - 1) or rot < 4:
            return f"rotary dims {rot} must be a power of two"
    return None


def set_decode(model, kind: str) -> str:
    """``layers``, ``fused`` or ``auto`` (fused on CUDA when the model is eligible and its attention
    is the fused kernel, else layers) for the model's one-row steps; returns the choice made."""
    check_choice("decode", kind, DECODES)
    if kind == "auto":
        attn_fused = all(getattr(b.mixer, "fused", True) for b in model.layers)   # GDN layers have no choice
        kind = "fused" if model.device.type == "cuda" and attn_fused and ineligible(model) is None else "layers"
    if kind == "fused":
        why = ineligible(model)
        if why:
            raise InputError(f"decode=fused: {model.spec.name}: {why}; use decode=layers")
    model.fused_decode = kind == "fused"
    return kind


def block_step(blk, x: torch.Tensor, inp, cos: torch.Tensor, sin: torch.Tensor, kv_len: int,
               kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One layer for one row ``x`` [1, hidden] (the whole RoPE tables ``cos``/``sin``; the step's
    position and slot stay on the device, so a CUDA graph replays it for any position). ``kv``:
    the K/V caches [nkv, S, hd] of a dense layer when not its own (a batch cache's slot)."""
    from specpilot.engine.gated_deltanet import GatedDeltaNet
    from specpilot.kernels.decode import gemv

    m = blk.mixer
    if isinstance(m, GatedDeltaNet):
        x = _gdn_mixer(blk, m, x)
    elif m.qk_norm or m.gate:
        x = _gated_attention_mixer(blk, m, x, inp, cos, sin, kv_len)
    else:
        from specpilot.kernels.attention.decode import masked_gqa_attention

        kc, vc = kv if kv is not None else (m.k_cache[0], m.v_cache[0])
        q = gemv.norm_qkv_rope_store(x, blk.attn_norm, blk.eps, _weight(m.wqkv), cos, sin, inp.pos, inp.slots,
                                     kc, vc, m.nh, m.nkv)
        o = masked_gqa_attention(q.view(1, m.nh, m.hd), kc[:, :kv_len], vc[:, :kv_len], inp.mask[:, :kv_len],
                                 m.hd ** -0.5, pdl=gemv.USE_PDL, slots=inp.slots)
        x = gemv.gemv_residual(o, _weight(m.wo), x)
    a = gemv.norm_gate_up_silu(x, blk.mlp_norm, blk.eps, _weight(blk.w13), blk.inter)
    return gemv.gemv_residual(a, _weight(blk.w2), x)


def _gdn_mixer(blk, m, x):
    """A GDN layer's AR step: RMSNorm + input projection, the conv (state advanced), the gated
    delta rule (state written), the gated RMSNorm, and ``x + out_proj(o)``."""
    from specpilot.kernels.decode import gemv
    from specpilot.kernels.gdn import rows

    proj = gemv.norm_proj(x, blk.attn_norm, blk.eps, _weight(m.in_proj))
    mixed, z, ab = m.split_proj(proj)
    conv = rows.conv_rows(mixed, m.conv_state, m.conv_weight, advance=True, pdl=gemv.USE_PDL)
    o = rows.gdn_rows(conv, ab, m.A_log, m.dt_bias, m.state, None, m.nk, new_state=m.state, pdl=gemv.USE_PDL)
    o = rows.gated_norm_rows(o.view(1, m.nv, m.dv), z, m.norm, m.eps, pdl=gemv.USE_PDL)
    return gemv.gemv_residual(o, _weight(m.out_proj), x)


def _gated_attention_mixer(blk, m, x, inp, cos, sin, kv_len):
    """A gated (q/k-normed, partial-RoPE) attention layer's AR step (kernels/decode/gated_attention.py)."""
    from specpilot.kernels.attention.decode import masked_gqa_attention
    from specpilot.kernels.decode import gated_attention as ga, gemv

    proj = gemv.norm_proj(x, blk.attn_norm, blk.eps, _weight(m.wqkv))
    q = ga.qk_norm_rope_store(proj, m.q_norm, m.k_norm, m.eps, cos, sin, inp.pos, inp.slots, m.k_cache[0],
                              m.v_cache[0], m.nh, m.nkv, m.gate, pdl=gemv.USE_PDL)
    o = masked_gqa_attention(q.view(1, m.nh, m.hd), m.k_cache[0, :, :kv_len], m.v_cache[0, :, :kv_len],
                             inp.mask[:, :kv_len], m.hd ** -0.5, pdl=gemv.USE_PDL, slots=inp.slots)
    if m.gate:
        o = ga.sigmoid_gate(o, proj, m.nh, pdl=gemv.USE_PDL)
    return gemv.gemv_residual(o, _weight(m.wo), x)


def _weight(lin):
    """What the kernels take: the dense weight, or a W12 projection's records (``KernelPack``)."""
    kp = getattr(lin, "kp", None)
    return kp if kp is not None else lin.weight
