"""Stream-K bf16 GEMM ``y = x @ W.T`` for verify steps on Hopper: weight tiles copied by TMA into a
shared-memory ring and consumed by ``wgmma``, the ring's first weights in flight before the wait
for the previous kernel.

cuBLAS takes no part in programmatic dependent launch (PDL): each projection of a verify step
starts reading its weights only when the kernel before it has finished, where the one-row decode
chain's GEMVs have theirs in flight already. Layer by layer this kernel is level with cuBLAS at 16
rows (0.97-1.02x on Llama-3.1-8B's projections, H200) and behind it at 32-64 rows (0.82-0.93x); in
whole steps of 9-16 rows it saves 0.13-0.36 ms on Llama-3.1-8B shapes by the weights it streams
while the kernel before drains, so the measured table routes it there (:mod:`.blas`,
docs/engine.md).

* **stream-K**: the layer's (weight block, K step) pairs, blocks of ``BLOCK_N`` rows, are cut into
  equal runs, one per program and one program per SM, so every SM streams the same bytes and no
  wave is left half full. A run crosses block boundaries: a block the program holds whole is stored
  directly; a block shared by several programs is summed through a workspace by the last of them
  in program order (bitwise identical run to run).
* **TMA ring, warp-specialized**: one copy warp fills ``STAGES`` stages, each ``KB`` boxes of
  ``BLOCK_N`` x 64 bf16 weights (128-byte swizzled; ``KB`` boxes read 128 x ``KB`` contiguous bytes
  of every row) and the matching x boxes (rows past M zero-filled by the copy); a consumer
  warpgroup waits on each stage's ``ready`` barrier, runs ``wgmma`` with both operands in shared
  memory (weights as A, so the step's rows are the MMA's narrow N side), and frees the stage once
  the next stage's ``wgmma`` is issued (``INFLIGHT``). The bytes in flight per SM are the ring's.
* **PDL**: weights are constant, so the copy warp issues the first ``STAGES`` stages' weight boxes
  before ``griddepcontrol.wait`` and their x boxes after it. With ``trigger`` every program lets
  the dependent kernel launch as it starts (the dependent still waits for this grid's end before
  it reads the output), so the row kernel after the GEMM is resident when the GEMM ends; without
  it the dependent launches when this grid exits. The table sets it per layer: on Llama-3.1-8B's
  o, gate/up and down projections it saves 0.09-0.14 ms a step; on q/k/v, whose dependents (the
  RoPE kernel, then the attention) take the SMs the GEMM's programs leave, it cost up to 0.3 ms.

The plain reference is :func:`.naive.linear`; Gluon does not run under Triton's interpreter, so on
a machine without a GPU the kernel is compiled for sm_90 only (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specpilot.kernels.triton_env import pdl_args
from specpilot.kernels.verify import common
from specpilot.kernels.w12.common import split_workspace
from specpilot.kernels.w12.gluon_common import cta_barrier, gl, gluon
from specpilot.kernels.w12.mma_tma import launch_regs

try:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - Triton without Gluon's Hopper module
    tma = mbarrier = fence_async_shared = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

AVAILABLE = gluon is not None and tma is not None and warpgroup_mma is not None
TILE_K = 64          # columns per tile: one 128-byte swizzle row of bf16
MIN_ROWS, MAX_ROWS = 1, 64


@dataclass(frozen=True)
class RingConfig:
    """``block_n`` weight rows per tile (64 or 128), ``stages`` ring depth, ``per_sm`` programs per SM."""

    block_n: int = 128
    stages: int = 8
    per_sm: int = 1
    regs: int = 0      # the consumer warpgroup's registers (setmaxnreg; 0: the compiler's choice)
    inflight: int = 1  # 1: a stage's wgmmas keep running while the next stage is awaited; 0: retired first
    kboxes: int = 1    # 64-column boxes per stage (a stage reads 128 x kboxes contiguous bytes per row)
    trigger: int = 0   # 1: the dependent kernel may launch as soon as every program has started; 0: at exit

    def key(self) -> str:
        return (f"n{self.block_n}-s{self.stages}-p{self.per_sm}-i{self.inflight}"
                + (f"-r{self.regs}" if self.regs else "") + (f"-k{self.kboxes}" if self.kboxes > 1 else "")
                + ("-t" if self.trigger else ""))


def block_m(m: int) -> int:
    """x rows per program (the ``wgmma`` N side): 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def schedule(nb: int, kt: int, programs: int) -> tuple[int, int, int]:
    """``(per, programs, slots)``: (block, tile) pairs per program, the programs launched (none
    empty) and the most programs one block's ``kt`` tiles can span (workspace slots per block)."""
    total = nb * kt
    per = -(-total // max(1, min(programs, total)))
    progs = -(-total // per)
    slots = min(progs, -(-(kt - 1) // per) + 1)
    return per, progs, slots


def check(cfg: RingConfig) -> None:
    """A config the kernel takes: 64- or 128-row blocks, 2-16 stages of 1, 2 or 4 boxes, at least
    one program per SM, ``inflight`` and ``trigger`` 0 or 1, ``regs`` 0 or 24-256."""
    if (cfg.block_n not in (64, 128) or not 2 <= cfg.stages <= 16 or cfg.per_sm < 1
            or cfg.inflight not in (0, 1) or cfg.kboxes not in (1, 2, 4) or cfg.trigger not in (0, 1)
            or not (cfg.regs == 0 or 24 <= cfg.regs <= 256)):
        raise ValueError(f"ring config: block_n 64 or 128, 2-16 stages, per_sm >= 1, inflight 0 or 1, "
                         f"kboxes 1, 2 or 4, regs 0 or 24-256, trigger 0 or 1; got {cfg}")


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Gluon's Hopper module, a compute capability 9.x GPU, 1-64 bf16 rows and a bf16 weight, both
    contiguous with K a multiple of 8 (TMA strides are 16-byte multiples)."""
    return (AVAILABLE and x.is_cuda and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and x.dtype == w.dtype == torch.bfloat16 and MIN_ROWS <= x.shape[0] <= MAX_ROWS
            and x.is_contiguous() and w.is_contiguous() and x.shape[1] % 8 == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device)[0] == 9)


if AVAILABLE:
    from specpilot.kernels.w12.gluon_epilogue import epilogue_layout

    # the copy is ``async_copy_global_to_shared`` in Triton 3.6 and ``async_load`` later
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _TK = gl.constexpr(TILE_K)

    @lru_cache(maxsize=None)
    def smem_layout():
        return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    @lru_cache(maxsize=None)
    def layouts(block_n: int, bm: int):
        """The consumer warpgroup's ``wgmma`` accumulator ``[block_n, bm]`` and the store layout."""
        acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bm, 16])
        return acc, epilogue_layout(bm, 4)

    @gluon.jit
    def _w_box(w_desc, w_s, bar, g, s, j, KT, BLOCK_N: gl.constexpr, KB: gl.constexpr):
        """Box ``j`` of (block, K step) pair ``g``'s weights into stage ``s``."""
        _tma_load(w_desc, [(g // KT) * BLOCK_N, ((g % KT) * KB + j) * _TK], bar, w_s.index(s * KB + j))

    @gluon.jit
    def _x_box(x_desc, x_s, bar, g, s, j, KT, KB: gl.constexpr):
        """Box ``j`` of pair ``g``'s x into stage ``s``."""
        _tma_load(x_desc, [0, ((g % KT) * KB + j) * _TK], bar, x_s.index(s * KB + j))

    @gluon.jit
    def _producer(pt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, KB: gl.constexpr,
                  PDL: gl.constexpr):
        """The copy warp: the weight boxes of the first ``STAGES`` stages, the wait for the previous
        kernel, their x boxes, then stage after stage as the consumer frees them."""
        w_desc, x_desc, w_s, x_s, ready, empty, g_begin, g_end, KT = pt
        n = g_end - g_begin
        pre = gl.minimum(n, STAGES)
        for i in range(0, pre):
            mbarrier.expect(ready.index(i), KB * (BLOCK_N + BLOCK_M) * _TK * 2)
            for j in gl.static_range(KB):
                _w_box(w_desc, w_s, ready.index(i), g_begin + i, i, j, KT, BLOCK_N, KB)
        if PDL:
            gdc_wait()
        for i in range(0, pre):
            for j in gl.static_range(KB):
                _x_box(x_desc, x_s, ready.index(i), g_begin + i, i, j, KT, KB)
        for i in range(pre, n):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), KB * (BLOCK_N + BLOCK_M) * _TK * 2)
            for j in gl.static_range(KB):
                _w_box(w_desc, w_s, ready.index(s), g_begin + i, s, j, KT, BLOCK_N, KB)
                _x_box(x_desc, x_s, ready.index(s), g_begin + i, s, j, KT, KB)

    @gluon.jit
    def _store(acc, y_ptr, n0, M, N, stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
               L_EP: gl.constexpr):
        y = gl.convert_layout(acc, L_EP)
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_EP))
        rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, L_EP))
        gl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], y.to(y_ptr.dtype.element_ty),
                 mask=(rn < N)[:, None] & (rm < M)[None, :])

    @gluon.jit
    def _finish(acc, y_ptr, ws_ptr, lock_ptr, blk, slot, parts, SLOTS, M, N, stride_ym,
                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ACC: gl.constexpr, L_EP: gl.constexpr):
        """Block ``blk``'s sums of this program: stored, or partial ``slot`` of ``parts`` into the
        workspace, the last program to count in summing them in slot order."""
        if parts == 1:
            _store(acc, y_ptr, blk * BLOCK_N, M, N, stride_ym, BLOCK_N, BLOCK_M, L_EP)
        else:
            TILE: gl.constexpr = BLOCK_N * BLOCK_M
            base = ws_ptr + blk.to(gl.int64) * (SLOTS * TILE)
            tr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
            tc = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
            offs = tr[:, None] * BLOCK_M + tc[None, :]
            gl.store(base + slot * TILE + offs, acc)
            cta_barrier()
            count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == parts - 1:
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
                for p in range(0, parts):
                    total += gl.load(base + p * TILE + offs, cache_modifier=".cg")
                gl.atomic_xchg(lock_ptr + blk, 0)
                _store(total, y_ptr, blk * BLOCK_N, M, N, stride_ym, BLOCK_N, BLOCK_M, L_EP)

    @gluon.jit
    def _consumer(rt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr,
                  L_EP: gl.constexpr, INFLIGHT: gl.constexpr, KB: gl.constexpr, H: gl.constexpr,
                  PARTS: gl.constexpr):
        """The consumer warpgroup: per stage, wait for it, ``wgmma`` on its boxes (weights A, x B, both
        in shared memory), then free the stage before (``INFLIGHT``: its ``wgmma`` retired while this
        one's run) or this one; at the end of each block its run holds, the block's store or
        partial. With ``PARTS`` warpgroups sharing each box (a lab variant; the routed kernel has
        one), this one takes its rows ``H * BLOCK_N ..`` and finishes them as block
        ``PARTS * block + H``."""
        (w_s, x_s, ready, empty, g_begin, g_end, KT, PER, SLOTS, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym) = rt
        i = 0
        for blk in range(g_begin // KT, (g_end - 1) // KT + 1):    # the blocks this program's run touches
            t0 = gl.maximum(g_begin, blk * KT)
            t1 = gl.minimum(g_end, blk * KT + KT)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
            for g in range(t0, t1):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                for j in gl.static_range(KB):
                    w_box = w_s.index(s * KB + j)
                    if PARTS > 1:
                        w_box = w_box.slice(H * BLOCK_N, BLOCK_N)
                    acc = warpgroup_mma(w_box, x_s.index(s * KB + j).permute((1, 0)), acc, is_async=True)
                if INFLIGHT:   # the previous stage's wgmmas have retired: that stage is free
                    acc = warpgroup_mma_wait(KB, deps=[acc])
                    if g > t0:
                        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                else:
                    acc = warpgroup_mma_wait(0, deps=[acc])
                    mbarrier.arrive(empty.index(s))
                i += 1
            if INFLIGHT:
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
            first = (blk * KT) // PER
            last = ((blk + 1) * KT - 1) // PER
            _finish(acc, y_ptr, ws_ptr, lock_ptr, blk * PARTS + H, gl.program_id(0) - first, last - first + 1, SLOTS,
                    M, N, stride_ym, BLOCK_N, BLOCK_M, ACC, L_EP)

    # (no value specialization of the sizes: Triton 3.6 failed to lower the kernel for K = 200,
    # N = 130, where the K steps and the stages per program are 1; without it that layer compiles)
    @gluon.jit(do_not_specialize=["M", "N", "KT", "PER", "SLOTS"])
    def _ring_kernel(w_desc, x_desc, y_ptr, ws_ptr, lock_ptr, M, N, KT, PER, SLOTS, stride_ym,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                     ACC: gl.constexpr, L_EP: gl.constexpr, PDL: gl.constexpr, INFLIGHT: gl.constexpr,
                     KB: gl.constexpr, TRIGGER: gl.constexpr):
        if TRIGGER:
            gdc_launch_dependents()
        pid = gl.program_id(0)
        g_begin = pid * PER
        g_end = gl.minimum(g_begin + PER, (N + BLOCK_N - 1) // BLOCK_N * KT)
        w_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BLOCK_N, _TK], w_desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BLOCK_M, _TK], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for p in gl.static_range(STAGES):
            mbarrier.init(ready.index(p), count=1)
            mbarrier.init(empty.index(p), count=1)
        fence_async_shared()
        rt = (w_s, x_s, ready, empty, g_begin, g_end, KT, PER, SLOTS, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym)
        pt = (w_desc, x_desc, w_s, x_s, ready, empty, g_begin, g_end, KT)
        gl.warp_specialize([(_consumer, (rt, BLOCK_N, BLOCK_M, STAGES, ACC, L_EP, INFLIGHT, KB, 0, 1)),
                            (_producer, (pt, BLOCK_N, BLOCK_M, STAGES, KB, PDL))], [1], [24])


