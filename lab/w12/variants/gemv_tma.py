"""One-row W12 GEMV fed by TMA copies into a shared-memory ring (Hopper): the Gluon GEMV's
arithmetic, with the weight stream decoupled from the decode.

In :mod:`.gemv_gluon` each warp loads its own records into registers ``depth`` records ahead, so
the bytes in flight per program are bounded by the register sets (three 1.5 KB records per warp at
most) and a warp that stalls on its decode stops issuing loads. Here one copy warp streams the
program's records into ``stages`` shared-memory stages with 3-D TMA boxes: a stage is ``RPS x
WARPS`` consecutive records of the program's ``ROWS`` rows, one box of views and one of nibbles.
With ``tma_box=256`` (default) ``rec32`` is seen as ``[records, 48, 64]`` words, so each row of a
box is 256 contiguous bytes (a program's rows are contiguous in a record); with ``tma_box=64`` the
boxes take the records' own rows (64-byte view rows, 32-byte nibble rows), the form first measured.
The consumer warps wait on each stage's ``ready`` mbarrier, read their records' words from shared
memory, release the stage (``fence.proxy.async``, then one arrival on ``empty`` after the partition's
barrier, which Gluon puts before a multi-warp partition's arrival: the rule of :mod:`.mma_tma`'s
group consumer) and decode. The bytes in flight are ``stages`` stages whatever the decode does.

Measured on the H200 (docs/w12.md; 64-byte and 256-byte box rows, with and without the loader
warp): 256-byte rows beat 64-byte ones,
but no form beats the routed register kernels by more than the run-to-run spread (1.264x against
1.288x geometric mean in the same run), and deeper rings were slower; not routed.

The consumers keep :mod:`.gemv_gluon`'s layouts and order exactly: warp ``w`` accumulates records
``w, w + WARPS, ...`` in the same ``[WARPS, ROWS, 16]`` fp32 accumulator, x staged in shared memory
by ``cp.async`` (zero past the range), the same decode, the same fixed reduction tree and the same
epilogue (row scale, exact escapes; its loads issued before the loop, or with ``tma_epi_warp`` by a
third partition, one warp that runs the three dependent round trips beside the ring and leaves the
row scales, the first escape chunk's per-row sums and the escape range in shared memory behind an
mbarrier, so the consumers start on the ring at once). So the output is bitwise
that of :func:`.gemv_gluon.w12_gemv_gluon` with the same ``rows`` and ``warps`` (GPU tests), and
identical run to run. A last stage past the range reads the next records of the buffer (or the
TMA unit's zero fill past its end); their staged x is zero, so they add +-0 to an accumulator that
is never -0.

The plain reference is :func:`.naive.w12_linear_ref`. No split-K: a program takes a whole row tile's
K range (configs with a split go to :mod:`.gemv_gluon`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .gemm import KernelPack
from . import gemv_gluon as _gg
from . import mma_tma as _mt
from .mma import gl, gluon

AVAILABLE = _mt.AVAILABLE
MAX_STAGES = 16
SMEM_LIMIT = 220 * 1024          # per program, of the H200's 227 KB
# registers of a consumer warp (``maxnreg`` of the config; the copy warp's warpgroup gets 24): with
# 88 the sm_90 compile (Triton 3.6) spills nothing at 8-32 rows and 1-4 records per stage
DEFAULT_REGS = 88


LOADER_REGS = 48   # the copy warp's warpgroup with the epilogue loader in it (24 spills there)


def launch_regs(warps: int, regs: int, epi_warp: bool = False) -> int:
    """The kernel's register cap for ``regs`` per consumer warp beside the worker warpgroup (the
    copy warp, and the epilogue loader with ``epi_warp``), which Triton gives the largest count any
    of its partitions asks for: 24, or :data:`LOADER_REGS`."""
    return _mt.launch_regs(warps, regs, 4, LOADER_REGS if epi_warp else 24)


def stage_bytes(rows: int, warps: int, rps: int, qpass: bool = False) -> int:
    """Bytes of one ring stage: ``rps * warps`` records' slices of ``rows`` rows."""
    return rps * warps * rows * (64 if qpass else 96)


