"""The TMA-ring GEMM of verify steps with two consumer warpgroups on one x box (the plan's second
next measurement, docs/plans/verify-gemm.md): ``kernels/verify/ring.py`` with 128-row weight
blocks, each stage's 128 x 64 weight box split between two warpgroups of 64 rows that share the
stage's x box.

The ring's 128-row blocks with one warpgroup read x once per 128 weight rows but double that
warpgroup's accumulator and ``wgmma`` chain per stage, and they lost to 64-row blocks; here each
warpgroup keeps a 64-row accumulator and its own ``wgmma`` chain, so two chains run per SM while x
is copied once per 128 rows.

* **copies**: the ring's copy warp (``ring._producer``), unchanged: each stage is ``KB`` boxes of
  128 weight rows and the matching x boxes, the first ``STAGES`` stages' weights before
  ``griddepcontrol.wait``, their x after it.
* **consumers**: the ring's consumer (``ring._consumer`` with ``PARTS = 2``) twice: warpgroup ``h``
  (0 or 1) waits on each stage's ``ready`` barrier, runs ``wgmma`` on rows ``64h .. 64h + 63`` of
  the stage's weight boxes (a slice of the shared tile) against the x boxes, and arrives on the
  stage's ``empty`` barrier, which counts both warpgroups.
* **stream-K**: the ring's schedule over (128-row block, K step) pairs; a warpgroup's half of a
  block is finished by the ring's ``_finish`` as a 64-row block of its own (index ``2 * block + h``),
  so a shared block's halves are summed through the workspace in program order, deterministic.

Not routed; :func:`dual_linear` is called by this script's sweep only. Reference: the fp32 product
(``naive.linear``), and bitwise run to run.

    python lab/verify/ring_dual.py [--rows 16,32,64] [--layers qkv,o,gu,down]
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
from specpilot.kernels.w12.mma_tma import launch_regs  # noqa: E402

TILE_K = 64
HALF = 64            # weight rows per warpgroup
BLOCK_N = 2 * HALF   # weight rows per stage box


@dataclass(frozen=True)
class DualConfig:
    """``stages`` ring depth, ``kboxes`` 64-column boxes per stage, ``inflight`` and ``trigger`` as
    the ring's, ``regs`` each consumer warpgroup's registers (``setmaxnreg``)."""

    stages: int = 3
    kboxes: int = 2
    inflight: int = 1
    trigger: int = 0
    regs: int = 152

    def key(self) -> str:
        return f"s{self.stages}-k{self.kboxes}-i{self.inflight}-r{self.regs}" + ("-t" if self.trigger else "")

    def smem_bytes(self, bm: int) -> int:
        """The ring's shared memory: ``stages x kboxes`` weight and x boxes."""
        return self.stages * self.kboxes * (BLOCK_N + bm) * TILE_K * 2


SMEM_BYTES = 227 * 1024 - 8 * 1024   # a Hopper program's shared memory less barriers and layout scratch


def check(cfg: DualConfig, bm: int) -> None:
    if (not 2 <= cfg.stages <= 8 or cfg.kboxes not in (1, 2, 4) or cfg.inflight not in (0, 1)
            or cfg.trigger not in (0, 1) or not 24 <= cfg.regs <= 256 or cfg.regs % 8):
        raise ValueError(f"dual ring config: 2-8 stages of 1, 2 or 4 boxes, inflight and trigger 0 or 1, regs "
                         f"24-256 in steps of 8; got {cfg}")
    if cfg.smem_bytes(bm) > SMEM_BYTES:
        raise ValueError(f"{cfg}: {cfg.smem_bytes(bm)} bytes of ring at {bm} rows exceed {SMEM_BYTES}")


try:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
except Exception:  # pragma: no cover - Triton without Gluon's Hopper module
    mbarrier = None

AVAILABLE = R.AVAILABLE and mbarrier is not None

