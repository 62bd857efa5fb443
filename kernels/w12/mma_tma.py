"""The W12 tensor-core kernel (:mod:`.mma`) fed by TMA copies and mbarriers instead of ``cp.async``
and CTA barriers (Hopper).

In the ``wsmem`` ring of :mod:`.mma` every thread issues 16-byte ``cp.async`` copies of the record
and of x (about 400 copy instructions per 64-row record), and every record costs a CTA barrier (two:
Triton's barrier analysis adds one between the copy into one stage and the reads of another), so
the warps of a program move in lockstep and one slow load stalls all of them. Nsight at 32 rows
(4096 -> 6144) sees 30 % of the stalls on global loads and 24 % on barriers there.

Here a record's three pieces are contiguous boxes, each one TMA copy issued by one thread:

* the program's rows of the 8-bit views: ``BLOCK_N`` x 64 bytes (``rec32`` seen as ``[records *
  192, 16]`` words, rows ``192 r + r_in ...``), and of the nibbles: ``BLOCK_N`` x 32 bytes (``rec32``
  as ``[records * 384, 8]``, rows ``384 r + 256 + r_in ...``), both unswizzled (the fragment reads
  of :func:`.mma.wsmem_mma` are conflict-free as they are);
* x ``[BLOCK_M, 64]`` at ``(m0, 64 t)``, 128-byte swizzled, which is the 16-byte-chunk XOR-by-row
  swizzle the ``mma`` kernel's x stages use (rows past M are zero-filled by the TMA unit).

The program is warp-specialized (``gl.warp_specialize``): a warpgroup of four copy warps (Triton
wants whole warpgroups in the default partition; one thread issues) walks the records and refills
each of ``stages`` shared-memory stages once its ``empty`` mbarrier has one arrival from every
consumer; one **consumer warp per 16 rows** (``tma=1``) waits on the stage's ``ready`` mbarrier (the
copies' bytes), reads its slice and the x tile into registers, arrives on ``empty`` and runs the
decode and the MMAs. A consumer warp synchronizes with nothing but the mbarriers (no CTA barrier in
its loop, tested on the compiled code), so a slow warp does not hold the others back until the ring
is full. ``setmaxnreg`` gives the consumers :data:`DEFAULT_REGS` registers and the copy warps 48 or
fewer.

Before a consumer arrives on ``empty`` it runs ``fence.proxy.async``: its reads of the stage are
generic-proxy accesses and the copy that refills the stage writes through the async proxy, which the
mbarrier's release/acquire alone does not order. Without the fence the refill lands under reads
still in flight whenever the ring runs full (several programs per SM; lab/w12/tma_race.py measures
it, evidence in docs/w12.md).

``tma=2`` keeps the ``mma`` kernel's layout: the program's 4 or 8 warps consume each stage together
(one arrival after their named barrier) beside one copy warp (padded to a warpgroup at 24
registers), so four 64-row programs fit per SM at 32 rows; with ``unroll`` the group takes two
records per step (both stages' reads, then both decodes and MMAs in the same order), which gives a
warp two independent chains to interleave (Nsight: 14.8 cycles per issued instruction with one).

``tma=3`` is the group on Hopper's ``wgmma`` (:func:`_wg_consumer`): the decoded record is the
register A operand and x is restaged in MMA k order for the B operand; it waits for each ``wgmma``
before the next record, since ptxas reuses the registers of an in-flight ``wgmma``'s A operand (SASS
check in tests/test_w12_mma_tma.py). With ``kgroups=2|4`` two or four such warpgroups share the
program's rows, each taking every 2nd or 4th record of the ring into its own accumulator; group 0
adds the others' sums in group order before the epilogue. Their chains interleave: on the 32-row
layers with about one program per SM this is 6-11 % faster than the other kernels (docs/w12.md).
The ring depth must be a multiple of the group count, so that each stage serves one group
(:func:`check`; tests/test_w12_kgroup_ring_model.py).

The epilogue is the ``mma`` kernel's (:func:`.gluon_epilogue.epilogue`: row scale, escapes,
fixed-order split-K), run by each consumer warp for its own 16-row block (a split-K slot and
counter of its own) with ``tma=1`` and by the group for the program's rows otherwise. The
fragments, the MMA order and the split-K order are those of the ``wsmem`` ring, so results are
bitwise the ring's (GPU tests) and identical run to run. Plain reference:
:func:`.naive.w12_linear_ref`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..triton_env import pdl_args
from . import fragments as _fr
from .common import split_workspace
from .fragments import WGMMA_AVAILABLE, a_operand, b_operand, warpgroup_mma, warpgroup_mma_wait, x_store
from .gluon_common import cta_barrier, gl, gluon, mma_v2, pdl_wait
from .gluon_epilogue import epilogue
from .pack import KernelPack

try:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - Triton without Gluon's Hopper module
    tma = mbarrier = fence_async_shared = TensorDescriptor = None

AVAILABLE = gluon is not None and tma is not None
MAX_STAGES = 12
# registers of a consumer warp (setmaxnreg) by x rows per program: the fewest that ptxas compiles
# without spills (sm_90, Triton 3.6: 8 rows fit in 72, 16 in 88, 32 in 104; 32 rows spill at 96;
# 64 rows: 168, not searched)
DEFAULT_REGS = {8: 72, 16: 88, 32: 104, 64: 168}


def supported(device) -> bool:
    """TMA and mbarriers: Gluon's Hopper module and a CUDA device of compute capability 9.0+."""
    return (AVAILABLE and torch.device(device).type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


SLICE_WARPS, GROUP, WGMMA = 1, 2, 3   # MmaConfig.tma: a consumer warp per 16 rows, the consumers as one
# group (mma.sync), or the group on wgmma (Hopper 9.x only)


def wgmma_supported(device) -> bool:
    """``tma=3``: :func:`supported` and ``wgmma`` (compute capability 9.x: Blackwell has no wgmma)."""
    return supported(device) and WGMMA_AVAILABLE and torch.cuda.get_device_capability(device)[0] == 9


def check(cfg) -> None:
    """A TMA config: 2-``MAX_STAGES`` stages, 32-, 64- or 128-row programs (2, 4 or 8 consumer warps)."""
    if not 2 <= cfg.depth <= MAX_STAGES:
        raise ValueError(f"a TMA ring has 2-{MAX_STAGES} stages (depth), got {cfg.depth}")
    if cfg.tma not in (SLICE_WARPS, GROUP, WGMMA):
        raise ValueError(f"tma is 1 (a consumer warp per 16 rows), 2 (one consumer group) or 3 (the group on "
                         f"wgmma), got {cfg.tma}")
    if cfg.block_n not in (32, 64, 128):
        raise ValueError(f"the TMA variant takes 32, 64 or 128 rows per program, got {cfg.block_n}")
    if cfg.kgroups not in (1, 2, 4) or (cfg.kgroups > 1 and (cfg.tma != WGMMA or cfg.num_warps != 4)):
        raise ValueError(f"kgroups is 1, 2 or 4 (warpgroups of 4 warps splitting the records, tma=3), got "
                         f"{cfg.kgroups} with tma={cfg.tma}")
    if cfg.kgroups > 1 and cfg.depth % cfg.kgroups:
        # then every stage serves one group only, which waits on it after its own previous record
        # there has landed. Otherwise a group can wait on a stage whose previous record (another
        # group's) is still in flight: TMA copies may land out of order, so the parity wait passes on
        # the fill before that one, the group reads a stale stage and frees it early (a hang or
        # wrong sums; 4 groups on 6 stages hang on the H200, tests/test_w12_kgroup_ring_model.py)
        raise ValueError(f"kgroups={cfg.kgroups} needs a ring depth that is a multiple of it, got {cfg.depth}")
    if cfg.unroll and cfg.tma != GROUP:
        raise ValueError("unroll (two records per consumer step) goes with the consumer group, tma=2")
    if cfg.tma in (GROUP, WGMMA) and (cfg.num_warps not in (4, 8) or cfg.block_n != 16 * cfg.num_warps):
        raise ValueError(f"a TMA consumer group is 4 or 8 warps of 16 rows each, got {cfg.block_n} rows on "
                         f"{cfg.num_warps} warps")


if AVAILABLE:
    # the copy is ``async_copy_global_to_shared`` in Triton 3.6 and ``async_load`` later
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @lru_cache(maxsize=None)
    def smem_layouts():
        """Shared layouts of the TMA boxes: record words unswizzled, x 128-byte swizzled."""
        w = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        x = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        return w, x

    @gluon.jit
    def _issue(v_desc, q_desc, x_desc, wv_s, wq_s, xs, bar, rec, r_in, m0, t,
               BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, QPASS: gl.constexpr):
        """Record ``rec`` (k-tile ``t``) of the program's rows and its x tile into one stage: the
        expected bytes on ``bar``, then the two or three copies."""
        if QPASS:
            mbarrier.expect(bar, BLOCK_N * 64 + BLOCK_M * 128)
        else:
            mbarrier.expect(bar, BLOCK_N * 96 + BLOCK_M * 128)
        _tma_load(v_desc, [rec * 192 + r_in, 0], bar, wv_s)
        if not QPASS:
            _tma_load(q_desc, [rec * 384 + 256 + r_in, 0], bar, wq_s)
        _tma_load(x_desc, [m0, t * 64], bar, xs)

    @gluon.constexpr_function
    def _layout(block_n, block_m, warps, i):
        """Layout ``i`` of :func:`.fragments.mma_layouts` (view, nibbles, x, MMA, A, B, epilogue) for ``block_n``
        rows on ``warps`` consumer warps."""
        # (getattr: no lru_cache object in the kernel's dependency walk)
        return getattr(_fr, "mma_layouts")(int(block_n), int(block_m), int(warps))[int(i)]

    @gluon.jit
    def _read(xs, wv_s, wq_s, ready, i, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, QPASS: gl.constexpr,
              L_VIEW: gl.constexpr, L_NIB: gl.constexpr, L_X: gl.constexpr, B_OP: gl.constexpr,
              SLICE: gl.constexpr = -1):
        """Record ``i`` of the ring, once landed: its x (B operand) and weight words in registers (all
        the program's rows, or the 16 rows of ``SLICE``)."""
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        b = b_operand(xs.index(s), L_X, B_OP, BLOCK_M)
        wv = wv_s.index(s)
        wq = wq_s.index(s)
        if SLICE >= 0:
            wv = wv.slice(16 * SLICE, 16)
            wq = wq.slice(16 * SLICE, 16)
        w = wv.load(L_VIEW)
        if QPASS:
            q = w
        else:
            q = wq.load(L_NIB)
        return b, w, q

    @gluon.jit
    def _producer(pt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, QPASS: gl.constexpr, STAGES: gl.constexpr):
        """The copy warps (one thread issues): record after record into the ring, each stage once all
        slices have read it."""
        v_desc, q_desc, x_desc, wv_s, wq_s, xs, ready, empty, rec0, r_in, m0, t_begin, n_rec = pt
        for i in range(0, n_rec):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)    # (a fresh barrier passes parity 1)
            _issue(v_desc, q_desc, x_desc, wv_s.index(s), wq_s.index(s), xs.index(s), ready.index(s),
                   rec0 + i, r_in, m0, t_begin + i, BLOCK_N, BLOCK_M, QPASS)

    @gluon.jit
    def _finish(acc, rt, SLICE: gl.constexpr, SLICES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                USE_SPLIT: gl.constexpr, ESC_CH: gl.constexpr, ACC: gl.constexpr, L_EP: gl.constexpr):
        """A consumer's epilogue (:func:`.gluon_epilogue.epilogue`) from the runtime tuple ``rt``: rows ``16 *
        SLICE ..`` of a program of ``SLICES`` slices, each its own split-K block (a group: 0 of 1)."""
        (_, _, _, _, _, _, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr,
         lock_ptr, n0, pid_n, pid_k, pid_m, M, N, NUM_N_BLOCKS, SPLIT_K, stride_xm, stride_ym) = rt
        epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                  n0 + 16 * SLICE, pid_n * SLICES + SLICE, pid_k, pid_m, M, N, NUM_N_BLOCKS * SLICES, SPLIT_K,
                  SPLIT_K, stride_xm, stride_ym, BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, ACC, L_EP)

    @gluon.jit
    def _consumer(rt, SLICE: gl.constexpr, SLICES: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr,
                  QPASS: gl.constexpr, ESC_CH: gl.constexpr, STAGES: gl.constexpr):
        """One warp, rows ``16 * SLICE ..`` of the program: each record's slice and x from the ring,
        decoded into the A operand, the MMA, one arrival on the stage's ``empty`` barrier; then its
        16-row block's epilogue (its own split-K slot and counter). ``rt``: the runtime arguments, one
        tuple (a partition's constexprs must be literals in its argument tuple)."""
        wv_s, wq_s, xs, ready, empty, n_rec = rt[0], rt[1], rt[2], rt[3], rt[4], rt[5]
        L_VIEW: gl.constexpr = _layout(16, BLOCK_M, 1, 0)
        L_NIB: gl.constexpr = _layout(16, BLOCK_M, 1, 1)
        L_X: gl.constexpr = _layout(16, BLOCK_M, 1, 2)
        MMA: gl.constexpr = _layout(16, BLOCK_M, 1, 3)
        A_OP: gl.constexpr = _layout(16, BLOCK_M, 1, 4)
        B_OP: gl.constexpr = _layout(16, BLOCK_M, 1, 5)
        L_EP: gl.constexpr = _layout(16, BLOCK_M, 1, 6)
        acc = gl.zeros([16, BLOCK_M], gl.float32, MMA)
        for i in range(0, n_rec):
            b, w, q = _read(xs, wv_s, wq_s, ready, i, STAGES, BLOCK_M, QPASS, L_VIEW, L_NIB, L_X, B_OP, SLICE)
            fence_async_shared()   # our shared reads before the copy that refills the stage (see module)
            mbarrier.arrive(empty.index(i % STAGES))
            acc = mma_v2(a_operand(w, q, L_VIEW, A_OP, 16, QPASS), b, acc)
        _finish(acc, rt, SLICE, SLICES, 16, BLOCK_M, USE_SPLIT, ESC_CH, MMA, L_EP)

    @gluon.jit
    def _group_consumer(rt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr,
                        QPASS: gl.constexpr, ESC_CH: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                        PAIR: gl.constexpr):
        """``tma=2``: the default partition's warps consume each stage together (the ``mma`` kernel's
        layouts, warps split the rows); one arrival per stage, after the partition's barrier."""
        wv_s, wq_s, xs, ready, empty, n_rec = rt[0], rt[1], rt[2], rt[3], rt[4], rt[5]
        L_VIEW: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 0)
        L_NIB: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 1)
        L_X: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 2)
        MMA: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 3)
        A_OP: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 4)
        B_OP: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 5)
        L_EP: gl.constexpr = _layout(BLOCK_N, BLOCK_M, WARPS, 6)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        i = 0
        if PAIR:   # two records per step: the second's loads and decode overlap the first's MMAs
            for i in range(0, n_rec - 1, 2):
                b0, w0, q0 = _read(xs, wv_s, wq_s, ready, i, STAGES, BLOCK_M, QPASS, L_VIEW, L_NIB, L_X, B_OP)
                b1, w1, q1 = _read(xs, wv_s, wq_s, ready, i + 1, STAGES, BLOCK_M, QPASS, L_VIEW, L_NIB, L_X,
                                         B_OP)
                fence_async_shared()
                mbarrier.arrive(empty.index(i % STAGES))
                mbarrier.arrive(empty.index((i + 1) % STAGES))
                acc = mma_v2(a_operand(w0, q0, L_VIEW, A_OP, BLOCK_N, QPASS), b0, acc)
                acc = mma_v2(a_operand(w1, q1, L_VIEW, A_OP, BLOCK_N, QPASS), b1, acc)
            i = n_rec - n_rec % 2
        for j in range(i, n_rec):   # every record, or the odd last one
            b, w, q = _read(xs, wv_s, wq_s, ready, j, STAGES, BLOCK_M, QPASS, L_VIEW, L_NIB, L_X, B_OP)
            fence_async_shared()
            mbarrier.arrive(empty.index(j % STAGES))
            acc = mma_v2(a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS), b, acc)
        _finish(acc, rt, 0, 1, BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, MMA, L_EP)

    @gluon.constexpr_function
    def _wg_layout(block_n, block_m, warps, i):
        """Layout ``i`` of :func:`.fragments.wgmma_layouts` (view, nibbles, accumulator, A, epilogue, x in
        physical k order, x stage)."""
        return getattr(_fr, "wgmma_layouts")(int(block_n), int(block_m), int(warps))[int(i)]

    @gluon.jit
    def _wg_step(acc, xs, wv_s, wq_s, xm, ready, empty, i, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                 QPASS: gl.constexpr, STAGES: gl.constexpr, L_VIEW: gl.constexpr, L_NIB: gl.constexpr,
                 A_OP: gl.constexpr, L_XP: gl.constexpr, j=None, ok=True, MASK: gl.constexpr = False):
        """Record ``i`` on ``wgmma`` (see :func:`_wg_consumer`), its x restaged in buffer ``j % 2``
        (default ``i``: the group takes every record). With ``MASK`` the record may not exist
        (``ok`` false: a second K group with no record): no wait, no arrival, and x taken as zero, so
        the ``wgmma`` still runs (ptxas serializes a path without one) and adds zeros (the decoded
        weights are finite whatever the stage holds: exponent code + 112 <= 127)."""
        if j is None:
            j = i
        s = i % STAGES
        if MASK:
            mbarrier.wait(ready.index(s), (i // STAGES) & 1, pred=ok)
        else:
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        xv = xs.index(s).load(L_XP)
        if MASK:
            xv = gl.where(ok, xv, 0.0)
        w = wv_s.index(s).load(L_VIEW)
        if QPASS:
            q = w
        else:
            q = wq_s.index(s).load(L_NIB)
        xb = xm.index(j % 2)
        x_store(xb, xv, BLOCK_M)
        fence_async_shared()                 # our stage reads and stores, before the copy and the wgmma
        cta_barrier()                       # the group's stores, before anyone's wgmma reads them
        if MASK:
            mbarrier.arrive(empty.index(s), pred=ok)
        else:
            mbarrier.arrive(empty.index(s))
        tok = warpgroup_mma(a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS), xb.permute((1, 0)), acc, is_async=True)
        # retired before the next record: ptxas does not keep a wgmma's register A operand for it while
        # it runs (the next record's loads land in those registers; tests/test_w12_mma_tma.py)
        acc = warpgroup_mma_wait(0, deps=[tok])
        return acc

    @gluon.jit
    def _wg_consumer(rt, xm, red, done, G: gl.constexpr, GROUPS: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, QPASS: gl.constexpr, ESC_CH: gl.constexpr,
                     STAGES: gl.constexpr, WARPS: gl.constexpr):
        """``tma=3``: the group as ``tma=2``, the MMA on ``wgmma``: the decoded record is the register
        A operand; the stage's x, read in physical k order, is stored in MMA k order into ``xm``
        (two buffers: the one written at record ``i`` was last read by ``wgmma i - 2``, which every
        warp retired before the barrier of record ``i - 1``). Each ``wgmma`` is waited for before the
        next record (see :func:`_wg_step`), so the MMA does not overlap the group's next decode; it
        saves the B-fragment shared loads and the 16 ``mma.sync`` per warp and record.

        ``kgroups=GROUPS`` (2 or 4): this is one of that many warpgroups on the
        same rows, each taking every GROUPS-th record of the ring (group ``G`` the records ``G, G +
        GROUPS, ...``) into its own accumulator, so the groups' decodes and MMAs overlap each other's
        waits for their ``wgmma``. Groups 1.. then leave their sums in ``red`` and arrive on
        ``done``; group 0 adds them to its own in group order (one fixed order: bitwise the same run
        to run) and runs the epilogue."""
        wv_s, wq_s, xs, ready, empty, n_rec = rt[0], rt[1], rt[2], rt[3], rt[4], rt[5]
        L_VIEW: gl.constexpr = _wg_layout(BLOCK_N, BLOCK_M, WARPS, 0)
        L_NIB: gl.constexpr = _wg_layout(BLOCK_N, BLOCK_M, WARPS, 1)
        ACC: gl.constexpr = _wg_layout(BLOCK_N, BLOCK_M, WARPS, 2)
        A_OP: gl.constexpr = _wg_layout(BLOCK_N, BLOCK_M, WARPS, 3)
        L_EP: gl.constexpr = _wg_layout(BLOCK_N, BLOCK_M, WARPS, 4)
        L_XP: gl.constexpr = _wg_layout(BLOCK_N, BLOCK_M, WARPS, 5)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
        # the group's first record before the loop (every split has one, but a later K group's may
        # not exist): a path from the zeroed accumulator to the final wait without a wgmma makes
        # ptxas serialize the in-flight ones (C7515)
        acc = _wg_step(acc, xs, wv_s, wq_s, xm, ready, empty, G, BLOCK_N, BLOCK_M, QPASS, STAGES, L_VIEW, L_NIB,
                       A_OP, L_XP, 0, G < n_rec, G > 0)
        for i in range(G + GROUPS, n_rec, GROUPS):
            acc = _wg_step(acc, xs, wv_s, wq_s, xm, ready, empty, i, BLOCK_N, BLOCK_M, QPASS, STAGES, L_VIEW, L_NIB,
                           A_OP, L_XP, (i - G) // GROUPS)
        if GROUPS == 1:
            _finish(acc, rt, 0, 1, BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, ACC, L_EP)
        elif G == 0:
            mbarrier.wait(done.index(0), 0)
            for g in gl.static_range(GROUPS - 1):
                acc = acc + red.index(g).load(ACC)
            _finish(acc, rt, 0, 1, BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, ACC, L_EP)
        else:
            red.index(G - 1).store(acc)
            cta_barrier()                   # every thread's sums stored before the group's one arrival
            mbarrier.arrive(done.index(0))

    @gluon.jit
    def _w12_mma_tma_kernel(
        v_desc, q_desc, x_desc,
        x_ptr, y_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, QPASS: gl.constexpr,
        ESC_CH: gl.constexpr, STAGES: gl.constexpr, REGS: gl.constexpr,
        GROUP: gl.constexpr = False, WARPS: gl.constexpr = 4, PAIR: gl.constexpr = False, WG: gl.constexpr = False,
        KGROUPS: gl.constexpr = 1, PDL: gl.constexpr = False,
    ):
        pdl_wait(PDL)
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        pid_m = gl.program_id(2)
        n0 = pid_n * BLOCK_N
        t_begin = pid_k * TILES_PER_SPLIT
        n_rec = gl.minimum(t_begin + TILES_PER_SPLIT, KT) - t_begin

        wv_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], v_desc.layout)
        wq_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 8], q_desc.layout)
        xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        SLICES: gl.constexpr = BLOCK_N // 16
        for p in gl.static_range(STAGES):
            mbarrier.init(ready.index(p), count=1)
            mbarrier.init(empty.index(p), count=1 if GROUP or WG else SLICES)
        fence_async_shared()
        # the default partition (4 warps; Triton wants whole warpgroups there) issues the copies, one
        # warp per 16-row slice consumes them
        rt = (wv_s, wq_s, xs, ready, empty, n_rec, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
              ws_ptr, lock_ptr, n0, pid_n, pid_k, pid_m, M, N, NUM_N_BLOCKS, SPLIT_K, stride_xm, stride_ym)
        pt = (v_desc, q_desc, x_desc, wv_s, wq_s, xs, ready, empty, (n0 // 128) * KT + t_begin, n0 % 128,
              pid_m * BLOCK_M, t_begin, n_rec)
        if GROUP:   # the kernel's warps consume together; one copy warp
            gl.warp_specialize([(_group_consumer, (rt, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES, WARPS, PAIR)),
                                (_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES))], [1], [24])
        elif WG and KGROUPS > 1:   # 2 or 4 warpgroups on the program's rows, every KGROUPS-th record each
            xm0 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 64], x_desc.layout)
            xm1 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 64], x_desc.layout)
            red = gl.allocate_shared_memory(gl.float32, [KGROUPS, BLOCK_N, BLOCK_M],   # (a power of two: one spare)
                                            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
            done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(done.index(0), count=KGROUPS - 1)
            fence_async_shared()
            if KGROUPS == 2:
                gl.warp_specialize([(_wg_consumer, (rt, xm0, red, done, 0, 2, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),
                                    (_wg_consumer, (rt, xm1, red, done, 1, 2, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),
                                    (_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES))], [4, 1], [REGS, 24])
            else:
                gl.static_assert(KGROUPS == 4, "kgroups is 1, 2 or 4")
                xm2 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 64], x_desc.layout)
                xm3 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 64], x_desc.layout)
                gl.warp_specialize([(_wg_consumer, (rt, xm0, red, done, 0, 4, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),
                                    (_wg_consumer, (rt, xm1, red, done, 1, 4, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),
                                    (_wg_consumer, (rt, xm2, red, done, 2, 4, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),
                                    (_wg_consumer, (rt, xm3, red, done, 3, 4, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),
                                    (_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES))], [4, 4, 4, 1],
                                   [REGS, REGS, REGS, 24])
        elif WG:   # the group on wgmma; x in MMA k order in two more buffers
            xm = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, 64], x_desc.layout)
            gl.warp_specialize([(_wg_consumer, (rt, xm, xm, empty, 0, 1, BLOCK_N, BLOCK_M, USE_SPLIT, QPASS,
                                                  ESC_CH, STAGES, WARPS)),   # (red, done unused)
                                (_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES))], [1], [24])
        elif SLICES == 2:
            gl.warp_specialize([(_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES)),
                                (_consumer, (rt, 0, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 1, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES))],
                               [1, 1], [REGS, REGS])
        elif SLICES == 4:
            gl.warp_specialize([(_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES)),
                                (_consumer, (rt, 0, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 1, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 2, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 3, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES))],
                               [1, 1, 1, 1], [REGS, REGS, REGS, REGS])
        else:
            gl.static_assert(SLICES == 8, "BLOCK_N is 32, 64 or 128")
            gl.warp_specialize([(_producer, (pt, BLOCK_N, BLOCK_M, QPASS, STAGES)),
                                (_consumer, (rt, 0, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 1, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 2, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 3, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 4, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 5, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 6, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES)),
                                (_consumer, (rt, 7, SLICES, BLOCK_M, USE_SPLIT, QPASS, ESC_CH, STAGES))],
                               [1, 1, 1, 1, 1, 1, 1, 1], [REGS, REGS, REGS, REGS, REGS, REGS, REGS, REGS])


