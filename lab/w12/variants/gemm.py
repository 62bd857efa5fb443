"""Fused W12 GEMM in Triton: ``y = x @ W.T`` decoding 12 KB records in registers.

Design (see docs/w12.md):
* a program owns ``BLOCK_N`` output channels and a contiguous range of k-tiles (split-K);
  per step it loads ``BLOCK_K/64`` records' slices with 16-byte loads (8-bit view as int64,
  nibbles as int32), decodes four bf16 pairs per 8 weights with a handful of 32-bit integer ops,
  and either feeds the tensor cores (``tl.dot``, the decoded tile is the A operand, x^T the B
  operand) or, for one row, multiplies on the CUDA cores (``GEMV`` variant);
* the decoded values are ``w * 2**(112 - L_n)``; the row scale ``2**(L_n - 112)`` is applied in
  the epilogue, then the escape corrections ``x[:, k] * (w - 2**(L_n - 127))``;
* split-K partials go to a workspace; the last program of an output block (a counter, not an
  atomic on the data) sums them in split order, so the result is bitwise identical run to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels import workspace
from specpilot.kernels.triton_env import interpreting, tl, triton  # sets TRITON_INTERPRET first without CUDA
from specpilot.kernels.w12.format import TILE_K
from specpilot.kernels.w12.pack import KernelPack


# ----------------------------------------------------------------------------------------------
# GPU layout
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _decode_pairs(b64, n32, QPASS: tl.constexpr):
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
    def _lo_bf16(p):
        return (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _hi_bf16(p):
        return (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _lo_f32(p):
        return (p << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _hi_f32(p):
        return (p & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_step(rec64_ptr, rec32_ptr, tile_row, t, t_end, g, jj, r, QPASS: tl.constexpr):
        rec = tile_row + t + g                              # [G] record index
        kmask = (t + g) < t_end
        b_idx = rec[None, :] * 1536 + r[:, None] * 8 + jj[None, :]
        b64 = tl.load(rec64_ptr + b_idx, mask=kmask[None, :], other=0)
        if QPASS:
            n32 = b64.to(tl.int32)
        else:
            n_idx = rec[None, :] * 3072 + 2048 + r[:, None] * 8 + jj[None, :]
            n32 = tl.load(rec32_ptr + n_idx, mask=kmask[None, :], other=0)
        return b64, n32

    @triton.jit
    def _fma_lane(acc3, wf, xk, i: tl.constexpr, kv, k8, K, m_mask):
        xv = tl.load(xk + i, mask=(kv & (k8 + i < K))[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
        return wf[:, :, None] * xv[None, :, :]

    @triton.jit
    def _fma_vec(wf, xk, i: tl.constexpr, kv, k8, K):
        xv = tl.load(xk + i, mask=kv & (k8 + i < K), other=0.0).to(tl.float32)
        return wf * xv[None, :]

    @triton.jit
    def _mma_lane_t(acc_t, wb, xk, i: tl.constexpr, kv, k8, K, m_mask, UPCAST: tl.constexpr):
        # x lane [BM, G] as the A operand, the decoded lane transposed [G, BN] as B (shared memory)
        xv = tl.load(xk + i, mask=m_mask[:, None] & (kv & (k8 + i < K))[None, :], other=0.0)
        if UPCAST:
            return acc_t + tl.dot(xv.to(tl.float32), tl.trans(wb).to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(xv.to(tl.bfloat16), tl.trans(wb), acc_t)

    @triton.jit
    def _mma(acc, w, xt, UPCAST: tl.constexpr):
        if UPCAST:
            return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(w, xt.to(tl.bfloat16), acc)

    @triton.jit
    def _mma_lane(acc, wb, xk, i: tl.constexpr, kv, k8, K, m_mask, UPCAST: tl.constexpr):
        xv = tl.load(xk + i, mask=(kv & (k8 + i < K))[:, None] & m_mask[None, :], other=0.0)
        return _mma(acc, wb, xv, UPCAST)

    @triton.jit
    def _w12_gemm_kernel(
        x_ptr, y_ptr, rec64_ptr, rec32_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_ym,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_SPLIT: tl.constexpr, MODE: tl.constexpr, PREFETCH: tl.constexpr, QPASS: tl.constexpr, UPCAST: tl.constexpr,
        ESC_CH: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        G: tl.constexpr = BLOCK_K // 8          # 8-weight groups per step
        RECS: tl.constexpr = BLOCK_K // 64    # records per step
        n0 = pid_n * BLOCK_N
        tn = n0 // 128
        r = (n0 % 128) + tl.arange(0, BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        j = tl.arange(0, G)
        g = j // 8
        jj = j % 8
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = tl.minimum(t_begin + TILES_PER_SPLIT, KT)
        tile_row = tn.to(tl.int64) * KT
        e_lo, e_hi, er0, contrib0 = _esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0, M, N,
                                               stride_xm, BLOCK_N, ESC_CH)

        if MODE == 0:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            # natural k of column q of the decoded tile (q = 4b + 2a + c -> 4a + 2b + c)
            q = tl.arange(0, BLOCK_K)
            qq = q % 8
            k_in_step = (q // 8) * 8 + ((qq & 1) | (((qq >> 2) & 1) << 1) | (((qq >> 1) & 1) << 2))
        elif MODE == 1:
            if BLOCK_M == 1:
                acc2 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
            else:
                acc3 = tl.zeros((BLOCK_N, G, BLOCK_M), dtype=tl.float32)
        elif MODE == 2:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        b_cur, n_cur = _load_step(rec64_ptr, rec32_ptr, tile_row, t_begin, t_end, g, jj, r, QPASS)
        for t in range(t_begin, t_end, RECS):
            if PREFETCH:  # registers double-buffered: next step's loads fly during this step's math
                b_nxt, n_nxt = _load_step(rec64_ptr, rec32_ptr, tile_row, t + RECS, t_end, g, jj, r, QPASS)
            else:
                b_cur, n_cur = _load_step(rec64_ptr, rec32_ptr, tile_row, t, t_end, g, jj, r, QPASS)
                b_nxt, n_nxt = b_cur, n_cur
            p0, p1, p2, p3 = _decode_pairs(b_cur, n_cur, QPASS)
            kbase = t * 64
            if MODE == 1 and BLOCK_M == 1:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + pid_m * stride_xm + k8
                acc2 += _fma_vec(_lo_f32(p0), xk, 0, kv, k8, K)
                acc2 += _fma_vec(_hi_f32(p0), xk, 1, kv, k8, K)
                acc2 += _fma_vec(_lo_f32(p1), xk, 2, kv, k8, K)
                acc2 += _fma_vec(_hi_f32(p1), xk, 3, kv, k8, K)
                acc2 += _fma_vec(_lo_f32(p2), xk, 4, kv, k8, K)
                acc2 += _fma_vec(_hi_f32(p2), xk, 5, kv, k8, K)
                acc2 += _fma_vec(_lo_f32(p3), xk, 6, kv, k8, K)
                acc2 += _fma_vec(_hi_f32(p3), xk, 7, kv, k8, K)
            elif MODE == 1:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + offs_m[None, :] * stride_xm + k8[:, None]
                acc3 += _fma_lane(acc3, _lo_f32(p0), xk, 0, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _hi_f32(p0), xk, 1, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _lo_f32(p1), xk, 2, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _hi_f32(p1), xk, 3, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _lo_f32(p2), xk, 4, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _hi_f32(p2), xk, 5, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _lo_f32(p3), xk, 6, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, _hi_f32(p3), xk, 7, kv, k8, K, m_mask)
            elif MODE == 0:
                t01 = tl.join(p0, p1)
                t23 = tl.join(p2, p3)
                tt = tl.join(t01, t23)
                w5 = tl.join(_lo_bf16(tt), _hi_bf16(tt))
                w = tl.reshape(w5, (BLOCK_N, BLOCK_K))
                kk = kbase + k_in_step
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None],
                             mask=m_mask[None, :] & (((kk // 64) < t_end) & (kk < K))[:, None], other=0.0)
                acc = _mma(acc, w, xt, UPCAST)
            elif MODE == 3:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + offs_m[:, None] * stride_xm + k8[None, :]
                acc_t = _mma_lane_t(acc_t, _lo_bf16(p0), xk, 0, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _hi_bf16(p0), xk, 1, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _lo_bf16(p1), xk, 2, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _hi_bf16(p1), xk, 3, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _lo_bf16(p2), xk, 4, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _hi_bf16(p2), xk, 5, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _lo_bf16(p3), xk, 6, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, _hi_bf16(p3), xk, 7, kv, k8, K, m_mask, UPCAST)
            else:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + offs_m[None, :] * stride_xm + k8[:, None]
                acc = _mma_lane(acc, _lo_bf16(p0), xk, 0, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _hi_bf16(p0), xk, 1, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _lo_bf16(p1), xk, 2, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _hi_bf16(p1), xk, 3, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _lo_bf16(p2), xk, 4, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _hi_bf16(p2), xk, 5, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _lo_bf16(p3), xk, 6, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, _hi_bf16(p3), xk, 7, kv, k8, K, m_mask, UPCAST)
            b_cur, n_cur = b_nxt, n_nxt

        if MODE == 1:
            if BLOCK_M == 1:
                acc = tl.reshape(tl.sum(acc2, axis=1), (BLOCK_N, 1))
            else:
                acc = tl.sum(acc3, axis=1)
        elif MODE == 3:
            acc = tl.trans(acc_t)

        if not USE_SPLIT:
            _finalize(acc, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er0, contrib0,
                      offs_n, offs_m, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH)
        else:
            blk = pid_m * NUM_N_BLOCKS + pid_n
            ws_base = ws_ptr + blk.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
            tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            tl.store(ws_base + pid_k * (BLOCK_N * BLOCK_M) + tile_offs, acc)
            tl.debug_barrier()
            count = tl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                total = _sum_splits(ws_base, tile_offs, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT_CHUNK)
                tl.atomic_xchg(lock_ptr + blk, 0)
                _finalize(total, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er0, contrib0,
                          offs_n, offs_m, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH)

    @triton.jit
    def _sum_splits(ws_base, tile_offs, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
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
    def _esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0, M, N, stride_xm,
                   BLOCK_N: tl.constexpr, ESC_CH: tl.constexpr):
        """The output block's escape range and its first chunk, loaded at the start of the kernel so
        that these three dependent loads are not paid in the tail (see :func:`_finalize`)."""
        e_lo = tl.load(eptr_ptr + n0)
        e_hi = tl.load(eptr_ptr + tl.minimum(n0 + BLOCK_N, N))
        er, contrib = _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, offs_m, M, stride_xm, ESC_CH)
        return e_lo, e_hi, er, contrib

    @triton.jit
    def _finalize(acc, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er, contrib,
                  offs_n, offs_m, M, N, stride_xm, stride_ym,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ESC_CH: tl.constexpr):
        """Row scale, exact escape corrections (the first chunk ``er``/``contrib`` from
        :func:`_esc_first`, later chunks loaded here) and the store."""
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


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------

MODES = {"dot": 0, "gemv": 1, "dot8": 2, "dot8t": 3}


@dataclass(frozen=True)
class Config:
    """One kernel variant. ``mode``: ``gemv`` (CUDA-core FMA, M <= 8), ``dot`` (one tensor-core
    dot per step on the joined tile) or ``dot8`` (eight dots per step, one per bf16 lane)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    mode: str = "gemv"
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = True

    def key(self) -> str:
        return (f"{self.mode}-n{self.block_n}-k{self.block_k}-s{self.split_k}-w{self.num_warps}"
                f"{'-pf' if self.prefetch else ''}")

    def for_rows(self, m: int) -> "Config":
        """The same config made valid for m rows (the FMA path serves at most 8 rows)."""
        if self.mode == "gemv" and m > 8:
            return Config(self.block_n, max(self.block_k, 128), self.split_k, "dot8", self.num_warps,
                          self.num_stages, self.prefetch)
        if self.mode in ("dot8", "dot8t") and self.block_k < 128:
            return Config(self.block_n, 128, self.split_k, self.mode, self.num_warps, self.num_stages,
                          self.prefetch)
        return self


