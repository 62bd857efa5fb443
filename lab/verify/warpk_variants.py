"""Unrouted: the warp-K bf16 GEMM (``kernels/verify/warpk.py``) with x loaded late, for 9-32 rows.

The product kernel keeps each register set's x beside its weights (for 16 x rows 16 registers per
set and lane, 32 for 32 rows), which raises its registers from 154 at 8 x rows to 211 at 16 and
spills at 32 (sm_90, depth 4). Its steps of 9-16 rows measured slower than cuBLAS's. Here (``x_late``,
as the W12 warp-K kernel does above 16 rows) a set holds only its weights and the slice index, and
x is loaded right before the set's MMAs, from L1/L2: fewer registers, one more exposed load per set.
On the H200 whole steps got slower with it (Llama-3.1-8B shapes, ``step_parts.py --variants
product,warpk-late:32:16=4:32=4``: 1 x 9 / 1 x 16 / 1 x 32 rows 4.67 / 4.97 / 5.02 -> 5.67 / 5.97 /
8.27 ms, 16 requests x 1 row 5.14 -> 6.35 ms). ``main`` compiles it for sm_90 and prints registers
and spills, and ``launch`` runs it (``lab/verify/step_parts.py`` can route it like ``warpk:``).

    python lab/verify/warpk_variants.py        # registers and spills per (x rows, depth, x_late)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from specpilot.kernels.triton_env import pdl_args  # noqa: E402
from specpilot.kernels.verify import common, warpk as W  # noqa: E402
from specpilot.kernels.w12.gluon_common import gl, gluon, pin  # noqa: E402

if gluon is not None:
    from triton.language.extra.cuda import gdc_wait

    @gluon.jit
    def _set(acc, w, x, t_next, wid, pw, px, t_end, tx, WARPS: gl.constexpr, ROWS: gl.constexpr,
             BM: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
             X_LATE: gl.constexpr):
        """One register set (``X_LATE``: ``x`` holds its slice indices and x is loaded here)."""
        if X_LATE:
            xv = W._load_x(px, x, t_end, tx, L_X)
        else:
            xv = x
        acc = W._mma(acc, w, xv, WARPS, ROWS, BM, A_OP, B_OP)
        w = W._load_w(pw, t_next + wid, t_end, L_W)
        if X_LATE:
            x = t_next + wid
        else:
            x = W._load_x(px, t_next + wid, t_end, tx, L_X)
        return acc, w, x, pin(wid, True)

    @gluon.jit
    def _kernel(x_ptr, w_ptr, y_ptr, M, N, KT, stride_x, stride_w, stride_y,
                ROWS: gl.constexpr, BM: gl.constexpr, WARPS: gl.constexpr, DEPTH: gl.constexpr,
                L_W: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                L_EP: gl.constexpr, PDL: gl.constexpr, X_LATE: gl.constexpr):
        pw, px, tx, wid = W._pointers(x_ptr, w_ptr, gl.program_id(0) * ROWS, M, N, stride_x, stride_w, ROWS, BM,
                                      WARPS, L_W, L_X)
        t_end = KT
        acc = gl.zeros([WARPS, ROWS, BM], gl.float32, MMA)
        w0 = W._load_w(pw, wid, t_end, L_W)
        w1 = W._load_w(pw, WARPS + wid, t_end, L_W)
        if DEPTH >= 3:
            w2 = W._load_w(pw, 2 * WARPS + wid, t_end, L_W)
        if DEPTH >= 4:
            w3 = W._load_w(pw, 3 * WARPS + wid, t_end, L_W)
        if PDL:
            gdc_wait()
        if X_LATE:
            x0 = wid
            x1 = WARPS + wid
            if DEPTH >= 3:
                x2 = 2 * WARPS + wid
            if DEPTH >= 4:
                x3 = 3 * WARPS + wid
        else:
            x0 = W._load_x(px, wid, t_end, tx, L_X)
            x1 = W._load_x(px, WARPS + wid, t_end, tx, L_X)
            if DEPTH >= 3:
                x2 = W._load_x(px, 2 * WARPS + wid, t_end, tx, L_X)
            if DEPTH >= 4:
                x3 = W._load_x(px, 3 * WARPS + wid, t_end, tx, L_X)
        wid = pin(wid, True)
        for t in range(0, t_end, DEPTH * WARPS):
            acc, w0, x0, wid = _set(acc, w0, x0, t + DEPTH * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS, BM,
                                    L_W, L_X, A_OP, B_OP, X_LATE)
            acc, w1, x1, wid = _set(acc, w1, x1, t + (DEPTH + 1) * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS, BM,
                                    L_W, L_X, A_OP, B_OP, X_LATE)
            if DEPTH >= 3:
                acc, w2, x2, wid = _set(acc, w2, x2, t + (DEPTH + 2) * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS,
                                        BM, L_W, L_X, A_OP, B_OP, X_LATE)
            if DEPTH >= 4:
                acc, w3, x3, wid = _set(acc, w3, x3, t + (DEPTH + 3) * WARPS, wid, pw, px, t_end, tx, WARPS, ROWS,
                                        BM, L_W, L_X, A_OP, B_OP, X_LATE)
        part = gl.convert_layout(gl.sum(acc, axis=0), L_EP)
        rn = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_EP))
        rm = gl.arange(0, BM, layout=gl.SliceLayout(0, L_EP))
        gl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], part.to(y_ptr.dtype.element_ty),
                 mask=(rn < N)[:, None] & (rm < M)[None, :])


def launch(x: torch.Tensor, w: torch.Tensor, depth: int = W.DEPTH, x_late: bool = True) -> torch.Tensor:
    """``x @ w.T`` (the product kernel's contract, :func:`specpilot.kernels.verify.warpk.supported`)."""
    if not W.supported(x, w):
        raise ValueError("x and w outside the warp-K kernel's contract")
    m, k = x.shape
    n = w.shape[0]
    bm = W.block_m(m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    l_w, l_x, mma, a_op, b_op, l_ep = W.layouts(W.ROWS, bm, W.WARPS)
    _kernel[(-(-n // W.ROWS),)](x, w, y, m, n, k // W.SLICE_K, x.stride(0), w.stride(0), y.stride(0),
                                ROWS=W.ROWS, BM=bm, WARPS=W.WARPS, DEPTH=depth, L_W=l_w, L_X=l_x, MMA=mma,
                                A_OP=a_op, B_OP=b_op, L_EP=l_ep, X_LATE=x_late, num_warps=W.WARPS,
                                **pdl_args(common.USE_PDL, x))
    return y


def main() -> None:
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from gluon_ptx import ptxas_report

    for bm in (8, 16, 32):
        for depth in (2, 3, 4):
            for late in (False, True):
                setup = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from lab.verify import warpk_variants as V
from specpilot.kernels.verify import warpk as W
k = V._kernel
l_w, l_x, mma, a_op, b_op, l_ep = W.layouts(W.ROWS, {bm}, W.WARPS)
const = dict(ROWS=W.ROWS, BM={bm}, WARPS=W.WARPS, DEPTH={depth}, L_W=l_w, L_X=l_x, MMA=mma, A_OP=a_op,
             B_OP=b_op, L_EP=l_ep, PDL=True, X_LATE={late})
ptrs = {{"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"}}
div = ["x_ptr", "w_ptr", "y_ptr", "stride_x", "stride_w", "stride_y"]
warps = W.WARPS
"""
                log = ptxas_report(setup)["log"]
                regs = re.findall(r"Used (\d+) registers", log)
                spill = re.findall(r"(\d+) bytes spill stores", log)
                print(f"x rows {bm:2d} depth {depth} x_late {late!s:5}: registers {regs[0] if regs else '?'}, "
                      f"spill stores {spill[0] if spill else '?'} bytes", flush=True)


if __name__ == "__main__":
    main()
