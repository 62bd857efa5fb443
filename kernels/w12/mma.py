"""W12 GEMM on the tensor cores for 2-64 rows, written in Gluon so the decode lands in the MMA
fragment layout (the decoded weights never go through shared memory).

Why Gluon: in plain Triton the decoded weight tile keeps the layout it was loaded in, and ``tl.dot``
moves it into the operand layout through shared memory (2-byte stores); that, not HBM, bounds the
general kernel (:mod:`.gemm`) at 0.3-0.6x of cuBLAS with 8-64 rows. Gluon lets the kernel choose
the register layout of every tensor, so here the record words are *loaded* in a layout whose
decoded bf16 pairs are exactly the ``mma.sync.m16n8k16`` A-operand registers (:mod:`.fragments`),
and the B operand (x) is 16 consecutive bf16 of one x row per thread, read from shared memory.

The record words arrive either straight into those registers, ``depth`` records ahead (the
register ring; ``unroll``: ``depth`` sets reloaded in place), or (``wsmem``) through a ``cp.async``
shared-memory ring shared with x, which holds no registers for bytes in flight (the register ring
caps occupancy at 25 % with 2-3 records ahead); the raw words are then read from shared memory in
the same layout, 16-byte loads, conflict-free. With ``tma`` a config runs on :mod:`.mma_tma`
instead (TMA copies and mbarriers, warp-specialized; Hopper).

The record is ``[128 rows, 64 k]``: 8 KB of 8-bit views (64 bytes per row, words ``(w0, w2, w1,
w3)``), then 4 KB of low nibbles (32 bytes per row, a word per 8 weights); see docs/w12.md. The
epilogue (:mod:`.gluon_epilogue`: row scale ``2**(L_n - 112)``, exact escape corrections ``x[:, k]
* (w - slot)``, fixed-order split-K reduction through a workspace and a per-block counter) makes
results bitwise identical run to run, like the other W12 kernels. The plain reference is
:func:`.naive.w12_linear_ref`.

Gluon kernels do not run under Triton's interpreter; on a machine without CUDA the layouts are
still built and the kernel still compiles for sm_90 (tests do both), and ``w12_linear`` uses the
other kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import tuning
from ..triton_env import pdl_args
from . import mma_tma
from .format import TILE_K
from .fragments import a_operand, b_operand, mma_layouts
from .gluon_common import (aligned_x, async_copy, check_call, cp_async, cta_barrier, esc_chunk, gl, gluon, load_rec,
                           mma_block_m, mma_v2, pdl_wait, pin, record_offsets, split_grid)
from .gluon_epilogue import epilogue
from .pack import KernelPack

if gluon is not None:

    @lru_cache(maxsize=None)
    def wsmem_layouts(num_warps: int):
        """For ``wsmem``: 16-byte cp.async copies of the view words (``[BLOCK_N, 16]``) and nibble
        words (``[BLOCK_N, 8]``), and their unswizzled shared layout (the fragment reads of 8 rows x
        64 or 32 contiguous bytes per instruction are conflict-free as they are)."""
        wc = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
        qc = gl.BlockedLayout([1, 4], [16, 2], [num_warps, 1], [1, 0])
        return wc, qc, gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

    @gluon.jit
    def _x_copy(xs, x_ptr, rows_c, kc, t, ok, M, K, stride_xm):
        """Start copying x[rows, 64t : 64t+64] into the shared-memory stage ``xs`` (cp.async, 8-16
        bytes per thread, zero-filled outside x or when not ``ok``) and commit it as one group."""
        kk = t * 64 + kc
        cp_async(
            xs, x_ptr + rows_c[:, None] * stride_xm + kk[None, :],
            mask=((rows_c < M)[:, None] & (kk < K)[None, :]) & ok)
        async_copy.commit_group()

    @gluon.jit
    def _w_copy(wv_s, wq_s, rec_ptr, tile_row, t, ok, offc_v, offc_q, QPASS: gl.constexpr):
        """Start copying record ``t``'s view (and nibble) words of the program's rows into a stage
        of the weight ring (cp.async, 16 bytes per thread; committed with the x copy that follows)."""
        base = (tile_row + t) * 3072
        cp_async(wv_s, rec_ptr + base + offc_v, mask=ok)
        if not QPASS:
            cp_async(wq_s, rec_ptr + base + offc_q, mask=ok)

    @gluon.jit
    def _copy_offsets(r_in, BLOCK_N: gl.constexpr, L_WC: gl.constexpr, L_QC: gl.constexpr):
        """Word offsets inside a record of rows ``r_in .. r_in + BLOCK_N``' view and nibble words, in
        the ``wsmem`` copy layouts (for :func:`_w_copy`)."""
        rcv = r_in + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_WC))
        offc_v = rcv[:, None] * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, L_WC))[None, :]
        rcq = r_in + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_QC))
        offc_q = 2048 + rcq[:, None] * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, L_QC))[None, :]
        return offc_v, offc_q

    @gluon.jit
    def wsmem_mma(acc, xs, wv_s, wq_s, stage, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr,
                  L_VIEW: gl.constexpr, L_NIB: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr,
                  B_OP: gl.constexpr):
        """One record of the ``wsmem`` ring: its x (B operand) and weight words from ring stage
        ``stage``, decoded into the A operand, and the MMA."""
        b = b_operand(xs.index(stage), L_X, B_OP, BLOCK_M)
        w = wv_s.index(stage).load(L_VIEW)
        if QPASS:
            q = w
        else:
            q = wq_s.index(stage).load(L_NIB)
        return mma_v2(a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS), b, acc)

    @gluon.jit
    def _ring_step(acc, w, q, xs, x_ptr, t, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
                   L_VIEW: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
        """Record ``t`` of the register-ring loop: its x stage (landed), the copy of x for ``t + DEPTH``
        into the stage freed by ``t - 1``, and the MMA of the record's weights ``w``/``q``."""
        XD: gl.constexpr = DEPTH + 1
        it = t - t_begin
        async_copy.wait_group(DEPTH - 1)        # this thread's copies of record t have landed
        cta_barrier()                          # ... everyone's, and stage (it - 1) is free again
        _x_copy(xs.index((it + DEPTH) % XD), x_ptr, rows_c, kc, t + DEPTH, t + DEPTH < t_end, M, K, stride_xm)
        b = b_operand(xs.index(it % XD), L_X, B_OP, BLOCK_M)
        return mma_v2(a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS), b, acc)

    @gluon.jit
    def _register_ring(acc, xs, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n, rows_c, kc, M, K, stride_xm,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
                       UNROLL: gl.constexpr, L_VIEW: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr,
                       B_OP: gl.constexpr):
        """The main loop with the weights DEPTH records ahead in registers and x DEPTH records ahead
        in a shared-memory ring filled by cp.async (one copy per program, not per warp). Loads past
        the range are predicated off.

        Rolled, the ring rotates (``w0 <- w1 <- next``): the move of the record just loaded waits
        for that load, so one record is in flight whatever DEPTH. ``UNROLL``: DEPTH register sets,
        the loop unrolled by DEPTH, each set reloaded in place after its MMA (DEPTH - 1 in flight);
        the last ``(t_end - t_begin) % DEPTH`` records (already loaded) run after the loop."""
        w0, q0 = load_rec(rec_ptr, tile_row, t_begin, t_begin < t_end, off_v, off_n, QPASS)
        if DEPTH >= 2:
            w1, q1 = load_rec(rec_ptr, tile_row, t_begin + 1, t_begin + 1 < t_end, off_v, off_n, QPASS)
        if DEPTH >= 3:
            w2, q2 = load_rec(rec_ptr, tile_row, t_begin + 2, t_begin + 2 < t_end, off_v, off_n, QPASS)
        for i in gl.static_range(DEPTH):
            _x_copy(xs.index(i), x_ptr, rows_c, kc, t_begin + i, t_begin + i < t_end, M, K, stride_xm)
        if UNROLL:
            t_main = t_begin + (t_end - t_begin) // DEPTH * DEPTH
            for t in range(t_begin, t_main, DEPTH):
                acc = _ring_step(acc, w0, q0, xs, x_ptr, t, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                 BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP)
                w0, q0 = load_rec(rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end, off_v, off_n, QPASS)
                if DEPTH >= 2:
                    acc = _ring_step(acc, w1, q1, xs, x_ptr, t + 1, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                     BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP)
                    w1, q1 = load_rec(rec_ptr, tile_row, t + 1 + DEPTH, t + 1 + DEPTH < t_end, off_v, off_n, QPASS)
                if DEPTH >= 3:
                    acc = _ring_step(acc, w2, q2, xs, x_ptr, t + 2, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                     BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP)
                    w2, q2 = load_rec(rec_ptr, tile_row, t + 2 + DEPTH, t + 2 + DEPTH < t_end, off_v, off_n, QPASS)
            if t_main < t_end:
                acc = _ring_step(acc, w0, q0, xs, x_ptr, t_main, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                 BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP)
            if DEPTH >= 3:
                if t_main + 1 < t_end:
                    acc = _ring_step(acc, w1, q1, xs, x_ptr, t_main + 1, t_begin, t_end, rows_c, kc, M, K,
                                     stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP)
        else:
            for t in range(t_begin, t_end):
                wx, qx = load_rec(rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end, off_v, off_n, QPASS)
                acc = _ring_step(acc, w0, q0, xs, x_ptr, t, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                 BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP)
                if DEPTH == 1:
                    w0, q0 = wx, qx
                elif DEPTH == 2:
                    w0, q0 = w1, q1
                    w1, q1 = wx, qx
                else:
                    w0, q0 = w1, q1
                    w1, q1 = w2, q2
                    w2, q2 = wx, qx
        return acc

    @gluon.jit
    def _w12_mma_kernel(
        x_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, QPASS: gl.constexpr,
        ESC_CH: gl.constexpr, DEPTH: gl.constexpr, WSMEM: gl.constexpr, UNROLL: gl.constexpr,
        L_VIEW: gl.constexpr, L_NIB: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr,
        A_OP: gl.constexpr, B_OP: gl.constexpr, L_EP: gl.constexpr, L_XC: gl.constexpr, XS: gl.constexpr,
        L_WC: gl.constexpr, L_QC: gl.constexpr, WSL: gl.constexpr,
        PDL: gl.constexpr = False,
    ):
        pdl_wait(PDL)
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        pid_m = gl.program_id(2)
        n0 = pid_n * BLOCK_N
        tile_row, off_v, off_n = record_offsets(n0, KT, BLOCK_N, L_VIEW, L_NIB)
        rows_c = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_XC))
        kc = gl.arange(0, 64, layout=gl.SliceLayout(0, L_XC))
        XD: gl.constexpr = DEPTH + 1
        xs = gl.allocate_shared_memory(gl.bfloat16, [XD, BLOCK_M, 64], XS)

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)

        if WSMEM:
            # weights and x: DEPTH records ahead in one shared-memory ring of DEPTH + 1 stages, filled
            # by cp.async (no registers held for bytes in flight); the fragments are read from it
            wv_s = gl.allocate_shared_memory(gl.int32, [XD, BLOCK_N, 16], WSL)
            wq_s = gl.allocate_shared_memory(gl.int32, [XD, BLOCK_N, 8], WSL)
            offc_v, offc_q = _copy_offsets(n0 % 128, BLOCK_N, L_WC, L_QC)
            for i in gl.static_range(DEPTH):
                ok = t_begin + i < t_end
                _w_copy(wv_s.index(i), wq_s.index(i), rec_ptr, tile_row, t_begin + i, ok, offc_v, offc_q, QPASS)
                _x_copy(xs.index(i), x_ptr, rows_c, kc, t_begin + i, ok, M, K, stride_xm)
            for t in range(t_begin, t_end):
                it = t - t_begin
                async_copy.wait_group(DEPTH - 1)        # this thread's copies of record t have landed
                cta_barrier()                          # ... everyone's, and stage (it - 1) is free again
                nxt = (it + DEPTH) % XD
                _w_copy(wv_s.index(nxt), wq_s.index(nxt), rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end,
                        offc_v, offc_q, QPASS)
                _x_copy(xs.index(nxt), x_ptr, rows_c, kc, t + DEPTH, t + DEPTH < t_end, M, K, stride_xm)
                acc = wsmem_mma(acc, xs, wv_s, wq_s, it % XD, BLOCK_M, BLOCK_N, QPASS, L_VIEW, L_NIB, L_X, A_OP, B_OP)
        else:
            acc = _register_ring(acc, xs, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n, rows_c, kc, M,
                                 K, stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, UNROLL, L_VIEW, L_X, A_OP, B_OP)
        async_copy.wait_group(0)
        epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                  n0, pid_n, pid_k, pid_m, M, N, NUM_N_BLOCKS, SPLIT_K, SPLIT_K, stride_xm, stride_ym,
                  BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, MMA, L_EP)


