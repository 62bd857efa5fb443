"""Steps of 2..64 rows (chain and tree verification, short prefills) through fused kernels
(``decode=fused``, the default on CUDA where it applies; :mod:`.fused_decode` takes one row).

A dense layer with bf16 (or fp32) weights runs as three fused projection kernels plus attention
(:mod:`specpilot.kernels.verify.gemm`, the one-row chain's prologues and epilogues on tensor cores):

1. RMSNorm + q/k/v projection + RoPE of q and k at each row's position + K/V into the cache at
   each row's slot;
2. the split-KV attention over the cache under the step's mask (the committed prefix plus, in a
   tree, each row's ancestors; tiles no row attends are skipped, so a CUDA graph over the static
   cache reads only the live context): ``kernels/attention``, two kernels;
3. o projection + residual add;
4. RMSNorm + gate/up projection + ``silu(gate) * up``;
5. down projection + residual add;

then the model's final RMSNorm (one kernel), the LM head (cuBLAS) and the rows' argmax (two
kernels). Every kernel is launched with programmatic dependent launch: a projection streams its
first weight tile while the previous kernel drains.

With W12 projections (``w12=1``) each projection is the routed W12 GEMM (``w12_linear``) and the
work between two GEMMs is one kernel (:mod:`specpilot.kernels.verify.rows`: RMSNorm, RoPE + cache
write, residual add + RMSNorm, SiLU * up), ten kernels per layer. :data:`DENSE_PATH` ``split`` runs
dense weights the same way with cuBLAS GEMMs (the design the fused kernels are measured against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 64
DENSE_PATH = "fused"   # "fused": kernels/verify/gemm.py; "split": cuBLAS GEMMs + kernels/verify/rows.py


def takes(model, rows: int) -> bool:
    """Whether a step of ``rows`` rows runs here (``decode=fused`` and 2..64 rows)."""
    return model.fused_decode and 1 < rows <= MAX_ROWS


def _is_w12(lin) -> bool:
    return getattr(lin, "kp", None) is not None


def hidden_rows(model, x: torch.Tensor, inp, kv_len: int, layers: int | None = None) -> torch.Tensor:
    """The final-normed hidden rows [T, hidden] of the step ``inp`` (``x``: its embedded tokens)
    through the first ``layers`` layers (all by default)."""
    blocks = model.layers[:layers]
    if not blocks:
        from specpilot.kernels.verify.rows import rms_norm_rows

        return rms_norm_rows(x, model.norm, model.spec.rms_norm_eps)
    if DENSE_PATH == "fused" and not _is_w12(blocks[0].mixer.wqkv):
        return _fused(model, blocks, x, inp, kv_len)
    return _split(model, blocks, x, inp, kv_len)


def _attend(m, q, inp, kv_len):
    from specpilot.kernels.attention.decode import masked_gqa_attention
    from specpilot.kernels.verify import common

    return masked_gqa_attention(q.view(q.shape[0], m.nh, m.hd), m.k_cache[0, :, :kv_len], m.v_cache[0, :, :kv_len],
                                inp.mask[:, :kv_len], m.hd ** -0.5, pdl=common.USE_PDL)


def _fused(model, blocks, x, inp, kv_len):
    from specpilot.kernels.verify import gemm
    from specpilot.kernels.verify.rows import rms_norm_rows

    for blk in blocks:
        m = blk.mixer
        q = gemm.norm_qkv_rope_store(x, blk.attn_norm, blk.eps, m.wqkv.weight, model.cos, model.sin, inp.pos,
                                     inp.slots, m.k_cache[0], m.v_cache[0], m.nh, m.nkv)
        x = gemm.gemm_residual(_attend(m, q, inp, kv_len), m.wo.weight, x)
        a = gemm.norm_gate_up_silu(x, blk.mlp_norm, blk.eps, blk.w13.weight, blk.inter)
        x = gemm.gemm_residual(a, blk.w2.weight, x)
    return rms_norm_rows(x, model.norm, model.spec.rms_norm_eps)


def _linear(h, lin):
    if _is_w12(lin):
        from specpilot.kernels.w12.routing import w12_linear

        return w12_linear(h, lin.kp)
    return F.linear(h, lin.weight)


def _split(model, blocks, x, inp, kv_len):
    from specpilot.kernels.verify import rows as R

    h = R.rms_norm_rows(x, blocks[0].attn_norm, blocks[0].eps)
    for i, blk in enumerate(blocks):
        m = blk.mixer
        q = R.rope_store_rows(_linear(h, m.wqkv), model.cos, model.sin, inp.pos, inp.slots, m.k_cache[0],
                              m.v_cache[0], m.nh, m.nkv)
        x, h = R.add_rms_norm_rows(x, _linear(_attend(m, q, inp, kv_len), m.wo), blk.mlp_norm, blk.eps)
        d = _linear(R.silu_mul_rows(_linear(h, blk.w13), blk.inter), blk.w2)
        if i + 1 < len(blocks):
            x, h = R.add_rms_norm_rows(x, d, blocks[i + 1].attn_norm, blocks[i + 1].eps)
        else:
            x, h = R.add_rms_norm_rows(x, d, model.norm, model.spec.rms_norm_eps)
    return h
