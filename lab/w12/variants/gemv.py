"""Streaming W12 GEMV for one to 16 rows: ``y = x @ W.T`` at the speed of the weight bytes.

The general kernel (:mod:`.gemm`) indexes records per 8-weight group, which Triton turns into
8-byte and 4-byte loads of the records and one 2-byte load per x element and lane. This kernel
is written for the decode regime (few rows, where the bytes matter most):

* a program owns ``BLOCK_N`` rows of one 128-row record tile and a contiguous range of k-tiles
  (split-K); per record it loads its rows' 8-bit view as an ``[BLOCK_N, 8]`` int64 tile and the low
  nibbles as an ``[BLOCK_N, 8]`` int32 tile, both contiguous along the last axis, so the loads are
  16-byte and 8-byte vector loads with no masks (records are padded to whole tiles);
* ``RECS`` records are loaded per iteration and, with ``PREFETCH``, the next iteration's records
  are issued before this iteration's math, so enough bytes are in flight to cover DRAM latency;
  with ``STAGES`` > 1 Triton's software pipeline does it instead (``cp.async`` into shared memory);
* x is read as bf16 pairs (int32), one load per pair and group, shared by all weight rows of the
  program; up to 16 input rows (``MB``) share each decoded weight;
* decode is the same 32-bit integer recipe as :func:`.gemm._decode_pairs`, the pair halves become
  fp32 with one shift or mask, fp32 accumulation;
* the epilogue (row scale, exact escape corrections, fixed-order split-K reduction) is the general
  kernel's, so results are bitwise identical run to run.

The plain reference is :func:`.naive.w12_linear_ref`; tests compare both, on the CPU under
``TRITON_INTERPRET=1`` and on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.w12.format import TILE_K, TILE_N
from .gemm import KernelPack, _workspace, bucket, split_chunk, tl, triton

if triton is not None:
    from .gemm import _decode_pairs, _esc_first, _finalize, _sum_splits
    from .gemm import _hi_f32 as _hi
    from .gemm import _lo_f32 as _lo

    @triton.jit
    def _load_rec(rec64_ptr, rec32_ptr, rec, rr, jj, QPASS: tl.constexpr):
        b = tl.load(rec64_ptr + rec * 1536 + rr[:, None] * 8 + jj[None, :])
        if QPASS:
            n = b.to(tl.int32)
        else:
            n = tl.load(rec32_ptr + rec * 3072 + 2048 + rr[:, None] * 8 + jj[None, :])
        return b, n

    @triton.jit
    def _rec_fma(acc, b, n, xrow, rm, t, jj, KH, M_LEFT, stride_x32m, MB: tl.constexpr, QPASS: tl.constexpr):
        """acc += the record's decoded weights times x. One row (``MB == 1``): acc ``[BLOCK_N, 8]``;
        more rows: acc ``[MB, BLOCK_N, 8]``, each weight decoded once for all of them."""
        p0, p1, p2, p3 = _decode_pairs(b, n, QPASS)
        # the record's 32 x pairs per row as [8 groups, 4 pairs] (16-byte loads), split into columns
        xi = t * 32 + jj[:, None] * 4 + tl.arange(0, 4)[None, :]
        if MB == 1:
            xt = tl.load(xrow + xi, mask=xi < KH, other=0).to(tl.uint32)
            xa, xb = tl.split(tl.reshape(xt, (8, 2, 2)))
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            acc += _lo(p0) * _lo(x0)[None, :]
            acc += _hi(p0) * _hi(x0)[None, :]
            acc += _lo(p1) * _lo(x1)[None, :]
            acc += _hi(p1) * _hi(x1)[None, :]
            acc += _lo(p2) * _lo(x2)[None, :]
            acc += _hi(p2) * _hi(x2)[None, :]
            acc += _lo(p3) * _lo(x3)[None, :]
            acc += _hi(p3) * _hi(x3)[None, :]
        else:
            xmask = (rm[:, None, None] < M_LEFT) & (xi < KH)[None, :, :]
            xt = tl.load(xrow + rm[:, None, None] * stride_x32m + xi[None, :, :], mask=xmask, other=0).to(tl.uint32)
            xa, xb = tl.split(tl.reshape(xt, (MB, 8, 2, 2)))
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            acc += _lo(p0)[None, :, :] * _lo(x0)[:, None, :]
            acc += _hi(p0)[None, :, :] * _hi(x0)[:, None, :]
            acc += _lo(p1)[None, :, :] * _lo(x1)[:, None, :]
            acc += _hi(p1)[None, :, :] * _hi(x1)[:, None, :]
            acc += _lo(p2)[None, :, :] * _lo(x2)[:, None, :]
            acc += _hi(p2)[None, :, :] * _hi(x2)[:, None, :]
            acc += _lo(p3)[None, :, :] * _lo(x3)[:, None, :]
            acc += _hi(p3)[None, :, :] * _hi(x3)[:, None, :]
        return acc

    @triton.jit
    def _load_step(rec64_ptr, rec32_ptr, rec, rr, jj, RECS: tl.constexpr, QPASS: tl.constexpr):
        """The RECS records of one iteration, from record ``rec`` (unused slots repeat the first)."""
        b0, n0 = _load_rec(rec64_ptr, rec32_ptr, rec, rr, jj, QPASS)
        b1, n1, b2, n2, b3, n3 = b0, n0, b0, n0, b0, n0
        if RECS >= 2:
            b1, n1 = _load_rec(rec64_ptr, rec32_ptr, rec + 1, rr, jj, QPASS)
        if RECS >= 4:
            b2, n2 = _load_rec(rec64_ptr, rec32_ptr, rec + 2, rr, jj, QPASS)
            b3, n3 = _load_rec(rec64_ptr, rec32_ptr, rec + 3, rr, jj, QPASS)
        return b0, n0, b1, n1, b2, n2, b3, n3

    @triton.jit
    def _step_fma(acc, b0, n0, b1, n1, b2, n2, b3, n3, xrow, rm, t, jj, KH, M_LEFT, stride_x32m,
                  MB: tl.constexpr, RECS: tl.constexpr, QPASS: tl.constexpr):
        acc = _rec_fma(acc, b0, n0, xrow, rm, t, jj, KH, M_LEFT, stride_x32m, MB, QPASS)
        if RECS >= 2:
            acc = _rec_fma(acc, b1, n1, xrow, rm, t + 1, jj, KH, M_LEFT, stride_x32m, MB, QPASS)
        if RECS >= 4:
            acc = _rec_fma(acc, b2, n2, xrow, rm, t + 2, jj, KH, M_LEFT, stride_x32m, MB, QPASS)
            acc = _rec_fma(acc, b3, n3, xrow, rm, t + 3, jj, KH, M_LEFT, stride_x32m, MB, QPASS)
        return acc

    @triton.jit
    def _w12_gemv_kernel(
        x_ptr, x32_ptr, y_ptr, rec64_ptr, rec32_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KH, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_x32m, stride_ym,
        BLOCK_N: tl.constexpr, MB: tl.constexpr, RECS: tl.constexpr, PREFETCH: tl.constexpr,
        STAGES: tl.constexpr, USE_SPLIT: tl.constexpr, QPASS: tl.constexpr, ESC_CH: tl.constexpr,
        SPLIT_CHUNK: tl.constexpr, ESC_EARLY: tl.constexpr,
    ):
        pid_m = tl.program_id(0)      # row blocks of x next to each other: they share the weight bytes in L2
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        n0 = pid_n * BLOCK_N
        rr = (n0 % 128) + tl.arange(0, BLOCK_N)
        jj = tl.arange(0, 8)
        rm = tl.arange(0, MB)
        offs_m = pid_m * MB + rm
        xrow = x32_ptr + pid_m * MB * stride_x32m
        M_LEFT = M - pid_m * MB
        tile_row = (n0 // 128).to(tl.int64) * KT
        t_begin = pid_k * TILES_PER_SPLIT
        t_end = tl.minimum(t_begin + TILES_PER_SPLIT, KT)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if ESC_EARLY:   # the escape range and first chunk now, off the tail
            e_lo, e_hi, er0, contrib0 = _esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0, M, N,
                                                   stride_xm, BLOCK_N, ESC_CH)
        if MB == 1:
            acc = tl.zeros((BLOCK_N, 8), dtype=tl.float32)
        else:
            acc = tl.zeros((MB, BLOCK_N, 8), dtype=tl.float32)

        if STAGES > 1:
            # the compiler's software pipeline (asynchronous copies STAGES - 1 iterations ahead)
            for t in tl.range(t_begin, t_end, RECS, num_stages=STAGES):
                b0, n0_, b1, n1, b2, n2, b3, n3 = _load_step(rec64_ptr, rec32_ptr, tile_row + t, rr, jj, RECS, QPASS)
                acc = _step_fma(acc, b0, n0_, b1, n1, b2, n2, b3, n3, xrow, rm, t, jj, KH, M_LEFT, stride_x32m,
                                MB, RECS, QPASS)
        else:
            # RECS records per iteration; the launcher makes every split a whole number of iterations
            b0, n0_, b1, n1, b2, n2, b3, n3 = _load_step(rec64_ptr, rec32_ptr, tile_row + t_begin, rr, jj, RECS, QPASS)
            for t in range(t_begin, t_end, RECS):
                # next iteration's records (clamped to the last step: always a valid address), issued
                # before this iteration's math with PREFETCH, after it without
                if PREFETCH:
                    tn = tl.minimum(t + RECS, t_end - RECS)
                    c0, m0, c1, m1, c2, m2, c3, m3 = _load_step(rec64_ptr, rec32_ptr, tile_row + tn, rr, jj, RECS, QPASS)
                acc = _step_fma(acc, b0, n0_, b1, n1, b2, n2, b3, n3, xrow, rm, t, jj, KH, M_LEFT, stride_x32m,
                                MB, RECS, QPASS)
                if not PREFETCH:
                    tn = tl.minimum(t + RECS, t_end - RECS)
                    c0, m0, c1, m1, c2, m2, c3, m3 = _load_step(rec64_ptr, rec32_ptr, tile_row + tn, rr, jj, RECS, QPASS)
                b0, n0_, b1, n1, b2, n2, b3, n3 = c0, m0, c1, m1, c2, m2, c3, m3

        if MB == 1:
            out = tl.reshape(tl.sum(acc, axis=1), (BLOCK_N, 1))
        else:
            out = tl.trans(tl.sum(acc, axis=2))          # [BLOCK_N, MB]
        if not USE_SPLIT:
            if not ESC_EARLY:
                e_lo, e_hi, er0, contrib0 = _esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0, M,
                                                       N, stride_xm, BLOCK_N, ESC_CH)
            _finalize(out, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er0, contrib0,
                      offs_n, offs_m, M, N, stride_xm, stride_ym, BLOCK_N, MB, ESC_CH)
        else:
            blk = pid_m * NUM_N_BLOCKS + pid_n
            ws_base = ws_ptr + blk.to(tl.int64) * (SPLIT_K * BLOCK_N * MB)
            offs = tl.arange(0, BLOCK_N)[:, None] * MB + tl.arange(0, MB)[None, :]
            tl.store(ws_base + pid_k * (BLOCK_N * MB) + offs, out)
            tl.debug_barrier()
            count = tl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                total = _sum_splits(ws_base, offs, SPLIT_K, BLOCK_N, MB, SPLIT_CHUNK)
                tl.atomic_xchg(lock_ptr + blk, 0)
                if not ESC_EARLY:
                    e_lo, e_hi, er0, contrib0 = _esc_first(x_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, offs_m, n0,
                                                           M, N, stride_xm, BLOCK_N, ESC_CH)
                _finalize(total, x_ptr, y_ptr, low_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, er0, contrib0,
                          offs_n, offs_m, M, N, stride_xm, stride_ym, BLOCK_N, MB, ESC_CH)


@dataclass(frozen=True)
class GemvConfig:
    """``block_n`` weight rows per program (divides 128), ``recs`` records per iteration, ``split_k``;
    ``rows``: input rows per program (each weight is decoded once for them; 0 = all rows, up to 16);
    ``stages`` > 1: the compiler's software pipeline instead of the register double buffer;
    ``early_esc``: load the block's escapes at the start (off the tail) rather than at the end."""

    block_n: int = 64
    recs: int = 2
    split_k: int = 1
    num_warps: int = 4
    prefetch: bool = True
    rows: int = 0
    stages: int = 1
    early_esc: bool = True

    def key(self) -> str:
        pipe = f"-st{self.stages}" if self.stages > 1 else "-pf" if self.prefetch else ""
        return (f"gemv3-n{self.block_n}-r{self.recs}-s{self.split_k}-w{self.num_warps}-m{self.rows}{pipe}"
                f"{'' if self.early_esc else '-le'}")


