"""Unrouted: a dense layer's projections for a verify step of 2..64 rows on tensor cores, fused as
the one-row chain is (``tl.dot``; the engine's multi-row step runs cuBLAS GEMMs with one fused
kernel between two GEMMs instead, ``engine/fused_verify.py``).

The one-row decode kernels (``kernels/decode/gemv.py``) stream a weight tile per iteration and
multiply it with one x row on the CUDA cores. Here the same program walks the same weight rows,
but multiplies the tile with the step's rows on the tensor cores: ``acc[2B, MP] += W[2B, BLOCK_K]
@ x[MP, BLOCK_K].T``, the weight rows on the MMA's long side and the step's rows (``MP``: 16, 32
or 64, rows past the step masked to zero) on its short side. The prologue and epilogues are the
one-row chain's: ``NORM`` (gamma applied to each x tile as it is loaded, the rows' sums of squares
accumulated alongside, ``1/RMS`` scaling the accumulator at the end), ``EPI_RESID``, ``EPI_SILU``,
``EPI_ROPE`` (RoPE at each row's position, K/V stored at each row's slot). A program owns ``2B``
weight rows (the one-row kernel's two groups interleaved into one tile). Under programmatic
dependent launch the first weight tile is loaded before ``griddepcontrol.wait``.

Why it is not routed (H200, Llama-3.1-8B layers, bf16, L2 flushed, the best of six configs per row
tile, ``lab/verify/sweep.py``): alone against cuBLAS ``F.linear`` it reached 0.57/0.58/0.32x on the
q/k/v layer at 16/32/64 rows, 0.70/0.76/0.59x on gate/up, 0.96/0.89/0.59x on o and 0.84/0.75/0.54x
on down; the normalising prologue keeps x off the asynchronous copy path. In the engine's step
(CUDA graph, PDL) 32 rows took 7.11 ms against 4.92 ms for the cuBLAS step and 3.93 ms for the AR
step. References: :mod:`lab.verify.naive`; under Triton's interpreter the tile product runs on
fp32 operands (the interpreter's bf16 ``tl.dot`` is wrong), exact for bf16 products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.decode.common import EPI_RESID, EPI_ROPE, EPI_SILU, program_rows
from specpilot.kernels.triton_env import interpreting, pdl_args, tl, triton
from specpilot.kernels.verify import common

MAX_ROWS = 64


def row_tile(rows: int) -> int:
    """Rows a tile covers (``tl.dot`` needs at least 16): the next power of two >= ``rows``."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the multi-row kernels take 1..{MAX_ROWS} rows, got {rows}")
    return max(16, 1 << (rows - 1).bit_length())


@dataclass(frozen=True)
class RowsConfig:
    """``pairs`` B (a program owns 2B weight rows, 2B >= 16), ``block_k`` columns per iteration,
    ``warps``, ``stages`` (software pipelining depth of the loads)."""

    pairs: int = 8
    block_k: int = 256
    warps: int = 4
    stages: int = 3

    def key(self) -> str:
        return f"p{self.pairs}-k{self.block_k}-w{self.warps}-s{self.stages}"


# the sweep's best per row tile (the q/k/v layer's; others were within 10-30 %)
BEST = {16: RowsConfig(16, 256, 4, 3), 32: RowsConfig(32, 128, 8, 3), 64: RowsConfig(32, 128, 8, 2)}


def config_for(epi: str, n: int, k: int, rows: int, device=None) -> RowsConfig:
    return BEST[row_tile(rows)]


