"""Skinny bf16 GEMM ``y = x @ W.T`` for 1-32 rows on the tensor cores with K split across the warps
of a program: the W12 ``warpk`` schedule (:mod:`specpilot.kernels.w12.warpk`) on plain bf16 weights.

cuBLAS kernels take no part in programmatic dependent launch: each starts streaming its weights
only when the previous kernel has finished, where the one-row decode chain's GEMVs have theirs in
flight already. This kernel does (the skinny kernel, :mod:`.skinny`, prefetches one tile), and
nothing in it goes through shared memory. Layer by layer it is level with cuBLAS at 2-8 rows; in
whole steps of one request it saves about 0.25 ms at 2-8 rows on Llama-3.1-8B shapes (H200,
docs/engine.md), none without PDL. The table routes it (:mod:`.blas`):

* a program owns 16 weight rows; each of its 4 warps streams its own 64-column slices of them
  (``t = i * 4 + w``), four slices ahead in register sets reloaded in place (each reload pinned
  with ``bar.warp.sync`` so ptxas keeps it ahead of the MMAs), no split-K across programs;
* a slice is loaded straight into the ``mma.sync.m16n8k16`` A registers: the k order inside an MMA
  is free as long as x uses the same one, so MMA k ``16j + 8s + 2t + c`` is slice column
  ``16t + 4j + 2s + c`` and lane ``t`` of a row quad loads 16 consecutive bf16 (two 16-byte loads)
  per row; x arrives the same way, 16 consecutive bf16 of one x row per lane from L1/L2, rows past
  M predicated off;
* under programmatic dependent launch the first register sets' weights load before the wait for
  the previous kernel (weights are constant), x after it. The kernel does not trigger its own
  dependents early: they launch when it exits. Triggered right after the weight loads, batched
  steps of 4 requests x 1 row took 5.31 instead of 4.70 ms (Llama-3.1-8B shapes, H200), one
  request's steps the same either way;
* the program sums its warps' accumulators in a fixed order: results are bitwise identical run to
  run.

Gluon (Triton's explicit-layout dialect) does not run under Triton's interpreter: on a machine
without CUDA the kernel still compiles for sm_90 (tests do), and :mod:`.blas` routes CPU and
interpreter calls elsewhere. The plain reference is :func:`.naive.linear`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from specpilot.kernels.triton_env import pdl_args
from specpilot.kernels.verify import common
from specpilot.kernels.w12.gluon_common import gl, gluon, log2, mma_v2, per_warp, pin, warp_batched_mma, x_operand
from specpilot.kernels.w12.gluon_epilogue import epilogue_layout

SLICE_K = 64     # columns per slice (4 MMAs along k)
ROWS = 16        # weight rows per program: one 16-row MMA slice per warp
WARPS = 4
MAX_ROWS = 32    # x rows per launch: one to four 8-row MMA column blocks
# register sets per warp (slices in flight): with two or three ptxas spills registers in the loop at
# 8-16 x rows and the sets stream through local memory (whole H200 steps 2-5 ms slower)
DEPTH = 4


def block_m(m: int) -> int:
    """x rows per launch, padded to an MMA column block multiple: 8, 16 or 32."""
    return 8 if m <= 8 else 16 if m <= 16 else 32


def layout_bases(rows: int, bm: int, warps: int) -> dict[str, tuple]:
    """Register/lane/warp bases of the ``[warps, rows, 64]`` weight slice and the ``[warps, bm, 64]``
    x slice: 16 consecutive columns per lane (registers), lanes ``t`` over the four 16-column
    groups and ``g`` over 8 rows, further rows in registers, the warp leading (a batch dimension)."""
    k_regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
    lanes = [[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    warp = [[1 << i, 0, 0] for i in range(log2(warps))]

    def reps(n):
        return [[0, 8 * (1 << i), 0] for i in range(log2(n // 8))]

    return {"w": (k_regs + reps(rows), lanes, warp, [warps, rows, SLICE_K]),
            "x": (k_regs + reps(bm), lanes, warp, [warps, bm, SLICE_K])}


if gluon is not None:
    from triton.language.extra.cuda import gdc_wait

    _K = gl.constexpr(SLICE_K)

    @lru_cache(maxsize=None)
    def layouts(rows: int, bm: int, warps: int):
        b = layout_bases(rows, bm, warps)
        lin = {k: gl.DistributedLinearLayout(v[0], v[1], v[2], [], v[3]) for k, v in b.items()}
        mma, a_op, b_op = warp_batched_mma(warps)
        return lin["w"], lin["x"], mma, a_op, b_op, epilogue_layout(bm, warps)

    @gluon.jit
    def _load_w(pw, t, t_end, L_W: gl.constexpr):
        """Each warp's slice ``t[w]``, clamped to the range (past it the last slice is re-read; its x
        is zero, so it adds +-0)."""
        return gl.load(pw + per_warp(gl.minimum(t, t_end - 1) * _K, L_W))

    @gluon.jit
    def _load_x(px, t, t_end, tx, L_X: gl.constexpr):
        return gl.load(px + per_warp(t * _K, L_X), mask=tx & per_warp(t < t_end, L_X), other=0.0)

    @gluon.jit
    def _load(pw, px, t, t_end, tx, L_W: gl.constexpr, L_X: gl.constexpr):
        return _load_w(pw, t, t_end, L_W), _load_x(px, t, t_end, tx, L_X)

    @gluon.jit
    def _mma(acc, w, x, WARPS: gl.constexpr, ROWS: gl.constexpr, BM: gl.constexpr, A_OP: gl.constexpr,
             B_OP: gl.constexpr):
        """acc ``[W, ROWS, BM]`` += each warp's weight slice times its x, both in MMA k order."""
        a = gl.permute(gl.reshape(w, [WARPS, ROWS, 4, 4, 2, 2]), [0, 1, 3, 4, 2, 5])   # [w, n, j, s, t, c]
        a = gl.convert_layout(gl.reshape(a, [WARPS, ROWS, _K]), A_OP, assert_trivial=True)
        return mma_v2(a, x_operand(x, WARPS, BM, B_OP), acc)

    @gluon.jit
    def _set(acc, w, x, t_next, wid, pw, px, t_end, tx, WARPS: gl.constexpr, ROWS: gl.constexpr,
             BM: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
        """One register set: its slices' MMAs, then the set reloaded in place and pinned there."""
        acc = _mma(acc, w, x, WARPS, ROWS, BM, A_OP, B_OP)
        w, x = _load(pw, px, t_next + wid, t_end, tx, L_W, L_X)
        return acc, w, x, pin(wid, True)

    @gluon.jit
    def _pointers(x_ptr, w_ptr, n0, M, N, stride_x, stride_w, ROWS: gl.constexpr, BM: gl.constexpr,
                  WARPS: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr):
        """Loop-invariant pointers: each lane's weight rows from ``n0`` (past N: the last row, never
        stored) and its x row, at the 16 columns it loads in a slice; which x rows exist; the warp
        index."""
        rw = gl.minimum(n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_W))), N - 1)
        kw = gl.arange(0, _K, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_W)))
        pw = (w_ptr + gl.expand_dims(gl.expand_dims(rw.to(gl.int64) * stride_w, 0), 2)
              + gl.expand_dims(gl.expand_dims(kw, 0), 1))
        mx = gl.expand_dims(gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_X))), 0), 2)
        kx = gl.expand_dims(gl.expand_dims(gl.arange(0, _K, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_X))), 0), 1)
        wid = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_W)))
        return pw, x_ptr + mx * stride_x + kx, mx < M, wid

    @gluon.jit
    def _warpk_kernel(x_ptr, w_ptr, y_ptr, M, N, KT, stride_x, stride_w, stride_y,
                      ROWS: gl.constexpr, BM: gl.constexpr, WARPS: gl.constexpr, DEPTH: gl.constexpr,
                      L_W: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr,
                      A_OP: gl.constexpr, B_OP: gl.constexpr, L_EP: gl.constexpr, PDL: gl.constexpr):
        n0 = gl.program_id(0) * ROWS
        pw, px, tx, wid = _pointers(x_ptr, w_ptr, n0, M, N, stride_x, stride_w, ROWS, BM, WARPS, L_W, L_X)

        t_begin = 0
        t_end = KT
        acc = gl.zeros([WARPS, ROWS, BM], gl.float32, MMA)
        # the first register sets' weights (constant) before x: under PDL they load while the
        # previous kernel drains, and x only after it has finished
        w0 = _load_w(pw, t_begin + wid, t_end, L_W)
        w1 = _load_w(pw, t_begin + WARPS + wid, t_end, L_W)
        if DEPTH >= 3:
            w2 = _load_w(pw, t_begin + 2 * WARPS + wid, t_end, L_W)
        if DEPTH >= 4:
            w3 = _load_w(pw, t_begin + 3 * WARPS + wid, t_end, L_W)
        if PDL:   # dependents are not triggered early: they launch at this grid's exit (see the module doc)
            gdc_wait()
        x0 = _load_x(px, t_begin + wid, t_end, tx, L_X)
        x1 = _load_x(px, t_begin + WARPS + wid, t_end, tx, L_X)
        if DEPTH >= 3:
            x2 = _load_x(px, t_begin + 2 * WARPS + wid, t_end, tx, L_X)
        if DEPTH >= 4:
            x3 = _load_x(px, t_begin + 3 * WARPS + wid, t_end, tx, L_X)
        wid = pin(wid, True)
        for t in range(t_begin, t_end, DEPTH * WARPS):
            acc, w0, x0, wid = _set(acc, w0, x0, t + DEPTH * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS, BM,
                                    L_W, L_X, A_OP, B_OP)
            acc, w1, x1, wid = _set(acc, w1, x1, t + (DEPTH + 1) * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS, BM,
                                    L_W, L_X, A_OP, B_OP)
            if DEPTH >= 3:
                acc, w2, x2, wid = _set(acc, w2, x2, t + (DEPTH + 2) * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS,
                                        BM, L_W, L_X, A_OP, B_OP)
            if DEPTH >= 4:
                acc, w3, x3, wid = _set(acc, w3, x3, t + (DEPTH + 3) * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS,
                                        BM, L_W, L_X, A_OP, B_OP)
        part = gl.convert_layout(gl.sum(acc, axis=0), L_EP)      # the warps, in a fixed order
        rn = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_EP))
        rm = gl.arange(0, BM, layout=gl.SliceLayout(0, L_EP))
        out = y_ptr + rm[None, :] * stride_y + rn[:, None]
        gl.store(out, part.to(y_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (rm < M)[None, :])


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Gluon present, 1-32 bf16 rows and a bf16 weight, both contiguous, K a multiple of 64, on a
    CUDA device with ``mma.sync`` (compute capability 8.0+)."""
    return (gluon is not None and x.is_cuda and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and x.dtype == w.dtype == torch.bfloat16 and 1 <= x.shape[0] <= MAX_ROWS
            and x.shape[1] % SLICE_K == 0 and x.stride(1) == 1 and w.stride(1) == 1
            and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def warpk_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (M = 1..32) and w [N, K], bf16; fp32 accumulation, deterministic."""
    if not supported(x, w):
        raise ValueError(f"warpk_linear takes 1-{MAX_ROWS} contiguous bf16 rows and a bf16 weight with K a "
                         f"multiple of {SLICE_K} on a CUDA GPU with mma.sync; got x {tuple(x.shape)} {x.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype}")
    return _launch(x, w, DEPTH)


def _launch(x: torch.Tensor, w: torch.Tensor, depth: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bm = block_m(m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    l_w, l_x, mma, a_op, b_op, l_ep = layouts(ROWS, bm, WARPS)
    _warpk_kernel[(-(-n // ROWS),)](x, w, y, m, n, k // SLICE_K, x.stride(0), w.stride(0), y.stride(0),
                                    ROWS=ROWS, BM=bm, WARPS=WARPS, DEPTH=depth, L_W=l_w, L_X=l_x, MMA=mma,
                                    A_OP=a_op, B_OP=b_op, L_EP=l_ep, num_warps=WARPS,
                                    **pdl_args(common.USE_PDL, x))
    return y
