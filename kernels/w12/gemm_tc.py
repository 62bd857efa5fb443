"""W12 GEMM on tensor cores for verify-sized row counts (M = 8..64): decode written as elementwise ops.

The general kernel (:mod:`.gemm`) decodes four bf16 pairs per 8 weights and then has to *join and
reshape* them into a dot operand, which Triton lowers to shuffles through shared memory on every
step. Here every decoded weight is an elementwise function of one byte of the 8-bit view and one
byte of the nibble plane, indexed directly in the dot's ``[BLOCK_K, BLOCK_N]`` B-operand shape:

* view byte of weight ``k`` of a row: ``64 * row + 8 * (k // 8) + 4 * (k % 8 // 4) + (0, 2, 1, 3)[k % 4]``
  (the in-word order of :mod:`.format`);
* its low nibble: byte ``8192 + 32 * row + 4 * (k // 8) + 2 * (k % 2) + (k % 8 // 4)``, shift
  ``4 * (k % 4 // 2)``;
* ``bf16 = (b & 0x80) << 8 | (b & 0x7F) << 4 | 0x3800 | nibble`` (``w * 2**(112 - L_n)``).

Because the chain from the loads to ``tl.dot`` is elementwise, Triton can pipeline the byte loads
(``num_stages``) and decode in the operand layout, the way mixed-precision (int4/int8 weight)
GEMMs are written in Triton. The epilogue (row scale, exact escape corrections, fixed-order
split-K) is the general kernel's, so results are bitwise identical run to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import TILE_K, TILE_N
from .gemm import KernelPack, _workspace, interpreting, tl, triton

if triton is not None:
    from .gemm import _finalize

    @triton.jit
    def _decode_tile(rec_ptr, rec, rr, ss, QPASS: tl.constexpr):
        """[BLOCK_K, BLOCK_N] bf16 tile of record ``rec`` (int64 per k), rows ``rr``, k in *storage*
        order ``ss`` (byte ``s`` of a row's 8-bit view), so the view loads are contiguous."""
        base = rec * 12288
        b = tl.load(rec_ptr + base[:, None] + rr[None, :] * 64 + ss[:, None]).to(tl.int32)
        if QPASS:
            nib = 8
        else:
            q = ss % 8        # view byte q of a group holds the weight whose nibble is byte NB[q]
            nb = 8192 + (ss // 8) * 4 + (q // 2 % 2) * 2 + (q // 4)
            n8 = tl.load(rec_ptr + base[:, None] + rr[None, :] * 32 + nb[:, None]).to(tl.int32)
            nib = (n8 >> (4 * (q % 2))[:, None]) & 15
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4) | 0x3800 | nib
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _w12_tc_kernel(
        x_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_ym,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_SPLIT: tl.constexpr, QPASS: tl.constexpr, UPCAST: tl.constexpr, ESC_CH: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        n0 = pid_n * BLOCK_N
        rr = (n0 % 128) + tl.arange(0, BLOCK_N)
        tile_row = (n0 // 128).to(tl.int64) * KT
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        kk = tl.arange(0, BLOCK_K)
        RECS: tl.constexpr = BLOCK_K // 64
        t_begin = pid_k * TILES_PER_SPLIT
        t_end = tl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t_begin, t_end, RECS):
            rec = tile_row + t + kk // 64
            w = _decode_tile(rec_ptr, rec, rr, kk % 64, QPASS)
            # natural k of storage byte s: group 8 * (s // 8), in-group (0, 2, 1, 3, 4, 6, 5, 7)[s % 8]
            sq = kk % 8
            kg = t * 64 + (kk // 8) * 8 + (sq // 4) * 4 + (sq % 4 % 2) * 2 + (sq % 4 // 2)
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kg[None, :],
                         mask=m_mask[:, None] & (kg < K)[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter's bf16 dot is wrong: check the same math in fp32
                acc += tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(xt.to(tl.bfloat16), w, acc)
        out = tl.trans(acc)                                  # [BLOCK_N, BLOCK_M] for the epilogue
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if not USE_SPLIT:
            _finalize(out, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                      offs_n, offs_m, n0, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH)
        else:
            blk = pid_m * NUM_N_BLOCKS + pid_n
            ws_base = ws_ptr + blk.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
            tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            tl.store(ws_base + pid_k * (BLOCK_N * BLOCK_M) + tile_offs, out)
            tl.debug_barrier()
            count = tl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(SPLIT_K):   # fixed order: bitwise identical results
                    total += tl.load(ws_base + s * (BLOCK_N * BLOCK_M) + tile_offs, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + blk, 0)
                _finalize(total, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
                          offs_n, offs_m, n0, M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH)


@dataclass(frozen=True)
class TcConfig:
    """``block_n`` rows per program (divides 128), ``block_k`` 64 or 128, pipelined ``num_stages``."""

    block_n: int = 128
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def key(self) -> str:
        return f"tc-n{self.block_n}-k{self.block_k}-s{self.split_k}-w{self.num_warps}-st{self.num_stages}"


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_config(m: int, n: int, k: int, sms: int = 132) -> TcConfig:
    tuned = TUNED.get((n, k, block_m_for(m)))
    if tuned is not None:
        return tuned
    kt = (k + TILE_K - 1) // TILE_K
    bn = 128 if n >= 16384 else 64
    blocks = (n + bn - 1) // bn * ((m + block_m_for(m) - 1) // block_m_for(m))
    split = max(1, min(kt, round(2 * sms / blocks)))
    return TcConfig(bn, 64, split)


# Fastest config per (N, K, BLOCK_M) on the H200 (benchmarks/w12_gemm.py --mode tc).
TUNED: dict[tuple[int, int, int], TcConfig] = {}


def w12_linear_tc(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: TcConfig | None = None,
                  out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` bf16 on tensor cores (M up to 64 per program row block)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    cfg = config or default_config(m, n, k)
    if TILE_N % cfg.block_n or cfg.block_k not in (64, 128):
        raise ValueError(f"bad config {cfg}")
    bm = block_m_for(m)
    kt = packed.k_tiles
    recs = cfg.block_k // TILE_K
    if kt % recs:
        cfg = TcConfig(cfg.block_n, 64, cfg.split_k, cfg.num_warps, cfg.num_stages)
        recs = 1
    tps = (kt + cfg.split_k - 1) // cfg.split_k
    tps = (tps + recs - 1) // recs * recs
    split = (kt + tps - 1) // tps
    nb = (n + cfg.block_n - 1) // cfg.block_n
    mb = (m + bm - 1) // bm
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    ws, locks = _workspace(x.device, nb * mb * split * cfg.block_n * bm if split > 1 else 1, nb * mb)
    esc_ch = max(1, min(16, 4096 // (cfg.block_n * bm)))
    esc_ch = 1 << (esc_ch.bit_length() - 1)
    _w12_tc_kernel[(nb, split, mb)](
        x, out, packed.rec64.view(torch.uint8), packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, BLOCK_K=cfg.block_k, USE_SPLIT=split > 1, QPASS=qpass,
        UPCAST=interpreting(), ESC_CH=esc_ch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
