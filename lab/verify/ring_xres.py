"""The TMA-ring GEMM of verify steps with x resident in shared memory for a K slice (the plan's
first next measurement, docs/plans/verify-gemm.md): where ``kernels/verify/ring.py`` copies the x
box of every (weight block, K step) pair again, so at 64 rows an SM takes in as many x bytes (from
L2) as weight bytes, here each program copies the x columns of its K slice once and walks several
weight blocks over them.

* **schedule**: K is cut into ``S`` equal slices (whole stages of ``KB`` 64-column boxes); the
  weight blocks (``BLOCK_N`` rows) of a slice are cut into equal runs, one per program, so
  ``S * ceil(blocks / run)`` programs, about one per SM. A block's ``S`` partial sums go through a
  workspace and the last of its programs to finish adds them in slice order (deterministic, as the
  ring's stream-K sum); with ``S = 1`` each block is stored directly.
* **copies**: one copy warp issues the first ``STAGES`` stages of weight boxes before
  ``griddepcontrol.wait`` (weights are constant), then the slice's x boxes (after the wait: x is
  the previous kernel's output) on their own barrier, then the remaining weight stages as the
  consumer frees them.
* **consumer**: one warpgroup runs ``wgmma`` with weights as A and the resident x boxes as B, both
  in shared memory, freeing each stage once the next stage's ``wgmma`` is issued.

Not routed; :func:`xres_linear` is called by this script's sweep only. Reference: ``naive.linear``
(the check is against fp32 and bitwise run to run).

    python lab/verify/ring_xres.py [--rows 16,32,64] [--layers qkv,o,gu,down]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap  # noqa: E402

bootstrap()   # specpilot from the working tree where it is not installed (the kernel below is built at import)

import torch  # noqa: E402

from specpilot.kernels.triton_env import pdl_args  # noqa: E402
from specpilot.kernels.verify import common  # noqa: E402
from specpilot.kernels.verify import ring as R  # noqa: E402
from specpilot.kernels.w12.common import split_workspace  # noqa: E402
from specpilot.kernels.w12.gluon_common import gl, gluon  # noqa: E402

TILE_K = 64
SMEM_BYTES = 227 * 1024   # an H100/H200 program's most dynamic shared memory
SCRATCH = 8 * 1024        # barriers and the compiler's layout-conversion buffers (6 KB measured at qkv)


@dataclass(frozen=True)
class XresConfig:
    """``slices`` K slices (0: the fewest whose x fits beside the ring), ``block_n`` weight rows per
    block, ``stages`` ring depth, ``kboxes`` 64-column boxes per stage, ``trigger`` as the ring's."""

    slices: int = 0
    block_n: int = 64
    stages: int = 3
    kboxes: int = 4
    trigger: int = 0

    def key(self) -> str:
        return f"s{self.slices}-n{self.block_n}-st{self.stages}-k{self.kboxes}" + ("-t" if self.trigger else "")


