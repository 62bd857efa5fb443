"""The general W12 kernel, in Triton: ``y = x @ W.T`` decoding 12 KB records in registers.

It runs wherever Triton does (also under the interpreter: the CPU tests) and takes what the faster
kernels do not (:mod:`.routing`). Design (see docs/w12.md):

* a program owns ``BLOCK_N`` output channels and a contiguous range of k-tiles (split-K);
  per step it loads ``BLOCK_K/64`` records' slices with 16-byte loads (8-bit view as int64,
  nibbles as int32), decodes four bf16 pairs per 8 weights with a handful of 32-bit integer ops
  (:func:`.common.decode_pairs`), and multiplies them with x in one of four forms, the config's
  ``product``: ``fma`` on the CUDA cores (up to 8 rows), ``dot`` (one tensor-core dot per step on
  the joined tile, the decoded tile the A operand, x^T the B operand), ``dot8`` (eight dots per
  step, one per bf16 lane) or ``dot8t`` (the same with x as the A operand);
* the decoded values are ``w * 2**(112 - L_n)``; the row scale ``2**(L_n - 112)`` is applied in
  the epilogue, then the escape corrections ``x[:, k] * (w - 2**(L_n - 127))``;
* split-K partials go to a workspace; the last program of an output block (a counter, not an
  atomic on the data) sums them in split order, so the result is bitwise identical run to run.

The plain reference is :func:`.naive.w12_linear_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import tuning
from ..triton_env import interpreting, tl, triton  # sets TRITON_INTERPRET first on a machine without CUDA
from .common import (decode_pairs, esc_first, finalize, hi_bf16, hi_f32, lo_bf16, lo_f32, row_block, split_chunk,
                     split_workspace, sum_splits)
from .format import TILE_K
from .pack import KernelPack

if triton is not None:

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
        USE_SPLIT: tl.constexpr, PRODUCT: tl.constexpr, PREFETCH: tl.constexpr, QPASS: tl.constexpr, UPCAST: tl.constexpr,
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
        e_lo, e_hi, er0, contrib0 = esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0, M, N,
                                               stride_xm, BLOCK_N, ESC_CH)

        if PRODUCT == 0:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            # natural k of column q of the decoded tile (q = 4b + 2a + c -> 4a + 2b + c)
            q = tl.arange(0, BLOCK_K)
            qq = q % 8
            k_in_step = (q // 8) * 8 + ((qq & 1) | (((qq >> 2) & 1) << 1) | (((qq >> 1) & 1) << 2))
        elif PRODUCT == 1:
            if BLOCK_M == 1:
                acc2 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
            else:
                acc3 = tl.zeros((BLOCK_N, G, BLOCK_M), dtype=tl.float32)
        elif PRODUCT == 2:
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
            p0, p1, p2, p3 = decode_pairs(b_cur, n_cur, QPASS)
            kbase = t * 64
            if PRODUCT == 1 and BLOCK_M == 1:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + pid_m * stride_xm + k8
                acc2 += _fma_vec(lo_f32(p0), xk, 0, kv, k8, K)
                acc2 += _fma_vec(hi_f32(p0), xk, 1, kv, k8, K)
                acc2 += _fma_vec(lo_f32(p1), xk, 2, kv, k8, K)
                acc2 += _fma_vec(hi_f32(p1), xk, 3, kv, k8, K)
                acc2 += _fma_vec(lo_f32(p2), xk, 4, kv, k8, K)
                acc2 += _fma_vec(hi_f32(p2), xk, 5, kv, k8, K)
                acc2 += _fma_vec(lo_f32(p3), xk, 6, kv, k8, K)
                acc2 += _fma_vec(hi_f32(p3), xk, 7, kv, k8, K)
            elif PRODUCT == 1:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + offs_m[None, :] * stride_xm + k8[:, None]
                acc3 += _fma_lane(acc3, lo_f32(p0), xk, 0, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, hi_f32(p0), xk, 1, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, lo_f32(p1), xk, 2, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, hi_f32(p1), xk, 3, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, lo_f32(p2), xk, 4, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, hi_f32(p2), xk, 5, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, lo_f32(p3), xk, 6, kv, k8, K, m_mask)
                acc3 += _fma_lane(acc3, hi_f32(p3), xk, 7, kv, k8, K, m_mask)
            elif PRODUCT == 0:
                t01 = tl.join(p0, p1)
                t23 = tl.join(p2, p3)
                tt = tl.join(t01, t23)
                w5 = tl.join(lo_bf16(tt), hi_bf16(tt))
                w = tl.reshape(w5, (BLOCK_N, BLOCK_K))
                kk = kbase + k_in_step
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None],
                             mask=m_mask[None, :] & (((kk // 64) < t_end) & (kk < K))[:, None], other=0.0)
                acc = _mma(acc, w, xt, UPCAST)
            elif PRODUCT == 3:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + offs_m[:, None] * stride_xm + k8[None, :]
                acc_t = _mma_lane_t(acc_t, lo_bf16(p0), xk, 0, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, hi_bf16(p0), xk, 1, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, lo_bf16(p1), xk, 2, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, hi_bf16(p1), xk, 3, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, lo_bf16(p2), xk, 4, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, hi_bf16(p2), xk, 5, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, lo_bf16(p3), xk, 6, kv, k8, K, m_mask, UPCAST)
                acc_t = _mma_lane_t(acc_t, hi_bf16(p3), xk, 7, kv, k8, K, m_mask, UPCAST)
            else:
                k8 = kbase + j * 8
                kv = (t + g) < t_end
                xk = x_ptr + offs_m[None, :] * stride_xm + k8[:, None]
                acc = _mma_lane(acc, lo_bf16(p0), xk, 0, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, hi_bf16(p0), xk, 1, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, lo_bf16(p1), xk, 2, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, hi_bf16(p1), xk, 3, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, lo_bf16(p2), xk, 4, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, hi_bf16(p2), xk, 5, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, lo_bf16(p3), xk, 6, kv, k8, K, m_mask, UPCAST)
                acc = _mma_lane(acc, hi_bf16(p3), xk, 7, kv, k8, K, m_mask, UPCAST)
            b_cur, n_cur = b_nxt, n_nxt

        if PRODUCT == 1:
            if BLOCK_M == 1:
                acc = tl.reshape(tl.sum(acc2, axis=1), (BLOCK_N, 1))
            else:
                acc = tl.sum(acc3, axis=1)
        elif PRODUCT == 3:
            acc = tl.trans(acc_t)

        if not USE_SPLIT:
            finalize(acc, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er0, contrib0,
                      offs_n, offs_m, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH)
        else:
            blk = pid_m * NUM_N_BLOCKS + pid_n
            ws_base = ws_ptr + blk.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
            tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            tl.store(ws_base + pid_k * (BLOCK_N * BLOCK_M) + tile_offs, acc)
            tl.debug_barrier()
            count = tl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                total = sum_splits(ws_base, tile_offs, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT_CHUNK)
                tl.atomic_xchg(lock_ptr + blk, 0)
                finalize(total, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er0, contrib0,
                          offs_n, offs_m, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH)


PRODUCTS = {"dot": 0, "fma": 1, "dot8": 2, "dot8t": 3}
NUM_WARPS = 4
NUM_STAGES = 1


@dataclass(frozen=True)
class Config:
    """One variant: ``block_n`` output rows and ``block_k`` columns per step, ``split_k`` K ranges
    across programs, ``product``: ``fma`` (CUDA-core FMA, up to 8 rows), ``dot`` (one tensor-core dot
    per step on the joined tile), ``dot8`` (eight dots per step, one per bf16 lane) or ``dot8t`` (x
    the A operand); ``prefetch``: the next step's loads issued before this step's math (registers
    double-buffered)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    product: str = "fma"
    prefetch: bool = True

    def key(self) -> str:
        return f"{self.product}-n{self.block_n}-k{self.block_k}-s{self.split_k}-w{NUM_WARPS}{'-pf' if self.prefetch else ''}"

    def for_rows(self, m: int) -> "Config":
        """The same config made valid for m rows (the FMA form serves at most 8 rows)."""
        if self.product == "fma" and m > 8:
            return Config(self.block_n, max(self.block_k, 128), self.split_k, "dot8", self.prefetch)
        if self.product in ("dot8", "dot8t") and self.block_k < 128:
            return Config(self.block_n, 128, self.split_k, self.product, self.prefetch)
        return self


