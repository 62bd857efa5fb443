"""The multi-row step's small kernels, one per step between two GEMMs, rounding like the layers.

Where a layer's projections run as separate GEMMs (cuBLAS, or the W12 GEMM ``w12_linear``), the
work between two GEMMs is one kernel each, not the layer modules' five to ten:

* :func:`rms_norm_rows`: RMSNorm of every row (the model's final norm, and a layer's first one);
* :func:`add_rms_norm_rows`: the residual add after a projection and the next RMSNorm;
* :func:`rope_store_rows`: RoPE of q and k at each row's position, K and V into the caches at
  each row's slot, q written out (the layer's split, two RoPEs and the cache write);
* :func:`silu_mul_rows`: ``silu(gate) * up``.

In an FP8 Q pass (:mod:`specpilot.kernels.fp8`) a GEMM's product comes as split rows, which the
kernel after it recombines as it reads them (``add_rms_norm_rows``, ``rope_store_rows``,
``silu_mul_rows``), and the normed rows going into the next GEMM leave split into e4m3 parts
(``rms_norm_rows`` and ``add_rms_norm_rows`` with ``quant``): no launch of their own for either.

Each rounds where ``engine/model.py`` rounds (:mod:`.naive` is that arithmetic); RMSNorm sums
the squares in another order and ``exp`` is the GPU's, so results agree to the last bits. Launched with programmatic dependent launch like the fused
chain (they read nothing the previous kernel writes before ``gdc_wait``).
"""

from __future__ import annotations

import torch

