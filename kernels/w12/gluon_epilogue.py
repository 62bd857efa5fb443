"""The epilogues of the W12 Gluon kernels: row scale ``2**(L_n - 112)``, the exact escape
corrections ``x[:, k] * (w - slot)`` and the store, bitwise identical run to run.

* tensor-core kernels (:mod:`.mma`, :mod:`.mma_tma`, :mod:`.warpk`): :func:`epilogue` takes an
  accumulator ``[BLOCK_N, BLOCK_M]`` to y directly or through the fixed-order split-K reduction (a
  workspace and a per-block counter); :mod:`.warpk` may issue its loads (:func:`finalize_loads`:
  three dependent round trips) before the main loop and apply them after (:func:`finalize_apply`);
* one-row kernels (:mod:`.gemv_gluon`, the fused decode kernels): :func:`row_epilogue_start` loads
  the block's row scales, escape range and first escape chunk, :func:`row_epilogue_end` applies
  them to the ``[ROWS]`` sums and stores.
"""

from __future__ import annotations

from .gluon_common import cta_barrier, gl, gluon

if gluon is not None:

    def epilogue_layout(block_m: int, num_warps: int):
        """The epilogue's ``[BLOCK_N, BLOCK_M]`` (and the escapes' ``[ESC_CH, BLOCK_M]``): rows over
        lanes and warps (:func:`finalize`)."""
        tm = min(block_m, 4)
        return gl.BlockedLayout([1, min(block_m // tm, 4)], [32 // tm, tm], [num_warps, 1], [1, 0])

    @gluon.jit
    def epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                  n0, pid_n, pid_k, pid_m, M, N, NUM_N_BLOCKS, SPLIT_K, SLOTS, stride_xm, stride_ym,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, ESC_CH: gl.constexpr,
                  ACC: gl.constexpr, L_EP: gl.constexpr):
        """The accumulator ``acc`` (layout ``ACC``) to y: directly, or through the fixed-order split-K
        reduction (partial ``pid_k`` of ``SPLIT_K`` to a workspace of ``SLOTS`` partials per block, a
        per-block counter, the last program sums them in order)."""
        if not USE_SPLIT:
            finalize(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N,
                      stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)
        else:
            blk = pid_m * NUM_N_BLOCKS + pid_n
            ws_base = ws_ptr + blk.to(gl.int64) * (SLOTS * BLOCK_N * BLOCK_M)
            tr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
            tc = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
            tile_offs = tr[:, None] * BLOCK_M + tc[None, :]
            zero_i = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, ACC)
            gl.store(ws_base + pid_k * (BLOCK_N * BLOCK_M) + tile_offs, acc)
            cta_barrier()
            count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
                # fixed order (bitwise identical run to run), four partials loaded at a time
                TILE: gl.constexpr = BLOCK_N * BLOCK_M
                for s in range(0, SPLIT_K, 4):
                    p0 = gl.load(ws_base + s * TILE + tile_offs, cache_modifier=".cg")
                    p1 = gl.load(ws_base + (s + 1) * TILE + tile_offs, mask=zero_i + s + 1 < SPLIT_K, other=0.0,
                                 cache_modifier=".cg")
                    p2 = gl.load(ws_base + (s + 2) * TILE + tile_offs, mask=zero_i + s + 2 < SPLIT_K, other=0.0,
                                 cache_modifier=".cg")
                    p3 = gl.load(ws_base + (s + 3) * TILE + tile_offs, mask=zero_i + s + 3 < SPLIT_K, other=0.0,
                                 cache_modifier=".cg")
                    total += p0
                    total += p1
                    total += p2
                    total += p3
                gl.atomic_xchg(lock_ptr + blk, 0)
                finalize(total, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m,
                          M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)

    @gluon.jit
    def finalize(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N,
                  stride_xm, stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr,
                  L_EP: gl.constexpr):
        """Row scale, exact escape corrections and the store.

        The escapes are CSR by row (``eptr``): the block's row ranges are loaded at once, then the
        columns and deltas of ``ESC_CH`` escapes and x at those columns (one pass for any real
        layer, so three dependent round trips in all, not two per handful of escapes), and each
        output adds its row's contributions in escape order through a register gather."""
        pre = finalize_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                              BLOCK_N, BLOCK_M, ESC_CH, L_EP)
        finalize_apply(acc, pre, x_ptr, y_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                        stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)

    @gluon.jit
    def _esc_contrib(x_ptr, ecol_ptr, edelta_ptr, e0, e_hi, offs_m, M, stride_xm, ESC_CH: gl.constexpr,
                     L_EP: gl.constexpr):
        """``x[m, col] * delta`` of escapes ``e0 .. e0 + ESC_CH`` (below ``e_hi``): ``[ESC_CH, BLOCK_M]``."""
        ok, ec, ed = esc_cols(ecol_ptr, edelta_ptr, e0, e_hi, ESC_CH, L_EP)
        return esc_x(x_ptr, ok, ec, offs_m, M, stride_xm).to(gl.float32) * ed[:, None]

    @gluon.jit
    def esc_cols(ecol_ptr, edelta_ptr, e0, e_hi, ESC_CH: gl.constexpr, L_EP: gl.constexpr):
        """Escapes ``e0 .. e0 + ESC_CH`` (below ``e_hi``: ``ok``): their columns and deltas."""
        idx = e0 + gl.arange(0, ESC_CH, layout=gl.SliceLayout(1, L_EP))
        ok = idx < e_hi
        ec = gl.load(ecol_ptr + idx, mask=ok, other=0)
        ed = gl.load(edelta_ptr + idx, mask=ok, other=0.0)
        return ok, ec, ed

    @gluon.jit
    def esc_x(x_ptr, ok, ec, offs_m, M, stride_xm):
        """x at the escapes' columns ``[ESC_CH, BLOCK_M]`` (bf16; zero where not ``ok`` or past M)."""
        return gl.load(x_ptr + offs_m[None, :] * stride_xm + ec[:, None], mask=ok[:, None] & (offs_m < M)[None, :],
                       other=0.0)

    @gluon.jit
    def finalize_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr, L_EP: gl.constexpr):
        """The epilogue's loads (three dependent round trips): row scales, the rows' escape ranges
        and the first ``ESC_CH`` escapes' contributions. A kernel may issue them before its main
        loop so they are not paid in the tail."""
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, L_EP))
        scale, r_lo, r_hi, e_lo, e_hi = finalize_range(low_ptr, eptr_ptr, n0, N, BLOCK_N, L_EP)
        contrib = _esc_contrib(x_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, offs_m, M, stride_xm, ESC_CH, L_EP)
        return scale, r_lo, r_hi, e_lo, e_hi, contrib

    @gluon.jit
    def finalize_range(low_ptr, eptr_ptr, n0, N, BLOCK_N: gl.constexpr, L_EP: gl.constexpr):
        """The independent loads of :func:`finalize_loads`: row scales, the rows' escape ranges."""
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_EP))
        n_mask = offs_n < N
        low = gl.load(low_ptr + offs_n, mask=n_mask, other=112).to(gl.int32)
        r_lo = gl.load(eptr_ptr + offs_n, mask=n_mask, other=0)
        r_hi = gl.load(eptr_ptr + offs_n + 1, mask=n_mask, other=0)
        # (a TMA kernel's 16-row slice may start past N: eptr has N + 1 entries)
        e_lo = gl.load(eptr_ptr + gl.minimum(n0, N))
        e_hi = gl.load(eptr_ptr + gl.minimum(n0 + BLOCK_N, N))
        scale = ((low + (127 - 112)) << 23).to(gl.float32, bitcast=True)
        return scale, r_lo, r_hi, e_lo, e_hi

    @gluon.jit
    def finalize_apply(acc, pre, x_ptr, y_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                        stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr,
                        L_EP: gl.constexpr):
        """:func:`finalize` after :func:`finalize_loads` (``pre``): scale, escapes (later chunks,
        rare, loaded now), store."""
        scale, r_lo, r_hi, e_lo, e_hi, contrib = pre
        y = gl.convert_layout(acc, L_EP) * scale[:, None]
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_EP))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, L_EP))
        n_mask = offs_n < N
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, L_EP)
        for e0 in range(e_lo, e_hi, ESC_CH):
            if e0 > e_lo:
                contrib = _esc_contrib(x_ptr, ecol_ptr, edelta_ptr, e0, e_hi, offs_m, M, stride_xm, ESC_CH, L_EP)
            lo = gl.where(n_mask, gl.maximum(r_lo, e0) - e0, 0)          # this chunk's slots of each row
            hi = gl.where(n_mask, gl.minimum(r_hi, e0 + ESC_CH) - e0, 0)
            for i in range(0, gl.max(hi - lo, axis=0)):                   # the most escapes in one row
                slot = lo + i
                got = gl.gather(contrib, zero + gl.minimum(slot, ESC_CH - 1)[:, None], 0)
                y += gl.where((slot < hi)[:, None], got, 0.0)
        gl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(y_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (offs_m < M)[None, :])

    @gluon.jit
    def _row_esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH: gl.constexpr, LE: gl.constexpr):
        """Escapes ``e .. e + ESC_CH`` (below ``e_hi``): their rows and ``x[col] * delta``."""
        ok, er, ec, ed = esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH, LE)
        return er, gl.load(x_ptr + ec, mask=ok, other=0.0).to(gl.float32) * ed

    @gluon.jit
    def esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH: gl.constexpr, LE: gl.constexpr):
        """Escapes ``e .. e + ESC_CH`` (below ``e_hi``: ``ok``): rows (-1 past the range), columns and
        deltas, in layout ``LE``."""
        idx = e + gl.arange(0, ESC_CH, layout=LE)
        ok = idx < e_hi
        er = gl.load(erow_ptr + idx, mask=ok, other=-1)
        ec = gl.load(ecol_ptr + idx, mask=ok, other=0)
        ed = gl.load(edelta_ptr + idx, mask=ok, other=0.0)
        return ok, er, ec, ed

    @gluon.jit
    def row_epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                        ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E: gl.constexpr):
        """The block's row scales ``2**(L_n - 112)``, escape range and first escape chunk."""
        scale, e_lo, e_hi = row_epilogue_range(low_ptr, eptr_ptr, n0, N, ROWS, L_E)
        er, contrib = _row_esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, ESC_CH, gl.SliceLayout(0, L_E))
        return scale, e_lo, e_hi, er, contrib

    @gluon.jit
    def row_epilogue_range(low_ptr, eptr_ptr, n0, N, ROWS: gl.constexpr, L_E: gl.constexpr):
        """The block's row scales ``2**(L_n - 112)`` and escape range: independent loads."""
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
        low = gl.load(low_ptr + offs_n, mask=offs_n < N, other=112).to(gl.int32)
        scale = ((low + (127 - 112)) << 23).to(gl.float32, bitcast=True)
        e_lo = gl.load(eptr_ptr + n0)
        e_hi = gl.load(eptr_ptr + gl.minimum(n0 + ROWS, N))
        return scale, e_lo, e_hi

    @gluon.jit
    def row_esc_sums(er, contrib, n0, ROWS: gl.constexpr, L_E: gl.constexpr):
        """An escape chunk's corrections summed per row of the block (``[ROWS]``, a fixed order)."""
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
        return gl.sum(gl.where(gl.expand_dims(er, 0) == gl.expand_dims(offs_n, 1), gl.expand_dims(contrib, 0), 0.0),
                      axis=1)

    @gluon.jit
    def row_epilogue_end(part, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                      ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E: gl.constexpr):
        """Scale, add the exact escape corrections (later chunks loaded now; rare) and store."""
        y = gl.convert_layout(part, gl.SliceLayout(1, L_E)) * scale
        y += row_esc_sums(er, contrib, n0, ROWS, L_E)
        row_epilogue_rest(y, e_lo, e_hi, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N, ROWS, ESC_CH, L_E)

    @gluon.jit
    def row_epilogue_rest(y, e_lo, e_hi, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                       ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E: gl.constexpr):
        """After the first escape chunk: the later chunks (loaded now; rare), then the store."""
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
        for e in range(e_lo + ESC_CH, e_hi, ESC_CH):
            er2, contrib2 = _row_esc_chunk(x_ptr, erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH, gl.SliceLayout(0, L_E))
            y += row_esc_sums(er2, contrib2, n0, ROWS, L_E)
        gl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)
