"""The fused one-row decode kernels on W12 weights, in Gluon: the CUDA path of :mod:`.gemv_w12`.

The Triton W12 variants (:mod:`.gemv_w12`) put a W12 engine's AR step at 0.94x of the bf16 fused
step on the H200: the 12-bit reads do not pay for their decode there. The one-row Gluon GEMV
(:mod:`specpilot.kernels.w12.gemv_gluon`) runs the same records at 1.26-1.30x of cuBLAS. This
module is that GEMV's main loop with the fused decode kernels' prologues and epilogues around it:

* a program owns two row groups of ``B`` rows (as in :mod:`.gemv`: the two halves of its block,
  the gate/up pair or the RoPE pair), held as ``2B`` rows in the order ``2i + g`` (row ``i`` of
  group ``g``), each with its own record pointer, so the groups may lie in different 128-row
  record tiles; warp ``w`` streams the records ``i * WARPS + w`` of all its rows, ``DEPTH``
  unrolled register sets reloaded in place (pinned, see the GEMV), decoded with the prmt/lop3
  recipe, fp32 FMAs against x staged once per program in shared memory; the warps are summed in a
  fixed tree, so results are bitwise identical run to run;
* ``NORM``: x staged normalised. The program computes the row's 1/RMS itself (two passes over x,
  a few KB in L2) and stores ``bf16(gamma * bf16(x * rstd))``, ``rms_norm``'s roundings, into
  shared memory; without ``NORM`` x is copied with ``cp.async``;
* under programmatic dependent launch everything constant is read before ``gdc_wait``: the first
  ``DEPTH`` records per warp, the row scales, both groups' escape ranges and first escape entries
  (and gamma at their columns); after the wait only x, and x at the escape columns, are read;
* the epilogue: row scale ``2**(L_n - 112)``, the exact escape corrections ``x[k] * (w - slot)`` in
  CSR order, rounding to bf16, then the residual add, ``silu(gate) * up``, rotate-half RoPE with
  the K/V cache store or nothing more (a hybrid layer's input projection), with :mod:`.gemv`'s
  roundings.

The plain reference is :mod:`.naive` on the decoded weights; the Triton variant gives the same
values up to the fp32 summation order. Gluon does not run under Triton's interpreter: CPU tests
compile the kernel for sm_90, GPU tests run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specpilot.kernels import tuning
from specpilot.kernels.decode.common import EPI_NAMES, epilogue_operands
from specpilot.kernels.triton_env import pdl_args
from specpilot.kernels.w12.gluon_common import (XS_CHUNK, XS_MAX_BYTES, async_copy, cta_barrier, f32_hi,
                                                f32_lo, gl, gluon, load_clamped, pin, stage_x, view_as,
                                                xs_group_count)

# escapes per group loaded ahead (random std-0.02 weights: about 3 per 8 rows)
ESC_CH = gl.constexpr(8) if gl is not None else 8


@dataclass(frozen=True)
class GluonFusedConfig:
    """``pairs`` B rows per group (a program owns 2B rows: 8, 16 or 32), ``warps`` (each streams its
    own records), ``depth`` unrolled register sets (2-4), ``maxnreg`` the ptxas register cap."""

    pairs: int = 8
    warps: int = 4
    depth: int = 4
    maxnreg: int | None = None

    def key(self) -> str:
        return f"gl-p{self.pairs}-w{self.warps}-d{self.depth}" + (f"-r{self.maxnreg}" if self.maxnreg else "")

    def xs_groups(self, k_tiles: int) -> int:
        return xs_group_count(k_tiles, self.warps, self.depth)

    def xs_bytes(self, k_tiles: int) -> int:
        return self.xs_groups(k_tiles) * self.warps * 128


# 8-row programs of 4 warps, four sets (64 registers with Triton 3.6): within 1 % of the best of the
# tuning sweep on three of the four Llama-3.1-8B kernels; shapes the table does not have
DEFAULT = GluonFusedConfig(4, 4, 4)


# the kernels compiled so far: (epilogue, N, K, config key) -> (registers, spill bytes), for benchmarks
COMPILED: dict[tuple[str, int, int, str], tuple] = {}
# False: the Triton W12 kernels take every call (A/B runs of the two in one process)
ENABLED = True


def config_for(epi: str, n: int, k: int, device=None) -> GluonFusedConfig:
    """The table's config for the epilogue and shape, else :data:`DEFAULT`."""
    found = tuning.lookup("decode", "gemv-w12-gluon", tuning.device_arch(device) if device is not None else None,
                          epilogue=epi, n=n, k=k)
    return GluonFusedConfig(**found[0]["config"]) if found else DEFAULT