def check_config(cfg: RowsConfig, epi: str = "resid", hd: int = 128) -> None:
    for name in ("pairs", "block_k", "warps", "stages"):
        v = getattr(cfg, name)
        if v < 1 or (name != "stages" and v & (v - 1)):
            raise ValueError(f"multi-row GEMM config: {name}={v} must be a positive power of two")
    if cfg.pairs < 8 or cfg.block_k < 16:
        raise ValueError(f"multi-row GEMM config: pairs >= 8 and block_k >= 16 (tensor-core tiles), got {cfg.key()}")
    if epi == "rope" and (hd // 2) % cfg.pairs:
        raise ValueError(f"multi-row GEMM config: pairs={cfg.pairs} must divide head_dim / 2 = {hd // 2}")


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _x_tile(x_ptr, gamma_ptr, m, m_ok, kk, K, stride_x, NORM: tl.constexpr):
        """Rows ``m`` of x at columns ``kk`` ([MP, BLOCK_K], zeros outside), times gamma with
        ``NORM`` (rounded to x's dtype), and the rows' sums of squares of the raw values."""
        km = kk < K
        xv = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & km[None, :], other=0.0)
        xf = xv.to(tl.float32)
        ss = tl.sum(xf * xf, axis=1)
        if NORM:
            g = tl.load(gamma_ptr + kk, mask=km, other=0.0).to(tl.float32)
            xv = (xf * g[None, :]).to(x_ptr.dtype.element_ty)
        return xv, ss

    @triton.jit
    def _mma(w, x, acc, IEEE: tl.constexpr, UP: tl.constexpr):
        """``acc + w @ x.T`` (w [2B, BLOCK_K], x [MP, BLOCK_K]) in fp32."""
        if UP:
            return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        elif IEEE:
            return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(x), acc)

    @triton.jit(do_not_specialize=["M"])   # one compiled kernel per row tile, whatever the rows
    def _rows_kernel(x_ptr, gamma_ptr, w_ptr, y_ptr, res_ptr,
                     cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                     M, K, stride_x, stride_w, stride_y, stride_r, eps, INTER, NH, NKV,
                     stride_ch, stride_cs, stride_dh, stride_ds, stride_rot,
                     NORM: tl.constexpr, EPI: tl.constexpr, HD: tl.constexpr, B: tl.constexpr,
                     MP: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     IEEE: tl.constexpr, UP: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        m = tl.arange(0, MP)
        m_ok = m < M
        rows_a, rows_b, p, d, head = program_rows(pid, INTER, EPI, HD, B)
        rows = tl.reshape(tl.join(rows_a, rows_b), [2 * B])     # a0, b0, a1, b1, ...
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :]

        # the first weight tile: constant, so under PDL it is read before the wait
        w = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()     # x, the residual and the caches of the previous kernel are visible from here

        xt, ss = _x_tile(x_ptr, gamma_ptr, m, m_ok, offs_k, K, stride_x, NORM)
        acc = _mma(w, xt, tl.zeros([2 * B, MP], tl.float32), IEEE, UP)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            w = tl.load(w_ptrs + k0, mask=((k0 + offs_k) < K)[None, :], other=0.0)
            xt, s2 = _x_tile(x_ptr, gamma_ptr, m, m_ok, k0 + offs_k, K, stride_x, NORM)
            ss += s2
            acc = _mma(w, xt, acc, IEEE, UP)
        if NORM:
            acc = acc * tl.math.rsqrt(ss / K + eps)[None, :]
        ya, yb = tl.split(tl.permute(tl.reshape(acc, [B, 2, MP]), (0, 2, 1)))   # [B, MP] each

        dt = y_ptr.dtype.element_ty
        ya = ya.to(dt)
        yb = yb.to(dt)
        ok = m_ok[None, :]
        if EPI == 1:
            ra = tl.load(res_ptr + m[None, :] * stride_r + rows_a[:, None], mask=ok, other=0.0).to(tl.float32)
            rb = tl.load(res_ptr + m[None, :] * stride_r + rows_b[:, None], mask=ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + m[None, :] * stride_y + rows_a[:, None], (ra + ya.to(tl.float32)).to(dt), mask=ok)
            tl.store(y_ptr + m[None, :] * stride_y + rows_b[:, None], (rb + yb.to(tl.float32)).to(dt), mask=ok)
        elif EPI == 2:
            gf = ya.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(dt)
            tl.store(y_ptr + m[None, :] * stride_y + p[:, None], (s.to(tl.float32) * yb.to(tl.float32)).to(dt),
                     mask=ok)
        else:
            HALF: tl.constexpr = HD // 2
            pos = tl.load(pos_ptr + m, mask=m_ok, other=0)
            slot = tl.load(slot_ptr + m, mask=m_ok, other=0)
            tab = pos[None, :] * stride_rot + d[:, None]
            c1 = tl.load(cos_ptr + tab, mask=ok, other=0.0).to(dt).to(tl.float32)
            c2 = tl.load(cos_ptr + tab + HALF, mask=ok, other=0.0).to(dt).to(tl.float32)
            s1 = tl.load(sin_ptr + tab, mask=ok, other=0.0).to(dt).to(tl.float32)
            s2 = tl.load(sin_ptr + tab + HALF, mask=ok, other=0.0).to(dt).to(tl.float32)
            a = ya.to(tl.float32)
            b = yb.to(tl.float32)
            # rotate-half: [a, b] -> [a c - b s, b c + a s], each product rounded as the layer does
            ra = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
            rb = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
            is_q = (rows_a < NH * HD)[:, None] & ok
            is_k = ((rows_a >= NH * HD) & (rows_a < (NH + NKV) * HD))[:, None] & ok
            is_v = (rows_a >= (NH + NKV) * HD)[:, None] & ok
            tl.store(y_ptr + m[None, :] * stride_y + rows_a[:, None], ra, mask=is_q)
            tl.store(y_ptr + m[None, :] * stride_y + rows_b[:, None], rb, mask=is_q)
            kbase = kc_ptr + (head - NH) * stride_ch + slot[None, :] * stride_cs
            tl.store(kbase + d[:, None], ra, mask=is_k)
            tl.store(kbase + d[:, None] + HALF, rb, mask=is_k)
            vbase = vc_ptr + (head - NH - NKV) * stride_dh + slot[None, :] * stride_ds
            tl.store(vbase + d[:, None], ya, mask=is_v)
            tl.store(vbase + d[:, None] + HALF, yb, mask=is_v)