from specpilot.kernels.fp8.rows import SplitRows
from specpilot.kernels.triton_env import pdl_args, tl, triton
from specpilot.kernels.verify import common

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from specpilot.kernels.fp8.rows import load_split, quant_hilo

    @triton.jit
    def rope_round(x, y, c, s, dt: tl.constexpr):
        """One RoPE output ``x * c + y * s`` (float32 operands; ``y`` the pair's other half, negated
        for the first half) rounded as the layers round: each product to ``dt``, then their sum."""
        return ((x * c).to(dt).to(tl.float32) + (y * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _norm(xf, g_ptr, k, K, eps, dt: tl.constexpr):
        """``rms_norm`` of one row in fp32 registers (``xf`` [XP], zero past K)."""
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return (g * (xf * rstd).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _rms_norm_rows_kernel(x_ptr, g_ptr, y_ptr, qs_ptr, K, T, stride_x, stride_y, eps, XP: tl.constexpr,
                              QUANT: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        k = tl.arange(0, XP)
        xf = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        if QUANT:   # y: split e4m3 rows [2T, K], scales at qs
            quant_hilo(_norm(xf, g_ptr, k, K, eps, x_ptr.dtype.element_ty).to(tl.float32), k, K, y_ptr, qs_ptr, t, T,
                       stride_y)
        else:
            tl.store(y_ptr + t * stride_y + k, _norm(xf, g_ptr, k, K, eps, y_ptr.dtype.element_ty), mask=k < K)

    @triton.jit
    def _add_rms_norm_rows_kernel(x_ptr, d_ptr, ds_ptr, g_ptr, s_ptr, y_ptr, qs_ptr, K, T, stride_x, stride_d,
                                  stride_s, stride_y, eps, XP: tl.constexpr, SPLIT: tl.constexpr,
                                  QUANT: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        k = tl.arange(0, XP)
        dt = s_ptr.dtype.element_ty
        xv = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        if SPLIT:   # delta: split rows [2T, K] with scales at ds (an FP8 GEMM's product)
            dv = load_split(d_ptr, ds_ptr, t, T, stride_d, k, k < K, dt).to(tl.float32)
        else:
            dv = tl.load(d_ptr + t * stride_d + k, mask=k < K, other=0.0).to(tl.float32)
        s = (xv + dv).to(dt)
        tl.store(s_ptr + t * stride_s + k, s, mask=k < K)
        y = _norm(s.to(tl.float32), g_ptr, k, K, eps, dt)
        if QUANT:
            quant_hilo(y.to(tl.float32), k, K, y_ptr, qs_ptr, t, T, stride_y)
        else:
            tl.store(y_ptr + t * stride_y + k, y, mask=k < K)

    @triton.jit
    def _rope_store_rows_kernel(qkv_ptr, qkvs_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, req_ptr, q_ptr, kc_ptr, vc_ptr,
                                T, stride_t, stride_q, stride_rot, stride_cb, stride_ch, stride_cs, stride_db,
                                stride_dh, stride_ds, NH, NKV, HD: tl.constexpr, REQ: tl.constexpr,
                                SPLIT: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        if REQ:   # continuous batching: the row's request owns cache slot req[t]
            r = tl.load(req_ptr + t).to(tl.int64)
            kc_ptr += r * stride_cb
            vc_ptr += r * stride_db
        HALF: tl.constexpr = HD // 2
        d = tl.arange(0, HALF)
        dt = q_ptr.dtype.element_ty
        if SPLIT:   # qkv: split rows [2T, N] with scales at qkvs (an FP8 GEMM's product)
            a = load_split(qkv_ptr, qkvs_ptr, t, T, stride_t, h * HD + d, d < HALF, dt)
            b = load_split(qkv_ptr, qkvs_ptr, t, T, stride_t, h * HD + d + HALF, d < HALF, dt)
        else:
            a = tl.load(qkv_ptr + t * stride_t + h * HD + d)
            b = tl.load(qkv_ptr + t * stride_t + h * HD + d + HALF)
        if h < NH + NKV:
            pos = tl.load(pos_ptr + t)
            c1 = tl.load(cos_ptr + pos * stride_rot + d).to(dt).to(tl.float32)
            c2 = tl.load(cos_ptr + pos * stride_rot + d + HALF).to(dt).to(tl.float32)
            s1 = tl.load(sin_ptr + pos * stride_rot + d).to(dt).to(tl.float32)
            s2 = tl.load(sin_ptr + pos * stride_rot + d + HALF).to(dt).to(tl.float32)
            af = a.to(tl.float32)
            bf = b.to(tl.float32)
            ra = rope_round(af, -bf, c1, s1, dt)
            rb = rope_round(bf, af, c2, s2, dt)
            if h < NH:
                tl.store(q_ptr + t * stride_q + h * HD + d, ra)
                tl.store(q_ptr + t * stride_q + h * HD + d + HALF, rb)
            else:
                slot = tl.load(slot_ptr + t)
                base = kc_ptr + (h - NH) * stride_ch + slot * stride_cs
                tl.store(base + d, ra)
                tl.store(base + d + HALF, rb)
        else:
            slot = tl.load(slot_ptr + t)
            base = vc_ptr + (h - NH - NKV) * stride_dh + slot * stride_ds
            tl.store(base + d, a)
            tl.store(base + d + HALF, b)

    @triton.jit
    def _silu_mul_rows_kernel(gu_ptr, gus_ptr, y_ptr, INTER, T, stride_g, stride_y, BLOCK: tl.constexpr,
                              SPLIT: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        dt = y_ptr.dtype.element_ty
        if SPLIT:   # gu: split rows [2T, 2 INTER] with scales at gus (an FP8 GEMM's product)
            g = load_split(gu_ptr, gus_ptr, t, T, stride_g, c, c < INTER, dt).to(tl.float32)
            u = load_split(gu_ptr, gus_ptr, t, T, stride_g, INTER + c, c < INTER, dt).to(tl.float32)
        else:
            g = tl.load(gu_ptr + t * stride_g + c, mask=c < INTER, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + t * stride_g + INTER + c, mask=c < INTER, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt)
        tl.store(y_ptr + t * stride_y + c, (s.to(tl.float32) * u).to(dt), mask=c < INTER)


def _rows(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: rows [T, K] contiguous in K expected, got {tuple(x.shape)}")


def _warps(K: int) -> int:
    return 4 if K <= 4096 else 8


def _split_out(T: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(2 * T, K, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(2 * T, dtype=torch.float32, device=device))


def rms_norm_rows(x: torch.Tensor, gamma: torch.Tensor, eps: float, quant: bool = False):
    """``rms_norm`` of every row of x [T, K]; with ``quant`` the normed rows as split e4m3 rows
    (:class:`~specpilot.kernels.fp8.rows.SplitRows`, for an FP8 GEMM)."""
    _rows(x)
    T, K = x.shape
    y, qs = _split_out(T, K, x.device) if quant else (torch.empty_like(x), x)
    _rms_norm_rows_kernel[(T,)](x, gamma, y, qs, K, T, x.stride(0), y.stride(0), float(eps),
                                XP=triton.next_power_of_2(K), QUANT=quant, num_warps=_warps(K),
                                **pdl_args(common.USE_PDL, x))
    return SplitRows(y, qs, x.dtype) if quant else y


def add_rms_norm_rows(x: torch.Tensor, delta, gamma: torch.Tensor, eps: float, quant: bool = False):
    """``s = x + delta`` (each row) and ``rms_norm(s)``: returns (s, normed). ``delta`` may be split
    rows (an FP8 GEMM's product, recombined here); with ``quant`` the normed rows leave as split
    e4m3 rows."""
    _rows(x)
    split = isinstance(delta, SplitRows)
    d = delta.data if split else delta
    _rows(d, "delta")
    if tuple(delta.shape) != tuple(x.shape):
        raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    T, K = x.shape
    s = torch.empty_like(x)
    y, qs = _split_out(T, K, x.device) if quant else (torch.empty_like(x), x)
    _add_rms_norm_rows_kernel[(T,)](x, d, delta.scale if split else x, gamma, s, y, qs, K, T, x.stride(0),
                                    d.stride(0), s.stride(0), y.stride(0), float(eps), XP=triton.next_power_of_2(K),
                                    SPLIT=split, QUANT=quant, num_warps=_warps(K), **pdl_args(common.USE_PDL, x))
    return s, (SplitRows(y, qs, x.dtype) if quant else y)


def rope_store_rows(qkv, cos, sin, pos, slots, k_cache, v_cache, nh: int, nkv: int,
                    req: torch.Tensor | None = None) -> torch.Tensor:
    """q/k/v rows [T, (nh + 2 nkv) hd] (or split rows, recombined here) -> q [T, nh * hd] with RoPE
    at ``pos`` [T]; K (RoPE) and V written to the caches [nkv, S, hd] at ``slots`` [T]. With ``req``
    [T] (continuous batching) the caches are [requests, nkv, S, hd] and row t writes to request
    ``req[t]``'s."""
    split = isinstance(qkv, SplitRows)
    data = qkv.data if split else qkv
    _rows(data, "qkv")
    T, N = qkv.shape
    hd = k_cache.shape[-1]
    if N != (nh + 2 * nkv) * hd or hd & (hd - 1) or hd < 2:
        raise ValueError(f"qkv must have (nh + 2 nkv) * hd columns, hd a power of two (got {N}, nh={nh}, "
                         f"nkv={nkv}, hd={hd})")
    kc, vc = common.request_caches(T, k_cache, v_cache, req)
    common.check_rope_store(T, hd, cos, sin, pos, slots, k_cache, v_cache)
    q = torch.empty(T, nh * hd, dtype=qkv.dtype, device=data.device)
    _rope_store_rows_kernel[(T, nh + 2 * nkv)](
        data, qkv.scale if split else data, cos, sin, pos, slots, pos if req is None else req, q, kc, vc, T,
        data.stride(0), q.stride(0), cos.stride(0), *kc.stride()[:3], *vc.stride()[:3], nh, nkv, HD=hd,
        REQ=req is not None, SPLIT=split, num_warps=1, **pdl_args(common.USE_PDL, data))
    return q


def silu_mul_rows(gu, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of rows [T, 2 inter] (gate columns first; or split rows, recombined
    here): [T, inter]."""
    split = isinstance(gu, SplitRows)
    data = gu.data if split else gu
    _rows(data, "gu")
    T, N = gu.shape
    if N != 2 * inter:
        raise ValueError(f"gate/up rows must have 2 * inter = {2 * inter} columns, got {N}")
    y = torch.empty(T, inter, dtype=gu.dtype, device=data.device)
    block = 1024
    _silu_mul_rows_kernel[(T, triton.cdiv(inter, block))](data, gu.scale if split else data, y, inter, T,
                                                         data.stride(0), y.stride(0), BLOCK=block, SPLIT=split,
                                                         num_warps=4, **pdl_args(common.USE_PDL, data))
    return y
