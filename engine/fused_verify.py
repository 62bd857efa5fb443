"""Steps of two rows or more (chain and tree verification, prompts) through fused kernels
(``decode=fused``, the default on CUDA where it applies; :mod:`.fused_decode` takes one row).

A dense layer is four GEMMs (bf16 weights: the kernel the measured table picks for the step's
rows, :mod:`specpilot.kernels.verify.blas` - the warp-K tensor-core GEMM for one request's short
steps, the TMA-ring GEMM, the skinny GEMM or cuBLAS elsewhere; the routed W12 GEMM ``w12_linear``
with ``w12=1``) and one kernel between two GEMMs (:mod:`specpilot.kernels.verify.rows`), ten
kernels instead of the layer modules' forty:

1. RMSNorm of the rows (fused into the previous layer's last kernel), q/k/v GEMM;
2. RoPE of q and k at each row's position, K/V into the cache at each row's slot, q out;
3. the split-KV attention over the cache under the step's mask (the committed prefix plus, in a
   tree, each row's ancestors; tiles no row attends are skipped, so a CUDA graph over the static
   cache reads only the live context): ``kernels/attention``, two kernels;
4. o GEMM, then the residual add and the MLP's RMSNorm in one kernel;
5. gate/up GEMM, ``silu(gate) * up``, down GEMM;
6. the residual add and the next layer's RMSNorm (after the last layer: the model's final norm).

Hybrid layers (Qwen3.5 / Qwen3-Next) keep steps 4-6 and replace 1-3: a GDN layer is its input
GEMM, the conv and the gated delta rule along each row's root path with the gated norm
(``GatedDeltaNet.mix``: :mod:`specpilot.kernels.gdn.rows`) and the out GEMM; a gated attention
layer is its GEMM, per-head q/k norm + partial RoPE + the cache write, the attention and
``sigmoid(gate)`` (:mod:`specpilot.kernels.decode.gated_attention`).

Batched steps (continuous batching, ``engine/batch``) take the same kernels for the rows of every
request: step 2 writes each row's K/V into its request's cache slot and step 3 is one launch over
all requests, each segment of rows over its own slot (``batched_gqa_attention``); a GDN layer runs
``GatedDeltaNet.mix_batch`` on the requests' own states.

Then the LM head (cuBLAS) and the rows' argmax (two kernels). The small kernels and the attention
are launched with programmatic dependent launch. The arithmetic is the layers' (each kernel rounds
where ``engine/model.py`` rounds, the GEMMs are ``F.linear`` calls of the same shapes, on cuBLASLt
at the row counts the table gives it, where they may round unlike the layers' cuBLAS kernels);
RMSNorm sums its squares in another order. On Llama-3.1-8B shapes (H200) this is the fastest verify step measured here:
the GEMMs stay near cuBLAS's flat cost from 1 to 64 rows, which fused tensor-core projections in
Triton did not reach (``lab/verify/gemm.py``).
"""

from __future__ import annotations

import torch

from specpilot.engine.spec import MAX_STEP_ROWS as MAX_ROWS


def takes(model, rows: int) -> bool:
    """Whether a step of ``rows`` rows runs here: with ``decode=fused``, every step of two rows or
    more, prompts included (the layer modules cost about forty small torch kernels per layer, a
    launch-bound prefill)."""
    return model.fused_decode and 1 < rows


def takes_invariant(model, rows: int) -> bool:
    """Whether a step of ``rows`` rows runs the row-invariant kernels (``set_deterministic``): every
    step of up to :data:`MAX_ROWS` rows, AR steps included; longer ones (prompts) do not."""
    return model.invariant and rows <= MAX_ROWS