def plan(m: int, n: int, k: int, cfg: XresConfig, sms: int) -> tuple[int, int, int, int]:
    """``(slices, boxes per slice, blocks per program, programs)`` for x [m, k] and w [n, k]: the
    slices divide K's 64-column boxes into whole stages and their x fits shared memory beside the
    ring; ValueError where no slice count does."""
    bm = R.block_m(m)
    kt = -(-k // TILE_K)
    ring = cfg.stages * cfg.kboxes * cfg.block_n * TILE_K * 2
    nb = -(-n // cfg.block_n)
    choices = [cfg.slices] if cfg.slices else [s for s in (1, 2, 4, 8, 16, 32) if s <= kt]
    for s in choices:
        if kt % (s * cfg.kboxes):
            continue
        xt = kt // s
        if ring + xt * bm * TILE_K * 2 + SCRATCH > SMEM_BYTES:
            continue
        groups = max(1, sms // s)
        per = -(-nb // groups)
        return s, xt, per, s * -(-nb // per)
    raise ValueError(f"no K slicing of {k} columns fits {cfg} at {m} rows")


try:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except Exception:  # pragma: no cover - Triton without Gluon's Hopper module
    mbarrier = None

AVAILABLE = R.AVAILABLE

if AVAILABLE:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from specpilot.kernels.verify.ring import _finish, _tma_load

    _TK = gl.constexpr(TILE_K)

    @gluon.jit
    def _producer(pt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, KB: gl.constexpr,
                  XT: gl.constexpr, PDL: gl.constexpr):
        """The copy warp: the first stages' weight boxes, the wait for the previous kernel, the
        slice's x boxes once, then weight stage after stage as the consumer frees them."""
        w_desc, x_desc, w_s, x_s, ready, empty, xbar, b0, nblk, kt0 = pt
        STEPS: gl.constexpr = XT // KB
        n = nblk * STEPS
        pre = gl.minimum(n, STAGES)
        for i in range(0, pre):
            mbarrier.expect(ready.index(i), KB * BLOCK_N * _TK * 2)
            for j in gl.static_range(KB):
                _tma_load(w_desc, [(b0 + i // STEPS) * BLOCK_N, (kt0 + (i % STEPS) * KB + j) * _TK],
                            ready.index(i), w_s.index(i * KB + j))
        if PDL:
            gdc_wait()
        mbarrier.expect(xbar.index(0), XT * BLOCK_M * _TK * 2)
        for t in gl.static_range(XT):
            _tma_load(x_desc, [0, (kt0 + t) * _TK], xbar.index(0), x_s.index(t))
        for i in range(pre, n):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), KB * BLOCK_N * _TK * 2)
            for j in gl.static_range(KB):
                _tma_load(w_desc, [(b0 + i // STEPS) * BLOCK_N, (kt0 + (i % STEPS) * KB + j) * _TK],
                            ready.index(s), w_s.index(s * KB + j))

    @gluon.jit
    def _consumer(rt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr,
                  L_EP: gl.constexpr, KB: gl.constexpr, XT: gl.constexpr):
        """Per block of the run: ``wgmma`` over the slice's stages (x from the resident boxes), each
        stage freed once the next one's ``wgmma`` is issued; then the block's store or partial."""
        (w_s, x_s, ready, empty, xbar, b0, nblk, slice_id, S, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym) = rt
        STEPS: gl.constexpr = XT // KB
        mbarrier.wait(xbar.index(0), 0)
        i = 0
        for b in range(0, nblk):
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
            for st in gl.static_range(STEPS):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                for j in gl.static_range(KB):
                    acc = warpgroup_mma(w_s.index(s * KB + j), x_s.index(st * KB + j).permute((1, 0)), acc,
                                        is_async=True)
                acc = warpgroup_mma_wait(KB, deps=[acc])
                if st > 0:
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                i += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
            _finish(acc, y_ptr, ws_ptr, lock_ptr, b0 + b, slice_id, S, S, M, N, stride_ym, BLOCK_N, BLOCK_M,
                      ACC, L_EP)

    @gluon.jit(do_not_specialize=["M", "N", "S", "PER", "NB"])
    def _xres_kernel(w_desc, x_desc, y_ptr, ws_ptr, lock_ptr, M, N, S, PER, NB, stride_ym,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, KB: gl.constexpr,
                     XT: gl.constexpr, ACC: gl.constexpr, L_EP: gl.constexpr, PDL: gl.constexpr,
                     TRIGGER: gl.constexpr):
        if TRIGGER:
            gdc_launch_dependents()
        groups = (NB + PER - 1) // PER
        pid = gl.program_id(0)
        slice_id = pid // groups
        b0 = (pid % groups) * PER
        nblk = gl.minimum(PER, NB - b0)
        kt0 = slice_id * XT
        w_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BLOCK_N, _TK], w_desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [XT, BLOCK_M, _TK], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        xbar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for p in gl.static_range(STAGES):
            mbarrier.init(ready.index(p), count=1)
            mbarrier.init(empty.index(p), count=1)
        mbarrier.init(xbar.index(0), count=1)
        fence_async_shared()
        rt = (w_s, x_s, ready, empty, xbar, b0, nblk, slice_id, S, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym)
        pt = (w_desc, x_desc, w_s, x_s, ready, empty, xbar, b0, nblk, kt0)
        gl.warp_specialize([(_consumer, (rt, BLOCK_N, BLOCK_M, STAGES, ACC, L_EP, KB, XT)),
                            (_producer, (pt, BLOCK_N, BLOCK_M, STAGES, KB, XT, PDL))], [1], [24])


def xres_linear(x: torch.Tensor, w: torch.Tensor, cfg: XresConfig = XresConfig()) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (M = 1..64) and w [N, K], bf16, on a Hopper GPU; fp32 accumulation,
    deterministic."""
    if not R.supported(x, w):
        raise ValueError(f"xres_linear takes what ring_linear takes; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    bm = R.block_m(m)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    s, xt, per, progs = plan(m, n, k, cfg, sms)
    nb = -(-n // cfg.block_n)
    ws, locks = split_workspace(x.device, nb * s * cfg.block_n * bm if s > 1 else 1, nb)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    w_desc = R.TensorDescriptor.from_tensor(w, [cfg.block_n, TILE_K], R.smem_layout())
    x_desc = R.TensorDescriptor.from_tensor(x, [bm, TILE_K], R.smem_layout())
    acc, ep = R.layouts(cfg.block_n, bm)
    _xres_kernel[(progs,)](w_desc, x_desc, y, ws, locks, m, n, s, per, nb, y.stride(0),
                           BLOCK_N=cfg.block_n, BLOCK_M=bm, STAGES=cfg.stages, KB=cfg.kboxes, XT=xt, ACC=acc,
                           L_EP=ep, TRIGGER=cfg.trigger, num_warps=4, **pdl_args(common.USE_PDL, x))
    return y


def sweep_configs() -> list[XresConfig]:
    return [XresConfig(0, 64, 3, 4), XresConfig(0, 64, 4, 4), XresConfig(0, 64, 2, 4), XresConfig(0, 128, 2, 2),
            XresConfig(0, 64, 4, 2), XresConfig(2, 64, 3, 4), XresConfig(4, 64, 3, 4), XresConfig(8, 64, 3, 4)]


def main() -> int:
    from lab.verify.ring import sweep_main

    # beside it the ring's configs, the first that fits the rows (its 9-16-row entry runs out of
    # shared memory at 64)
    return sweep_main("ring_xres", xres_linear, sweep_configs(), (R.RingConfig(64, 4, 1, 0, 1, 4),))


if __name__ == "__main__":
    raise SystemExit(main())