def check_rows(cfg, block_m: int) -> None:
    """Four K groups hold four accumulators and x buffers: at most 32 x rows per program (at 64 the
    program needs more registers and shared memory than an SM has)."""
    if cfg.kgroups == 4 and block_m > 32:
        raise ValueError(f"kgroups=4 takes at most 32 x rows per program, got {block_m} (use kgroups=2)")

def launch_regs(consumers: int, regs: int, copiers: int = 4, copier_regs: int = 48) -> int:
    """The register count the kernel is launched with: ``setmaxnreg`` then gives each consumer warp
    ``regs`` and the copy warps what is left (about ``copier_regs``), so the total covers both."""
    return -(-(regs * consumers + copier_regs * copiers) // (consumers + copiers) // 8) * 8

def record_descriptors(packed: KernelPack, block_n: int) -> tuple:
    """The TMA descriptors of the records' view rows (``[records * 192, 16]`` words, box
    ``[block_n, 16]``) and nibble rows (``[records * 384, 8]``, box ``[block_n, 8]``); cached on the
    pack (they only hold its address and shape)."""
    cache = packed.__dict__.setdefault("_tma_desc", {})
    if block_n not in cache:
        w_layout, _ = smem_layouts()
        rec = packed.rec32.reshape(-1)
        cache[block_n] = (TensorDescriptor.from_tensor(rec.view(-1, 16), [block_n, 16], w_layout),
                          TensorDescriptor.from_tensor(rec.view(-1, 8), [block_n, 8], w_layout))
    return cache[block_n]

def launch(x: torch.Tensor, packed: KernelPack, out: torch.Tensor, qpass: bool, cfg, grid: tuple,
           esc_ch: int) -> None:
    """Launch the TMA kernel for ``cfg`` (``depth`` stages, one warp per 16 rows plus the copy
    warp); ``x`` is already aligned (:func:`.gluon_common.aligned_x`), ``grid`` is
    :func:`.gluon_common.split_grid`'s with the counters of 16-row blocks."""
    check(cfg)
    check_rows(cfg, grid[0])
    regs = DEFAULT_REGS[grid[0]]
    bm, tps, split, nb, mb, ws, locks = grid
    group = cfg.tma in (GROUP, WGMMA)
    if cfg.tma == WGMMA and not wgmma_supported(x.device):
        raise RuntimeError("tma=3 (wgmma) needs a Hopper GPU (compute capability 9.x)")
    slices = cfg.block_n // 16
    if split > 1 and not group:
        locks = split_workspace(x.device, 1, nb * slices * mb)[1]   # a counter per slice
    m, k = x.shape
    n, kt = packed.shape[0], packed.k_tiles
    v_desc, q_desc = record_descriptors(packed, cfg.block_n)
    x_desc = TensorDescriptor.from_tensor(x, [bm, 64], smem_layouts()[1])
    grid3 = (nb, split, mb)
    _w12_mma_tma_kernel[grid3](
        v_desc, q_desc, x_desc,
        x, out, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, USE_SPLIT=split > 1, QPASS=qpass, ESC_CH=esc_ch, STAGES=cfg.depth,
        REGS=regs, GROUP=cfg.tma == GROUP, WARPS=cfg.num_warps, PAIR=cfg.unroll, WG=cfg.tma == WGMMA,
        KGROUPS=cfg.kgroups,
        num_warps=cfg.num_warps if group else 4,
        # (the one copy warp of a group is padded to a warpgroup, its idle warps at 24 registers too)
        maxnreg=launch_regs(cfg.num_warps * cfg.kgroups, regs, 4, 24) if group else launch_regs(slices, regs),
        **pdl_args(cfg.pdl, x),
    )
