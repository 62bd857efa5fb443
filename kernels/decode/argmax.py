"""Greedy argmax of rows of logits in two small kernels (the last kernels of a step).

torch's ``argmax`` of a 128256-wide bf16 row is one reduction kernel of 36 us on the H200 (one
block walks the row). Here ``_argmax_chunks`` gives each of ``P`` programs per row a slice and
keeps the slice's maximum and its first index; ``_argmax_merge`` picks the row's best slice, first
on ties. The
result is ``torch.argmax``'s: the lowest index of the maximum, and a NaN counts as above every
number (the first NaN wins). The plain reference is ``torch.argmax`` itself.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_env import tl, triton

CHUNK = 1024   # logits per program

if triton is not None:

    @triton.jit
    def _argmax_chunks(x_ptr, val_ptr, idx_ptr, nan_ptr, V, stride_x, CHUNK: tl.constexpr):
        row = tl.program_id(1)
        pid = row * tl.num_programs(0) + tl.program_id(0)
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
        isnan = (x != x) & ok
        big = V + CHUNK
        first_nan = tl.min(tl.where(isnan, offs, big), axis=0)
        xs = tl.where(isnan, float("-inf"), x)
        m = tl.max(xs, axis=0)
        first = tl.min(tl.where((xs == m) & ok, offs, big), axis=0)
        tl.store(val_ptr + pid, m)
        tl.store(idx_ptr + pid, tl.where(first_nan < big, first_nan, first))
        tl.store(nan_ptr + pid, (first_nan < big).to(tl.int32))

    @triton.jit
    def _argmax_merge(val_ptr, idx_ptr, nan_ptr, out_ptr, P, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        p = tl.arange(0, BLOCK)
        ok = p < P
        v = tl.load(val_ptr + row * P + p, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + row * P + p, mask=ok, other=0)
        n = tl.load(nan_ptr + row * P + p, mask=ok, other=0)
        big = 2147483647
        first_nan = tl.min(tl.where(n != 0, i, big), axis=0)
        m = tl.max(v, axis=0)
        # slices are disjoint and in index order: the lowest index among slices holding the max;
        # an all -inf row (every slice's max -inf) still gives index 0, as torch does
        first = tl.min(tl.where((v == m) & ok, i, big), axis=0)
        tl.store(out_ptr + row, tl.where(first_nan < big, first_nan, first).to(tl.int64))


def argmax_row(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of one row ``[1, V]`` (any float dtype): an int64 tensor ``[1]``."""
    if logits.dim() != 2 or logits.shape[0] != 1 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_row takes one contiguous row [1, V], got {tuple(logits.shape)}")
    return argmax_rows(logits)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of rows ``[T, V]`` (any float dtype, contiguous in V): int64 ``[T]``."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows takes rows [T, V] contiguous in V, got {tuple(logits.shape)}")
    T, V = logits.shape
    if V == 0:
        raise ValueError("argmax of an empty row")
    P = triton.cdiv(V, CHUNK)
    dev = logits.device
    val = torch.empty(T, P, dtype=torch.float32, device=dev)
    idx = torch.empty(T, P, dtype=torch.int32, device=dev)
    nan = torch.empty(T, P, dtype=torch.int32, device=dev)
    out = torch.empty(T, dtype=torch.int64, device=dev)
    if T == 0:
        return out
    _argmax_chunks[(P, T)](logits, val, idx, nan, V, logits.stride(0), CHUNK=CHUNK, num_warps=4)
    _argmax_merge[(T,)](val, idx, nan, out, P, BLOCK=max(16, triton.next_power_of_2(P)), num_warps=4)
    return out
