"""W12 GEMM for 2-64 rows on Hopper's asynchronous tensor-core instruction (``wgmma``), in Gluon.

Same decode and record access as :mod:`.mma` (the ``mma.sync`` kernel), different MMA:

* the decoded weights are the **A operand straight from registers**: the ``mma.sync`` A layout the
  decode already produces is, for a 64-row warpgroup tile, exactly ``wgmma``'s register A layout
  (``DotOperandLayout(0, NVMMADistributedLayout([3, 0], ...), k_width=2)``), so
  :func:`.mma._a_operand` feeds it with its trivial (asserted) conversion;
* x is the **B operand in shared memory**, read by the tensor cores through a descriptor (no
  B-fragment shared loads in the warps). It must be stored in the record's MMA k order
  (:func:`.mma.mma_k_to_physical`), a 4-byte-granular permutation no shared layout expresses, so
  each record's x tile is loaded into registers one record ahead, permuted there (register renaming
  only) and stored into a ring of three stages;
* the MMA is waited for before the next record (``warpgroup_mma_wait(0)``). It ran asynchronously
  at first (``wait(1)``: ``wgmma`` of record ``t`` in flight while the warps decode record ``t + 1``),
  but ptxas does not keep the registers of an in-flight ``wgmma``'s A operand: the next record's
  loads and decode landed in them (SASS, tests/test_w12_wgmma.py), which made results depend on
  timing. One CTA barrier per record: the stage written at record ``t`` was last read by ``wgmma
  t - 2``, which every warp retired before the previous barrier.

Measured on the H200, with the unsafe ``wait(1)``, it was slower than the ``mma.sync`` kernel (1.05x
vs 1.09x cuBLAS at 8 rows, 0.78x vs 0.84x at 32; docs/w12.md), so ``w12_linear`` does not route
here; it stays callable and benchmarked (``lab/w12/sweep.py --mode wgmma``).

Epilogue, split-K and determinism are :mod:`.mma`'s (:func:`.mma._epilogue`): a fixed-order
reduction, bitwise identical run to run. Bits may differ from the ``mma.sync`` kernel's (the order
of the fp32 sums inside an MMA is the hardware's). Design notes and the compile-time evidence:
docs/plans/w12-wgmma.md. Plain reference: :func:`.naive.w12_linear_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import mma as M
from specpilot.kernels.w12.format import TILE_K
from .gemm import KernelPack, triton
from .mma import _cta_barrier, block_m_for, gl, gluon

try:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - Triton without Gluon's Hopper module
    warpgroup_mma = warpgroup_mma_wait = fence_async_shared = None

AVAILABLE = gluon is not None and warpgroup_mma is not None


@dataclass(frozen=True)
class WgmmaConfig:
    """``block_n`` weight rows per program (64 per warpgroup: 64 with 4 warps, 128 with 8),
    ``split_k`` k ranges, ``depth`` records of weights loaded ahead in registers (1-3)."""

    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    depth: int = 2
    unroll: bool = False   # x stages in three allocations, loop unrolled by three (depth 2 only)

    def key(self) -> str:
        return f"wg-n{self.block_n}-s{self.split_k}-w{self.num_warps}-d{self.depth}{'-u' if self.unroll else ''}"


def check_config(cfg: WgmmaConfig) -> None:
    if (cfg.block_n, cfg.num_warps) not in ((64, 4), (128, 8)):
        raise ValueError(f"block_n/num_warps must be 64/4 or 128/8 (64 rows per warpgroup), got "
                         f"{cfg.block_n}/{cfg.num_warps}")
    if cfg.depth not in (1, 2, 3):
        raise ValueError(f"depth must be 1-3, got {cfg.depth}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")
    if cfg.unroll and cfg.depth != 2:
        raise ValueError("the unrolled loop loads weights two records ahead (depth 2)")


def x_phys_bases(block_m: int, num_warps: int) -> tuple[list, list, list]:
    """Register/lane/warp bases of the ``[block_m, 64]`` x load (physical k ``16t + 4j + 2s + c``):
    a thread holds 4 consecutive k (8 bytes: ``s``, ``c``) of one row and, in registers, the ``t``
    the warps do not take; lanes take ``j`` and 8 rows; warps take further rows, then ``t``."""
    rows = [[1 << i, 0] for i in range(3, M._log2(block_m))]
    ts = [[0, 16], [0, 32]]
    warps = []
    for _ in range(M._log2(num_warps)):
        warps.append(rows.pop(0) if rows else ts.pop() if ts else [0, 0])
    return [[0, 1], [0, 2]] + ts + rows, [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warps


if AVAILABLE:

    @lru_cache(maxsize=None)
    def layouts(block_n: int, block_m: int, num_warps: int):
        """Weight loads and the epilogue as in :func:`.mma.layouts`; the wgmma accumulator and A
        operand; the x load (physical k) and the x stage (128-byte swizzled, k contiguous)."""
        l_view, l_nib, _, _, _, _, l_ep, _, _ = M.layouts(block_n, block_m, num_warps)
        acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])
        a_op = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
        reg, lane, warp = x_phys_bases(block_m, num_warps)
        l_xp = gl.DistributedLinearLayout(reg, lane, warp, [], [block_m, TILE_K])
        xsl = gl.NVMMASharedLayout.get_default_for([block_m, TILE_K], gl.bfloat16)
        return l_view, l_nib, acc, a_op, l_ep, l_xp, xsl

    @gluon.jit
    def _x_load(x_ptr, rows, kx, t, ok, M_rows, stride_xm):
        """x[rows, 64t : 64t + 64] in physical k order, zero for rows past M or when not ``ok``."""
        kk = t * 64 + kx
        return gl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows < M_rows)[:, None] & ok,
                       other=0.0)

    @gluon.jit
    def _x_store(xs, xv, BLOCK_M: gl.constexpr):
        """Store an x tile into a stage in MMA k order: ``[m, t, j, s, c] -> [m, j, s, t, c]``."""
        xv = gl.permute(gl.reshape(xv, [BLOCK_M, 4, 4, 2, 2]), [0, 2, 3, 1, 4])
        xs.store(gl.reshape(xv, [BLOCK_M, 64]))

    @gluon.jit
    def _step(acc, w0, q0, w1, q1, xr, cur, nxt, x_ptr, rec_ptr, tile_row, t, t_end, off_v, off_n, rows, kx, M_rows,
              stride_xm, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, QPASS: gl.constexpr, L_VIEW: gl.constexpr,
              A_OP: gl.constexpr):
        """One record of the unrolled loop (weights two records ahead): wgmma ``t`` on stage ``cur``,
        x of ``t + 1`` into stage ``nxt``, x of ``t + 2`` into registers."""
        wx, qx = M._load_rec(rec_ptr, tile_row, t + 2, t + 2 < t_end, off_v, off_n, QPASS)
        xn = _x_load(x_ptr, rows, kx, t + 2, t + 2 < t_end, M_rows, stride_xm)
        a = M._a_operand(w0, q0, L_VIEW, A_OP, BLOCK_N, QPASS, False)
        tok = warpgroup_mma(a, cur.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[tok])   # (A is in registers: see the module)
        _x_store(nxt, xr, BLOCK_M)
        fence_async_shared()
        _cta_barrier()
        return acc, w1, q1, wx, qx, xn

    @gluon.jit
    def _w12_wgmma_kernel(
        x_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M_rows, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, QPASS: gl.constexpr,
        ESC_CH: gl.constexpr, DEPTH: gl.constexpr, UNROLL: gl.constexpr,
        L_VIEW: gl.constexpr, L_NIB: gl.constexpr, ACC: gl.constexpr, A_OP: gl.constexpr, L_EP: gl.constexpr,
        L_XP: gl.constexpr, XSL: gl.constexpr,
    ):
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        pid_m = gl.program_id(2)
        n0 = pid_n * BLOCK_N
        tile_row, off_v, off_n = M._record_offsets(n0, KT, BLOCK_N, L_VIEW, L_NIB)
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_XP))
        kx = gl.arange(0, 64, layout=gl.SliceLayout(0, L_XP))
        xs = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, 64], XSL)

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)

        w0, q0 = M._load_rec(rec_ptr, tile_row, t_begin, t_begin < t_end, off_v, off_n, QPASS)
        if DEPTH >= 2:
            w1, q1 = M._load_rec(rec_ptr, tile_row, t_begin + 1, t_begin + 1 < t_end, off_v, off_n, QPASS)
        if DEPTH >= 3:
            w2, q2 = M._load_rec(rec_ptr, tile_row, t_begin + 2, t_begin + 2 < t_end, off_v, off_n, QPASS)
        _x_store(xs.index(0), _x_load(x_ptr, rows, kx, t_begin, t_begin < t_end, M_rows, stride_xm), BLOCK_M)
        xr = _x_load(x_ptr, rows, kx, t_begin + 1, t_begin + 1 < t_end, M_rows, stride_xm)
        fence_async_shared()
        _cta_barrier()
        if UNROLL:
            # three stages in separate allocations and the loop unrolled by three, every step
            # unconditional (a wgmma under a branch makes ptxas serialize them all): the barrier
            # analysis then sees which stage each step writes and adds no barrier of its own.
            # Steps past the range decode masked (zero) words against zero x and add +0.0.
            xb = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], XSL)
            xc = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], XSL)
            for t in range(t_begin, t_end, 3):
                acc, w0, q0, w1, q1, xr = _step(acc, w0, q0, w1, q1, xr, xs.index(0), xb, x_ptr, rec_ptr, tile_row,
                                                t, t_end, off_v, off_n, rows, kx, M_rows, stride_xm,
                                                BLOCK_N, BLOCK_M, QPASS, L_VIEW, A_OP)
                acc, w0, q0, w1, q1, xr = _step(acc, w0, q0, w1, q1, xr, xb, xc, x_ptr, rec_ptr, tile_row,
                                                t + 1, t_end, off_v, off_n, rows, kx, M_rows, stride_xm,
                                                BLOCK_N, BLOCK_M, QPASS, L_VIEW, A_OP)
                acc, w0, q0, w1, q1, xr = _step(acc, w0, q0, w1, q1, xr, xc, xs.index(0), x_ptr, rec_ptr, tile_row,
                                                t + 2, t_end, off_v, off_n, rows, kx, M_rows, stride_xm,
                                                BLOCK_N, BLOCK_M, QPASS, L_VIEW, A_OP)
        else:
            for t in range(t_begin, t_end):
                it = t - t_begin
                wx, qx = M._load_rec(rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end, off_v, off_n, QPASS)
                xn = _x_load(x_ptr, rows, kx, t + 2, t + 2 < t_end, M_rows, stride_xm)
                a = M._a_operand(w0, q0, L_VIEW, A_OP, BLOCK_N, QPASS, False)
                tok = warpgroup_mma(a, xs.index(it % 3).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[tok])      # retired: its A registers are reused next
                _x_store(xs.index((it + 1) % 3), xr, BLOCK_M)  # last read by wgmma t - 2
                xr = xn
                fence_async_shared()
                _cta_barrier()                                # the record's CTA barrier
                if DEPTH == 1:
                    w0, q0 = wx, qx
                elif DEPTH == 2:
                    w0, q0 = w1, q1
                    w1, q1 = wx, qx
                else:
                    w0, q0 = w1, q1
                    w1, q1 = w2, q2
                    w2, q2 = wx, qx
        acc = warpgroup_mma_wait(0, deps=[acc])
        M._epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                    n0, pid_n, pid_k, pid_m, M_rows, N, NUM_N_BLOCKS, SPLIT_K, SPLIT_K, stride_xm, stride_ym,
                    BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, ACC, L_EP)


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Gluon with its Hopper module, bf16 rows on a CUDA device of compute capability 9.x (wgmma)."""
    return (AVAILABLE and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and packed.rec32.is_cuda
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def default_config(m: int, n: int, k: int, sms: int = 132) -> WgmmaConfig:
    """64-row programs, two records ahead, and
    split-K for about four programs per SM."""
    kt = (k + TILE_K - 1) // TILE_K
    blocks = (n + 63) // 64 * ((m + block_m_for(m) - 1) // block_m_for(m))
    return WgmmaConfig(64, max(1, min(kt, round(4 * sms / blocks))), 4, 2)


def w12_wgmma(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: WgmmaConfig | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` bf16 (any M; 64 rows per program), fp32 accumulation,
    deterministic; needs a Hopper GPU (:func:`supported`)."""
    if not AVAILABLE or triton is None:
        raise RuntimeError("Gluon with the Hopper wgmma module (triton >= 3.4) is not available")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    m, k = x.shape
    n = packed.shape[0]
    kt = packed.k_tiles
    cfg = config or default_config(m, n, k)
    check_config(cfg)
    x, k = M.aligned_x(x, kt)
    bm, tps, split, nb, mb, ws, locks = M.split_grid(m, n, kt, cfg.block_n, cfg.split_k, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    esc_ch = M.esc_chunk(bm)
    l_view, l_nib, acc, a_op, l_ep, l_xp, xsl = layouts(cfg.block_n, bm, cfg.num_warps)
    _w12_wgmma_kernel[(nb, split, mb)](
        x, out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, USE_SPLIT=split > 1, QPASS=qpass, ESC_CH=esc_ch, DEPTH=cfg.depth,
        UNROLL=cfg.unroll,
        L_VIEW=l_view, L_NIB=l_nib, ACC=acc, A_OP=a_op, L_EP=l_ep, L_XP=l_xp, XSL=xsl,
        num_warps=cfg.num_warps,
    )
    return out