def xs_groups(k_tiles: int, warps: int, rps: int) -> int:
    """Groups of ``warps`` records of staged x: covers every step, a multiple of the cp.async chunk
    (:data:`.gemv_gluon.XS_CHUNK`) and of ``rps`` (:func:`.gemv_gluon.xs_group_count`)."""
    return _gg.xs_group_count(k_tiles, warps, rps)


def smem_bytes(k_tiles: int, rows: int, warps: int, stages: int, rps: int) -> int:
    """Shared memory of a program: the ring, the staged x, the barriers."""
    return stages * stage_bytes(rows, warps, rps) + xs_groups(k_tiles, warps, rps) * warps * 128 + 16 * stages


def check(cfg) -> None:
    """A TMA GEMV config (``GluonGemvConfig(..., tma=True)``): 4 or 8 consumer warps (a warpgroup or
    two), ``depth`` stages (2-16), ``tma_rps``
    records per warp and stage (1, 2 or 4), ``tma_box`` bytes per box row (256 or 64), ``tma_epi_warp``
    (a loader warp for the epilogue's operands), no split-K, no register ring options."""
    if cfg.warps not in (4, 8):
        raise ValueError(f"the TMA GEMV's consumers are whole warpgroups: warps 4 or 8, got {cfg.warps}")
    if not 2 <= cfg.depth <= MAX_STAGES:
        raise ValueError(f"a TMA GEMV ring has 2-{MAX_STAGES} stages (depth), got {cfg.depth}")
    if cfg.tma_box not in (64, 256):
        raise ValueError(f"tma_box (bytes per view box row) is 256 or 64 (the records' own rows), got {cfg.tma_box}")
    if cfg.tma_rps not in (1, 2, 4):
        raise ValueError(f"tma_rps (records per warp and stage) is 1, 2 or 4, got {cfg.tma_rps}")
    if cfg.split_k != 1:
        raise ValueError("the TMA GEMV takes a whole K range per program (split_k=1)")
    if cfg.unroll or cfg.xs or cfg.xf32 or cfg.late_epilogue:
        raise ValueError("tma=True has its own ring: unroll, xs, xf32 and late_epilogue do not apply")


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """:func:`.gemv_gluon.supported` and TMA (Gluon's Hopper module, compute capability 9.0+)."""
    return _gg.supported(x, packed) and _mt.supported(x.device)