def gemm_block_m(m: int, product: str) -> int:
    """x rows per program: 1-8 for the FMA form, 16, 32 or 64 for the tensor-core forms."""
    return min(row_block(m), 8) if product == "fma" else max(16, row_block(m))


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Triton present (the general kernel takes any shape, any device Triton runs on)."""
    return triton is not None


def tuned_config(m: int, n: int, k: int, device=None) -> Config | None:
    """The table's config for ``m`` rows of the ``n x k`` layer (:mod:`specpilot.kernels.tuning`)."""
    found = tuning.lookup("w12", "gemm", tuning.device_arch(device) if device is not None else None, rows=m, n=n, k=k)
    return Config(**found[0]["config"]) if found else None


def default_config(m: int, n: int, k: int, *, device=None) -> Config:
    """The table's config, else a heuristic split for about 2 waves."""
    tuned = tuned_config(m, n, k, device)
    if tuned is not None:
        return tuned
    kt = (k + TILE_K - 1) // TILE_K
    product = "fma" if m <= 8 else "dot8"
    bn = 64 if product == "fma" else 128
    bk = 256 if kt >= 4 else 128 if product == "dot8" else 64
    blocks = (n + bn - 1) // bn
    split = 1
    while blocks * split < 264 and kt // (split * 2) >= bk // 64:
        split *= 2
    return Config(block_n=bn, block_k=bk, split_k=split, product=product)


def w12_gemm(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: Config | None = None,
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
    cfg = (config or default_config(m, n, k, device=x.device)).for_rows(m)
    bm = gemm_block_m(m, cfg.product)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    kt = packed.k_tiles
    recs = cfg.block_k // TILE_K
    tps = (kt + cfg.split_k - 1) // cfg.split_k
    tps = (tps + recs - 1) // recs * recs
    split = (kt + tps - 1) // tps
    nb = (n + cfg.block_n - 1) // cfg.block_n
    mb = (m + bm - 1) // bm
    ws, locks = split_workspace(x.device, nb * mb * split * cfg.block_n * bm if split > 1 else 1, nb * mb)
    esc_ch = max(1, min(16, 4096 // (cfg.block_n * bm)))
    esc_ch = 1 << (esc_ch.bit_length() - 1)
    grid = (nb, split, mb)
    _w12_gemm_kernel[grid](
        x, out, packed.rec64, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, BLOCK_K=cfg.block_k, USE_SPLIT=split > 1, PRODUCT=PRODUCTS[cfg.product],
        PREFETCH=cfg.prefetch, QPASS=qpass, UPCAST=interpreting(), ESC_CH=esc_ch,
        SPLIT_CHUNK=split_chunk(split, cfg.block_n * bm), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
