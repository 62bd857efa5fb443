"""The FP8 Q pass's row kernels: a step's rows split into e4m3 high and low parts
(:func:`quantize_rows`) and split rows recombined (:func:`combine_rows`), one program per row (per
row and column block for the recombination), launched with programmatic dependent launch like the
verify step's row kernels. ``quant_hilo`` and ``load_split`` are the same arithmetic for the row
kernels of :mod:`specpilot.kernels.verify.rows` that take or give split rows in passing. Their
arithmetic is :mod:`.naive`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.triton_env import pdl_args, tl, triton
from specpilot.kernels.verify import common

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pow2(amax):
        """(scale, inverse) ``2^(floor(log2 amax) - 7)`` of a float32 scalar, exact; 1 below 2^-119."""
        e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        ok = e >= 8
        s = tl.where(ok, (e - 7) << 23, 127 << 23).to(tl.float32, bitcast=True)
        inv = tl.where(ok, (261 - e) << 23, 127 << 23).to(tl.float32, bitcast=True)
        return s, inv

    @triton.jit
    def round_e4m3(v):
        """float32 ``v`` (|v| <= 256) rounded to nearest even e4m3 value, still float32: its quantum
        ``2^(max(e, -6) - 3)`` from the exponent bits, the rounding by the 1.5 * 2^23 addition. The
        conversion that follows is then exact (Triton's interpreter rounds a carry into the next
        binade wrongly: 127.9 became 64)."""
        vb = v.to(tl.int32, bitcast=True)
        a = vb & 0x7FFFFFFF
        eq = tl.maximum(a >> 23, 121) - 3
        q = (eq << 23).to(tl.float32, bitcast=True)
        iq = ((254 - eq) << 23).to(tl.float32, bitcast=True)
        r = ((v * iq + 12582912.0) - 12582912.0) * q
        return (r.to(tl.int32, bitcast=True) | (vb ^ a)).to(tl.float32, bitcast=True)   # -0 for what rounds away

    @triton.jit
    def quant_hilo(yf, k, K, q_ptr, qs_ptr, t, T, stride_q):
        """Row ``t``'s float32 values ``yf`` (zero past K) into split rows: its high part at row t of
        ``q``, what that missed at row T + t, their scales at ``qs[t]`` and ``qs[T + t]``."""
        s_hi, inv_hi = pow2(tl.max(tl.abs(yf), axis=0))
        hi = round_e4m3(yf * inv_hi)
        r = yf - hi * s_hi
        s_lo, inv_lo = pow2(tl.max(tl.abs(r), axis=0))
        tl.store(q_ptr + t * stride_q + k, hi.to(tl.float8e4nv), mask=k < K)
        tl.store(q_ptr + (T + t) * stride_q + k, round_e4m3(r * inv_lo).to(tl.float8e4nv), mask=k < K)
        tl.store(qs_ptr + t, s_hi)
        tl.store(qs_ptr + T + t, s_lo)

    @triton.jit
    def load_split(y_ptr, ys_ptr, t, T, stride_y, offs, mask, dt: tl.constexpr):
        """Row ``t`` of split rows at columns ``offs``: ``y[t] s[t] + y[T+t] s[T+t]`` in float32,
        rounded to ``dt``."""
        a = tl.load(y_ptr + t * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(y_ptr + (T + t) * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        return (a * tl.load(ys_ptr + t) + b * tl.load(ys_ptr + T + t)).to(dt)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, qs_ptr, K, T, stride_x, stride_q, XP: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        k = tl.arange(0, XP)
        xf = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        quant_hilo(xf, k, K, q_ptr, qs_ptr, t, T, stride_q)

    @triton.jit
    def _dequant_split_kernel(y_ptr, ys_ptr, o_ptr, N, T, stride_y, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        v = load_split(y_ptr, ys_ptr, t, T, stride_y, c, c < N, o_ptr.dtype.element_ty)
        tl.store(o_ptr + t * stride_o + c, v, mask=c < N)


@dataclass
class SplitRows:
    """A step's M rows held as 2M rows and their float32 scales: row m is
    ``data[m] * scale[m] + data[M + m] * scale[M + m]`` (``data`` e4m3 going into an FP8 GEMM,
    bf16 coming out of one); ``dtype``: the rows' own (the model's), what they recombine to."""

    data: torch.Tensor    # [2M, K]
    scale: torch.Tensor   # [2M] float32
    dtype: torch.dtype = torch.bfloat16

    @property
    def rows(self) -> int:
        return self.data.shape[0] // 2

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.data.shape[1])

    def dense(self) -> torch.Tensor:
        """The rows [M, K] in their dtype (:func:`combine_rows`)."""
        return combine_rows(self)


def _rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rows [T, K] contiguous in K expected, got {tuple(x.shape)}")


def quantize_rows(x: torch.Tensor) -> SplitRows:
    """Rows ``x`` [M, K] as split e4m3 rows (high part, then what it missed; a power-of-two scale
    per row and part)."""
    _rows(x)
    T, K = x.shape
    q = torch.empty(2 * T, K, dtype=torch.float8_e4m3fn, device=x.device)
    qs = torch.empty(2 * T, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(T,)](x, q, qs, K, T, x.stride(0), q.stride(0), XP=triton.next_power_of_2(K),
                                num_warps=4 if K <= 4096 else 8, **pdl_args(common.USE_PDL, x))
    return SplitRows(q, qs, x.dtype)


def combine_rows(y: SplitRows) -> torch.Tensor:
    """Split rows back to [M, N] in their dtype."""
    _rows(y.data)
    T, N = y.shape
    out = torch.empty(T, N, dtype=y.dtype, device=y.data.device)
    block = 1024
    _dequant_split_kernel[(T, triton.cdiv(N, block))](y.data, y.scale, out, N, T, y.data.stride(0), out.stride(0),
                                                      BLOCK=block, num_warps=4, **pdl_args(common.USE_PDL, out))
    return out