def _project(h, lin, invariant: bool = False, batched: bool = False, split: bool = False):
    """``h @ lin.T`` through the kernel the projection takes. ``h`` may be split rows (an FP8 Q
    pass's); with ``split`` an FP8 projection leaves its product split for the row kernel after it."""
    q8 = getattr(lin, "q8", None)
    if q8 is not None:    # a TLV Q pass with qview=fp8 (engine/tlv.py QView): the e4m3 copy, cuBLASLt FP8 GEMM
        from specpilot.kernels.fp8 import fp8_linear

        return fp8_linear(h, q8, split_out=split)
    if not isinstance(h, torch.Tensor):   # split rows where this projection has no e4m3 copy
        h = h.dense()
    qkp = getattr(lin, "qkp", None)
    if qkp is not None:   # a TLV Q pass (engine/tlv.py QView): the 8-bit view through the QPASS kernels
        from specpilot.kernels.w12.routing import w12_linear

        return w12_linear(h.to(torch.bfloat16), qkp, qpass=True, out_dtype=h.dtype)
    kp = getattr(lin, "kp", None)
    if kp is not None:
        from specpilot.kernels.w12.routing import w12_linear

        return w12_linear(h, kp)
    if invariant:
        from specpilot.kernels.verify import invariant as inv

        return inv.linear(h, lin.weight)
    # here, not at the top: the step path imports this module on every device, and the GEMM's
    # Triton modules would cost a CPU engine's first request half a second
    from specpilot.kernels.verify import blas

    return blas.linear(h, lin.weight, batched)


def takes_batch(model) -> bool:
    """Whether batched steps (continuous batching, :meth:`Transformer.hidden_batch`) run here:
    with ``decode=fused`` (the models the fused decode kernels take, dense and hybrid)."""
    return model.fused_decode


def one_row_chain(model) -> bool:
    """Whether a batched step of one row may take the one-row decode chain (``fused_decode``) on
    its request's cache slot: dense attention layers (the chain's GDN and gated layers use the
    layers' own states), outside a TLV Q pass (the chain reads the exact weights)."""
    from specpilot.engine.model import Attention

    return all(isinstance(b.mixer, Attention) and not (b.mixer.qk_norm or b.mixer.gate)
               and getattr(b.mixer.wqkv, "qkp", None) is None and getattr(b.mixer.wqkv, "q8", None) is None
               for b in model.layers)


def _segments(inp):
    """A batched step's segment table (first row, rows, slot) on the device, made once per input
    (a CUDA graph's input keeps it: made during the warm-up, before capture)."""
    if inp.seg_table is None:
        from specpilot.kernels.attention.decode import segment_table

        inp.seg_table = segment_table(inp.segments, inp.tokens.device)
    return inp.seg_table


def _attend(m, q, inp, kv_len, lc=None, keys=None):
    from specpilot.kernels.attention import decode
    from specpilot.kernels.verify import common

    q = q.view(q.shape[0], m.nh, m.hd)
    if keys is not None:
        from specpilot.kernels.attention import invariant

        return invariant.masked_gqa_attention(q, m.k_cache[0, :, :kv_len], m.v_cache[0, :, :kv_len],
                                              inp.mask[:, :kv_len], m.hd ** -0.5, pdl=common.USE_PDL, keys=keys)
    if lc is None:
        return decode.masked_gqa_attention(q, m.k_cache[0, :, :kv_len], m.v_cache[0, :, :kv_len],
                                           inp.mask[:, :kv_len], m.hd ** -0.5, pdl=common.USE_PDL,
                                           slots=inp.slots)
    segs, seg_rows = _segments(inp)
    return decode.batched_gqa_attention(q, lc.k[:, :, :kv_len], lc.v[:, :, :kv_len], inp.mask[:, :kv_len],
                                        m.hd ** -0.5, segs, seg_rows, pdl=common.USE_PDL, slots=inp.slots)


def _rope_in_attention(m, inp) -> bool:
    """Whether a batched step's dense attention layer takes RoPE and the K/V write into the
    attention's split pass: every request one row, the measured table's config says so."""
    from specpilot.kernels.attention import decode

    segs, seg_rows = _segments(inp)
    return seg_rows == 1 and segs.shape[0] == inp.tokens.shape[0] and \
        decode.split_config(inp.tokens.device, True, 1, m.hd, segs.shape[0]).rope


def _rope_attend(m, qkv, model, inp, kv_len, lc):
    from specpilot.kernels.attention import decode
    from specpilot.kernels.verify import common

    segs, _ = _segments(inp)
    return decode.rope_batched_gqa_attention(qkv, model.cos, model.sin, inp.pos, inp.slots, inp.req,
                                             lc.k[:, :, :kv_len], lc.v[:, :, :kv_len], inp.mask[:, :kv_len],
                                             m.hd ** -0.5, segs, m.nh, pdl=common.USE_PDL)


def mlp(h, blk, linear, split: bool = False):
    """The MLP of block ``blk`` on rows ``h``: gate/up GEMM, ``silu(gate) * up``, down GEMM
    (``linear(h, lin, split)`` the step's projection)."""
    from specpilot.kernels.verify import rows as R

    return linear(R.silu_mul_rows(linear(h, blk.w13, split), blk.inter), blk.w2, split)