def _check(x: torch.Tensor, w: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: 1..{MAX_ROWS} rows contiguous in K expected, got {tuple(x.shape)}")
    if w.dim() != 2 or w.stride(-1) != 1 or w.dtype != x.dtype or w.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[1]}], contiguous in K and of x's dtype ({x.dtype}), got "
                         f"{tuple(w.shape)} {w.dtype}")


def _launch(grid, x, gamma, w, y, res, eps, epi, norm, cfg: RowsConfig, inter=0, nh=0, nkv=0, hd=16,
            cos=None, sin=None, pos=None, slots=None, k_cache=None, v_cache=None):
    M, K = x.shape
    t = [z if z is not None else x for z in (res, cos, sin, pos, slots, k_cache, v_cache)]
    cs = k_cache.stride() if k_cache is not None else (0, 0, 0)
    vs = v_cache.stride() if v_cache is not None else (0, 0, 0)
    _rows_kernel[grid](
        x, gamma if gamma is not None else x, w, y, *t,
        M, K, x.stride(0), w.stride(0), y.stride(0), res.stride(0) if res is not None else 0, float(eps),
        inter, nh, nkv, cs[0], cs[1], vs[0], vs[1], cos.stride(0) if cos is not None else 0,
        NORM=norm, EPI=epi, HD=hd, B=cfg.pairs, MP=row_tile(M), BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        IEEE=x.dtype == torch.float32, UP=interpreting(), num_warps=cfg.warps, **pdl_args(common.USE_PDL, x))


def gemm_residual(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, cfg: RowsConfig | None = None) -> torch.Tensor:
    """``res + x @ w.T`` for rows x [T, K] (T <= 64) and w [N, K]; ``N`` a multiple of ``2 * pairs``."""
    _check(x, w)
    N, K = w.shape
    cfg = cfg or config_for("resid", N, K, x.shape[0], x.device)
    check_config(cfg)
    if res.shape != (x.shape[0], N) or res.stride(-1) != 1:
        raise ValueError(f"res must be [{x.shape[0]}, {N}] contiguous in N, got {tuple(res.shape)}")
    if N % (2 * cfg.pairs):
        raise ValueError(f"N={N} is not a multiple of {2 * cfg.pairs} rows per program")
    y = torch.empty_like(res)
    _launch((N // (2 * cfg.pairs),), x, None, w, y, res, 0.0, EPI_RESID, False, cfg)
    return y


def norm_gate_up_silu(x: torch.Tensor, gamma: torch.Tensor, eps: float, w13: torch.Tensor, inter: int,
                      cfg: RowsConfig | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of the normalised rows' gate/up projection (gate rows first): [T, inter]."""
    _check(x, w13)
    N, K = w13.shape
    cfg = cfg or config_for("silu", N, K, x.shape[0], x.device)
    check_config(cfg)
    if N != 2 * inter or inter % cfg.pairs:
        raise ValueError(f"w13 must have 2 * inter rows with inter a multiple of {cfg.pairs} (got {N}, {inter})")
    y = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    _launch((inter // cfg.pairs,), x, gamma, w13, y, None, eps, EPI_SILU, True, cfg, inter=inter)
    return y


def norm_qkv_rope_store(x, gamma, eps, w_qkv, cos, sin, pos, slots, k_cache, v_cache, nh: int, nkv: int,
                        cfg: RowsConfig | None = None) -> torch.Tensor:
    """RMSNorm, q/k/v projection, RoPE of q and k at each row's position ``pos`` [T] (``cos``/``sin``:
    the [positions, hd] tables), K and V into the caches [nkv, S, hd] at ``slots`` [T]. Returns q
    [T, nh * hd]."""
    _check(x, w_qkv)
    N, K = w_qkv.shape
    hd = k_cache.shape[-1]
    cfg = cfg or config_for("rope", N, K, x.shape[0], x.device)
    check_config(cfg, "rope", hd)
    T = x.shape[0]
    if N != (nh + 2 * nkv) * hd or hd & (hd - 1):
        raise ValueError(f"w_qkv must have (nh + 2 nkv) * hd rows with hd a power of two "
                         f"(got {N} rows, nh={nh}, nkv={nkv}, hd={hd})")
    common.check_rope_store(T, hd, cos, sin, pos, slots, k_cache, v_cache)
    q = torch.empty(T, nh * hd, dtype=x.dtype, device=x.device)
    _launch((N // 2 // cfg.pairs,), x, gamma, w_qkv, q, None, eps, EPI_ROPE, True, cfg, nh=nh, nkv=nkv, hd=hd,
            cos=cos, sin=sin, pos=pos, slots=slots, k_cache=k_cache, v_cache=v_cache)
    return q
