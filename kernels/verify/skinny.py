"""Skinny bf16 GEMM ``y = x @ W.T`` for steps of 2..64 rows: split-K on the tensor cores with a
fixed-order reduction, where the measured table says it beats cuBLAS (:mod:`.blas` routes).

cuBLAS picks tiles for GEMMs whose rows fill an MMA; a verify or batched step's 2..64 rows do not,
and its kernels stream the weights below the bandwidth the one-row GEMV reaches. Here a program
owns ``BLOCK_N`` weight rows and a contiguous range of ``BLOCK_K``-column tiles: each iteration
loads one ``[BLOCK_N, BLOCK_K]`` weight tile and the step's ``[MP, BLOCK_K]`` x tile (``MP``: the
rows padded to a power of two >= 16, rows past M read as zero) and accumulates
``W_tile @ x_tile.T`` in fp32, weights on the MMA's long side. With ``split > 1`` the programs of
an output block write fp32 partial tiles to a workspace (:mod:`specpilot.kernels.workspace`) and
the last of them (a counter) sums them in a fixed order (the W12 kernels' ``sum_splits``):
results are bitwise identical run to run.
Under programmatic dependent launch a program loads its first weight tile before it waits for
the previous kernel. The plain reference is :func:`.naive.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels import workspace
from specpilot.kernels.triton_env import interpreting, pdl_args, tl, triton
from specpilot.kernels.verify import common
from specpilot.kernels.w12.common import split_chunk, sum_splits

MAX_ROWS = 64

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _mma(acc, w, x, UPCAST: tl.constexpr):
        """``acc + w @ x.T`` in fp32. ``UPCAST``: both operands as fp32, IEEE products - under the
        interpreter (its bf16 ``tl.dot`` is wrong; fp32 holds bf16 products exactly) and for fp32
        weights (no TF32)."""
        if UPCAST:
            return acc + tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(x), acc)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, TILES, SPLIT, stride_x, stride_w, stride_y,
                       MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_SPLIT: tl.constexpr,
                       SPLIT_CHUNK: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
        # row tiles (one unless a caller fixes MP below the rows) vary fastest: the tiles of one
        # weight block run together and read it once from memory, the others from L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * MP + tl.arange(0, MP)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        mmask = rm < M
        k0 = pid_k * TILES * BLOCK_K
        w_base = w_ptr + rn[:, None].to(tl.int64) * stride_w
        x_base = x_ptr + rm[:, None] * stride_x
        # the first weight tile: weights are constant, so under PDL it is read before the wait,
        # while the previous kernel drains
        w = tl.load(w_base + (k0 + rk)[None, :], mask=nmask[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        x = tl.load(x_base + (k0 + rk)[None, :], mask=mmask[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        acc = _mma(tl.zeros((BLOCK_N, MP), dtype=tl.float32), w, x, UPCAST)
        for i in tl.range(1, TILES, num_stages=STAGES):
            kk = k0 + i * BLOCK_K + rk
            kmask = kk < K
            w = tl.load(w_base + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_base + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc = _mma(acc, w, x, UPCAST)
        out = y_ptr + rm[None, :] * stride_y + rn[:, None]
        omask = nmask[:, None] & mmask[None, :]
        if not USE_SPLIT:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            tile = tl.arange(0, BLOCK_N)[:, None] * MP + tl.arange(0, MP)[None, :]
            block = pid_n * tl.num_programs(0) + pid_m
            blk = ws_ptr + block.to(tl.int64) * (SPLIT * BLOCK_N * MP)
            tl.store(blk + pid_k * (BLOCK_N * MP) + tile, acc, cache_modifier=".cg")
            if tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel") == SPLIT - 1:
                total = sum_splits(blk, tile, SPLIT, BLOCK_N, MP, SPLIT_CHUNK)
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=omask)
                tl.store(cnt_ptr + block, 0)


# the tile every routed config takes (the sweep, lab/verify/skinny.py, also tried 128 weight rows,
# 256 columns and 8 warps: no layer's winner used them)
BLOCK_N = 64
BLOCK_K = 128
WARPS = 4


@dataclass(frozen=True)
class SkinnyConfig:
    """``split`` programs along K per output block (1: no workspace), ``stages`` (software
    pipelining depth of the loads); tiles of ``BLOCK_N`` weight rows x ``BLOCK_K`` columns."""

    split: int = 1
    stages: int = 4

    def key(self) -> str:
        return f"s{self.split}-st{self.stages}"


def row_tile(rows: int) -> int:
    """Rows a tile covers (``tl.dot`` needs at least 16): the next power of two >= ``rows``."""
    return max(16, 1 << (rows - 1).bit_length())


def skinny_linear(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig = SkinnyConfig()) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (1 <= M <= 64, contiguous in K) and w [N, K] contiguous, bf16 or fp16."""
    check_operands(x, w)
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the skinny GEMM takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the skinny GEMM takes bf16 or fp16 operands, got {x.dtype}")
    return launch(x, w, row_tile(x.shape[0]), cfg.split, cfg.stages)


def check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError("x and w must be contiguous in K and of one dtype")


def launch(x: torch.Tensor, w: torch.Tensor, mp: int, split: int, stages: int) -> torch.Tensor:
    """``x @ w.T`` in row tiles of ``mp`` rows (a power of two >= 16; ceil(M / mp) tiles, each its own
    programs), ``split`` programs along K per output block (fewer where K has fewer tiles)."""
    M, K = x.shape
    N = w.shape[0]
    kt = triton.cdiv(K, BLOCK_K)
    tiles = triton.cdiv(kt, max(1, min(split, kt)))
    split = triton.cdiv(kt, tiles)          # no program without a tile
    nb = triton.cdiv(N, BLOCK_N)
    mt = triton.cdiv(M, mp)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if split > 1:
        ws = workspace.scratch(x.device, "skinny.partials", mt * nb * split * BLOCK_N * mp)
        cnt = workspace.counters(x.device, "skinny.blocks", mt * nb)
    else:
        ws = cnt = y
    _skinny_kernel[(mt, nb, split)](x, w, y, ws, cnt, M, N, K, tiles, split, x.stride(0), w.stride(0), y.stride(0),
                                    MP=mp, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, USE_SPLIT=split > 1,
                                    SPLIT_CHUNK=split_chunk(split, BLOCK_N * mp), STAGES=stages,
                                    UPCAST=interpreting() or x.dtype == torch.float32, num_warps=WARPS,
                                    **pdl_args(common.USE_PDL, x))
    return y