MAX_ROWS = 16  # input rows one program decodes the weights for; more rows go to the general kernel


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """The streaming GEMV needs at most 16 bf16/fp16 rows of even length (x is read as 32-bit pairs)."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] % 2 == 0 and x.stride(1) == 1
            and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0 and x.element_size() == 2)


def default_config(m: int, n: int, k: int, sms: int = 132) -> GemvConfig:
    """Split-K for about three programs per SM."""
    kt = (k + TILE_K - 1) // TILE_K
    bn = 32 if n < 16384 else 64        # what the sweep chose: 2 warps, 2 records per step
    recs = 2 if kt % 2 == 0 else 1
    blocks = (n + bn - 1) // bn * ((m + MAX_ROWS - 1) // MAX_ROWS)
    split = max(1, min(kt // recs, round(8 * sms / blocks)))
    return GemvConfig(bn, recs, split, num_warps=2)


def w12_gemv(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: GemvConfig | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for a few rows (``supported(x, packed)``), fp32 accumulation, deterministic."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")
    if not supported(x, packed):
        raise ValueError(f"w12_gemv needs at most {MAX_ROWS} contiguous bf16/fp16 rows of even length")
    m, k = x.shape
    n = packed.shape[0]
    cfg = config or default_config(m, n, k)
    if TILE_N % cfg.block_n:
        raise ValueError(f"block_n {cfg.block_n} must divide {TILE_N}")
    kt = packed.k_tiles
    recs = cfg.recs
    while kt % recs:
        recs //= 2
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    tps = (kt + cfg.split_k - 1) // cfg.split_k
    tps = (tps + recs - 1) // recs * recs
    split = (kt + tps - 1) // tps
    nb = (n + cfg.block_n - 1) // cfg.block_n
    mb = min(bucket(cfg.rows or m), bucket(m))   # rows per program: a power of two (m <= 16 here)
    grid_m = (m + mb - 1) // mb
    ws, locks = _workspace(x.device, nb * grid_m * split * cfg.block_n * mb if split > 1 else 1, nb * grid_m)
    esc_ch = max(1, 16 // mb)
    x32 = x.view(torch.int32)
    _w12_gemv_kernel[(grid_m, nb, split)](
        x, x32, out, packed.rec64, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, k // 2, kt, tps, nb, split,
        x.stride(0), x32.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, MB=mb, RECS=recs, PREFETCH=cfg.prefetch, STAGES=cfg.stages,
        USE_SPLIT=split > 1, QPASS=qpass, ESC_CH=esc_ch, SPLIT_CHUNK=split_chunk(split, cfg.block_n * mb),
        ESC_EARLY=cfg.early_esc,
        num_warps=cfg.num_warps, num_stages=1,
    )
    return out
