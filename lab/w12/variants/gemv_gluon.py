"""One-row W12 GEMV in Gluon: K split across the warps of a program, not across programs.

The Triton GEMV (:mod:`.gemv`) gives each program ``BLOCK_N`` weight rows and a K range, and reaches
enough bytes in flight on small layers only by splitting K across programs, which adds a tail:
partials to a workspace, a counter, and the last program summing them. On the H200 that kernel
ran at 0.76x (geometric mean) of a plain read of the same bytes (``benchmarks/read_floor.py``). Here the split is inside the program:

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
  iteration issue together after its last FMA and the next iteration waits on them at once
  (``docs/plans/w12-gemv-registers.md``). A register set is then 12 registers, not 20, so depth 3-4
  fits in 96 registers (``maxnreg``);
* the epilogue (row scale, exact escapes ``x[k] * (w - slot)``) issues its loads before the main
  loop, so their three dependent round trips (escape range, escape entries, x at their columns)
  hide behind the weight stream instead of adding to the tail; results are bitwise identical run
  to run.

The plain reference is :func:`.naive.w12_linear_ref`. Gluon does not run under Triton's
interpreter; tests compile the kernel for sm_90 on the CPU and run it on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from specpilot.kernels.w12.format import TILE_K
from .gemm import KernelPack, _workspace
from .mma import _cp_async, _cta_barrier, async_copy, check_call, gl, gluon, launch_options

XS_CHUNK = 8            # staged x: groups of ``warps`` records per cp.async chunk
XS_MAX_BYTES = 100 * 1024


@dataclass(frozen=True)
class GluonGemvConfig:
    """``rows`` weight rows per program (8, 16 or 32; divides 128), ``warps`` (each streams its own
    records), ``depth`` records loaded ahead per warp (1-4), ``split_k`` K ranges across programs,
    ``unroll``: ``depth`` register sets reloaded in place (depth - 1 records in flight per warp),
    instead of a rotated ring (one in flight whatever the depth, see the kernel), ``xs``: x staged
    in shared memory, clamped record indices and pinned reloads (see the module), ``maxnreg``: the
    register cap passed to ptxas (None: its own choice), ``late_epilogue``: the epilogue's loads
    (row scales, escapes) issued after the first records' loads instead of before them; ``tma``:
    the records through a TMA ring of ``depth`` shared-memory stages of ``tma_rps`` records per warp
    (:mod:`.gemv_tma`; bitwise the same output as the register ring of the same rows and warps)."""

    rows: int = 16
    warps: int = 4
    depth: int = 1
    split_k: int = 1
    unroll: bool = False
    plain_decode: bool = False   # mma._decode_pairs instead of the prmt/lop3 form (A/B runs only)
    xs: bool = False
    maxnreg: int | None = None
    late_epilogue: bool = False   # the escape loads after the first weight loads, not before
    xf32: bool = False   # with xs: the staged x converted to fp32 once per program, not per record
    epi_spread: bool = False   # with xs, unroll, no split: the escape chain spread over step 0 (see kernel)
    tma: bool = False    # records through a TMA shared-memory ring of ``depth`` stages (:mod:`.gemv_tma`)
    tma_rps: int = 1     # with tma: records per warp and stage
    tma_box: int = 256   # with tma: bytes per row of the view boxes (256, or 64: the records' own rows)
    tma_epi_warp: bool = False   # with tma: one more warp loads the epilogue's operands beside the ring

    def key(self) -> str:
        return (f"gl-r{self.rows}-w{self.warps}-d{self.depth}-s{self.split_k}{'-u' if self.unroll else ''}"
                f"{'-xs' if self.xs else ''}{f'-r{self.maxnreg}' if self.maxnreg else ''}"
                f"{'-el' if self.late_epilogue else ''}{'-es' if self.epi_spread else ''}{'-xf' if self.xf32 else ''}"
                f"{f'-tma{self.tma_rps}' if self.tma else ''}{'-b64' if self.tma and self.tma_box == 64 else ''}"
                f"{'-ew' if self.tma and self.tma_epi_warp else ''}"
                f"{'-plain' if self.plain_decode else ''}")

    def xs_bytes(self, k_tiles: int) -> int:
        """Shared memory of the staged x: bf16 pairs, plus the fp32 copy with ``xf32``."""
        return self.xs_groups(k_tiles) * self.warps * 128 * (3 if self.xf32 else 1)

    def xs_groups(self, k_tiles: int) -> int:
        """Staged x: groups of ``warps`` records (a multiple of the cp.async chunk and of the unroll)."""
        return xs_group_count(-(-k_tiles // self.split_k), self.warps, self.depth if self.unroll else 1)


def xs_group_count(records: int, warps: int, unit: int = 1) -> int:
    """Groups of ``warps`` records of staged x covering ``records``: a multiple of the cp.async chunk
    (:data:`XS_CHUNK`) and of ``unit`` (the records a warp takes per loop step)."""
    m = math.lcm(XS_CHUNK, unit)
    return -(-(-(-records // warps)) // m) * m


def check_config(cfg: GluonGemvConfig) -> None:
    if cfg.rows not in (8, 16, 32):
        raise ValueError(f"rows must be 8, 16 or 32, got {cfg.rows}")
    if cfg.warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be a power of two up to 16, got {cfg.warps}")
    if cfg.epi_spread and not (cfg.xs and cfg.unroll and cfg.split_k == 1 and not cfg.late_epilogue and not cfg.tma):
        raise ValueError("epi_spread (the escape chain spread over the first step) needs xs=True, unroll=True, "
                         "split_k=1 and replaces late_epilogue")
    if cfg.tma_epi_warp and not cfg.tma:
        raise ValueError("tma_epi_warp (a loader warp beside the TMA ring) needs tma=True")
    if cfg.tma:
        from . import gemv_tma

        gemv_tma.check(cfg)
    elif cfg.depth not in (1, 2, 3, 4):
        raise ValueError(f"depth must be 1-4, got {cfg.depth}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")
    if cfg.unroll and cfg.depth < 2:
        raise ValueError("an unrolled ring needs depth >= 2")
    if cfg.maxnreg is not None and not 32 <= cfg.maxnreg <= 255:
        raise ValueError(f"maxnreg must be 32-255, got {cfg.maxnreg}")
    if cfg.xf32 and not (cfg.xs and cfg.unroll):
        raise ValueError("xf32 converts the staged x of an unrolled ring: it needs xs=True and unroll=True")


if gluon is not None:
    from .mma import _decode_pairs, _decode_pairs_fast, _pin

    @lru_cache(maxsize=None)
    def layouts(rows: int, warps: int):
        """``[warps, rows, 16]`` view words (4 per lane: 16 bytes), ``[warps, rows, 8]`` nibble words
        (2 per lane), ``[warps, rows, 32]`` x words (8 per lane), the epilogue's ``[rows, ESC_CH]``."""
        lv = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
        lq = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
        lx = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
        le = gl.BlockedLayout([1, 1], [32, 1], [warps, 1], [1, 0])     # [rows, escapes]: escapes in registers
        return lv, lq, lx, le

    @lru_cache(maxsize=None)
    def xf32_layout(warps: int):
        """``[warps, rows, 64]`` fp32 x (16 consecutive k per lane: the lane's 4 view words' weights)."""
        return gl.BlockedLayout([1, 1, 16], [1, 8, 4], [warps, 1, 1], [2, 1, 0])

    @gluon.jit
    def _f32_lo(p):
        return (p << 16).to(gl.float32, bitcast=True)

    @gluon.jit
    def _f32_hi(p):
        return (p & 0xFFFF0000).to(gl.float32, bitcast=True)

    @gluon.jit
    def _per_warp(v, L: gl.constexpr):
        """A ``[WARPS]`` vector as ``[WARPS, 1, 1]`` in the 3-D layout ``L``."""
        return gl.expand_dims(gl.expand_dims(gl.convert_layout(v, gl.SliceLayout(1, gl.SliceLayout(2, L))), 1), 2)

    @gluon.jit
    def _record_offsets_3d(n0, KT, ROWS: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr):
        """:func:`.mma._record_offsets` for ``[WARPS, ROWS, ...]`` tiles (every warp the same rows):
        the index of the row tile's first record and the word offsets inside a record of the rows'
        view words (``row * 16``) and nibble words (``2048 + row * 8``). Shared with :mod:`.warpk`."""
        tile_row = (n0 // 128).to(gl.int64) * KT
        r_in = n0 % 128
        rv = r_in + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_V)))
        cv = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_V)))
        off_v = gl.expand_dims(gl.expand_dims(rv, 0), 2) * 16 + gl.expand_dims(gl.expand_dims(cv, 0), 1)
        rq = r_in + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_Q)))
        cq = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_Q)))
        off_q = 2048 + gl.expand_dims(gl.expand_dims(rq, 0), 2) * 8 + gl.expand_dims(gl.expand_dims(cq, 0), 1)
        return tile_row, off_v, off_q

    @gluon.jit
    def _load_clamped(pv, pq, t, t_end, L_V: gl.constexpr, L_Q: gl.constexpr, QPASS: gl.constexpr):
        """Each warp's record ``t[w]``, clamped to the range (past it the last record is re-read),
        through the loop-invariant view and nibble pointers ``pv``/``pq``: view words, nibble words
        (the view again in the Q pass). Shared with :mod:`.warpk`."""
        d = gl.minimum(t, t_end - 1) * 3072
        v = gl.load(pv + _per_warp(d, L_V))
        if QPASS:
            q = v
        else:
            q = gl.load(pq + _per_warp(d, L_Q))
        return v, q

    @gluon.jit
    def _load_recs(rec_ptr, x32_ptr, tile_row, t, t_end, KH, off_v, off_q, xw, pv, pq,
                   L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, QPASS: gl.constexpr, XS: gl.constexpr):
        """Each warp's record ``t[w]``: its rows' view words, nibble words and the 32 x words. ``XS``:
        no x (staged in shared memory, read at use), and past the range the last record is re-read
        unmasked through the loop-invariant pointers ``pv``/``pq``: its staged x is zero, so it adds
        +-0 and leaves the (never -0) accumulator's bits unchanged."""
        if XS:
            v, q = _load_clamped(pv, pq, t, t_end, L_V, L_Q, QPASS)
            x = 0
        else:
            ok = t < t_end                                                # [W]
            base = (tile_row + t) * 3072
            v = gl.load(rec_ptr + _per_warp(base, L_V) + off_v, mask=_per_warp(ok, L_V), other=0)
            if QPASS:
                q = v
            else:
                q = gl.load(rec_ptr + _per_warp(base, L_Q) + off_q, mask=_per_warp(ok, L_Q), other=0)
            xi = _per_warp(t, L_X) * 32 + xw                              # [W, 1, 32]
            x = gl.load(x32_ptr + xi, mask=_per_warp(ok, L_X) & (xi < KH), other=0)   # zero past K
        return v, q, x

    @gluon.jit
    def _rec_fma(acc, v, q, x, WARPS: gl.constexpr, ROWS: gl.constexpr, L_V: gl.constexpr,
                 QPASS: gl.constexpr, PLAIN: gl.constexpr, XF32: gl.constexpr = False):
        """acc ``[W, ROWS, 16]`` += the decoded weights of each warp's record times its x."""
        if PLAIN:   # the plain decode, kept for A/B runs (lab/w12/decode_ab.py)
            p0, p1 = _decode_pairs(v, q, L_V, QPASS)
        else:       # p0: weights 4c, 4c+1 (x word 2c); p1: 4c+2, 4c+3
            p0, p1 = _decode_pairs_fast(v, q, L_V, QPASS)
        if XF32:   # x [W, 1, 64] fp32, k = 4c + 2a + b: the same products in the same order
            xe, xo = gl.split(gl.reshape(x, [WARPS, 1, 16, 2, 2]))      # b = 0, 1
            x0, x2 = gl.split(xe)                                        # a = 0, 1
            x1, x3 = gl.split(xo)
            acc += _f32_lo(p0) * gl.convert_layout(x0, L_V, assert_trivial=True)
            acc += _f32_hi(p0) * gl.convert_layout(x1, L_V, assert_trivial=True)
            acc += _f32_lo(p1) * gl.convert_layout(x2, L_V, assert_trivial=True)
            acc += _f32_hi(p1) * gl.convert_layout(x3, L_V, assert_trivial=True)
        else:
            xa, xb = gl.split(gl.reshape(x.to(gl.uint32), [WARPS, 1, 16, 2]))
            xa = gl.convert_layout(xa, L_V, assert_trivial=True)
            xb = gl.convert_layout(xb, L_V, assert_trivial=True)
            acc += _f32_lo(p0) * _f32_lo(xa)
            acc += _f32_hi(p0) * _f32_hi(xa)
            acc += _f32_lo(p1) * _f32_lo(xb)
            acc += _f32_hi(p1) * _f32_hi(xb)
        return acc

    @gluon.jit
    def _x_of(x, xs, i, L_X: gl.constexpr, XS: gl.constexpr):
        """Step ``i``'s x words (records ``t_begin + i * WARPS + w``): the ring's, or the staged ones
        (``L_X`` is then the fp32 layout when the staged x is fp32)."""
        if XS:
            x = gl.expand_dims(xs.index(i).load(gl.SliceLayout(1, L_X)), 1)
        return x

    @gluon.jit
    def _ring_set(acc, v, q, x, xs, i, t_next, wid, rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                  WARPS: gl.constexpr, ROWS: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr,
                  QPASS: gl.constexpr, PLAIN: gl.constexpr, XS: gl.constexpr, L_XF: gl.constexpr = None,
                  XF32: gl.constexpr = False):
        """One register set of the unrolled ring: its records' FMAs (step ``i``), then the set
        reloaded in place with records ``t_next + w`` (pinned there with ``XS``); with ``XF32`` the
        staged x is fp32 (layout ``L_XF``)."""
        if XF32:
            acc = _rec_fma(acc, v, q, _x_of(x, xs, i, L_XF, XS), WARPS, ROWS, L_V, QPASS, PLAIN, True)
        else:
            acc = _rec_fma(acc, v, q, _x_of(x, xs, i, L_X, XS), WARPS, ROWS, L_V, QPASS, PLAIN)
        v, q, x = _load_recs(rec_ptr, x32_ptr, tile_row, t_next + wid, t_end, KH, off_v, off_q, xw, pv, pq,
                             L_V, L_Q, L_X, QPASS, XS)
        return acc, v, q, x, _pin(wid, XS)

    # the shared-memory view cast is ``_reinterpret`` in Triton 3.6 and ``reinterpret`` later
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _view(buf, dtype: gl.constexpr, shape: gl.constexpr, order: gl.constexpr):
        """``buf``'s bytes as ``dtype`` ``shape``, unswizzled with dimension order ``order``."""
        if _PUBLIC_REINTERPRET:
            out = buf.reinterpret(dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, order=order))
        else:
            out = buf._reinterpret(dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, order=order))
        return out

    @gluon.jit
    def _stage_x(x32_ptr, t_begin, t_end, KH, WARPS: gl.constexpr, XS_IT: gl.constexpr, XS_CH: gl.constexpr):
        """Shared memory ``[XS_IT, WARPS, 32]`` (group ``i``, warp ``w``: the x words of record
        ``t_begin + i * WARPS + w``, zero past ``t_end`` and ``KH``), filled by cp.async in chunks of
        ``XS_CH`` groups, 16 bytes per copy; one commit group."""
        CW: gl.constexpr = XS_CH * WARPS * 32
        xc = gl.allocate_shared_memory(gl.int32, [XS_IT // XS_CH, CW], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        off = gl.arange(0, CW, layout=gl.BlockedLayout([CW // (32 * WARPS)], [32], [WARPS], [0]))
        lim = gl.minimum(t_end * 32, KH)
        for c in range(0, XS_IT // XS_CH):
            g = t_begin * 32 + c * CW + off
            _cp_async(xc.index(c), x32_ptr + g, mask=g < lim)
        async_copy.commit_group()
        return _view(xc, gl.int32, [XS_IT, WARPS, 32], [1, 0])

    @gluon.jit
    def _x_to_f32(xs, WARPS: gl.constexpr, XS_IT: gl.constexpr, XS_CH: gl.constexpr):
        """The staged bf16 pairs (landed, after the barrier) as fp32 ``[XS_IT, WARPS, 64]`` in natural
        k order, converted once: ``XS_CH`` groups per pass (a CTA barrier between passes: Triton's
        analysis sees one buffer), then a barrier."""
        CW: gl.constexpr = XS_CH * WARPS * 32
        L: gl.constexpr = gl.BlockedLayout([CW // (32 * WARPS)], [32], [WARPS], [0])
        # (an indexed 2-D buffer is laid out as in _stage_x: order [0], the 1-D pieces contiguous)
        src = _view(xs, gl.int32, [XS_IT // XS_CH, CW], [0])
        xf = gl.allocate_shared_memory(gl.float32, [XS_IT // XS_CH, 2 * CW], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for c in range(0, XS_IT // XS_CH):
            w = src.index(c).load(L).to(gl.uint32)
            xf.index(c).store(gl.reshape(gl.join(_f32_lo(w), _f32_hi(w)), [2 * CW]))
        _cta_barrier()
        return _view(xf, gl.float32, [XS_IT, WARPS, 64], [1, 0])

    @gluon.jit
    def _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH: gl.constexpr, LE: gl.constexpr):
        """Escapes ``e .. e + ESC_CH`` (below ``e_hi``): their rows and ``x[col] * delta``."""
        ok, er, ec, ed = _esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH, LE)
        return er, gl.load(x_ptr + ec, mask=ok, other=0.0).to(gl.float32) * ed

    @gluon.jit
    def _esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH: gl.constexpr, LE: gl.constexpr):
        """Escapes ``e .. e + ESC_CH`` (below ``e_hi``: ``ok``): rows (-1 past the range), columns and
        deltas, in layout ``LE``."""
        idx = e + gl.arange(0, ESC_CH, layout=LE)
        ok = idx < e_hi
        er = gl.load(erow_ptr + idx, mask=ok, other=-1)
        ec = gl.load(ecol_ptr + idx, mask=ok, other=0)
        ed = gl.load(edelta_ptr + idx, mask=ok, other=0.0)
        return ok, er, ec, ed

    @gluon.jit
    def _epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                        ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E: gl.constexpr):
        """The block's row scales ``2**(L_n - 112)``, escape range and first escape chunk."""
        scale, e_lo, e_hi = _epilogue_range(low_ptr, eptr_ptr, n0, N, ROWS, L_E)
        er, contrib = _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, ESC_CH, gl.SliceLayout(0, L_E))
        return scale, e_lo, e_hi, er, contrib

    @gluon.jit
    def _epilogue_range(low_ptr, eptr_ptr, n0, N, ROWS: gl.constexpr, L_E: gl.constexpr):
        """The block's row scales ``2**(L_n - 112)`` and escape range: independent loads."""
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
        low = gl.load(low_ptr + offs_n, mask=offs_n < N, other=112).to(gl.int32)
        scale = ((low + (127 - 112)) << 23).to(gl.float32, bitcast=True)
        e_lo = gl.load(eptr_ptr + n0)
        e_hi = gl.load(eptr_ptr + gl.minimum(n0 + ROWS, N))
        return scale, e_lo, e_hi

    @gluon.jit
    def _esc_rows(er, contrib, n0, ROWS: gl.constexpr, L_E: gl.constexpr):
        """An escape chunk's corrections summed per row of the block (``[ROWS]``, a fixed order)."""
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
        return gl.sum(gl.where(gl.expand_dims(er, 0) == gl.expand_dims(offs_n, 1), gl.expand_dims(contrib, 0), 0.0),
                      axis=1)

    @gluon.jit
    def _epilogue_end(part, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                      ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E: gl.constexpr):
        """Scale, add the exact escape corrections (later chunks loaded now; rare) and store."""
        y = gl.convert_layout(part, gl.SliceLayout(1, L_E)) * scale
        y += _esc_rows(er, contrib, n0, ROWS, L_E)
        _epilogue_rest(y, e_lo, e_hi, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N, ROWS, ESC_CH, L_E)

    @gluon.jit
    def _epilogue_rest(y, e_lo, e_hi, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                       ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E: gl.constexpr):
        """After the first escape chunk: the later chunks (loaded now; rare), then the store."""
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
        for e in range(e_lo + ESC_CH, e_hi, ESC_CH):
            er2, contrib2 = _esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH, gl.SliceLayout(0, L_E))
            y += _esc_rows(er2, contrib2, n0, ROWS, L_E)
        gl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)

    @gluon.jit
    def _w12_gemv_gl_kernel(
        x_ptr, x32_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        N, KH, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K, stride_ym,
        ROWS: gl.constexpr, WARPS: gl.constexpr, DEPTH: gl.constexpr, UNROLL: gl.constexpr, USE_SPLIT: gl.constexpr,
        QPASS: gl.constexpr, PLAIN: gl.constexpr, ESC_CH: gl.constexpr,
        L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, L_E: gl.constexpr,
        XS: gl.constexpr = False, XS_IT: gl.constexpr = 8, XS_CH: gl.constexpr = 8, EPI_LATE: gl.constexpr = False,
        XF32: gl.constexpr = False, L_XF: gl.constexpr = None, EPI_SPREAD: gl.constexpr = False,
    ):
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        n0 = pid_n * ROWS
        tile_row, off_v, off_q = _record_offsets_3d(n0, KT, ROWS, L_V, L_Q)
        cx = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_X)))
        xw = gl.expand_dims(gl.expand_dims(cx, 0), 1)                    # [1, 1, 32]
        wid = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_V)))

        pv = rec_ptr + tile_row * 3072 + off_v     # loop-invariant record pointers (XS)
        pq = rec_ptr + tile_row * 3072 + off_q

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = gl.zeros([WARPS, ROWS, 16], gl.float32, L_V)
        if XS:   # the program's x range, once: cp.async now, waited for after the first weight loads
            xs = _stage_x(x32_ptr, t_begin, t_end, KH, WARPS, XS_IT, XS_CH)
        else:
            xs = 0
        # with split-K only the last program needs the epilogue's loads, and it is not known yet;
        # EPI_LATE: after the first weight loads (pinned: ptxas would put the escape chain first)
        if not USE_SPLIT and not EPI_LATE and not EPI_SPREAD:
            scale, e_lo, e_hi, er, contrib = _epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
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
            wid = _pin(wid, True)
            scale, e_lo, e_hi = _epilogue_range(low_ptr, eptr_ptr, n0, N, ROWS, L_E)
        if not USE_SPLIT and EPI_LATE:
            wid = _pin(wid, True)
            scale, e_lo, e_hi, er, contrib = _epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                                                             n0, N, ROWS, ESC_CH, L_E)
        if XS:
            async_copy.wait_group(0)
            _cta_barrier()      # the only barrier before the loop (with XF32, a few more); none inside
            if XF32:
                xs = _x_to_f32(xs, WARPS, XS_IT, XS_CH)
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
                acc, v0, q0, x0, wid = _ring_set(acc, v0, q0, x0, xs, 0, t_begin + DEPTH * WARPS, wid, rec_ptr,
                                                 x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                 L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
                L_D: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])    # one escape per lane
                eok, er_d, ec_d, ed_d = _esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, ESC_CH, L_D)
                wid = _pin(wid, True)
                if DEPTH >= 2:
                    acc, v1, q1, x1, wid = _ring_set(acc, v1, q1, x1, xs, 1, t_begin + (DEPTH + 1) * WARPS, wid,
                                                     rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                                                     WARPS, ROWS, L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
                if DEPTH >= 3:
                    acc, v2, q2, x2, wid = _ring_set(acc, v2, q2, x2, xs, 2, t_begin + (DEPTH + 2) * WARPS, wid,
                                                     rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                                                     WARPS, ROWS, L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
                if DEPTH >= 4:
                    acc, v3, q3, x3, wid = _ring_set(acc, v3, q3, x3, xs, 3, t_begin + (DEPTH + 3) * WARPS, wid,
                                                     rec_ptr, x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq,
                                                     WARPS, ROWS, L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
                xe_d = gl.load(x_ptr + ec_d, mask=eok, other=0.0)
                wid = _pin(wid, True)
                t0 = t_begin + DEPTH * WARPS
            for t in range(t0, t_end, DEPTH * WARPS):
                i = (t - t_begin) // WARPS
                acc, v0, q0, x0, wid = _ring_set(acc, v0, q0, x0, xs, i, t + DEPTH * WARPS, wid, rec_ptr, x32_ptr,
                                                 tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS, L_V, L_Q,
                                                 L_X, QPASS, PLAIN, XS, L_XF, XF32)
                if DEPTH >= 2:
                    acc, v1, q1, x1, wid = _ring_set(acc, v1, q1, x1, xs, i + 1, t + (DEPTH + 1) * WARPS, wid, rec_ptr,
                                                     x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                     L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
                if DEPTH >= 3:
                    acc, v2, q2, x2, wid = _ring_set(acc, v2, q2, x2, xs, i + 2, t + (DEPTH + 2) * WARPS, wid, rec_ptr,
                                                     x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                     L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
                if DEPTH >= 4:
                    acc, v3, q3, x3, wid = _ring_set(acc, v3, q3, x3, xs, i + 3, t + (DEPTH + 3) * WARPS, wid, rec_ptr,
                                                     x32_ptr, tile_row, t_end, KH, off_v, off_q, xw, pv, pq, WARPS, ROWS,
                                                     L_V, L_Q, L_X, QPASS, PLAIN, XS, L_XF, XF32)
        else:
            for t in range(t_begin, t_end, WARPS):
                vn, qn, xn = _load_recs(rec_ptr, x32_ptr, tile_row, t + DEPTH * WARPS + wid, t_end, KH, off_v, off_q,
                                        xw, pv, pq, L_V, L_Q, L_X, QPASS, XS)
                acc = _rec_fma(acc, v0, q0, _x_of(x0, xs, (t - t_begin) // WARPS, L_X, XS), WARPS, ROWS, L_V, QPASS,
                               PLAIN)
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
        if EPI_SPREAD:   # the first chunk's x[col] * delta now, the same products as _esc_chunk's
            er = gl.convert_layout(er_d, gl.SliceLayout(0, L_E))
            contrib = gl.convert_layout(xe_d.to(gl.float32) * ed_d, gl.SliceLayout(0, L_E))
        if not USE_SPLIT:
            _epilogue_end(part, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                          ROWS, ESC_CH, L_E)
        else:
            ws_base = ws_ptr + pid_n.to(gl.int64) * (SPLIT_K * ROWS)
            ro = gl.arange(0, ROWS, layout=LR)
            gl.store(ws_base + pid_k * ROWS + ro, part)
            _cta_barrier()
            count = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                scale, e_lo, e_hi, er, contrib = _epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
                                                                 edelta_ptr, n0, N, ROWS, ESC_CH, L_E)
                total = gl.zeros([ROWS], gl.float32, LR)
                for s in range(0, SPLIT_K):     # fixed order
                    total += gl.load(ws_base + s * ROWS + ro, cache_modifier=".cg")
                gl.atomic_xchg(lock_ptr + pid_n, 0)
                _epilogue_end(total, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                              n0, N, ROWS, ESC_CH, L_E)


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Gluon present, one contiguous bf16 row of even length on a CUDA device (x read as pairs)."""
    return (gluon is not None and x.is_cuda and packed.rec32.is_cuda and x.dtype == torch.bfloat16
            and x.dim() == 2 and x.shape[0] == 1 and x.shape[1] % 2 == 0 and x.stride(1) == 1
            and x.data_ptr() % 16 == 0)


def default_config(n: int, k: int, sms: int = 132) -> GluonGemvConfig:
    """16-row programs of 4 warps, four unrolled register sets with x staged (capped at 96
    registers, the escapes loaded after the first records), and split-K only when there are fewer
    than two programs per SM (or the staged x would not fit)."""
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
    cfg = config or default_config(packed.shape[0], x.shape[1])
    check_config(cfg)
    n, k = packed.shape
    if out is None:
        out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    if cfg.tma:
        from . import gemv_tma

        gemv_tma.launch(x, packed, out, qpass, cfg)
        return out
    kt = packed.k_tiles
    tps = (kt + cfg.split_k - 1) // cfg.split_k
    split = (kt + tps - 1) // tps
    nb = (n + cfg.rows - 1) // cfg.rows
    xs_it = cfg.xs_groups(kt) if cfg.xs else XS_CHUNK
    if cfg.xs and cfg.xs_bytes(kt) > XS_MAX_BYTES:
        raise ValueError(f"{cfg.key()}: staged x would take {cfg.xs_bytes(kt)} bytes of shared memory "
                         f"(limit {XS_MAX_BYTES}); use a larger split_k or xs=False")
    ws, locks = _workspace(x.device, nb * split * cfg.rows if split > 1 else 1, nb)
    lv, lq, lx, le = layouts(cfg.rows, cfg.warps)
    _w12_gemv_gl_kernel[(nb, split)](
        x, x.view(torch.int32), out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        n, k // 2, kt, tps, nb, split, out.stride(0),
        ROWS=cfg.rows, WARPS=cfg.warps, DEPTH=cfg.depth, UNROLL=cfg.unroll, USE_SPLIT=split > 1, QPASS=qpass,
        PLAIN=cfg.plain_decode,
        ESC_CH=8, L_V=lv, L_Q=lq, L_X=lx, L_E=le, XS=cfg.xs, XS_IT=xs_it, XS_CH=XS_CHUNK,
        EPI_LATE=cfg.late_epilogue, EPI_SPREAD=cfg.epi_spread, XF32=cfg.xf32,
        L_XF=xf32_layout(cfg.warps) if cfg.xf32 else None,
        num_warps=cfg.warps, **launch_options(cfg),
    )
    return out