@dataclass(frozen=True)
class MmaConfig:
    """One variant: ``block_n`` rows per program (16 per warp slice), ``split_k`` K ranges across
    programs, ``depth`` records loaded ahead."""

    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    depth: int = 2     # records loaded ahead (1-3 in registers, 1-6 with wsmem, 2-12 TMA stages)
    wsmem: bool = False  # weights through a cp.async shared-memory ring instead of registers
    unroll: bool = False  # register ring: depth sets reloaded in place (depth 2-3), not rotated; tma=2: two
                          # records per consumer step
    tma: int = 0        # weights and x by TMA into ``depth`` stages with mbarriers (mma_tma): 1 a consumer
                        # warp per 16 rows, 2 the program's warps as one consumer group, 3 the group on wgmma
    kgroups: int = 1    # tma=3: 2 or 4 warpgroups on the program's rows, each taking every kgroups-th record
    pdl: bool = True    # launched under PDL (placed while the previous kernel drains; waits before any read)

    def key(self) -> str:
        return (f"mma-n{self.block_n}-s{self.split_k}-w{self.num_warps}-d{self.depth}{'-ws' if self.wsmem else ''}"
                f"{'-u' if self.unroll else ''}{f'-tma{self.tma}' if self.tma else ''}"
                f"{f'-kg{self.kgroups}' if self.kgroups > 1 else ''}{'' if self.pdl else '-nopdl'}")


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Gluon present, bf16 rows on a CUDA device with compute capability 8.0+ (mma.sync, cp.async)."""
    return (gluon is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
            and packed.rec32.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 8)


def runs(cfg: MmaConfig, tma: bool, wgmma: bool) -> bool:
    """Whether a device runs ``cfg``: TMA configs need ``tma`` (compute capability 9.0+), the
    ``wgmma`` ones (``tma=3``) ``wgmma`` too (9.x)."""
    return (tma or not cfg.tma) and (wgmma or cfg.tma != mma_tma.WGMMA)


def tuned_config(m: int, n: int, k: int, tma: bool = True, wgmma: bool = True, *, device=None) -> MmaConfig | None:
    """The table's config for ``m`` rows of the ``n x k`` layer (:mod:`specpilot.kernels.tuning`), if
    the device runs it (:func:`runs`)."""
    found = tuning.lookup("w12", "mma", tuning.device_arch(device) if device is not None else None, rows=m, n=n, k=k)
    cfg = MmaConfig(**found[0]["config"]) if found else None
    return cfg if cfg is not None and runs(cfg, tma, wgmma) else None


def default_config(m: int, n: int, k: int, sms: int = 132, tma: bool = True, wgmma: bool = True, *,
                   device=None) -> MmaConfig:
    """The table's config where the device runs it (``tma``: compute capability 9.0+, ``wgmma``:
    9.x), else 64-row programs, the weights two records ahead in the shared-memory ring, and
    split-K for about four programs per SM (the sweeps' most frequent choice)."""
    tuned = tuned_config(m, n, k, tma, wgmma, device=device)
    if tuned is not None:
        return tuned
    kt = (k + TILE_K - 1) // TILE_K
    bn = 64
    blocks = (n + bn - 1) // bn * ((m + mma_block_m(m) - 1) // mma_block_m(m))
    split = max(1, min(kt, round(4 * sms / blocks)))
    return MmaConfig(block_n=bn, split_k=split, depth=2, wsmem=True)


def check_config(cfg: MmaConfig) -> None:
    if cfg.tma:
        mma_tma.check(cfg)
    elif cfg.depth not in ((1, 2, 3, 4, 5, 6) if cfg.wsmem else (1, 2, 3)):
        raise ValueError(f"depth must be 1-3 (1-6 with wsmem), got {cfg.depth}")
    if cfg.unroll and (cfg.wsmem or cfg.depth < 2):
        raise ValueError("an unrolled ring is a register ring of depth 2-3 (not wsmem)")


def w12_mma(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: MmaConfig | None = None,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` bf16 (any M; 64 rows per program), fp32 accumulation, deterministic."""
    check_call(x, packed)
    if config is not None:
        if config.tma and not mma_tma.AVAILABLE:
            raise RuntimeError("the TMA variant needs Gluon's Hopper module (triton >= 3.5)")
        check_config(config)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    m, k = x.shape
    n = packed.shape[0]
    kt = packed.k_tiles
    if config is None:
        cfg = default_config(m, n, k, tma=mma_tma.supported(x.device), wgmma=mma_tma.wgmma_supported(x.device),
                             device=x.device)
    else:
        cfg = config
    x, k = aligned_x(x, kt)
    bm, tps, split, nb, mb, ws, locks = split_grid(m, n, kt, cfg.block_n, cfg.split_k, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    esc_ch = esc_chunk(bm)
    if cfg.tma == mma_tma.SLICE_WARPS and mb > 1:
        # on the H200 this layout faulted (illegal address) on its second x row block; the table
        # routes it to 1-8 rows only. The epilogue's read of a row pointer past N by a slice that
        # starts past the last row (tests/test_w12_mma_tma.py) may have been the cause: unverified
        raise ValueError(f"tma=1 takes at most 64 x rows (one row block), got {m}; use tma=2 or 3")
    if cfg.tma:
        mma_tma.launch(x, packed, out, qpass, cfg, (bm, tps, split, nb, mb, ws, locks), esc_ch)
        return out
    l_view, l_nib, l_x, mma, a_op, b_op, l_ep, l_xc, xs = mma_layouts(cfg.block_n, bm, cfg.num_warps)
    l_wc, l_qc, wsl = wsmem_layouts(cfg.num_warps)
    _w12_mma_kernel[(nb, split, mb)](
        x, out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, USE_SPLIT=split > 1, QPASS=qpass, ESC_CH=esc_ch, DEPTH=cfg.depth,
        WSMEM=cfg.wsmem, UNROLL=cfg.unroll,
        L_VIEW=l_view, L_NIB=l_nib, L_X=l_x, MMA=mma, A_OP=a_op, B_OP=b_op, L_EP=l_ep, L_XC=l_xc,
        XS=xs, L_WC=l_wc, L_QC=l_qc, WSL=wsl,
        num_warps=cfg.num_warps, **pdl_args(cfg.pdl, x),
    )
    return out