if AVAILABLE:
    from .gemv_gluon import (_epilogue_end, _epilogue_rest, _epilogue_start, _esc_rows, _rec_fma, _stage_x, _view,
                             _x_of)
    from .mma import _cta_barrier, async_copy
    from .mma_tma import _tma_load, fence_async_shared, mbarrier

    @gluon.jit
    def _producer(pt, ROWS: gl.constexpr, WARPS: gl.constexpr, RPS: gl.constexpr, STAGES: gl.constexpr,
                  QPASS: gl.constexpr, VW: gl.constexpr, QW: gl.constexpr):
        """The copy warp (one thread issues): stage ``i`` = records ``rec0 + i * RPS * WARPS ..``, the
        program's rows of their views and nibbles (boxes of ``VW``- and ``QW``-word rows), once every
        consumer has released the stage."""
        v_desc, q_desc, wv_s, wq_s, ready, empty, rec0, r_in, n_steps = pt
        for i in range(0, n_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)    # (a fresh barrier passes parity 1)
            bar = ready.index(s)
            r = rec0 + i * (RPS * WARPS)
            if QPASS:
                mbarrier.expect(bar, RPS * WARPS * ROWS * 64)
            else:
                mbarrier.expect(bar, RPS * WARPS * ROWS * 96)
            _tma_load(v_desc, [r, r_in * 16 // VW, 0], bar, wv_s.index(s))
            if not QPASS:
                _tma_load(q_desc, [r, (2048 + r_in * 8) // QW, 0], bar, wq_s.index(s))

    @gluon.jit
    def _consumer(rt, ROWS: gl.constexpr, WARPS: gl.constexpr, RPS: gl.constexpr, STAGES: gl.constexpr,
                  QPASS: gl.constexpr, PLAIN: gl.constexpr, ESC_CH: gl.constexpr, XS_IT: gl.constexpr,
                  XS_CH: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr,
                  L_E: gl.constexpr, EPI_WARP: gl.constexpr):
        """The ``WARPS`` consumer warps: stage x, start the epilogue's loads (unless ``EPI_WARP``:
        the loader warp does), then every stage's records (warp ``w`` the ``w``-th of each group of
        ``WARPS``) decoded into the accumulator; the lanes' and warps' sums in a fixed tree, the
        epilogue, the store."""
        (wv_b, wq_b, ready, empty, n_steps, x_ptr, x32_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
         edelta_ptr, n0, N, KT, KH, epi_f, epi_i, epi_bar) = rt
        # the stages as [stage, record, row, words] (the boxes' bytes, unswizzled)
        wv_s = _view(wv_b, gl.int32, [STAGES, RPS * WARPS, ROWS, 16], [2, 1, 0])
        wq_s = _view(wq_b, gl.int32, [STAGES, RPS * WARPS, ROWS, 8], [2, 1, 0])
        xs = _stage_x(x32_ptr, 0, KT, KH, WARPS, XS_IT, XS_CH)
        if not EPI_WARP:
            scale, e_lo, e_hi, er, contrib = _epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
                                                             edelta_ptr, n0, N, ROWS, ESC_CH, L_E)
        async_copy.wait_group(0)
        _cta_barrier()          # (the partition's barrier) every warp's staged x has landed
        acc = gl.zeros([WARPS, ROWS, 16], gl.float32, L_V)
        for i in range(0, n_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            wv = wv_s.index(s)
            wq = wq_s.index(s)
            v0 = wv.slice(0, WARPS).load(L_V)
            if QPASS:
                q0 = v0
            else:
                q0 = wq.slice(0, WARPS).load(L_Q)
            if RPS >= 2:
                v1 = wv.slice(WARPS, WARPS).load(L_V)
                if QPASS:
                    q1 = v1
                else:
                    q1 = wq.slice(WARPS, WARPS).load(L_Q)
            if RPS >= 4:
                v2 = wv.slice(2 * WARPS, WARPS).load(L_V)
                v3 = wv.slice(3 * WARPS, WARPS).load(L_V)
                if QPASS:
                    q2 = v2
                    q3 = v3
                else:
                    q2 = wq.slice(2 * WARPS, WARPS).load(L_Q)
                    q3 = wq.slice(3 * WARPS, WARPS).load(L_Q)
            fence_async_shared()   # our shared reads before the copy that refills the stage (mma_tma)
            mbarrier.arrive(empty.index(s))   # (one arrival, after the partition's barrier: Gluon's)
            acc = _rec_fma(acc, v0, q0, _x_of(0, xs, i * RPS, L_X, True), WARPS, ROWS, L_V, QPASS, PLAIN)
            if RPS >= 2:
                acc = _rec_fma(acc, v1, q1, _x_of(0, xs, i * RPS + 1, L_X, True), WARPS, ROWS, L_V, QPASS, PLAIN)
            if RPS >= 4:
                acc = _rec_fma(acc, v2, q2, _x_of(0, xs, i * RPS + 2, L_X, True), WARPS, ROWS, L_V, QPASS, PLAIN)
                acc = _rec_fma(acc, v3, q3, _x_of(0, xs, i * RPS + 3, L_X, True), WARPS, ROWS, L_V, QPASS, PLAIN)
        part = gl.convert_layout(gl.sum(gl.sum(acc, axis=2), axis=0), gl.SliceLayout(1, L_E))
        if EPI_WARP:   # the loader's row scales, first chunk's sums and escape range: the same values
            mbarrier.wait(epi_bar, 0)
            y = part * epi_f.index(0).load(gl.SliceLayout(1, L_E))
            y += epi_f.index(1).load(gl.SliceLayout(1, L_E))
            e = epi_i.load(gl.SliceLayout(1, L_E))
            j = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E))
            _epilogue_rest(y, gl.max(gl.where(j == 0, e, 0), axis=0), gl.max(gl.where(j == 1, e, 0), axis=0),
                           x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N, ROWS, ESC_CH, L_E)
        else:
            _epilogue_end(part, scale, e_lo, e_hi, er, contrib, x_ptr, y_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N,
                          ROWS, ESC_CH, L_E)

    @gluon.jit
    def _epi_loader(et, ROWS: gl.constexpr, ESC_CH: gl.constexpr, L_E1: gl.constexpr):
        """One warp beside the ring: the epilogue's three dependent round trips (row scales, escape
        range, first escape chunk and x at its columns), off the consumers' path; it leaves the row
        scales, the chunk's per-row sums (:func:`.gemv_gluon._esc_rows`, the consumers' order) and
        ``e_lo, e_hi`` in shared memory and arrives on ``epi_bar``."""
        x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N, epi_f, epi_i, epi_bar = et
        scale, e_lo, e_hi, er, contrib = _epilogue_start(x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                                                         n0, N, ROWS, ESC_CH, L_E1)
        epi_f.index(0).store(scale)
        epi_f.index(1).store(_esc_rows(er, contrib, n0, ROWS, L_E1))
        j = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_E1))
        epi_i.store(gl.where(j == 0, e_lo, e_hi))
        _cta_barrier()          # (the warp's) every lane's stores before the arrival
        mbarrier.arrive(epi_bar)

    @gluon.jit
    def _w12_gemv_tma_kernel(
        v_desc, q_desc, x_ptr, x32_ptr, y_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        N, KH, KT,
        ROWS: gl.constexpr, WARPS: gl.constexpr, RPS: gl.constexpr, STAGES: gl.constexpr, QPASS: gl.constexpr,
        PLAIN: gl.constexpr, ESC_CH: gl.constexpr, XS_IT: gl.constexpr, XS_CH: gl.constexpr,
        L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, L_E: gl.constexpr,
        VW: gl.constexpr = 64, QW: gl.constexpr = 64, EPI_WARP: gl.constexpr = False, L_E1: gl.constexpr = None,
    ):
        pid_n = gl.program_id(0)
        n0 = pid_n * ROWS
        n_steps = (KT + RPS * WARPS - 1) // (RPS * WARPS)
        wv_s = gl.allocate_shared_memory(gl.int32, [STAGES, RPS * WARPS, ROWS * 16 // VW, VW], v_desc.layout)
        wq_s = gl.allocate_shared_memory(gl.int32, [STAGES, RPS * WARPS, ROWS * 8 // QW, QW], q_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for p in gl.static_range(STAGES):
            mbarrier.init(ready.index(p), count=1)
            mbarrier.init(empty.index(p), count=1)
        pt = (v_desc, q_desc, wv_s, wq_s, ready, empty, (n0 // 128) * KT, n0 % 128, n_steps)
        if EPI_WARP:   # a third partition: one warp loads the epilogue's operands
            # (allocated only here: an mbarrier nothing waits on is dead to the allocator, which put it
            # inside the staged x, so cp.async overwrote an initialized mbarrier: wrong, run-to-run
            # different sums on the H200 until this was moved under the flag)
            epi_f = gl.allocate_shared_memory(gl.float32, [2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            epi_i = gl.allocate_shared_memory(gl.int32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            epi_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(epi_bar, count=1)
            fence_async_shared()
            rt = (wv_s, wq_s, ready, empty, n_steps, x_ptr, x32_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
                  edelta_ptr, n0, N, KT, KH, epi_f, epi_i, epi_bar)
            et = (x_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, N, epi_f, epi_i, epi_bar)
            gl.warp_specialize([(_consumer, (rt, ROWS, WARPS, RPS, STAGES, QPASS, PLAIN, ESC_CH, XS_IT, XS_CH,
                                             L_V, L_Q, L_X, L_E, True)),
                                (_producer, (pt, ROWS, WARPS, RPS, STAGES, QPASS, VW, QW)),
                                (_epi_loader, (et, ROWS, ESC_CH, L_E1))], [1, 1], [24, 48])   # LOADER_REGS
        else:
            fence_async_shared()
            rt = (wv_s, wq_s, ready, empty, n_steps, x_ptr, x32_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
                  edelta_ptr, n0, N, KT, KH, 0, 0, 0)
            gl.warp_specialize([(_consumer, (rt, ROWS, WARPS, RPS, STAGES, QPASS, PLAIN, ESC_CH, XS_IT, XS_CH,
                                             L_V, L_Q, L_X, L_E, False)),
                                (_producer, (pt, ROWS, WARPS, RPS, STAGES, QPASS, VW, QW))], [1], [24])

    @lru_cache(maxsize=None)
    def _box_layout():
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def box_words(box_bytes: int) -> tuple[int, int]:
    """Words per box row of the view and nibble boxes: 256-byte rows (64, 64; the records seen as
    ``[records, 48, 64]``), or the records' own rows (16, 8: 64-byte view rows, 32-byte nibble rows)."""
    return (64, 64) if box_bytes == 256 else (16, 8)


def record_descriptors(packed: KernelPack, rows: int, box_records: int, box_bytes: int = 256) -> tuple:
    """TMA descriptors of the records' views and nibbles, boxes of ``box_records`` records and the
    program's ``rows`` rows. With 256-byte box rows the records are ``[records, 48, 64]`` words: the
    views are ``rows / 4`` rows from ``r_in / 4``, the nibbles ``rows / 8`` from ``32 + r_in / 8``;
    with 64 (the records' own rows) ``[records, 192, 16]`` and ``[records, 384, 8]``. Cached on the
    pack."""
    cache = packed.__dict__.setdefault("_tma_gemv_desc", {})
    key = (rows, box_records, box_bytes)
    if key not in cache:
        vw, qw = box_words(box_bytes)
        rec = packed.rec32.reshape(-1)
        lay = _box_layout()
        cache[key] = (_mt.TensorDescriptor.from_tensor(rec.view(-1, 3072 // vw, vw), [box_records, rows * 16 // vw, vw],
                                                       lay),
                      _mt.TensorDescriptor.from_tensor(rec.view(-1, 3072 // qw, qw), [box_records, rows * 8 // qw, qw],
                                                       lay))
    return cache[key]


def launch(x: torch.Tensor, packed: KernelPack, out: torch.Tensor, qpass: bool, cfg) -> None:
    """Run the TMA GEMV for ``cfg`` (already checked: :func:`.gemv_gluon.check_config` calls
    :func:`check`); ``x`` one aligned bf16 row."""
    if not _mt.supported(x.device):
        raise RuntimeError("the TMA GEMV needs Gluon's Hopper module and a GPU of compute capability 9.0+")
    n, k = packed.shape
    kt = packed.k_tiles
    need = smem_bytes(kt, cfg.rows, cfg.warps, cfg.depth, cfg.tma_rps)
    if need > SMEM_LIMIT:
        raise ValueError(f"{cfg.key()}: {need} bytes of shared memory per program (limit {SMEM_LIMIT}); "
                         f"use fewer stages or rows")
    v_desc, q_desc = record_descriptors(packed, cfg.rows, cfg.tma_rps * cfg.warps, cfg.tma_box)
    vw, qw = box_words(cfg.tma_box)
    lv, lq, lx, le = _gg.layouts(cfg.rows, cfg.warps)
    regs = cfg.maxnreg or DEFAULT_REGS
    _w12_gemv_tma_kernel[((n + cfg.rows - 1) // cfg.rows,)](
        v_desc, q_desc, x, x.view(torch.int32), out, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        n, k // 2, kt,
        ROWS=cfg.rows, WARPS=cfg.warps, RPS=cfg.tma_rps, STAGES=cfg.depth, QPASS=qpass, PLAIN=cfg.plain_decode,
        ESC_CH=8, XS_IT=xs_groups(kt, cfg.warps, cfg.tma_rps), XS_CH=_gg.XS_CHUNK, L_V=lv, L_Q=lq, L_X=lx,
        L_E=le, VW=vw, QW=qw, EPI_WARP=cfg.tma_epi_warp, L_E1=_gg.layouts(cfg.rows, 1)[3], num_warps=cfg.warps,
        # (the copy warp is padded to a warpgroup at 24 registers, as in mma_tma's group)
        maxnreg=launch_regs(cfg.warps, regs, cfg.tma_epi_warp),
    )
