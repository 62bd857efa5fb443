"""One-row W12 GEMV in Gluon: K split across the warps of a program, not across programs.

The Triton GEMV (:mod:`.gemv`) gives each program ``BLOCK_N`` weight rows and a K range, and reaches
enough bytes in flight on small layers only by splitting K across programs, which adds a tail:
partials to a workspace, a counter, and the last program summing them (on the H200 it runs at 0.76x
of a plain read of the same bytes, geometric mean). Here the split is inside the program:

* a program owns ``ROWS`` rows (8-32) of one 128-row record tile; warp ``w`` takes the records
  ``t = t0 + i * WARPS + w`` of that tile, so each warp streams its own 12 KB records (``ROWS`` x 64
  bytes of 8-bit views and ``ROWS`` x 32 bytes of nibbles each, 16-byte and 8-byte loads), ``DEPTH``
  records ahead in registers;
* a lane holds 4 view words (16 weights) of one or more rows and the 8 matching x words (bf16
  pairs, two 16-byte loads that hit L1/L2), decodes with the same integer recipe as the other W12
  kernels and accumulates in fp32;
* the program sums its warps (a fixed reduction tree in shared memory) and stores; split-K across
  programs stays available for layers with few row blocks, with the same fixed-order reduction;
* ``xs`` (staged x): the program's x range goes to shared memory once (``cp.async``), the weight
  loads past the range re-read the last record (its staged x is zero), the record pointers are
  computed once, and a ``bar.warp.sync`` after each reload of an unrolled ring stops ptxas from
  sinking the reloads to the end of the loop body: without it the ``depth`` reloads of one
  iteration issue together after its last FMA and the next iteration waits on them at once. A
  register set is then 12 registers, not 20, so depth 3-4 fits in 96 registers (``maxnreg``);
* the epilogue (row scale, exact escapes ``x[k] * (w - slot)``) issues its loads before the main
  loop, so their three dependent round trips (escape range, escape entries, x at their columns)
  hide behind the weight stream instead of adding to the tail; results are bitwise identical run
  to run.

The unrolled ring (:func:`ring_set`) is also the main loop of the fused decode kernels
(:mod:`specpilot.kernels.decode.gemv_w12_gluon`). The plain reference is :func:`.naive.w12_linear_ref`.
Gluon does not run under Triton's interpreter; tests compile the kernel for sm_90 on the CPU and
run it on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import tuning
from .common import split_workspace
from .format import TILE_K
from .gluon_common import (XS_CHUNK, XS_MAX_BYTES, async_copy, check_call, cta_barrier, decode_pairs, f32_hi, f32_lo, gl,
                           gluon, load_clamped, per_warp, pin, record_offsets_3d, stage_x,
                           xs_group_count)
from .gluon_epilogue import esc_entries, row_epilogue_end, row_epilogue_range, row_epilogue_start
from .pack import KernelPack


@dataclass(frozen=True)
class GluonGemvConfig:
    """``rows`` weight rows per program (8, 16 or 32; divides 128), ``warps`` (each streams its own
    records), ``depth`` records loaded ahead per warp (1-4), ``split_k`` K ranges across programs,
    ``unroll``: ``depth`` register sets reloaded in place (depth - 1 records in flight per warp),
    instead of a rotated ring (one in flight whatever the depth, see the kernel), ``xs``: x staged
    in shared memory, clamped record indices and pinned reloads (see the module), ``maxnreg``: the
    register cap passed to ptxas (None: its own choice), ``late_epilogue``: the epilogue's loads
    (row scales, escapes) issued after the first records' loads instead of before them,
    ``epi_spread`` (with ``xs``, ``unroll``, no split): the escape chain spread over step 0."""

    rows: int = 16
    warps: int = 4
    depth: int = 1
    split_k: int = 1
    unroll: bool = False
    xs: bool = False
    maxnreg: int | None = None
    late_epilogue: bool = False
    epi_spread: bool = False

    def key(self) -> str:
        return (f"gl-r{self.rows}-w{self.warps}-d{self.depth}-s{self.split_k}{'-u' if self.unroll else ''}"
                f"{'-xs' if self.xs else ''}{f'-r{self.maxnreg}' if self.maxnreg else ''}"
                f"{'-el' if self.late_epilogue else ''}{'-es' if self.epi_spread else ''}")

    def xs_bytes(self, k_tiles: int) -> int:
        """Shared memory of the staged x (bf16 pairs)."""
        return self.xs_groups(k_tiles) * self.warps * 128

    def xs_groups(self, k_tiles: int) -> int:
        """Staged x: groups of ``warps`` records (a multiple of the cp.async chunk and of the unroll)."""
        return xs_group_count(-(-k_tiles // self.split_k), self.warps, self.depth if self.unroll else 1)


def check_config(cfg: GluonGemvConfig) -> None:
    if cfg.rows not in (8, 16, 32):
        raise ValueError(f"rows must be 8, 16 or 32, got {cfg.rows}")
    if cfg.warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be a power of two up to 16, got {cfg.warps}")
    if cfg.epi_spread and not (cfg.xs and cfg.unroll and cfg.split_k == 1 and not cfg.late_epilogue):
        raise ValueError("epi_spread (the escape chain spread over the first step) needs xs=True, unroll=True, "
                         "split_k=1 and replaces late_epilogue")
    if cfg.depth not in (1, 2, 3, 4):
        raise ValueError(f"depth must be 1-4, got {cfg.depth}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")
    if cfg.unroll and cfg.depth < 2:
        raise ValueError("an unrolled ring needs depth >= 2")
    if cfg.maxnreg is not None and not 32 <= cfg.maxnreg <= 255:
        raise ValueError(f"maxnreg must be 32-255, got {cfg.maxnreg}")


if gluon is not None:

    @lru_cache(maxsize=None)
    def layouts(rows: int, warps: int):
        """``[warps, rows, 16]`` view words (4 per lane: 16 bytes), ``[warps, rows, 8]`` nibble words
        (2 per lane), ``[warps, rows, 32]`` x words (8 per lane), the epilogue's ``[rows, ESC_CH]``."""
        lv = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
        lq = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
        lx = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
        le = gl.BlockedLayout([1, 1], [32, 1], [warps, 1], [1, 0])     # [rows, escapes]: escapes in registers
        return lv, lq, lx, le

    @gluon.jit
    def _load_recs(rec_ptr, x32_ptr, tile_row, t, t_end, KH, off_v, off_q, xw, pv, pq,
                   L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, QPASS: gl.constexpr, XS: gl.constexpr):
        """Each warp's record ``t[w]``: its rows' view words, nibble words and the 32 x words. ``XS``:
        no x (staged in shared memory, read at use), and past the range the last record is re-read
        unmasked through the loop-invariant pointers ``pv``/``pq``: its staged x is zero, so it adds
        +-0 and leaves the (never -0) accumulator's bits unchanged."""
        if XS:
            v, q = load_clamped(pv, pq, t, t_end, L_V, L_Q, QPASS)
            x = 0
        else:
            ok = t < t_end                                                # [W]
            base = (tile_row + t) * 3072
            v = gl.load(rec_ptr + per_warp(base, L_V) + off_v, mask=per_warp(ok, L_V), other=0)
            if QPASS:
                q = v
            else:
                q = gl.load(rec_ptr + per_warp(base, L_Q) + off_q, mask=per_warp(ok, L_Q), other=0)
            xi = per_warp(t, L_X) * 32 + xw                              # [W, 1, 32]
            x = gl.load(x32_ptr + xi, mask=per_warp(ok, L_X) & (xi < KH), other=0)   # zero past K
        return v, q, x

    @gluon.jit
    def _rec_fma(acc, v, q, x, WARPS: gl.constexpr, ROWS: gl.constexpr, L_V: gl.constexpr, QPASS: gl.constexpr):
        """acc ``[W, ROWS, 16]`` += the decoded weights of each warp's record times its x."""
        p0, p1 = decode_pairs(v, q, L_V, QPASS)      # p0: weights 4c, 4c+1 (x word 2c); p1: 4c+2, 4c+3
        xa, xb = gl.split(gl.reshape(x.to(gl.uint32), [WARPS, 1, 16, 2]))
        xa = gl.convert_layout(xa, L_V, assert_trivial=True)
        xb = gl.convert_layout(xb, L_V, assert_trivial=True)
        acc += f32_lo(p0) * f32_lo(xa)
        acc += f32_hi(p0) * f32_hi(xa)
        acc += f32_lo(p1) * f32_lo(xb)
        acc += f32_hi(p1) * f32_hi(xb)
        return acc

    @gluon.jit
    def _x_of(x, xs, i, L_X: gl.constexpr, XS: gl.constexpr):
        """Step ``i``'s x words (records ``t_begin + i * WARPS + w``): the ring's, or the staged ones."""
        if XS:
            x = gl.expand_dims(xs.index(i).load(gl.SliceLayout(1, L_X)), 1)
        return x

    @gluon.jit
    def ring_set(acc, v, q, x, xs, i, t_next, wid, rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                 WARPS: gl.constexpr, ROWS: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr,
                 QPASS: gl.constexpr, XS: gl.constexpr):
        """One register set of the unrolled ring: its records' FMAs (step ``i``), then the set
        reloaded in place with records ``t_next + w`` (pinned there with ``XS``)."""
        acc = _rec_fma(acc, v, q, _x_of(x, xs, i, L_X, XS), WARPS, ROWS, L_V, QPASS)
        v, q, x = _load_recs(rec_ptr, x32_ptr, tile_row, t_next + wid, t_end, KH, off_v, off_q, xw, pv, pq,
                             L_V, L_Q, L_X, QPASS, XS)
        return acc, v, q, x, pin(wid, XS)

    @gluon.jit
    def _w12_gemv_gl_kernel(
        x_ptr, x32_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        N, KH, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K, stride_ym,
        ROWS: gl.constexpr, WARPS: gl.constexpr, DEPTH: gl.constexpr, UNROLL: gl.constexpr, USE_SPLIT: gl.constexpr,
        QPASS: gl.constexpr, ESC_CH: gl.constexpr,
        L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, L_E: gl.constexpr,
        XS: gl.constexpr = False, XS_IT: gl.constexpr = 8, XS_CH: gl.constexpr = 8, EPI_LATE: gl.constexpr = False,
        EPI_SPREAD: gl.constexpr = False,
    ):
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        n0 = pid_n * ROWS
        tile_row, off_v, off_q = record_offsets_3d(n0, KT, ROWS, L_V, L_Q)
        cx = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_X)))
        xw = gl.expand_dims(gl.expand_dims(cx, 0), 1)                    # [1, 1, 32]
        wid = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_V)))

        pv = rec_ptr + tile_row * 3072 + off_v     # loop-invariant record pointers (XS)
        pq = rec_ptr + tile_row * 3072 + off_q

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = gl.zeros([WARPS, ROWS, 16], gl.float32, L_V)
        if XS:   # the program's x range, once: cp.async now, waited for after the first weight loads
            xs = stage_x(x32_ptr, t_begin, t_end, KH, WARPS, XS_IT, XS_CH)
        else:
            xs = 0
        # with split-K only the last program needs the epilogue's loads, and it is not known yet;
        # EPI_LATE: after the first weight loads (pinned: ptxas would put the escape chain first)
        if not USE_SPLIT and not EPI_LATE and not EPI_SPREAD:
            scale, e_lo, e_hi, er, contrib = row_epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                                                             n0, N, ROWS, ESC_CH, L_E)
        v0, q0, x0 = _load_recs(rec_ptr, x32_ptr, tile_row, t_begin + wid, t_end, KH, off_v, off_q, xw, pv, pq,
                                L_V, L_Q, L_X, QPASS, XS)
        if DEPTH >= 2:
            v1, q1, x1 = _load_recs(rec_ptr, x32_ptr, tile_row, t_begin + WARPS + wid, t_end, KH, off_v, off_q, xw,
                                    pv, pq, L_V, L_Q, L_X, QPASS, XS)
        if DEPTH >= 3:
            v2, q2, x2 = _load_recs(rec_ptr, x32_ptr, tile_row, t_begin + 2 * WARPS + wid, t_end, KH, off_v, off_q,
                                    xw, pv, pq, L_V, L_Q, L_X, QPASS, XS)
        if DEPTH >= 4:
            v3, q3, x3 = _load_recs(rec_ptr, x32_ptr, tile_row, t_begin + 3 * WARPS + wid, t_end, KH, off_v, off_q,
                                    xw, pv, pq, L_V, L_Q, L_X, QPASS, XS)
        if EPI_SPREAD:   # only the independent loads now (row scales, escape range); the chain in step 0
            wid = pin(wid, True)
            scale, e_lo, e_hi = row_epilogue_range(low_ptr, eptr_ptr, n0, N, ROWS, L_E)
        if not USE_SPLIT and EPI_LATE:
            wid = pin(wid, True)
            scale, e_lo, e_hi, er, contrib = row_epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                                                             n0, N, ROWS, ESC_CH, L_E)
        if XS:
            async_copy.wait_group(0)
            cta_barrier()      # the only barrier; none in the loop
        if UNROLL:
            # DEPTH register sets and the loop unrolled by DEPTH: each set is reloaded in place right
            # after it is consumed. (In the rolled loop below the ring rotation is a register move of
            # the record just loaded, which waits for that load: whatever DEPTH, one record is in
            # flight.) Without XS's pins ptxas sinks the reloads to the end of the body, so they
            # issue together; with them DEPTH - 1 records per warp stay in flight over the decode.
            # Steps past the range add zeros.
            t0 = t_begin
            if EPI_SPREAD:
                # step 0 peeled (the same sets in the same order): the escape chain's dependent loads
                # go between its register sets, where the range and then the columns have landed,
                # and x at the columns is multiplied only after the loop, so no warp waits on the
                # chain before its first FMA (the plain order waits three round trips)
                acc, v0, q0, x0, wid = ring_set(acc, v0, q0, x0, xs, 0, t_begin + DEPTH * WARPS, wid, rec_ptr,
                                                 x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                 L_V, L_Q, L_X, QPASS, XS)
                L_D: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])    # one escape per lane
                eok, er_d, ec_d, ed_d = esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, ESC_CH, L_D)
                wid = pin(wid, True)
                if DEPTH >= 2:
                    acc, v1, q1, x1, wid = ring_set(acc, v1, q1, x1, xs, 1, t_begin + (DEPTH + 1) * WARPS, wid,
                                                     rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                                                     WARPS, ROWS, L_V, L_Q, L_X, QPASS, XS)
                if DEPTH >= 3:
                    acc, v2, q2, x2, wid = ring_set(acc, v2, q2, x2, xs, 2, t_begin + (DEPTH + 2) * WARPS, wid,
                                                     rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                                                     WARPS, ROWS, L_V, L_Q, L_X, QPASS, XS)
                if DEPTH >= 4:
                    acc, v3, q3, x3, wid = ring_set(acc, v3, q3, x3, xs, 3, t_begin + (DEPTH + 3) * WARPS, wid,
                                                     rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                                                     WARPS, ROWS, L_V, L_Q, L_X, QPASS, XS)
                xe_d = gl.load(x_ptr + ec_d, mask=eok, other=0.0)
                wid = pin(wid, True)
                t0 = t_begin + DEPTH * WARPS
            for t in range(t0, t_end, DEPTH * WARPS):
                i = (t - t_begin) // WARPS
                acc, v0, q0, x0, wid = ring_set(acc, v0, q0, x0, xs, i, t + DEPTH * WARPS, wid, rec_ptr, x32_ptr,
                                                 tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS, L_V, L_Q,
                                                 L_X, QPASS, XS)
                if DEPTH >= 2:
                    acc, v1, q1, x1, wid = ring_set(acc, v1, q1, x1, xs, i + 1, t + (DEPTH + 1) * WARPS, wid, rec_ptr,
                                                     x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                     L_V, L_Q, L_X, QPASS, XS)
                if DEPTH >= 3:
                    acc, v2, q2, x2, wid = ring_set(acc, v2, q2, x2, xs, i + 2, t + (DEPTH + 2) * WARPS, wid, rec_ptr,
                                                     x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                     L_V, L_Q, L_X, QPASS, XS)
                if DEPTH >= 4:
                    acc, v3, q3, x3, wid = ring_set(acc, v3, q3, x3, xs, i + 3, t + (DEPTH + 3) * WARPS, wid, rec_ptr,
                                                     x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                     L_V, L_Q, L_X, QPASS, XS)
        else:
            for t in range(t_begin, t_end, WARPS):
                vn, qn, xn = _load_recs(rec_ptr, x32_ptr, tile_row, t + DEPTH * WARPS + wid, t_end, KH, off_v, off_q,
                                        xw, pv, pq, L_V, L_Q, L_X, QPASS, XS)
                acc = _rec_fma(acc, v0, q0, _x_of(x0, xs, (t - t_begin) // WARPS, L_X, XS), WARPS, ROWS, L_V, QPASS)
                if DEPTH == 1:
                    v0, q0, x0 = vn, qn, xn
                elif DEPTH == 2:
                    v0, q0, x0 = v1, q1, x1
                    v1, q1, x1 = vn, qn, xn
                elif DEPTH == 3:
                    v0, q0, x0 = v1, q1, x1
                    v1, q1, x1 = v2, q2, x2
                    v2, q2, x2 = vn, qn, xn
                else:
                    v0, q0, x0 = v1, q1, x1
                    v1, q1, x1 = v2, q2, x2
                    v2, q2, x2 = v3, q3, x3
                    v3, q3, x3 = vn, qn, xn

        # lanes, then warps, in a fixed tree: bitwise identical run to run
        LR: gl.constexpr = gl.SliceLayout(1, L_E)
        part = gl.convert_layout(gl.sum(gl.sum(acc, axis=2), axis=0), LR)
        if EPI_SPREAD:   # the first chunk's x[col] * delta now, the products of row_epilogue_start
            er = gl.convert_layout(er_d, gl.SliceLayout(0, L_E))
            contrib = gl.convert_layout(xe_d.to(gl.float32) * ed_d, gl.SliceLayout(0, L_E))
        if not USE_SPLIT:
            row_epilogue_end(part, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                          ROWS, ESC_CH, L_E)
        else:
            ws_base = ws_ptr + pid_n.to(gl.int64) * (SPLIT_K * ROWS)
            ro = gl.arange(0, ROWS, layout=LR)
            gl.store(ws_base + pid_k * ROWS + ro, part)
            cta_barrier()
            count = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                scale, e_lo, e_hi, er, contrib = row_epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
                                                                 edelta_ptr, n0, N, ROWS, ESC_CH, L_E)
                total = gl.zeros([ROWS], gl.float32, LR)
                for s in range(0, SPLIT_K):     # fixed order
                    total += gl.load(ws_base + s * ROWS + ro, cache_modifier=".cg")
                gl.atomic_xchg(lock_ptr + pid_n, 0)
                row_epilogue_end(total, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                              n0, N, ROWS, ESC_CH, L_E)


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Gluon present, one contiguous bf16 row of even length on a CUDA device (x read as pairs)."""
    return (gluon is not None and x.is_cuda and packed.rec32.is_cuda and x.dtype == torch.bfloat16
            and x.dim() == 2 and x.shape[0] == 1 and x.shape[1] % 2 == 0 and x.stride(1) == 1
            and x.data_ptr() % 16 == 0)


def tuned_config(n: int, k: int, device=None) -> GluonGemvConfig | None:
    """The table's config for the ``n x k`` layer (:mod:`specpilot.kernels.tuning`)."""
    found = tuning.lookup("w12", "gemv-gluon", tuning.device_arch(device) if device is not None else None,
                          rows=1, n=n, k=k)
    return GluonGemvConfig(**found[0]["config"]) if found else None


def default_config(n: int, k: int, sms: int = 132, *, device=None) -> GluonGemvConfig:
    """The table's config, else what the sweeps chose most: 16-row programs of 4 warps, four
    unrolled register sets with x staged (capped at 96 registers, the escapes loaded after the
    first records), and split-K only when there are fewer than two programs per SM (or the staged
    x would not fit)."""
    tuned = tuned_config(n, k, device)
    if tuned is not None:
        return tuned
    kt = (k + TILE_K - 1) // TILE_K
    blocks = (n + 15) // 16
    split = 1 if blocks >= 2 * sms else max(1, min(max(1, kt // 4), (2 * sms + blocks - 1) // blocks))
    cfg = GluonGemvConfig(16, 4, 4, split, True, xs=True, maxnreg=96, late_epilogue=True)
    while cfg.xs_groups(kt) * cfg.warps * 128 > XS_MAX_BYTES:
        cfg = GluonGemvConfig(16, 4, 4, cfg.split_k * 2, True, xs=True, maxnreg=96, late_epilogue=True)
    return cfg


def w12_gemv_gluon(x: torch.Tensor, packed: KernelPack, qpass: bool = False,
                   config: GluonGemvConfig | None = None, out: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for one bf16 row ``x [1, K]``; fp32 accumulation, deterministic."""
    check_call(x, packed)
    if not supported(x, packed):
        raise ValueError("w12_gemv_gluon needs one contiguous, 16-byte aligned bf16 CUDA row of even length")
    cfg = config or default_config(packed.shape[0], x.shape[1], device=x.device)
    check_config(cfg)
    n, k = packed.shape
    if out is None:
        out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    kt = packed.k_tiles
    tps = (kt + cfg.split_k - 1) // cfg.split_k
    split = (kt + tps - 1) // tps
    nb = (n + cfg.rows - 1) // cfg.rows
    xs_it = cfg.xs_groups(kt) if cfg.xs else XS_CHUNK
    if cfg.xs and cfg.xs_bytes(kt) > XS_MAX_BYTES:
        raise ValueError(f"{cfg.key()}: staged x would take {cfg.xs_bytes(kt)} bytes of shared memory "
                         f"(limit {XS_MAX_BYTES}); use a larger split_k or xs=False")
    ws, locks = split_workspace(x.device, nb * split * cfg.rows if split > 1 else 1, nb)
    lv, lq, lx, le = layouts(cfg.rows, cfg.warps)
    _w12_gemv_gl_kernel[(nb, split)](
        x, x.view(torch.int32), out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        n, k // 2, kt, tps, nb, split, out.stride(0),
        ROWS=cfg.rows, WARPS=cfg.warps, DEPTH=cfg.depth, UNROLL=cfg.unroll, USE_SPLIT=split > 1, QPASS=qpass,
        ESC_CH=8, L_V=lv, L_Q=lq, L_X=lx, L_E=le, XS=cfg.xs, XS_IT=xs_it, XS_CH=XS_CHUNK,
        EPI_LATE=cfg.late_epilogue, EPI_SPREAD=cfg.epi_spread,
        num_warps=cfg.warps, **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )
    return out