def hidden_rows(model, x: torch.Tensor, inp, kv_len: int, layers: int | None = None, cache=None,
                invariant: bool = False) -> torch.Tensor:
    """The final-normed hidden rows [T, hidden] of the step ``inp`` (``x``: its embedded tokens)
    through the first ``layers`` layers (all by default). With ``cache`` (a ``BatchCache``; ``inp``
    a ``BatchStepInput``, :func:`takes_batch` models) the rows of several requests, each writing and
    attending its own slot. ``invariant`` (one request, up to :data:`MAX_ROWS` rows, any from one):
    the row-invariant GEMM and attention (``EngineSpec.deterministic``); the other kernels here work
    row by row already, and a GDN layer walks each row's path as its AR step would."""
    from specpilot.engine.gated_deltanet import GatedDeltaNet
    from specpilot.kernels.decode import gated_attention as ga
    from specpilot.kernels.verify import common, rows as R

    keys = None
    if invariant:
        if cache is not None or not 1 <= x.shape[0] <= MAX_ROWS:
            raise ValueError(f"row-invariant steps take one request's 1..{MAX_ROWS} rows")
        from specpilot.kernels.attention.invariant import key_table

        keys = key_table(inp.mask[:, :kv_len])   # every attention layer's; recomputed at each graph replay

    def _linear(h, lin, split: bool = False):
        return _project(h, lin, invariant, cache is not None, split)

    blocks = model.layers[:layers]
    caches = [None] * len(blocks) if cache is None else cache.layers
    eps = model.spec.rms_norm_eps
    if not blocks:
        return R.rms_norm_rows(x, model.norm, eps)
    # an FP8 Q pass: products stay split into the row kernel after them, normed rows leave split
    q8 = getattr(blocks[0].w13, "q8", None) is not None
    h = R.rms_norm_rows(x, blocks[0].attn_norm, blocks[0].eps, quant=q8)
    for i, (blk, lc) in enumerate(zip(blocks, caches)):
        m = blk.mixer
        if isinstance(m, GatedDeltaNet):
            proj = _linear(h, m.in_proj)
            o = m.mix(proj, inp) if lc is None else m.mix_batch(proj, inp, lc)
            x, h = R.add_rms_norm_rows(x, _linear(o, m.out_proj, q8), blk.mlp_norm, blk.eps, quant=q8)
        elif m.qk_norm or m.gate:
            proj = _linear(h, m.wqkv)
            kc, vc = (m.k_cache[0], m.v_cache[0]) if lc is None else (lc.k, lc.v)
            q = ga.qk_norm_rope_store(proj, m.q_norm, m.k_norm, m.eps, model.cos, model.sin, inp.pos, inp.slots,
                                      kc, vc, m.nh, m.nkv, m.gate, pdl=common.USE_PDL,
                                      req=None if lc is None else inp.req)
            o = _attend(m, q, inp, kv_len, lc, keys)
            if m.gate:
                o = ga.sigmoid_gate(o, proj, m.nh, pdl=common.USE_PDL)
            x, h = R.add_rms_norm_rows(x, _linear(o, m.wo, q8), blk.mlp_norm, blk.eps, quant=q8)
        elif lc is not None and not q8 and _rope_in_attention(m, inp):
            o = _rope_attend(m, _linear(h, m.wqkv), model, inp, kv_len, lc)
            x, h = R.add_rms_norm_rows(x, _linear(o, m.wo), blk.mlp_norm, blk.eps)
        else:
            kc, vc = (m.k_cache[0], m.v_cache[0]) if lc is None else (lc.k, lc.v)
            q = R.rope_store_rows(_linear(h, m.wqkv, q8), model.cos, model.sin, inp.pos, inp.slots, kc, vc, m.nh,
                                  m.nkv, req=None if lc is None else inp.req)
            x, h = R.add_rms_norm_rows(x, _linear(_attend(m, q, inp, kv_len, lc, keys), m.wo, q8), blk.mlp_norm,
                                       blk.eps, quant=q8)
        d = mlp(h, blk, _linear, q8)
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        x, h = R.add_rms_norm_rows(x, d, nxt.attn_norm if nxt else model.norm, nxt.eps if nxt else eps,
                                   quant=q8 and nxt is not None)
    return h