if AVAILABLE:
    _HALF = gl.constexpr(HALF)
    _BN = gl.constexpr(BLOCK_N)
    _TK = gl.constexpr(TILE_K)

    @gluon.jit(do_not_specialize=["M", "N", "KT", "PER", "SLOTS"])
    def _dual_kernel(w_desc, x_desc, y_ptr, ws_ptr, lock_ptr, M, N, KT, PER, SLOTS, stride_ym,
                     BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr, L_EP: gl.constexpr,
                     PDL: gl.constexpr, INFLIGHT: gl.constexpr, KB: gl.constexpr, TRIGGER: gl.constexpr,
                     REGS: gl.constexpr):
        if TRIGGER:
            R.gdc_launch_dependents()
        pid = gl.program_id(0)
        g_begin = pid * PER
        g_end = gl.minimum(g_begin + PER, (N + _BN - 1) // _BN * KT)
        w_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, _BN, _TK], w_desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BLOCK_M, _TK], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for p in gl.static_range(STAGES):
            mbarrier.init(ready.index(p), count=1)
            mbarrier.init(empty.index(p), count=2)   # both warpgroups free a stage
        fence_async_shared()
        rt = (w_s, x_s, ready, empty, g_begin, g_end, KT, PER, SLOTS, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym)
        pt = (w_desc, x_desc, w_s, x_s, ready, empty, g_begin, g_end, KT)
        gl.warp_specialize([(R._consumer, (rt, _HALF, BLOCK_M, STAGES, ACC, L_EP, INFLIGHT, KB, 0, 2)),
                            (R._consumer, (rt, _HALF, BLOCK_M, STAGES, ACC, L_EP, INFLIGHT, KB, 1, 2)),
                            (R._producer, (pt, _BN, BLOCK_M, STAGES, KB, PDL))], [4, 1], [REGS, 24])


def dual_linear(x: torch.Tensor, w: torch.Tensor, cfg: DualConfig = DualConfig()) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (M = 1..64) and w [N, K], bf16, on a Hopper GPU; fp32 accumulation,
    deterministic."""
    if not AVAILABLE or not R.supported(x, w):
        raise ValueError(f"dual_linear takes what ring_linear takes; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    bm = R.block_m(m)
    check(cfg, bm)
    kt = -(-k // (TILE_K * cfg.kboxes))
    nb = -(-n // BLOCK_N)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    per, progs, slots = R.schedule(nb, kt, sms)
    ws, locks = split_workspace(x.device, 2 * nb * slots * HALF * bm if slots > 1 else 1, 2 * nb)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    w_desc = R.TensorDescriptor.from_tensor(w, [BLOCK_N, TILE_K], R.smem_layout())
    x_desc = R.TensorDescriptor.from_tensor(x, [bm, TILE_K], R.smem_layout())
    acc, ep = R.layouts(HALF, bm)
    _dual_kernel[(progs,)](w_desc, x_desc, y, ws, locks, m, n, kt, per, slots, y.stride(0),
                           BLOCK_M=bm, STAGES=cfg.stages, ACC=acc, L_EP=ep, INFLIGHT=cfg.inflight, KB=cfg.kboxes,
                           TRIGGER=cfg.trigger, REGS=cfg.regs, num_warps=4,
                           maxnreg=launch_regs(8, cfg.regs, 4, 24), **pdl_args(common.USE_PDL, x))
    return y




def sweep_configs() -> list[DualConfig]:
    return [DualConfig(3, 2), DualConfig(4, 2), DualConfig(2, 4), DualConfig(3, 1), DualConfig(6, 1),
            DualConfig(3, 2, inflight=0), DualConfig(3, 2, regs=232)]


def main() -> int:
    from lab.verify.ring import sweep_main

    # beside it the ring's configs, the first that fits the rows (its 9-16-row entry runs out of
    # shared memory at 64)
    return sweep_main("ring_dual", dual_linear, sweep_configs(), (R.RingConfig(64, 4, 1, 0, 1, 4), R.RingConfig(64, 3, 1, 0, 1, 2), R.RingConfig(64, 4, 1, 0, 1, 1)))


if __name__ == "__main__":
    raise SystemExit(main())