def check_config(cfg: GluonFusedConfig, k_tiles: int | None = None) -> None:
    if 2 * cfg.pairs not in (8, 16, 32):
        raise ValueError(f"W12 Gluon decode config: pairs={cfg.pairs} must be 4, 8 or 16 (2 * pairs rows per program)")
    if cfg.warps not in (1, 2, 4, 8):
        raise ValueError(f"W12 Gluon decode config: warps={cfg.warps} must be 1, 2, 4 or 8")
    if cfg.depth not in (2, 3, 4):
        raise ValueError(f"W12 Gluon decode config: depth={cfg.depth} must be 2, 3 or 4")
    if cfg.maxnreg is not None and not 32 <= cfg.maxnreg <= 255:
        raise ValueError(f"W12 Gluon decode config: maxnreg={cfg.maxnreg} must be 32-255")
    if k_tiles is not None and cfg.xs_bytes(k_tiles) > XS_MAX_BYTES:
        raise ValueError(f"W12 Gluon decode config {cfg.key()}: staged x would take {cfg.xs_bytes(k_tiles)} bytes "
                         f"of shared memory (limit {XS_MAX_BYTES})")


def available(x: torch.Tensor) -> bool:
    """Whether the Gluon kernels can run on ``x``: Gluon present, x a 16-byte aligned CUDA row of even
    length (staged as bf16 pairs), compute capability 8.0 or later (``cp.async``), and :data:`ENABLED`."""
    if not ENABLED or gluon is None or not x.is_cuda or x.shape[-1] % 2 or x.data_ptr() % 16:
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 8


@lru_cache(maxsize=None)
def _capability(device: int) -> int:
    return torch.cuda.get_device_capability(device)[0]


