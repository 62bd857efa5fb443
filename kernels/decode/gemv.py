"""Fused one-row decode kernels: a dense layer's AR step in four GEMV kernels plus attention.

An AR step of a dense Llama-family layer, written as modules and compiled, is about fifteen
kernels on the H200 (two RMSNorms, the q/k/v projection, two RoPE kernels, the cache write, a copy,
two attention kernels, the output projection, split-K reductions, gate/up, SiLU, down). Each one
costs launch and ramp time, and at batch 1 every one of them is small. Here one GEMV kernel with a
prologue and an epilogue chosen at compile time takes the whole layer apart from attention:

* ``NORM`` prologue: the program computes the row's RMS itself (the row is a few KB, read from L2)
  and normalises each x chunk as it goes (``rms_norm``'s roundings);
* ``EPI_RESID``: ``res + bf16(x @ W.T)`` (the residual adds after ``wo`` and ``w2``);
* ``EPI_SILU``: a program owns gate rows ``n .. n+B`` and the matching up rows ``inter + n``, and
  writes ``silu(gate) * up`` (the gate/up projection and the activation);
* ``EPI_PLAIN``: ``bf16(x @ W.T)`` (a hybrid layer's input projections, whose outputs go on to the
  GDN or gated-attention kernels);
* ``EPI_ROPE``: a program owns dims ``i`` and ``i + hd/2`` of one q/k/v head, applies rotate-half
  RoPE to q and k at the step's position and writes q to its buffer and K/V into the caches at the
  step's slot (the q/k/v projection, both RoPE kernels and the cache write).

Every program loads two ``[B, BLOCK_K]`` weight tiles per iteration (rows ``a`` and ``b``: the
two halves of its block, or the gate/up or RoPE pairs), accumulates in fp32 and reduces once at
the end: no atomics, no split-K, so results are bitwise identical run to run. Each function also
takes W12 weights (a ``KernelPack``): the same kernels reading 12-bit records (:mod:`.gemv_w12_gluon`
where Gluon runs, else :mod:`.gemv_w12`). Configs come from the measured table
(``kernels/decode/tuned/<arch>.json``, :mod:`specpilot.kernels.tuning`), else the kernel's default.
The plain reference is :mod:`.naive`; the kernels also run under Triton's interpreter (CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specpilot.kernels import tuning
from specpilot.kernels.decode import gemv_w12, gemv_w12_gluon
from specpilot.kernels.decode.common import (EPI_PLAIN, EPI_RESID, EPI_ROPE, EPI_SILU, epilogue,
                                             epilogue_operands, program_rows, row_rstd, x_at)
from specpilot.kernels.triton_env import pdl_args, tl, triton

# programmatic dependent launch for the fused kernels (and the attention they call): each kernel
# lets the next one launch at its start and waits for the previous one before touching activations
USE_PDL = True


@dataclass(frozen=True)
class GemvConfig:
    """``pairs`` B (a program owns 2B output rows), ``block_k`` columns per iteration, ``warps``,
    ``stages`` (software pipelining depth of the weight loads)."""

    pairs: int = 8
    block_k: int = 512
    warps: int = 4
    stages: int = 2

    def key(self) -> str:
        return f"p{self.pairs}-k{self.block_k}-w{self.warps}-s{self.stages}"


DEFAULT = GemvConfig()   # shapes the table does not have


def config_for(epi: str, n: int, k: int, device=None) -> GemvConfig:
    """The table's config for the epilogue and shape, else :data:`DEFAULT`."""
    found = tuning.lookup("decode", "gemv", tuning.device_arch(device) if device is not None else None,
                          epilogue=epi, n=n, k=k)
    return GemvConfig(**found[0]["config"]) if found else DEFAULT


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _x_chunk(x_ptr, gamma_ptr, kk, K, rstd, NORM: tl.constexpr):
        """:func:`x_at` of ``kk`` as a ``[1, BLOCK_K]`` row."""
        return x_at(x_ptr, gamma_ptr, kk, K, rstd, NORM)[None, :]

    @triton.jit
    def _gemv_kernel(x_ptr, gamma_ptr, w_ptr, y_ptr, res_ptr,
                     cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                     K, stride_w, eps, INTER, NH, NKV,
                     stride_ch, stride_cs, stride_dh, stride_ds, stride_rot,
                     NORM: tl.constexpr, EPI: tl.constexpr, HD: tl.constexpr,
                     B: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, XP: tl.constexpr,
                     PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        rows_a, rows_b, p, d, head = program_rows(pid, INTER, EPI, HD, B)
        wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
        wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * stride_w + offs_k[None, :]

        # the first weight chunk: weights are constant, so under PDL they are read before the wait,
        # while the previous kernel drains
        wa = tl.load(wa_ptrs, mask=(offs_k < K)[None, :], other=0.0)
        wb = tl.load(wb_ptrs, mask=(offs_k < K)[None, :], other=0.0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()       # the previous kernel's writes (x, res, the caches) are visible from here

        rstd = row_rstd(x_ptr, K, eps, NORM, XP)

        xf = _x_chunk(x_ptr, gamma_ptr, offs_k, K, rstd, NORM)
        acc_a = wa.to(tl.float32) * xf
        acc_b = wb.to(tl.float32) * xf
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            km = (k0 + offs_k) < K
            wa = tl.load(wa_ptrs + k0, mask=km[None, :], other=0.0)
            wb = tl.load(wb_ptrs + k0, mask=km[None, :], other=0.0)
            xf = _x_chunk(x_ptr, gamma_ptr, k0 + offs_k, K, rstd, NORM)
            acc_a += wa.to(tl.float32) * xf
            acc_b += wb.to(tl.float32) * xf
        dt = y_ptr.dtype.element_ty
        ya = tl.sum(acc_a, axis=1).to(dt)
        yb = tl.sum(acc_b, axis=1).to(dt)

        epilogue(ya, yb, rows_a, rows_b, p, d, head, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                  kc_ptr, vc_ptr, NH, NKV, stride_ch, stride_cs, stride_dh, stride_ds, stride_rot, EPI, HD)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, gamma_ptr, y_ptr, K, eps, XP: tl.constexpr, PDL: tl.constexpr):
        k = tl.arange(0, XP)
        g = tl.load(gamma_ptr + k, mask=k < K, other=0.0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        xv = tl.load(x_ptr + k, mask=k < K, other=0.0)
        xf = xv.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        xn = (xf * rstd).to(x_ptr.dtype.element_ty)
        tl.store(y_ptr + k, (g.to(tl.float32) * xn.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=k < K)


def rms_norm_row(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` of one row x [1, K] in one kernel (the model's final norm in the fused chain)."""
    K = x.shape[-1]
    _check_row(x, K, "x")
    y = torch.empty_like(x)
    _rms_norm_kernel[(1,)](x, gamma, y, K, float(eps), XP=triton.next_power_of_2(K),
                           num_warps=4 if K <= 4096 else 8, **pdl_args(USE_PDL, x))
    return y

def _check_row(x: torch.Tensor, k: int, name: str) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(f"{name}: one contiguous row of {k} values expected, got shape {tuple(x.shape)}")

def _check_weight(w, x: torch.Tensor) -> None:
    if gemv_w12.is_w12(w):
        if w.rec64.device != x.device:
            raise ValueError(f"W12 weight on {w.rec64.device}, x on {x.device}")
        return
    if w.dim() != 2 or w.stride(-1) != 1 or w.dtype != x.dtype:
        raise ValueError(f"weight must be 2-D, contiguous in K and of x's dtype ({x.dtype}), got "
                         f"{tuple(w.shape)} {w.dtype}")

def _config(epi: str, w, cfg, x: torch.Tensor):
    """The kernel config: ``cfg`` if given (a :class:`GemvConfig`, or for a W12 weight a
    ``gemv_w12.W12GemvConfig`` (Triton) or ``gemv_w12_gluon.GluonFusedConfig``), else the table's
    for the shape: for a W12 weight the Gluon kernel's where it runs (CUDA, Gluon), else Triton's."""
    w12 = gemv_w12.is_w12(w)
    if cfg is None:
        if w12 and gemv_w12_gluon.available(x):
            return gemv_w12_gluon.config_for(epi, *w.shape, device=x.device)
        return (gemv_w12.config_for if w12 else config_for)(epi, *w.shape, device=x.device)
    if isinstance(cfg, (gemv_w12.W12GemvConfig, gemv_w12_gluon.GluonFusedConfig)) != w12:
        raise ValueError(f"{type(cfg).__name__} does not fit a {'W12' if w12 else 'dense'} weight")
    if isinstance(cfg, gemv_w12_gluon.GluonFusedConfig):
        if not gemv_w12_gluon.available(x):
            raise ValueError("the Gluon W12 decode kernels need Gluon and a 16-byte aligned CUDA row of even length")
        gemv_w12_gluon.check_config(cfg, w.k_tiles)
    elif w12:
        gemv_w12.check_config(cfg)
    return cfg

def _launch(grid, x, gamma, w, y, res, eps, epi, norm, cfg, inter=0, nh=0, nkv=0, hd=16,
            cos=None, sin=None, pos=None, slot=None, k_cache=None, v_cache=None):
    if gemv_w12.is_w12(w):
        gemv_w12.launch(grid, x, gamma, w, y, res, eps, epi, norm, cfg, inter, nh, nkv, hd,
                        cos, sin, pos, slot, k_cache, v_cache, pdl=USE_PDL)
        return
    K = w.shape[1]
    ptrs, strides = epilogue_operands(x, res, cos, sin, pos, slot, k_cache, v_cache)
    _gemv_kernel[grid](
        x, gamma if gamma is not None else x, w, y, *ptrs,
        K, w.stride(0), float(eps), inter, nh, nkv, *strides,
        NORM=norm, EPI=epi, HD=hd, B=cfg.pairs, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        XP=triton.next_power_of_2(K) if norm else 1, num_warps=cfg.warps,
        **pdl_args(USE_PDL, x))

def gemv_residual(x: torch.Tensor, w, res: torch.Tensor, cfg=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``res + x @ w.T`` for one row x [1, K] and w [N, K] (a dense tensor, or a W12 ``KernelPack``
    with a ``gemv_w12_gluon.GluonFusedConfig`` or a ``gemv_w12.W12GemvConfig``: :mod:`.gemv_w12_gluon`,
    :mod:`.gemv_w12`); ``N`` a multiple of ``2 * pairs``."""
    N, K = w.shape
    cfg = _config("resid", w, cfg, x)
    _check_row(x, K, "x")
    _check_weight(w, x)
    _check_row(res, N, "res")
    if N % (2 * cfg.pairs):
        raise ValueError(f"N={N} is not a multiple of {2 * cfg.pairs} rows per program")
    y = out if out is not None else torch.empty_like(res)
    _launch((N // (2 * cfg.pairs),), x, None, w, y, res, 0.0, EPI_RESID, False, cfg)
    return y

def norm_proj(x: torch.Tensor, gamma: torch.Tensor, eps: float, w, cfg=None) -> torch.Tensor:
    """``rms_norm(x) @ w.T`` for one row x [1, K] and w [N, K] (dense or a W12 ``KernelPack``;
    ``N`` even; the config's row pairs halve until they divide it): the input projection of a
    hybrid model's layers, [1, N]."""
    N, K = w.shape
    auto = cfg is None
    cfg = _config("plain", w, cfg, x)
    # a width the Gluon kernel's 8-row programs do not divide: the Triton W12 kernel's config
    if auto and isinstance(cfg, gemv_w12_gluon.GluonFusedConfig) and N % 8:
        cfg = gemv_w12.config_for("plain", N, K, device=x.device)
    least = 4 if isinstance(cfg, gemv_w12_gluon.GluonFusedConfig) else 1
    while N % (2 * cfg.pairs) and cfg.pairs > least:   # odd projection widths (GDN: conv + z + 2 x heads)
        cfg = replace(cfg, pairs=cfg.pairs // 2)
    _check_row(x, K, "x")
    _check_weight(w, x)
    if N % (2 * cfg.pairs):
        raise ValueError(f"N={N} is not a multiple of {2 * cfg.pairs} rows per program")
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _launch((N // (2 * cfg.pairs),), x, gamma, w, y, None, eps, EPI_PLAIN, True, cfg)
    return y

def norm_gate_up_silu(x: torch.Tensor, gamma: torch.Tensor, eps: float, w13, inter: int,
                      cfg=None) -> torch.Tensor:
    """``silu(gate) * up`` of ``rms_norm(x) @ w13.T`` (gate rows ``[0, inter)``, up rows after): [1, inter]."""
    N, K = w13.shape
    cfg = _config("silu", w13, cfg, x)
    _check_row(x, K, "x")
    _check_weight(w13, x)
    if N != 2 * inter or inter % cfg.pairs:
        raise ValueError(f"w13 must have 2 * inter rows with inter a multiple of {cfg.pairs} (got {N}, {inter})")
    y = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    _launch((inter // cfg.pairs,), x, gamma, w13, y, None, eps, EPI_SILU, True, cfg, inter=inter)
    return y

def norm_qkv_rope_store(x, gamma, eps, w_qkv, cos, sin, pos, slot, k_cache, v_cache, nh: int, nkv: int,
                        cfg=None) -> torch.Tensor:
    """RMSNorm, q/k/v projection, rotate-half RoPE of q and k at ``pos`` (a one-element device
    tensor; ``cos``/``sin`` are the [positions, hd] tables), K/V written to the caches [nkv, S, hd]
    at ``slot`` (one-element device tensor). Returns q [1, nh * hd]."""
    N, K = w_qkv.shape
    hd = k_cache.shape[-1]
    cfg = _config("rope", w_qkv, cfg, x)
    _check_row(x, K, "x")
    _check_weight(w_qkv, x)
    if N != (nh + 2 * nkv) * hd or (hd // 2) % cfg.pairs or hd & (hd - 1):
        raise ValueError(f"w_qkv must have (nh + 2 nkv) * hd rows, hd a power of two with hd/2 a multiple of "
                         f"{cfg.pairs} (got {N} rows, nh={nh}, nkv={nkv}, hd={hd})")
    if cos.shape[-1] != hd or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("RoPE tables must be [positions, head_dim], contiguous (partial rotary is not fused)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in head_dim")
    q = torch.empty(1, nh * hd, dtype=x.dtype, device=x.device)
    _launch(((nh + 2 * nkv) * hd // 2 // cfg.pairs,), x, gamma, w_qkv, q, None, eps, EPI_ROPE, True, cfg,
            nh=nh, nkv=nkv, hd=hd, cos=cos, sin=sin, pos=pos, slot=slot, k_cache=k_cache, v_cache=v_cache)
    return q
