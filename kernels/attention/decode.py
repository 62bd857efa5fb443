"""Masked grouped-query attention as one split-KV Triton pass plus a fixed-order merge.

The same contract as :func:`.naive.masked_gqa_attention` (``q`` [T, nh, hd], ``k``/``v``
[nkv, S, hd], ``mask`` bool [T, S]), for AR decode and for chain/tree verification rows. Where
the reference launches a dozen kernels per layer (two batched GEMMs, scaling, masking, softmax,
casts and permutes), this is two:

1. ``_attn_split``: program (KV head, KV split, row block) holds the group's query rows of that
   head (row ``r = g * T + t``: group member ``g``, step row ``t``) and walks its slice of the
   cache in ``BLOCK_N`` tiles with an online softmax (float32 scores, max and sum). A tile no row
   may attend (the unused tail of a static cache, which CUDA graphs read whole) is skipped
   without loading its K and V, so a step reads only the live context.
2. ``_attn_merge``: per (KV head, row), combines the splits' partial outputs in split order -
   deterministic, no atomics.

Scores are accumulated in float32 from the cache dtype (``tl.dot``; IEEE float32 when the cache
is float32), probabilities enter the value product in the cache dtype as in the reference.
Runs on CUDA and under ``TRITON_INTERPRET=1`` (the CPU tests).
"""

from __future__ import annotations

import torch

from ..triton_env import pdl_args, tl, triton  # sets TRITON_INTERPRET first on a machine without CUDA

BLOCK_N = 64        # cache slots per tile
MAX_BLOCK_M = 64    # query rows per program (group members x step rows); more rows: more programs
TARGET_PROGRAMS = 256  # split the cache until about this many programs run (fills the SMs)

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": a row with nothing to attend in a split stays finite

    @triton.jit
    def _attn_split(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr,
                    T, S, R, chunk, scale,
                    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_mt,
                    GRP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr, PDL: tl.constexpr):
        if PDL:   # the fused decode chain: let the merge launch, then wait for q and the cache write
            gdc_launch_dependents()
            gdc_wait()
        kvh = tl.program_id(0)
        sp = tl.program_id(1)
        rb = tl.program_id(2)
        nsplit = tl.num_programs(1)
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < R
        g = rows // T
        t = rows % T
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + t[:, None] * stride_qt + (kvh * GRP + g)[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, S)
        for s0 in range(lo, hi, BLOCK_N):
            n = s0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            allowed = tl.load(mask_ptr + t[:, None] * stride_mt + n[None, :],
                              mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
            if tl.max(allowed.to(tl.int32)) > 0:  # skip tiles no row attends: K/V never loaded
                k = tl.load(k_ptr + kvh * stride_kh + n[:, None] * stride_ks + d[None, :], mask=n_ok[:, None],
                            other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(allowed, s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + kvh * stride_vh + n[:, None] * stride_vs + d[None, :], mask=n_ok[:, None],
                            other=0.0)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        base = (kvh * nsplit + sp) * R + rows  # workspace [nkv, nsplit, R, ...]
        tl.store(acc_ptr + base[:, None] * HD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _attn_merge(acc_ptr, ml_ptr, out_ptr, T, R, nsplit, stride_ot,
                    GRP: tl.constexpr, HD: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        kvh = tl.program_id(0)
        r = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        ok = sp < nsplit
        base = (kvh * nsplit + sp) * R + r
        m = tl.load(ml_ptr + base * 2, mask=ok, other=NEG)
        l_s = tl.load(ml_ptr + base * 2 + 1, mask=ok, other=0.0)
        w = tl.exp(m - tl.max(m, 0))
        d = tl.arange(0, HD)
        acc = tl.load(acc_ptr + base[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        g = r // T
        t = r % T
        tl.store(out_ptr + t * stride_ot + (kvh * GRP + g) * HD + d, o.to(out_ptr.dtype.element_ty))


if triton is not None:

    @triton.jit
    def _store_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_ch, stride_cs, stride_dh, stride_ds, HD: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + t)
        d = tl.arange(0, HD)
        tl.store(kc_ptr + h * stride_ch + slot * stride_cs + d, tl.load(k_ptr + t * stride_kt + h * stride_kh + d))
        tl.store(vc_ptr + h * stride_dh + slot * stride_ds + d, tl.load(v_ptr + t * stride_vt + h * stride_vh + d))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``k_cache[:, slots[t]] = k[t]`` (and V) for rows ``k``/``v`` [T, nkv, hd] into caches [nkv, S, hd]:
    one launch for both caches (torch's index_put is two launches of a generic kernel)."""
    T, nkv, hd = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv needs rows and caches contiguous in head_dim")
    _store_kv[(T, nkv)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), HD=hd,
                        num_warps=1)


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles these shapes (``tl.dot`` tiles need a power-of-two head_dim >= 16)."""
    return heads % kv_heads == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def plan(T: int, nh: int, nkv: int, S: int) -> tuple[int, int, int, int]:
    """(rows R, row block, row blocks, splits) for a step: enough programs to fill the GPU."""
    R = (nh // nkv) * T
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(R)))
    row_blocks = triton.cdiv(R, block_m)
    tiles = triton.cdiv(S, BLOCK_N)
    splits = max(1, min(tiles, triton.cdiv(TARGET_PROGRAMS, nkv * row_blocks)))
    return R, block_m, row_blocks, splits


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float, pdl: bool = False) -> torch.Tensor:
    """Fused masked GQA attention; output [T, nh * hd] in ``v``'s dtype (see the module doc).
    ``pdl``: launch both kernels with programmatic dependent launch (kernels/triton_env.pdl_args;
    the fused decode chain)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("the fused attention needs triton")
    T, nh, hd = q.shape
    nkv, S, _ = k.shape
    if not supports(nh, nkv, hd):
        raise ValueError(f"fused attention needs heads divisible by KV heads and a power-of-two head_dim >= 16 "
                         f"(got {nh} heads, {nkv} KV heads, head_dim {hd})")
    q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("fused attention needs K/V caches contiguous in head_dim")
    mask = mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8).contiguous()
    R, block_m, row_blocks, splits = plan(T, nh, nkv, S)
    chunk = triton.cdiv(triton.cdiv(S, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(S, chunk)
    acc = torch.empty(nkv, splits, R, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(nkv, splits, R, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(T, nh * hd, dtype=v.dtype, device=q.device)
    ieee = v.dtype == torch.float32
    _attn_split[(nkv, splits, row_blocks)](
        q, k, v, mask, acc, ml, T, S, R, chunk, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask.stride(0),
        GRP=nh // nkv, HD=hd, BLOCK_M=block_m, BLOCK_N=BLOCK_N, IEEE=ieee, num_warps=4, **pdl_args(pdl, q))
    _attn_merge[(nkv, R)](acc, ml, out, T, R, splits, out.stride(0), GRP=nh // nkv, HD=hd,
                          SPLITS=max(2, triton.next_power_of_2(splits)), num_warps=4, **pdl_args(pdl, q))
    return out