if gluon is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from specpilot.kernels.w12.gemv_gluon import layouts, ring_set
    from specpilot.kernels.w12.gluon_epilogue import esc_entries

    @gluon.jit
    def _group_starts(pid, INTER, EPI: gl.constexpr, HD: gl.constexpr, B: gl.constexpr):
        """The first rows ``a0``/``b0`` of the program's groups, and for RoPE its head."""
        if EPI == 2:      # gate rows p .. p+B, up rows INTER + p ..
            a0 = pid * B
            b0 = INTER + a0
            head = pid
        elif EPI == 3:    # dims d .. d+B and d + HD/2 .. of one head
            HALF: gl.constexpr = HD // 2
            head = (pid * B) // HALF
            a0 = head * HD + (pid * B) % HALF
            b0 = a0 + HALF
        else:             # rows pid*2B .. +B and +B .. +2B
            a0 = pid * (2 * B)
            b0 = a0 + B
            head = pid
        return a0, b0, head

    @gluon.jit
    def _row_ids(a0, b0, ROWS: gl.constexpr, L: gl.constexpr):
        """The program's rows in layout ``L``: position ``2i + g`` is row ``i`` of group ``g``."""
        j = gl.arange(0, ROWS, layout=L)
        return gl.where(j % 2 == 0, a0, b0) + j // 2

    @gluon.jit
    def _row_pointers(rec_ptr, a0, b0, KT, ROWS: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr):
        """Per row, the pointers of its view words (``[1, ROWS, 16]``) and nibble words (``[1, ROWS, 8]``)
        in record 0 of its tile row; record ``t`` is ``t * 3072`` words further."""
        rv = _row_ids(a0, b0, ROWS, gl.SliceLayout(0, gl.SliceLayout(2, L_V)))
        bv = (rv // 128).to(gl.int64) * (KT * 3072) + (rv % 128) * 16
        cv = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_V)))
        pv = rec_ptr + (gl.expand_dims(gl.expand_dims(bv, 0), 2) + gl.expand_dims(gl.expand_dims(cv, 0), 1))
        rq = _row_ids(a0, b0, ROWS, gl.SliceLayout(0, gl.SliceLayout(2, L_Q)))
        bq = (rq // 128).to(gl.int64) * (KT * 3072) + 2048 + (rq % 128) * 8
        cq = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_Q)))
        pq = rec_ptr + (gl.expand_dims(gl.expand_dims(bq, 0), 2) + gl.expand_dims(gl.expand_dims(cq, 0), 1))
        return pv, pq

    @gluon.jit
    def _bf16_bits(v):
        """fp32 ``v`` rounded to bf16, its 16 bits in the low half of a uint32."""
        return v.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)

    @gluon.jit
    def _norm_pair(w, g, rstd):
        """A word of two bf16 x values and the word of their gammas -> the word of
        ``bf16(gamma * bf16(x * rstd))`` (``rms_norm``'s roundings, :func:`.common.x_at`)."""
        lo = f32_lo(_bf16_bits(f32_lo(w) * rstd)) * f32_lo(g)
        hi = f32_lo(_bf16_bits(f32_hi(w) * rstd)) * f32_hi(g)
        return (_bf16_bits(lo) | (_bf16_bits(hi) << 16)).to(gl.int32, bitcast=True)

    @gluon.jit
    def _stage_x_norm(x32_ptr, g32_ptr, KH, K, eps, WARPS: gl.constexpr, XS_IT: gl.constexpr, XS_CH: gl.constexpr):
        """x normalised into shared memory, laid out as
        :func:`specpilot.kernels.w12.gluon_common.stage_x` lays x out (zero from ``KH`` words on),
        and 1/RMS: one pass for the sum of squares, one to normalise."""
        CW: gl.constexpr = XS_CH * WARPS * 32
        LC: gl.constexpr = gl.BlockedLayout([CW // (32 * WARPS)], [32], [WARPS], [0])
        off = gl.arange(0, CW, layout=LC)
        ss = gl.zeros([CW], gl.float32, LC)
        for c in range(0, XS_IT // XS_CH):
            g = c * CW + off
            w = gl.load(x32_ptr + g, mask=g < KH, other=0).to(gl.uint32)
            lo = f32_lo(w)
            hi = f32_hi(w)
            ss += lo * lo + hi * hi
        rstd = gl.rsqrt(gl.sum(ss, axis=0) / K + eps)
        xc = gl.allocate_shared_memory(gl.int32, [XS_IT // XS_CH, CW], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for c in range(0, XS_IT // XS_CH):
            g = c * CW + off
            m = g < KH
            w = gl.load(x32_ptr + g, mask=m, other=0).to(gl.uint32)
            gw = gl.load(g32_ptr + g, mask=m, other=0).to(gl.uint32)
            xc.index(c).store(_norm_pair(w, gw, rstd))
        return view_as(xc, gl.int32, [XS_IT, WARPS, 32], [1, 0]), rstd

    @gluon.jit
    def _x_hat(x_ptr, gamma_ptr, cols, ok, g, rstd, NORM: gl.constexpr):
        """x at ``cols`` in fp32 as staged (``g`` gamma there, loaded earlier; ``NORM``: normalised)."""
        xv = gl.load(x_ptr + cols, mask=ok, other=0.0)
        if NORM:
            xn = (xv.to(gl.float32) * rstd).to(gl.bfloat16)
            xv = (g.to(gl.float32) * xn.to(gl.float32)).to(gl.bfloat16)
        return xv.to(gl.float32)

    @gluon.jit
    def _esc_load(erow_ptr, ecol_ptr, edelta_ptr, gamma_ptr, e, e_hi, NORM: gl.constexpr, LE: gl.constexpr):
        """:func:`specpilot.kernels.w12.gluon_epilogue.esc_entries` (escapes ``e .. e + ESC_CH``
        below ``e_hi``: ok, rows, columns, deltas) and, for ``NORM``, gamma at the columns:
        constant data."""
        ok, er, ec, ed = esc_entries(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH, LE)
        if NORM:
            g = gl.load(gamma_ptr + ec, mask=ok, other=0.0)
        else:
            g = ed
        return ok, er, ec, ed, g

    @gluon.jit
    def _esc_sum(er, contrib, rows):
        """Per row of ``rows``, the sum of the chunk's corrections on it (a fixed order)."""
        return gl.sum(gl.where(gl.expand_dims(er, 0) == gl.expand_dims(rows, 1), gl.expand_dims(contrib, 0), 0.0),
                      axis=1)

    @gluon.jit
    def _esc_rest(y, rows, e_lo, e_hi, x_ptr, gamma_ptr, erow_ptr, ecol_ptr, edelta_ptr, rstd,
                  NORM: gl.constexpr, LE: gl.constexpr):
        """A group's escapes after its first chunk (rare), in CSR order."""
        for e in range(e_lo + ESC_CH, e_hi, ESC_CH):
            ok, er, ec, ed, g = _esc_load(erow_ptr, ecol_ptr, edelta_ptr, gamma_ptr, e, e_hi, NORM, LE)
            y += _esc_sum(er, _x_hat(x_ptr, gamma_ptr, ec, ok, g, rstd, NORM) * ed, rows)
        return y

    @gluon.jit
    def _epilogue(yd, rows, head, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, NH, NKV,
                  stride_ch, stride_cs, stride_dh, stride_ds, stride_rot,
                  EPI: gl.constexpr, HD: gl.constexpr, B: gl.constexpr, WARPS: gl.constexpr):
        """:func:`.common.epilogue` on the rows' bf16 outputs ``yd`` (positions ``2i + g``)."""
        dt: gl.constexpr = y_ptr.dtype.element_ty
        if EPI == 1:
            r = gl.load(res_ptr + rows).to(gl.float32)
            gl.store(y_ptr + rows, (r + yd.to(gl.float32)).to(dt))
        elif EPI == 4:
            gl.store(y_ptr + rows, yd)
        else:
            LP: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [WARPS, 1], [1, 0])
            ya, yb = gl.split(gl.convert_layout(gl.reshape(yd, [B, 2]), LP))
            rows_a, rows_b = gl.split(gl.convert_layout(gl.reshape(rows, [B, 2]), LP))
            if EPI == 2:
                gf = ya.to(gl.float32)
                s = (gf / (1.0 + gl.exp(-gf))).to(dt)
                gl.store(y_ptr + rows_a, (s.to(gl.float32) * yb.to(gl.float32)).to(dt))
            else:
                HALF: gl.constexpr = HD // 2
                d = rows_a - head * HD
                pos = gl.load(pos_ptr)
                slot = gl.load(slot_ptr)
                c1 = gl.load(cos_ptr + pos * stride_rot + d).to(dt).to(gl.float32)
                c2 = gl.load(cos_ptr + pos * stride_rot + d + HALF).to(dt).to(gl.float32)
                s1 = gl.load(sin_ptr + pos * stride_rot + d).to(dt).to(gl.float32)
                s2 = gl.load(sin_ptr + pos * stride_rot + d + HALF).to(dt).to(gl.float32)
                a = ya.to(gl.float32)
                b = yb.to(gl.float32)
                ra = ((a * c1).to(dt).to(gl.float32) + (-b * s1).to(dt).to(gl.float32)).to(dt)
                rb = ((b * c2).to(dt).to(gl.float32) + (a * s2).to(dt).to(gl.float32)).to(dt)
                is_q = rows_a < NH * HD
                is_k = (rows_a >= NH * HD) & (rows_a < (NH + NKV) * HD)
                is_v = rows_a >= (NH + NKV) * HD
                gl.store(y_ptr + rows_a, ra, mask=is_q)
                gl.store(y_ptr + rows_b, rb, mask=is_q)
                kbase = kc_ptr + (head - NH) * stride_ch + slot * stride_cs
                gl.store(kbase + d, ra, mask=is_k)
                gl.store(kbase + d + HALF, rb, mask=is_k)
                vbase = vc_ptr + (head - NH - NKV) * stride_dh + slot * stride_ds
                gl.store(vbase + d, ya, mask=is_v)
                gl.store(vbase + d + HALF, yb, mask=is_v)

    @gluon.jit
    def _w12_fused_gl_kernel(
        x_ptr, x32_ptr, gamma_ptr, g32_ptr, rec_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
        K, KH, KT, eps, INTER, NH, NKV, stride_ch, stride_cs, stride_dh, stride_ds, stride_rot,
        NORM: gl.constexpr, EPI: gl.constexpr, HD: gl.constexpr, B: gl.constexpr, WARPS: gl.constexpr,
        DEPTH: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, L_E: gl.constexpr,
        XS_IT: gl.constexpr, XS_CH: gl.constexpr, PDL: gl.constexpr,
    ):
        ROWS: gl.constexpr = 2 * B
        pid = gl.program_id(0)
        a0, b0, head = _group_starts(pid, INTER, EPI, HD, B)
        pv, pq = _row_pointers(rec_ptr, a0, b0, KT, ROWS, L_V, L_Q)
        wid = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_V)))

        # constant data first: under PDL it is read while the previous kernel drains
        v0, q0 = load_clamped(pv, pq, wid, KT, L_V, L_Q, False)
        v1, q1 = load_clamped(pv, pq, WARPS + wid, KT, L_V, L_Q, False)
        if DEPTH >= 3:
            v2, q2 = load_clamped(pv, pq, 2 * WARPS + wid, KT, L_V, L_Q, False)
        if DEPTH >= 4:
            v3, q3 = load_clamped(pv, pq, 3 * WARPS + wid, KT, L_V, L_Q, False)
        wid = pin(wid, True)     # the records' loads stay ahead of the epilogue's
        LR: gl.constexpr = gl.SliceLayout(1, L_E)
        LE: gl.constexpr = gl.SliceLayout(0, L_E)
        L_D: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])   # one escape per lane until the end
        rows = _row_ids(a0, b0, ROWS, LR)
        low = gl.load(low_ptr + rows).to(gl.int32)
        scale = ((low + (127 - 112)) << 23).to(gl.float32, bitcast=True)
        ea_lo = gl.load(eptr_ptr + a0)
        ea_hi = gl.load(eptr_ptr + a0 + B)
        eb_lo = gl.load(eptr_ptr + b0)
        eb_hi = gl.load(eptr_ptr + b0 + B)
        oka, era, eca, eda, ga = _esc_load(erow_ptr, ecol_ptr, edelta_ptr, gamma_ptr, ea_lo, ea_hi, NORM, L_D)
        okb, erb, ecb, edb, gb = _esc_load(erow_ptr, ecol_ptr, edelta_ptr, gamma_ptr, eb_lo, eb_hi, NORM, L_D)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()       # the previous kernel's writes (x, res, the caches) are visible from here

        if NORM:
            xs, rstd = _stage_x_norm(x32_ptr, g32_ptr, KH, K, eps, WARPS, XS_IT, XS_CH)
        else:
            xs = stage_x(x32_ptr, 0, KT, KH, WARPS, XS_IT, XS_CH)
            rstd = 1.0
        # x at the escape columns now; multiplied only after the loop
        xea = _x_hat(x_ptr, gamma_ptr, eca, oka, ga, rstd, NORM)
        xeb = _x_hat(x_ptr, gamma_ptr, ecb, okb, gb, rstd, NORM)
        if not NORM:
            async_copy.wait_group(0)
        cta_barrier()      # the only barrier; none in the loop

        acc = gl.zeros([WARPS, ROWS, 16], gl.float32, L_V)
        for t in range(0, KT, DEPTH * WARPS):
            i = t // WARPS
            acc, v0, q0, x0, wid = ring_set(acc, v0, q0, 0, xs, i, t + DEPTH * WARPS, wid, rec_ptr, x32_ptr, 0, KT,
                                             KH, 0, 0, 0, pv, pq, WARPS, ROWS, L_V, L_Q, L_X, False, True)
            acc, v1, q1, x1, wid = ring_set(acc, v1, q1, 0, xs, i + 1, t + (DEPTH + 1) * WARPS, wid, rec_ptr,
                                             x32_ptr, 0, KT, KH, 0, 0, 0, pv, pq, WARPS, ROWS, L_V, L_Q, L_X,
                                             False, True)
            if DEPTH >= 3:
                acc, v2, q2, x2, wid = ring_set(acc, v2, q2, 0, xs, i + 2, t + (DEPTH + 2) * WARPS, wid, rec_ptr,
                                                 x32_ptr, 0, KT, KH, 0, 0, 0, pv, pq, WARPS, ROWS, L_V, L_Q, L_X,
                                                 False, True)
            if DEPTH >= 4:
                acc, v3, q3, x3, wid = ring_set(acc, v3, q3, 0, xs, i + 3, t + (DEPTH + 3) * WARPS, wid, rec_ptr,
                                                 x32_ptr, 0, KT, KH, 0, 0, 0, pv, pq, WARPS, ROWS, L_V, L_Q, L_X,
                                                 False, True)

        # lanes, then warps, in a fixed tree; then the scale and the escapes in CSR order
        y = gl.convert_layout(gl.sum(gl.sum(acc, axis=2), axis=0), LR) * scale
        y += _esc_sum(gl.convert_layout(era, LE), gl.convert_layout(xea * eda, LE), rows)
        y += _esc_sum(gl.convert_layout(erb, LE), gl.convert_layout(xeb * edb, LE), rows)
        y = _esc_rest(y, rows, ea_lo, ea_hi, x_ptr, gamma_ptr, erow_ptr, ecol_ptr, edelta_ptr, rstd, NORM, LE)
        y = _esc_rest(y, rows, eb_lo, eb_hi, x_ptr, gamma_ptr, erow_ptr, ecol_ptr, edelta_ptr, rstd, NORM, LE)
        _epilogue(y.to(y_ptr.dtype.element_ty), rows, head, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                  kc_ptr, vc_ptr, NH, NKV, stride_ch, stride_cs, stride_dh, stride_ds, stride_rot, EPI, HD, B, WARPS)


