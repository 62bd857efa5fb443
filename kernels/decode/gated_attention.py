"""The one-row pieces of a hybrid model's gated full-attention layer (Qwen3.5 / Qwen3-Next).

Those layers differ from Llama's in three ways the fused RoPE epilogue of :mod:`.gemv` cannot
take: q and k are RMS-normalised per head (``q_norm``/``k_norm``) before RoPE, RoPE turns only the
first ``rot`` dims of a head (partial rotary), and the attention output is multiplied by
``sigmoid(gate)``, the gate coming out of the q projection (per head: q dims, then gate dims). So
the AR step of such a layer is (the two kernels here also take the rows of a verify step):
:func:`.gemv.norm_proj` (RMSNorm + the q/gate/k/v projection),
:func:`qk_norm_rope_store` (one program per head: norm, partial RoPE, q out, K/V into the caches),
the split-KV attention, :func:`sigmoid_gate`, then :func:`.gemv.gemv_residual` with ``wo``. Each
rounds where the layer (``engine/model.py``) rounds; references in :mod:`.naive`.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_env import pdl_args, tl, triton
from specpilot.kernels.verify.common import request_caches

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _qk_norm_rope_kernel(p_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, req_ptr, q_ptr, kc_ptr,
                             vc_ptr, eps, stride_p, stride_rot, stride_cb, stride_ch, stride_cs, stride_db, stride_dh,
                             stride_ds, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                             GATED: tl.constexpr, REQ: tl.constexpr, PDL: tl.constexpr):
        h = tl.program_id(0)
        row = tl.program_id(1)
        p_ptr += row * stride_p
        q_ptr += row * NH * HD
        pos_ptr += row
        slot_ptr += row
        d = tl.arange(0, HD)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        if REQ:   # continuous batching: the row's request owns cache slot req[row]
            r = tl.load(req_ptr + row).to(tl.int64)
            kc_ptr += r * stride_cb
            vc_ptr += r * stride_db
        dt = q_ptr.dtype.element_ty
        QW: tl.constexpr = 2 * HD if GATED else HD      # a q head's width in the projection
        if h < NH + NKV:
            is_q = h < NH
            base = tl.where(is_q, h * QW, NH * QW + (h - NH) * HD)
            x = tl.load(p_ptr + base + d).to(tl.float32)
            w = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
            xn = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            # partial rotate-half RoPE over dims < ROT: [a, b] -> [a c - b s, b c + a s]
            HALF: tl.constexpr = ROT // 2
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            xp = tl.load(p_ptr + base + partner).to(tl.float32)
            xp = (tl.load(tl.where(is_q, qn_ptr, kn_ptr) + partner).to(tl.float32)
                  * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            pos = tl.load(pos_ptr)
            rot = d < ROT
            c = tl.load(cos_ptr + pos * stride_rot + d, mask=rot, other=1.0).to(dt).to(tl.float32)
            s = tl.load(sin_ptr + pos * stride_rot + d, mask=rot, other=0.0).to(dt).to(tl.float32)
            sgn = tl.where(d < HALF, -1.0, 1.0)
            y = tl.where(rot, ((xn * c).to(dt).to(tl.float32) + (sgn * xp * s).to(dt).to(tl.float32)).to(dt),
                         xn.to(dt))
            if is_q:
                tl.store(q_ptr + h * HD + d, y)
            else:
                slot = tl.load(slot_ptr)
                tl.store(kc_ptr + (h - NH) * stride_ch + slot * stride_cs + d, y)
        else:   # a V head: into the cache as projected
            slot = tl.load(slot_ptr)
            vh = h - NH - NKV
            v = tl.load(p_ptr + NH * QW + NKV * HD + vh * HD + d)
            tl.store(vc_ptr + vh * stride_dh + slot * stride_ds + d, v)

    @triton.jit
    def _sigmoid_gate_kernel(o_ptr, p_ptr, y_ptr, stride_o, stride_p, HD: tl.constexpr, PDL: tl.constexpr):
        h = tl.program_id(0)
        row = tl.program_id(1)
        o_ptr += row * stride_o
        y_ptr += row * stride_o
        p_ptr += row * stride_p
        d = tl.arange(0, HD)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        dt = y_ptr.dtype.element_ty
        o = tl.load(o_ptr + h * HD + d).to(tl.float32)
        g = tl.load(p_ptr + h * 2 * HD + HD + d).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(y_ptr + h * HD + d, (o * sg).to(dt))


def qk_norm_rope_store(proj, q_norm, k_norm, eps, cos, sin, pos, slot, k_cache, v_cache, nh: int, nkv: int,
                       gated: bool, pdl: bool = False, req: torch.Tensor | None = None) -> torch.Tensor:
    """From rows of the q(/gate)/k/v projection ``proj`` [T, nh*hd*(2 if gated) + 2*nkv*hd]:
    RMS-normalised (``q_norm``/``k_norm`` [hd]) q and k with RoPE over the first ``cos.shape[-1]``
    dims at each row's ``pos``, K/V written to the caches [nkv, S, hd] at each row's ``slot``
    (``pos``/``slot``: [T] device tensors); returns q [T, nh * hd]. With ``req`` [T] (continuous
    batching) the caches are [requests, nkv, S, hd] and row t writes to request ``req[t]``'s."""
    hd = k_cache.shape[-1]
    rot = cos.shape[-1]
    T = proj.shape[0]
    if proj.dim() != 2 or proj.shape[1] != nh * hd * (2 if gated else 1) + 2 * nkv * hd or proj.stride(1) != 1:
        raise ValueError(f"qk_norm_rope_store: projection rows [T, {nh * hd * (2 if gated else 1) + 2 * nkv * hd}] "
                         f"(contiguous in the row) expected, got {tuple(proj.shape)}")
    if hd & (hd - 1) or rot % 2 or rot > hd or (rot // 2) & (rot // 2 - 1) or cos.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope_store: head_dim {hd} and rotary dims {rot} must be powers of two, rot <= hd")
    if pos.numel() != T or slot.numel() != T:
        raise ValueError(f"qk_norm_rope_store: one position and slot per row ({T}) expected")
    kc, vc = request_caches(T, k_cache, v_cache, req)
    q = torch.empty(T, nh * hd, dtype=proj.dtype, device=proj.device)
    _qk_norm_rope_kernel[(nh + 2 * nkv, T)](
        proj, q_norm, k_norm, cos, sin, pos, slot, slot if req is None else req, q, kc, vc, float(eps),
        proj.stride(0), cos.stride(0), *kc.stride()[:3], *vc.stride()[:3],
        NH=nh, NKV=nkv, HD=hd, ROT=rot, GATED=gated, REQ=req is not None, num_warps=4, **pdl_args(pdl, proj))
    return q


def sigmoid_gate(o: torch.Tensor, proj: torch.Tensor, nh: int, pdl: bool = False) -> torch.Tensor:
    """``o * sigmoid(gate)`` for attention output rows o [T, nh * hd], the gate being each head's
    second half in the projection rows ``proj`` [T, >= 2 * nh * hd]."""
    T = o.shape[0]
    hd = o.shape[-1] // nh
    if (o.dim() != 2 or o.shape[1] != nh * hd or o.stride(1) != 1 or proj.shape[0] != T or proj.stride(1) != 1
            or proj.shape[-1] < 2 * nh * hd):
        raise ValueError("sigmoid_gate: o [T, nh * hd] and the gated projection rows [T, >= 2 nh hd] expected")
    y = torch.empty_like(o)
    _sigmoid_gate_kernel[(nh, T)](o, proj, y, o.stride(0), proj.stride(0), HD=hd, num_warps=4, **pdl_args(pdl, o))
    return y