def ring_linear(x: torch.Tensor, w: torch.Tensor, cfg: RingConfig = RingConfig()) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (M = 1..64) and w [N, K], bf16; fp32 accumulation, deterministic."""
    if not supported(x, w):
        raise ValueError(f"ring_linear takes {MIN_ROWS}-{MAX_ROWS} contiguous bf16 rows and a contiguous bf16 weight "
                         f"(K a multiple of 8) on a Hopper GPU; got x {tuple(x.shape)} {x.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype}")
    check(cfg)
    m, k = x.shape
    n = w.shape[0]
    bm = block_m(m)
    kt = -(-k // (TILE_K * cfg.kboxes))
    nb = -(-n // cfg.block_n)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    per, progs, slots = schedule(nb, kt, sms * cfg.per_sm)
    ws, locks = split_workspace(x.device, nb * slots * cfg.block_n * bm if slots > 1 else 1, nb)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # (rows past M and columns past K are zero-filled by the copies)
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, TILE_K], smem_layout())
    x_desc = TensorDescriptor.from_tensor(x, [bm, TILE_K], smem_layout())
    acc, ep = layouts(cfg.block_n, bm)
    _ring_kernel[(progs,)](w_desc, x_desc, y, ws, locks, m, n, kt, per, slots, y.stride(0),
                           BLOCK_N=cfg.block_n, BLOCK_M=bm, STAGES=cfg.stages, ACC=acc, L_EP=ep,
                           INFLIGHT=cfg.inflight, KB=cfg.kboxes, TRIGGER=cfg.trigger, num_warps=4,
                           **({"maxnreg": launch_regs(4, cfg.regs, 4, 24)} if cfg.regs else {}),
                           **pdl_args(common.USE_PDL, x))
    return y