def launch(grid, x, gamma, kp, y, res, eps, epi, norm, cfg: GluonFusedConfig, inter=0, nh=0, nkv=0, hd=16,
           cos=None, sin=None, pos=None, slot=None, k_cache=None, v_cache=None, pdl: bool = True) -> None:
    """One fused W12 Gluon kernel (the arguments of :func:`.gemv_w12.launch`)."""
    kt = kp.k_tiles
    check_config(cfg, kt)
    K = kp.shape[1]
    ptrs, strides = epilogue_operands(x, res, cos, sin, pos, slot, k_cache, v_cache)
    g = gamma if gamma is not None else x
    lv, lq, lx, le = layouts(2 * cfg.pairs, cfg.warps)
    k = _w12_fused_gl_kernel[grid](
        x, x.view(torch.int32), g, g.view(torch.int32), kp.rec32, kp.low_exp, kp.esc_rowptr, kp.esc_row,
        kp.esc_col, kp.esc_delta, y, *ptrs,
        K, K // 2, kt, float(eps), inter, nh, nkv, *strides,
        NORM=norm, EPI=epi, HD=hd, B=cfg.pairs, WARPS=cfg.warps, DEPTH=cfg.depth, L_V=lv, L_Q=lq, L_X=lx, L_E=le,
        XS_IT=cfg.xs_groups(kt), XS_CH=XS_CHUNK, num_warps=cfg.warps,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}), **pdl_args(pdl, x))
    COMPILED[(EPI_NAMES[epi], *kp.shape, cfg.key())] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None))
