"""A verify step's MLP (gate/up GEMM, ``silu(gate) * up``, down GEMM) as one persistent TMA-ring
kernel, so that the down projection's weights stream through the GEMM boundary.

Between two ring GEMMs (``kernels/verify/ring.py``) the SMs' weight streams stop: the next GEMM's
programs (168 KB of shared memory each) are placed only as the previous one's exit, and their
first weights arrive a loaded-memory latency later (on the H100 a 16-row gate/up and down cost
5 and 4 us more than the one-row chain's GEMVs, whose next kernel is resident and reading while
the previous drains; smaller rings that would let two GEMMs share an SM stream slower,
``lab/verify/step_parts.py ring:...``). Here one program per SM runs all three phases:

* **gate/up**: the ring's stream-K GEMM over ``w13`` (the ring's schedule, stores and fixed-order
  fix-ups, so the same bits as ``ring_linear``), into a ``[M, 2 * inter]`` buffer;
* grid barrier; **silu**: each program computes ``silu(gate) * up`` for its slice of the columns
  (the row kernel's roundings, ``kernels/verify/rows.py``), into a ``[M, inter]`` buffer;
* grid barrier; **down**: the ring's GEMM over ``w2`` with that buffer as x.

The copy warp never stops at the boundaries: as the consumer frees the ring's stages at the end
of gate/up it fills them with ``w2``'s first boxes (weights are constant), and only their x boxes
wait for the second barrier (the consumer, having seen it, arrives on a shared-memory barrier the
copy warp waits on). Every program must be resident for a grid barrier: the kernel lets its
dependents launch as it starts (they are placed only once all of its programs are), and one
program per SM is what its shared memory allows. The barriers' counters return to zero by the
kernel's end (the last to arrive at one resets the one before; a third count resets the second).

Not routed; :func:`mlp_ring` is called by this script's timing and by
``lab/verify/step_parts.py``'s ``mlp-ring`` variant. Reference: the three routed kernels
(``ring_linear``, ``silu_mul_rows``, ``ring_linear``), bitwise.

    python lab/verify/ring_mlp.py [--rows 1,16] [--stages 4] [--kboxes 4]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap  # noqa: E402

bootstrap()   # specpilot from the working tree where it is not installed (the kernel below is built at import)

import torch  # noqa: E402

from specpilot.kernels import workspace  # noqa: E402
from specpilot.kernels.triton_env import pdl_args  # noqa: E402
from specpilot.kernels.verify import common  # noqa: E402
from specpilot.kernels.verify import ring as R  # noqa: E402
from specpilot.kernels.w12.common import split_workspace  # noqa: E402
from specpilot.kernels.w12.gluon_common import cta_barrier, gl, gluon  # noqa: E402

AVAILABLE = R.AVAILABLE
SILU_COLS = 128    # columns per silu tile (x the step's rows)

if AVAILABLE:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _COLS = gl.constexpr(SILU_COLS)

    @gluon.jit
    def _proxy_fence(L: gl.constexpr):
        """``fence.proxy.async.global`` by every thread: generic-proxy writes ordered against the
        TMA copies (async proxy) that read them after the grid barrier."""
        z = gl.zeros([128], gl.int32, L)
        gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [z], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _arrive(bar_ptr):
        """This program's arrival (after every thread's writes), the count before it."""
        cta_barrier()
        return gl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")

    @gluon.jit
    def _wait_all(bar_ptr, P, seen):
        cur = seen
        while cur < P:
            cur = gl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        cta_barrier()

    @gluon.jit
    def _run(w_s, x_s, ready, empty, i, g_begin, g_end, KT, PER, SLOTS, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym,
             BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr,
             L_EP: gl.constexpr, KB: gl.constexpr):
        """The ring consumer's run (``ring._consumer`` with ``INFLIGHT``, one warpgroup) from ring
        position ``i``; returns the position after it."""
        for blk in range(g_begin // KT, (g_end - 1) // KT + 1):
            t0 = gl.maximum(g_begin, blk * KT)
            t1 = gl.minimum(g_end, blk * KT + KT)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
            for g in range(t0, t1):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                for j in gl.static_range(KB):
                    acc = warpgroup_mma(w_s.index(s * KB + j), x_s.index(s * KB + j).permute((1, 0)), acc,
                                        is_async=True)
                acc = warpgroup_mma_wait(KB, deps=[acc])
                if g > t0:
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                i += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
            first = (blk * KT) // PER
            last = ((blk + 1) * KT - 1) // PER
            R._finish(acc, y_ptr, ws_ptr, lock_ptr, blk, gl.program_id(0) - first, last - first + 1, SLOTS,
                      M, N, stride_ym, BLOCK_N, BLOCK_M, ACC, L_EP)
        return i

    @gluon.jit
    def _silu(gu_ptr, act_ptr, M, INTER, lo, hi, stride_g, stride_a, BLOCK_M: gl.constexpr, L: gl.constexpr):
        """``act[:, lo:hi] = silu(gate) * up`` of the gate/up rows (``kernels/verify/rows.py``'s roundings);
        ``.cg`` loads: other programs wrote them."""
        rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
        for c0 in range(lo, hi, _COLS):
            rc = c0 + gl.arange(0, _COLS, layout=gl.SliceLayout(0, L))
            ok = (rm < M)[:, None] & (rc < hi)[None, :]
            off = rm[:, None] * stride_g + rc[None, :]
            g = gl.load(gu_ptr + off, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)
            u = gl.load(gu_ptr + off + INTER, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)
            s = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16)
            gl.store(act_ptr + rm[:, None] * stride_a + rc[None, :], (s.to(gl.float32) * u).to(gl.bfloat16),
                     mask=ok)

    @gluon.jit
    def _consumer(ct, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr,
                  L_EP: gl.constexpr, L_SILU: gl.constexpr, L_FENCE: gl.constexpr, KB: gl.constexpr):
        (w_s, x_s, ready, empty, go, gb1, ge1, KT1, PER1, SLOTS1, gu_ptr, N1, gb2, ge2, KT2, PER2, SLOTS2, y_ptr, N2,
         act_ptr, INTER, CH, ws_ptr, lock_ptr, bar_ptr, M, stride_g, stride_a, stride_y) = ct
        P = gl.num_programs(0)
        i = _run(w_s, x_s, ready, empty, gb1 * 0, gb1, ge1, KT1, PER1, SLOTS1, gu_ptr, ws_ptr, lock_ptr, M, N1, stride_g,
                 BLOCK_N, BLOCK_M, STAGES, ACC, L_EP, KB)
        _wait_all(bar_ptr, P, _arrive(bar_ptr) + 1)                 # every gate/up block stored
        lo = gl.program_id(0) * CH
        _silu(gu_ptr, act_ptr, M, INTER, lo, gl.minimum(lo + CH, INTER), stride_g, stride_a, BLOCK_M, L_SILU)
        _proxy_fence(L_FENCE)
        seen = _arrive(bar_ptr + 1) + 1
        if seen == P:      # every program is past the first barrier: reset its count
            gl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        _wait_all(bar_ptr + 1, P, seen)                             # every silu column stored
        _proxy_fence(L_FENCE)
        mbarrier.arrive(go)                                         # the copy warp may read them
        _run(w_s, x_s, ready, empty, i, gb2, ge2, KT2, PER2, SLOTS2, y_ptr, ws_ptr, lock_ptr, M, N2, stride_y,
             BLOCK_N, BLOCK_M, STAGES, ACC, L_EP, KB)
        if _arrive(bar_ptr + 2) == P - 1:   # every program has seen the second barrier: reset it and this count
            gl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(bar_ptr + 2, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _producer(pt, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, KB: gl.constexpr,
                  PDL: gl.constexpr):
        """The copy warp: gate/up as the ring's (first stages' weights before the PDL wait), then
        the down weights into each stage as it is freed, their x boxes once the consumer has seen
        the second barrier."""
        w1_desc, x1_desc, w2_desc, x2_desc, w_s, x_s, ready, empty, go, gb1, ge1, KT1, gb2, ge2, KT2 = pt
        BYTES: gl.constexpr = KB * (BLOCK_N + BLOCK_M) * 64 * 2
        n1 = gl.maximum(ge1 - gb1, 0)
        pre = gl.minimum(n1, STAGES)
        for i in range(0, pre):
            mbarrier.expect(ready.index(i), BYTES)
            for j in gl.static_range(KB):
                R._w_box(w1_desc, w_s, ready.index(i), gb1 + i, i, j, KT1, BLOCK_N, KB)
        if PDL:
            gdc_wait()
        for i in range(0, pre):
            for j in gl.static_range(KB):
                R._x_box(x1_desc, x_s, ready.index(i), gb1 + i, i, j, KT1, KB)
        for i in range(pre, n1):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), BYTES)
            for j in gl.static_range(KB):
                R._w_box(w1_desc, w_s, ready.index(s), gb1 + i, s, j, KT1, BLOCK_N, KB)
                R._x_box(x1_desc, x_s, ready.index(s), gb1 + i, s, j, KT1, KB)
        n2 = gl.maximum(ge2 - gb2, 0)
        pre2 = gl.minimum(n2, STAGES)
        for i in range(0, pre2):
            ii = n1 + i
            s = ii % STAGES
            mbarrier.wait(empty.index(s), ((ii // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), BYTES)
            for j in gl.static_range(KB):
                R._w_box(w2_desc, w_s, ready.index(s), gb2 + i, s, j, KT2, BLOCK_N, KB)
        mbarrier.wait(go, 0)
        for i in range(0, pre2):
            s = (n1 + i) % STAGES
            for j in gl.static_range(KB):
                R._x_box(x2_desc, x_s, ready.index(s), gb2 + i, s, j, KT2, KB)
        for i in range(pre2, n2):
            ii = n1 + i
            s = ii % STAGES
            mbarrier.wait(empty.index(s), ((ii // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), BYTES)
            for j in gl.static_range(KB):
                R._w_box(w2_desc, w_s, ready.index(s), gb2 + i, s, j, KT2, BLOCK_N, KB)
                R._x_box(x2_desc, x_s, ready.index(s), gb2 + i, s, j, KT2, KB)

    @gluon.jit(do_not_specialize=["M", "N1", "KT1", "PER1", "SLOTS1", "N2", "KT2", "PER2", "SLOTS2", "INTER", "CH"])
    def _mlp_kernel(w1_desc, x1_desc, w2_desc, x2_desc, gu_ptr, act_ptr, y_ptr, ws_ptr, lock_ptr, bar_ptr,
                    M, N1, KT1, PER1, SLOTS1, N2, KT2, PER2, SLOTS2, INTER, CH, stride_g, stride_a, stride_y,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr,
                    L_EP: gl.constexpr, L_SILU: gl.constexpr, L_FENCE: gl.constexpr, PDL: gl.constexpr,
                    KB: gl.constexpr):
        gdc_launch_dependents()   # dependents placed only once every program is (the grid barriers need them all)
        pid = gl.program_id(0)
        gb1 = pid * PER1
        ge1 = gl.minimum(gb1 + PER1, (N1 + BLOCK_N - 1) // BLOCK_N * KT1)
        gb2 = pid * PER2
        ge2 = gl.minimum(gb2 + PER2, (N2 + BLOCK_N - 1) // BLOCK_N * KT2)
        w_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BLOCK_N, 64], w1_desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * KB, BLOCK_M, 64], x1_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        go = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for p in gl.static_range(STAGES):
            mbarrier.init(ready.index(p), count=1)
            mbarrier.init(empty.index(p), count=1)
        mbarrier.init(go, count=1)
        fence_async_shared()
        ct = (w_s, x_s, ready, empty, go, gb1, ge1, KT1, PER1, SLOTS1, gu_ptr, N1, gb2, ge2, KT2, PER2, SLOTS2,
              y_ptr, N2, act_ptr, INTER, CH, ws_ptr, lock_ptr, bar_ptr, M, stride_g, stride_a, stride_y)
        pt = (w1_desc, x1_desc, w2_desc, x2_desc, w_s, x_s, ready, empty, go, gb1, ge1, KT1, gb2, ge2, KT2)
        gl.warp_specialize([(_consumer, (ct, BLOCK_N, BLOCK_M, STAGES, ACC, L_EP, L_SILU, L_FENCE, KB)),
                            (_producer, (pt, BLOCK_N, BLOCK_M, STAGES, KB, PDL))], [1], [24])


def silu_layout():
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0])


def fence_layout():
    return gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])


def default_config(m: int) -> R.RingConfig:
    """The ring's routed config at 9-16 rows (64-row blocks, four stages of four boxes), two boxes
    a stage above 32 rows (what fits in shared memory)."""
    return R.RingConfig(64, 4, kboxes=4 if m <= 32 else 2)


def mlp_ring(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, cfg: R.RingConfig | None = None,
             gu: torch.Tensor | None = None) -> torch.Tensor:
    """``(silu(h @ gate.T) * (h @ up.T)) @ w2.T`` for rows ``h`` [M, K] (1..64), ``w13`` [2 inter, K]
    (gate rows, then up rows) and ``w2`` [N, inter], bf16, with the rounding of the three routed
    kernels. ``gu``: the gate/up buffer to use (its product is left there)."""
    if not (R.supported(h, w13) and w2.dtype == torch.bfloat16 and w2.is_contiguous()
            and w13.shape[0] % 2 == 0 and w2.shape[1] * 2 == w13.shape[0] and w2.shape[1] % 8 == 0):
        raise ValueError(f"mlp_ring: rows {tuple(h.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    cfg = cfg or default_config(h.shape[0])
    R.check(cfg)
    m, k = h.shape
    n1, inter, n2 = w13.shape[0], w2.shape[1], w2.shape[0]
    bm = R.block_m(m)
    kt1 = -(-k // (64 * cfg.kboxes))
    kt2 = -(-inter // (64 * cfg.kboxes))
    nb1 = -(-n1 // cfg.block_n)
    nb2 = -(-n2 // cfg.block_n)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    per1, _, slots1 = R.schedule(nb1, kt1, sms)
    per2, _, slots2 = R.schedule(nb2, kt2, sms)
    ws, locks = split_workspace(h.device, max(nb1 * slots1, nb2 * slots2) * cfg.block_n * bm, max(nb1, nb2))
    bar = workspace.counters(h.device, "mlp_ring.grid", 3)
    gu = torch.empty(m, n1, dtype=h.dtype, device=h.device) if gu is None else gu
    act = torch.empty(m, inter, dtype=h.dtype, device=h.device)
    y = torch.empty(m, n2, dtype=h.dtype, device=h.device)
    sl = R.smem_layout()
    w1_desc = R.TensorDescriptor.from_tensor(w13, [cfg.block_n, 64], sl)
    x1_desc = R.TensorDescriptor.from_tensor(h, [bm, 64], sl)
    w2_desc = R.TensorDescriptor.from_tensor(w2, [cfg.block_n, 64], sl)
    x2_desc = R.TensorDescriptor.from_tensor(act, [bm, 64], sl)
    acc, ep = R.layouts(cfg.block_n, bm)
    ch = -(-inter // sms)
    _mlp_kernel[(sms,)](w1_desc, x1_desc, w2_desc, x2_desc, gu, act, y, ws, locks, bar,
                        m, n1, kt1, per1, slots1, n2, kt2, per2, slots2, inter, ch, gu.stride(0), act.stride(0),
                        y.stride(0), BLOCK_N=cfg.block_n, BLOCK_M=bm, STAGES=cfg.stages, ACC=acc, L_EP=ep,
                        L_SILU=silu_layout(), L_FENCE=fence_layout(), KB=cfg.kboxes,
                        num_warps=4, **pdl_args(common.USE_PDL, h))
    return y


def reference(h, w13, w2, cfg: R.RingConfig | None = None):
    """The routed kernels' MLP: ring gate/up, the row kernel's silu * up, ring down."""
    from specpilot.kernels.verify import rows

    cfg = cfg or default_config(h.shape[0])
    return R.ring_linear(rows.silu_mul_rows(R.ring_linear(h, w13, cfg), w2.shape[1]), w2, cfg)


def main() -> int:
    import argparse

    from lab.common import print_table, write_results

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--kboxes", type=int, default=0, help="boxes a stage (default: default_config's)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    w13 = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) * 0.02
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    out = []
    for m in (int(r) for r in args.rows.split(",")):
        h = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        cfg = R.RingConfig(64, args.stages, kboxes=args.kboxes or default_config(m).kboxes)
        a, b = mlp_ring(h, w13, w2, cfg), reference(h, w13, w2, cfg)
        same = bool(torch.equal(a, b))
        times = {}
        for name, fn in (("three kernels", lambda: reference(h, w13, w2, cfg)), ("mlp ring", lambda: mlp_ring(h, w13, w2, cfg))):
            ev = []
            for _ in range(args.reps):
                flush.add_(1)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                ev.append((s, e))
            torch.cuda.synchronize()
            times[name] = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)[len(ev) // 2]
        out.append({"rows": m, "bitwise_equal": same, "three_kernels_us": times["three kernels"],
                    "mlp_ring_us": times["mlp ring"]})
    print_table(out, ["rows", "bitwise_equal", "three_kernels_us", "mlp_ring_us"])
    write_results("ring_mlp", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
