"""Triton pieces shared by the W12 kernels (:mod:`.gemm`, :mod:`.gemv` and the fused decode kernels
of :mod:`specpilot.kernels.decode.gemv_w12`).

* the decode: :func:`decode_pairs` turns 8-bit views and nibbles into bf16 pairs in 32-bit words
  with a handful of integer ops (the values ``w * 2**(112 - L_n)``), :func:`lo_bf16` ... :func:`hi_f32`
  take the halves;
* the epilogue: :func:`esc_first` loads the block's escape range and first escapes early,
  :func:`finalize` applies the row scale ``2**(L_n - 112)`` and the exact escape corrections
  ``x[:, k] * (w - 2**(L_n - 127))`` and stores;
* split-K: partials go to a workspace (:func:`split_workspace`); the last program of an output
  block (a counter, not an atomic on the data) sums them in split order (:func:`sum_splits`), so
  results are bitwise identical run to run.
"""

from __future__ import annotations

from .. import workspace
from ..triton_env import tl, triton  # sets TRITON_INTERPRET first on a machine without CUDA


def row_block(m: int) -> int:
    """The power-of-two block of x rows that holds ``m`` rows (1 to 64; 64 above)."""
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def split_chunk(split: int, tile: int) -> int:
    """How many split-K partial tiles of ``tile`` values the last program sums per load: all of
    them (next power of two) when that stays within 4096 values, else fewer."""
    chunk = 1
    while chunk < split and 2 * chunk * tile <= 4096:
        chunk *= 2
    return chunk

def split_workspace(device, nbytes_f32: int, nlocks: int):
    """Split-K partials and per-block counters (zero between uses), shared by launches on a stream."""
    return workspace.scratch(device, "w12.partials", nbytes_f32), workspace.counters(device, "w12.blocks", nlocks)


if triton is not None:

    @triton.jit
    def decode_pairs(b64, n32, QPASS: tl.constexpr):
        """int64 [.., G] 8-bit views + int32 [.., G] nibbles -> 4 uint32 bf16-pair tensors."""
        be = b64.to(tl.uint32)
        bo = (b64 >> 32).to(tl.uint32)
        SGN: tl.constexpr = 0x80008000
        MAG: tl.constexpr = 0x07F007F0
        NIB: tl.constexpr = 0x000F000F
        EXP: tl.constexpr = 0x38003800
        if QPASS:
            ln0 = 0x00080008
            ln1 = 0x00080008
            ln2 = 0x00080008
            ln3 = 0x00080008
        else:
            nn = n32.to(tl.uint32)
            ln0 = nn & NIB
            ln1 = (nn >> 4) & NIB
            ln2 = (nn >> 8) & NIB
            ln3 = (nn >> 12) & NIB
        p0 = ((be << 8) & SGN) | ((be << 4) & MAG) | ln0 | EXP
        p1 = (be & SGN) | ((be >> 4) & MAG) | ln1 | EXP
        p2 = ((bo << 8) & SGN) | ((bo << 4) & MAG) | ln2 | EXP
        p3 = (bo & SGN) | ((bo >> 4) & MAG) | ln3 | EXP
        return p0, p1, p2, p3

    @triton.jit
    def lo_bf16(p):
        return (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def hi_bf16(p):
        return (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def lo_f32(p):
        return (p << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def hi_f32(p):
        return (p & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def sum_splits(ws_base, tile_offs, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    SPLIT_CHUNK: tl.constexpr):
        """The sum of the SPLIT_K partial tiles at ``ws_base``, SPLIT_CHUNK of them per load (one L2
        round trip per chunk, not per split: the last program's tail), in a fixed order, so the
        result is bitwise identical run to run."""
        sc = tl.arange(0, SPLIT_CHUNK)
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for s0 in range(0, SPLIT_K, SPLIT_CHUNK):
            sp = s0 + sc
            part = tl.load(ws_base + sp[:, None, None] * (BLOCK_N * BLOCK_M) + tile_offs[None, :, :],
                           mask=(sp < SPLIT_K)[:, None, None], other=0.0, cache_modifier=".cg")
            total += tl.sum(part, axis=0)
        return total

    @triton.jit
    def _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, offs_m, M, stride_xm, ESC_CH: tl.constexpr):
        """Escapes ``e .. e + ESC_CH`` (below ``e_hi``): their rows and ``x[:, col] * delta`` [CH, BM]."""
        idx = e + tl.arange(0, ESC_CH)
        em = idx < e_hi
        er = tl.load(erow_ptr + idx, mask=em, other=-1)
        ec = tl.load(ecol_ptr + idx, mask=em, other=0)
        ed = tl.load(edelta_ptr + idx, mask=em, other=0.0)
        xv = tl.load(x_ptr + offs_m[None, :] * stride_xm + ec[:, None],
                     mask=em[:, None] & (offs_m < M)[None, :], other=0.0).to(tl.float32)
        return er, xv * ed[:, None]

    @triton.jit
    def esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0, M, N, stride_xm,
                   BLOCK_N: tl.constexpr, ESC_CH: tl.constexpr):
        """The output block's escape range and its first chunk, loaded at the start of the kernel so
        that these three dependent loads are not paid in the tail (see :func:`finalize`)."""
        e_lo = tl.load(eptr_ptr + n0)
        e_hi = tl.load(eptr_ptr + tl.minimum(n0 + BLOCK_N, N))
        er, contrib = _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, offs_m, M, stride_xm, ESC_CH)
        return e_lo, e_hi, er, contrib

    @triton.jit
    def finalize(acc, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er, contrib,
                  offs_n, offs_m, M, N, stride_xm, stride_ym,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ESC_CH: tl.constexpr):
        """Row scale, exact escape corrections (the first chunk ``er``/``contrib`` from
        :func:`esc_first`, later chunks loaded here) and the store."""
        n_mask = offs_n < N
        m_mask = offs_m < M
        low = tl.load(low_ptr + offs_n, mask=n_mask, other=112).to(tl.int32)
        scale = ((low + (127 - 112)) << 23).to(tl.float32, bitcast=True)
        y = acc * scale[:, None]
        hit = er[None, :] == offs_n[:, None]                             # [BN, CH]
        y += tl.sum(tl.where(hit[:, :, None], contrib[None, :, :], 0.0), axis=1)
        for e in range(e_lo + ESC_CH, e_hi, ESC_CH):
            er2, contrib2 = _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, offs_m, M, stride_xm, ESC_CH)
            hit2 = er2[None, :] == offs_n[:, None]
            y += tl.sum(tl.where(hit2[:, :, None], contrib2[None, :, :], 0.0), axis=1)
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                 y.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])