def block_m_for(m: int, mode: str) -> int:
    if mode == "gemv":
        return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_config(m: int, n: int, k: int) -> Config:
    """A heuristic split for about 2 waves."""
    kt = (k + TILE_K - 1) // TILE_K
    mode = "gemv" if m <= 8 else "dot8"
    bn = 64 if mode == "gemv" else 128
    bk = 256 if kt >= 4 else 128 if mode == "dot8" else 64
    blocks = (n + bn - 1) // bn
    split = 1
    while blocks * split < 264 and kt // (split * 2) >= bk // 64:
        split *= 2
    return Config(block_n=bn, block_k=bk, split_k=split, mode=mode)


def bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def split_chunk(split: int, tile: int) -> int:
    """How many split-K partial tiles of ``tile`` values the last program sums per load: all of
    them (next power of two) when that stays within 4096 values, else fewer."""
    chunk = 1
    while chunk < split and 2 * chunk * tile <= 4096:
        chunk *= 2
    return chunk


def _workspace(device, nbytes_f32: int, nlocks: int):
    """Split-K partials and per-block counters (zero between uses), shared by launches on a stream."""
    return workspace.scratch(device, "w12.partials", nbytes_f32), workspace.counters(device, "w12.blocks", nlocks)


def w12_linear(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: Config | None = None,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` (bf16), W in W12 form; fp32 accumulation, deterministic."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = (config or default_config(m, n, k)).for_rows(m)
    bm = block_m_for(m, cfg.mode)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    kt = packed.k_tiles
    recs = cfg.block_k // TILE_K
    tps = (kt + cfg.split_k - 1) // cfg.split_k
    tps = (tps + recs - 1) // recs * recs
    split = (kt + tps - 1) // tps
    nb = (n + cfg.block_n - 1) // cfg.block_n
    mb = (m + bm - 1) // bm
    ws, locks = _workspace(x.device, nb * mb * split * cfg.block_n * bm if split > 1 else 1, nb * mb)
    esc_ch = max(1, min(16, 4096 // (cfg.block_n * bm)))
    esc_ch = 1 << (esc_ch.bit_length() - 1)
    grid = (nb, split, mb)
    _w12_gemm_kernel[grid](
        x, out, packed.rec64, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, BLOCK_K=cfg.block_k, USE_SPLIT=split > 1, MODE=MODES[cfg.mode], PREFETCH=cfg.prefetch,
        QPASS=qpass, UPCAST=interpreting(), ESC_CH=esc_ch, SPLIT_CHUNK=split_chunk(split, cfg.block_n * bm),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
