"""W12 products of many rows (prompt prefill): restore the bf16 weight, then cuBLAS.

The W12 kernels read each record once per block of at most 64 x rows, so a 1000-row prefill reads
the records 16 times and runs far below cuBLAS at those sizes, where a product is bound by its
FLOPs, not by the weight's bytes. Above the route table's row bound the weight is instead restored
into a per-device scratch buffer (12 bits read and 16 written per weight, at about the HBM's
bandwidth) and multiplied by ``F.linear``. The restore is exact (the
original bf16 bits, escapes included), so the product is the dense engine's bit for bit.

* :func:`restore` decodes the records into ``[N, K]`` bf16: one program per 128-row tile and
  record, the decode of :func:`.common.decode_pairs` with the pairs joined in natural k order, the
  row scale ``2**(L_n - 112)`` applied in fp32 (exact), then a second launch writes every escape's
  exact bits over its slot;
* :func:`w12_restore_linear` is the routed launcher (``w12_linear``'s signature).

The plain reference is :func:`.format.decode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import workspace
from ..triton_env import tl, triton
from .common import decode_pairs, hi_bf16, lo_bf16
from .pack import KernelPack

RECORD_ROWS = 128   # one program per record: 12 KB read, 16 KB written
ESC_BLOCK = 1024    # escapes per program of the scatter


@dataclass(frozen=True)
class RestoreConfig:
    """No knobs: one program per record and 1024 escapes per scatter program."""


if triton is not None:

    @triton.jit
    def _restore_kernel(rec64_ptr, rec32_ptr, low_ptr, w_ptr, N, K, KT, stride_w,
                        QPASS: tl.constexpr, ROWS: tl.constexpr):
        tn = tl.program_id(0)
        t = tl.program_id(1)
        r = tl.arange(0, ROWS)
        jj = tl.arange(0, 8)                                  # 8-weight groups of the record's 64 k
        rec = tn.to(tl.int64) * KT + t
        b64 = tl.load(rec64_ptr + rec * 1536 + r[:, None] * 8 + jj[None, :])
        if QPASS:
            n32 = b64.to(tl.int32)
        else:
            n32 = tl.load(rec32_ptr + rec * 3072 + 2048 + r[:, None] * 8 + jj[None, :])
        p0, p1, p2, p3 = decode_pairs(b64, n32, QPASS)
        # pair p of a group holds weights 2p, 2p + 1: join as [group, p // 2, p % 2, half] (natural k)
        tt = tl.join(tl.join(p0, p2), tl.join(p1, p3))
        w = tl.reshape(tl.join(lo_bf16(tt), hi_bf16(tt)), (ROWS, 64))
        offs_n = tn * ROWS + r
        offs_k = t * 64 + tl.arange(0, 64)
        n_mask = offs_n < N
        low = tl.load(low_ptr + offs_n, mask=n_mask, other=112).to(tl.int32)
        scale = ((low + (127 - 112)) << 23).to(tl.float32, bitcast=True)
        y = (w.to(tl.float32) * scale[:, None]).to(tl.bfloat16)
        tl.store(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :], y,
                 mask=n_mask[:, None] & (offs_k < K)[None, :])

    @triton.jit
    def _escape_kernel(erow_ptr, ecol_ptr, ew_ptr, w_ptr, nnz, stride_w, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < nnz
        row = tl.load(erow_ptr + i, mask=m, other=0).to(tl.int64)
        col = tl.load(ecol_ptr + i, mask=m, other=0)
        tl.store(w_ptr + row * stride_w + col, tl.load(ew_ptr + i, mask=m), mask=m)


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """bf16 rows on a CUDA device, and a pack that carries its escapes' exact bits (``esc_w``)."""
    return (triton is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
            and packed.esc_w is not None and packed.rec64.is_cuda)


def tuned_config(m: int, n: int, k: int, device=None) -> None:
    """No table entries: the kernel has no knobs."""
    return None


def restore(packed: KernelPack, qpass: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``[N, K]`` in bf16, bit for bit the original (``qpass``: the 8-bit view, escapes
    exact as in the Q pass); into ``out`` (``[N, K]`` bf16, rows contiguous) when given."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if packed.esc_w is None:
        raise ValueError("restore needs the escapes' exact bits (KernelPack.esc_w)")
    n, k = packed.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16, device=packed.rec64.device)
    if out.shape != (n, k) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"restore: out must be [{n}, {k}] bf16 with contiguous rows, got {tuple(out.shape)}")
    kt = packed.k_tiles
    _restore_kernel[((n + RECORD_ROWS - 1) // RECORD_ROWS, kt)](
        packed.rec64, packed.rec32, packed.low_exp, out, n, k, kt, out.stride(0),
        QPASS=qpass, ROWS=RECORD_ROWS, num_warps=4)
    nnz = packed.esc_w.numel()
    if nnz:
        _escape_kernel[((nnz + ESC_BLOCK - 1) // ESC_BLOCK,)](
            packed.esc_row, packed.esc_col, packed.esc_w, out, nnz, out.stride(0), BLOCK=ESC_BLOCK, num_warps=4)
    return out


def w12_restore_linear(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: RestoreConfig | None = None,
                       out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` bf16: W restored into a shared scratch buffer, then cuBLAS."""
    if not supported(x, packed):
        raise ValueError("w12_restore_linear needs bf16 rows on a CUDA GPU and a pack with esc_w")
    n, k = packed.shape
    buf = workspace.scratch(x.device, "w12.restored", (n * k + 1) // 2)   # float32 words: bf16 pairs
    w = restore(packed, qpass, buf.view(torch.bfloat16)[: n * k].view(n, k))
    if out is None:
        y = torch.nn.functional.linear(x, w)
        return y if out_dtype in (None, y.dtype) else y.to(out_dtype)
    if out.dtype == x.dtype:
        return torch.mm(x, w.t(), out=out)
    out.copy_(torch.nn.functional.linear(x, w))
    return out
