"""The fused one-row decode kernels (:mod:`.gemv`) on W12 weights, in Triton: the same prologues and
epilogues, the weights read as 12 KB W12 records and decoded in registers. On CUDA with Gluon the
faster Gluon kernels (:mod:`.gemv_w12_gluon`) take the calls; these run elsewhere and under the
interpreter (CPU tests).

With ``engine:...,w12=1,decode=fused`` a dense layer's AR step is still four GEMV kernels plus
attention, chained with programmatic dependent launch, but each projection reads 12 bits per
weight instead of 16. A program owns the same two row groups as the bf16 kernel (``B`` rows
each: the two halves of its block, the gate/up pair or the RoPE pair); a group of ``B`` rows
aligned to ``B`` (``B`` divides 128) lies inside one 128-row record tile, so per iteration the
program loads, for ``RECS`` consecutive records, each group's rows' 8-bit views (``[B, RECS*8]``
int64, 64 contiguous bytes per row and record) and low nibbles (``[B, RECS*8]`` int32), decodes
them with the W12 GEMM's integer recipe (:func:`specpilot.kernels.w12.common.decode_pairs`: the
values ``w * 2**(112 - L_n)``) and multiplies them on the CUDA cores with the (normalised) x in
fp32. The epilogue applies the row scale ``2**(L_n - 112)`` and the exact escape corrections
``x[k] * (w - slot)`` in a fixed order, rounds to the model's dtype and then runs the bf16
kernel's epilogue (:func:`.common.epilogue`).

The weights are the bf16 weights bit for bit, so the result differs from the bf16 kernel's only
by the fp32 summation order; no atomics, no split-K: bitwise identical run to run. Under PDL the
first records, the row exponents and the escape lists (all constant) are read before the wait.
The plain reference is the bf16 path's (:mod:`.naive`) on the decoded weights; the kernel also
runs under Triton's interpreter (CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.kernels import tuning
from specpilot.kernels.decode import gemv_w12_gluon
from specpilot.kernels.decode.common import epilogue, epilogue_operands, program_rows, row_rstd, x_at
from specpilot.kernels.triton_env import interpreting, pdl_args, tl, triton
from specpilot.kernels.w12.common import decode_pairs, hi_f32, lo_f32
from specpilot.kernels.w12.pack import KernelPack


@dataclass(frozen=True)
class W12GemvConfig:
    """``pairs`` B (a program owns 2B output rows; B divides 128), ``recs`` records (64 columns
    each) per iteration, ``warps``, ``stages`` (software pipelining depth of the record loads),
    and escapes are corrected :data:`ESC_CH` at a time."""

    pairs: int = 4
    recs: int = 4
    warps: int = 4
    stages: int = 3

    def key(self) -> str:
        return f"p{self.pairs}-r{self.recs}-w{self.warps}-s{self.stages}"


DEFAULT = W12GemvConfig()   # shapes the table does not have; on CUDA with Gluon the Gluon kernels run
ESC_CH = 16   # escapes per correction chunk (a power of two)


def config_for(epi: str, n: int, k: int, device=None) -> W12GemvConfig:
    """The table's config for the epilogue and shape, else :data:`DEFAULT`."""
    found = tuning.lookup("decode", "gemv-w12", tuning.device_arch(device) if device is not None else None,
                          epilogue=epi, n=n, k=k)
    return W12GemvConfig(**found[0]["config"]) if found else DEFAULT


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _load_records(rec64_ptr, rec32_ptr, tile_row, r_in, t0, KT, RECS: tl.constexpr):
        """Views ``[B, RECS*8]`` (int64) and nibbles (int32) of records ``t0 .. t0 + RECS`` of the
        tile starting at record ``tile_row``, rows ``r_in`` inside it (records from KT on: 0): a
        scalar base pointer plus int32 offsets inside the records."""
        c = tl.arange(0, RECS * 8)
        q = c // 8
        m = ((t0 + q) < KT)[None, :]
        base = (tile_row + t0).to(tl.int64)
        offs = (q * 1536 + c % 8)[None, :] + r_in[:, None] * 8
        v = tl.load(rec64_ptr + base * 1536 + offs, mask=m, other=0)
        nb = tl.load(rec32_ptr + (base * 3072 + 2048) + (offs + q[None, :] * 1536), mask=m, other=0)
        return v, nb

    @triton.jit
    def _asm2(a, b, ASM: tl.constexpr):
        """One two-operand PTX instruction ``ASM`` on uint32 tensors."""
        return tl.inline_asm_elementwise(ASM, "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1)

    @triton.jit
    def _pairs_prmt(w, nn, e, SX: tl.constexpr, SY: tl.constexpr):
        """One 32-bit view word ``w`` (4 weights) and its nibble word ``nn`` -> the two bf16 pairs, in
        eight instructions: the sequence of :func:`specpilot.kernels.w12.gluon_common.decode_pairs`
        (prmt puts each sign next to its nibble, one lop3 per bit select and per exponent OR; the
        exhaustive check of the selectors: tests/test_w12_decode_prmt.py). Same bits as
        :func:`specpilot.kernels.w12.common.decode_pairs` for every input."""
        xs = _asm2(w, nn, SX)
        t0 = _asm2(w << 4, xs, "lop3.b32 $0, $1, 0x07F007F0, $2, 0xE2;")
        ys = _asm2(w, nn, SY)
        t1 = _asm2(w, ys >> 4, "lop3.b32 $0, $1, 0x80008000, $2, 0xE2;")
        p0 = _asm2(t0, e, "lop3.b32 $0, $1, 0x87FF87FF, $2, 0xEA;")
        p1 = _asm2(t1, e, "lop3.b32 $0, $1, 0x87FF87FF, $2, 0xEA;")
        return p0, p1

    @triton.jit
    def _fma_records(acc, v, nb, x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o, FAST: tl.constexpr):
        """acc ``[B, RECS*8]`` += the decoded weights times x (pair i of each 8-column group:
        ``xie`` its even column, ``xio`` its odd one; each ``[1, RECS*8]``), one FMA per weight.
        ``FAST``: the prmt/lop3 decode (compiled kernels), else the plain integer recipe (also the
        interpreter's: it has no inline PTX); the same bits either way."""
        if FAST:
            nn = nb.to(tl.uint32)
            e = tl.full(nn.shape, 0x38003800, tl.uint32)
            p0, p1 = _pairs_prmt(v.to(tl.uint32), nn, e, "prmt.b32 $0, $1, $2, 0x2604;", "prmt.b32 $0, $1, $2, 0x3614;")
            p2, p3 = _pairs_prmt((v >> 32).to(tl.uint32), nn, e, "prmt.b32 $0, $1, $2, 0x2705;",
                                 "prmt.b32 $0, $1, $2, 0x3715;")
        else:
            p0, p1, p2, p3 = decode_pairs(v, nb, False)
        acc += lo_f32(p0) * x0e
        acc += hi_f32(p0) * x0o
        acc += lo_f32(p1) * x1e
        acc += hi_f32(p1) * x1o
        acc += lo_f32(p2) * x2e
        acc += hi_f32(p2) * x2o
        acc += lo_f32(p3) * x3e
        acc += hi_f32(p3) * x3o
        return acc

    @triton.jit
    def _x_pairs(x_ptr, gamma_ptr, t0, K, rstd, NORM: tl.constexpr, RECS: tl.constexpr):
        """The x of records ``t0 .. t0 + RECS`` split like the decoded pairs: 8 ``[1, RECS*8]`` rows."""
        c = tl.arange(0, RECS * 8)
        e = tl.arange(0, 8)
        kk = t0 * 64 + c[:, None] * 8 + e[None, :]                  # [RECS*8, 8]: group c, element e = 2i + s
        xf = tl.reshape(x_at(x_ptr, gamma_ptr, kk, K, rstd, NORM), (RECS * 8, 2, 2, 2))   # [c, i>>1, i&1, s]
        xe, xo = tl.split(xf)                                         # s = 0 / 1: [c, i>>1, i&1]
        xe01, xe23 = tl.split(tl.permute(xe, (0, 2, 1)))              # [c, i&1] for i>>1 = 0 / 1
        xo01, xo23 = tl.split(tl.permute(xo, (0, 2, 1)))
        x0e, x1e = tl.split(xe01)
        x2e, x3e = tl.split(xe23)
        x0o, x1o = tl.split(xo01)
        x2o, x3o = tl.split(xo23)
        return (x0e[None, :], x0o[None, :], x1e[None, :], x1o[None, :],
                x2e[None, :], x2o[None, :], x3e[None, :], x3o[None, :])

    @triton.jit
    def _esc_load(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH: tl.constexpr):
        """Escapes ``e .. e + ESC_CH`` (below ``e_hi``) of the CSR lists: rows, columns, deltas."""
        idx = e + tl.arange(0, ESC_CH)
        em = idx < e_hi
        er = tl.load(erow_ptr + idx, mask=em, other=-1)
        ec = tl.load(ecol_ptr + idx, mask=em, other=0)
        ed = tl.load(edelta_ptr + idx, mask=em, other=0.0)
        return er, ec, ed

    @triton.jit
    def _esc_add(y, rows, er, ec, ed, x_ptr, gamma_ptr, K, rstd, NORM: tl.constexpr):
        """``y`` [B] plus the loaded escapes' ``x[col] * delta`` on their rows."""
        contrib = x_at(x_ptr, gamma_ptr, ec, K, rstd, NORM) * ed
        return y + tl.sum(tl.where(er[None, :] == rows[:, None], contrib[None, :], 0.0), axis=1)

    @triton.jit
    def _scale_and_escapes(acc, rows, low, esc0, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi,
                           x_ptr, gamma_ptr, K, rstd, NORM: tl.constexpr, ESC_CH: tl.constexpr):
        """The group's fp32 outputs: the row sums times ``2**(L_n - 112)`` (``low`` the rows' L_n),
        plus the first escape chunk's corrections ``esc0`` (added before the main loop) and the
        rest in CSR order (fixed, so bitwise run to run)."""
        scale = ((low.to(tl.int32) + (127 - 112)) << 23).to(tl.float32, bitcast=True)
        y = tl.sum(acc, axis=1) * scale + esc0
        for e in range(e_lo + ESC_CH, e_hi, ESC_CH):
            er, ec, ed = _esc_load(erow_ptr, ecol_ptr, edelta_ptr, e, e_hi, ESC_CH)
            y = _esc_add(y, rows, er, ec, ed, x_ptr, gamma_ptr, K, rstd, NORM)
        return y

    @triton.jit
    def _w12_gemv_kernel(x_ptr, gamma_ptr, rec64_ptr, rec32_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr,
                         edelta_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                         K, KT, eps, INTER, NH, NKV,
                         stride_ch, stride_cs, stride_dh, stride_ds, stride_rot,
                         NORM: tl.constexpr, EPI: tl.constexpr, HD: tl.constexpr, B: tl.constexpr,
                         RECS: tl.constexpr, STAGES: tl.constexpr, XP: tl.constexpr, ESC_CH: tl.constexpr,
                         FAST: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        rows_a, rows_b, p, d, head = program_rows(pid, INTER, EPI, HD, B)
        a0 = tl.min(rows_a, axis=0)
        b0 = tl.min(rows_b, axis=0)
        tile_a = (a0 // 128).to(tl.int64) * KT
        tile_b = (b0 // 128).to(tl.int64) * KT
        ra = rows_a % 128
        rb = rows_b % 128

        # constant data first: under PDL it is read while the previous kernel drains
        va, na = _load_records(rec64_ptr, rec32_ptr, tile_a, ra, 0, KT, RECS)
        vb, nbb = _load_records(rec64_ptr, rec32_ptr, tile_b, rb, 0, KT, RECS)
        ea_lo = tl.load(eptr_ptr + a0)
        ea_hi = tl.load(eptr_ptr + a0 + B)
        eb_lo = tl.load(eptr_ptr + b0)
        eb_hi = tl.load(eptr_ptr + b0 + B)
        # the row exponents and the first escape chunk too, so the tail waits on none of them
        low_a = tl.load(low_ptr + rows_a)
        low_b = tl.load(low_ptr + rows_b)
        er_a, ec_a, ed_a = _esc_load(erow_ptr, ecol_ptr, edelta_ptr, ea_lo, ea_hi, ESC_CH)
        er_b, ec_b, ed_b = _esc_load(erow_ptr, ecol_ptr, edelta_ptr, eb_lo, eb_hi, ESC_CH)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()       # the previous kernel's writes (x, res, the caches) are visible from here
        rstd = row_rstd(x_ptr, K, eps, NORM, XP)
        zero = tl.zeros((B,), tl.float32)
        esc_a = _esc_add(zero, rows_a, er_a, ec_a, ed_a, x_ptr, gamma_ptr, K, rstd, NORM)
        esc_b = _esc_add(zero, rows_b, er_b, ec_b, ed_b, x_ptr, gamma_ptr, K, rstd, NORM)

        x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o = _x_pairs(x_ptr, gamma_ptr, 0, K, rstd, NORM, RECS)
        acc_a = _fma_records(tl.zeros((B, RECS * 8), tl.float32), va, na, x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o, FAST)
        acc_b = _fma_records(tl.zeros((B, RECS * 8), tl.float32), vb, nbb, x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o, FAST)
        for t0 in tl.range(RECS, KT, RECS, num_stages=STAGES):
            va, na = _load_records(rec64_ptr, rec32_ptr, tile_a, ra, t0, KT, RECS)
            vb, nbb = _load_records(rec64_ptr, rec32_ptr, tile_b, rb, t0, KT, RECS)
            x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o = _x_pairs(x_ptr, gamma_ptr, t0, K, rstd, NORM, RECS)
            acc_a = _fma_records(acc_a, va, na, x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o, FAST)
            acc_b = _fma_records(acc_b, vb, nbb, x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o, FAST)

        dt = y_ptr.dtype.element_ty
        ya = _scale_and_escapes(acc_a, rows_a, low_a, esc_a, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ea_lo, ea_hi,
                                x_ptr, gamma_ptr, K, rstd, NORM, ESC_CH).to(dt)
        yb = _scale_and_escapes(acc_b, rows_b, low_b, esc_b, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, eb_lo, eb_hi,
                                x_ptr, gamma_ptr, K, rstd, NORM, ESC_CH).to(dt)
        epilogue(ya, yb, rows_a, rows_b, p, d, head, y_ptr, res_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                  kc_ptr, vc_ptr, NH, NKV, stride_ch, stride_cs, stride_dh, stride_ds, stride_rot, EPI, HD)


def check_config(cfg: W12GemvConfig) -> None:
    for name in ("pairs", "recs", "warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"W12 GEMV config: {name}={v} must be a power of two")
    if cfg.pairs > 64:
        raise ValueError(f"W12 GEMV config: pairs={cfg.pairs} must divide the 128-row record tile (at most 64)")

def launch(grid, x, gamma, kp, y, res, eps, epi, norm, cfg: W12GemvConfig, inter=0, nh=0, nkv=0, hd=16,
           cos=None, sin=None, pos=None, slot=None, k_cache=None, v_cache=None, fast: bool | None = None,
           pdl: bool = True) -> None:
    """One fused W12 kernel (the arguments of :func:`.gemv._launch`, ``kp`` a W12 ``KernelPack``):
    the Gluon kernel for a ``gemv_w12_gluon.GluonFusedConfig``, else this module's Triton kernel;
    ``fast``: the prmt decode (default: whenever compiled, not under the interpreter); ``pdl``:
    programmatic dependent launch where it runs (:func:`specpilot.kernels.triton_env.pdl_args`)."""
    if isinstance(cfg, gemv_w12_gluon.GluonFusedConfig):
        gemv_w12_gluon.launch(grid, x, gamma, kp, y, res, eps, epi, norm, cfg, inter, nh, nkv, hd,
                              cos, sin, pos, slot, k_cache, v_cache, pdl=pdl)
        return
    check_config(cfg)
    K = kp.shape[1]
    ptrs, strides = epilogue_operands(x, res, cos, sin, pos, slot, k_cache, v_cache)
    _w12_gemv_kernel[grid](
        x, gamma if gamma is not None else x, kp.rec64, kp.rec32, kp.low_exp, kp.esc_rowptr, kp.esc_row,
        kp.esc_col, kp.esc_delta, y, *ptrs,
        K, kp.k_tiles, float(eps), inter, nh, nkv, *strides,
        NORM=norm, EPI=epi, HD=hd, B=cfg.pairs, RECS=cfg.recs, STAGES=cfg.stages,
        XP=triton.next_power_of_2(K) if norm else 1, ESC_CH=ESC_CH,
        FAST=(not interpreting()) if fast is None else fast, num_warps=cfg.warps,
        **pdl_args(pdl, x))

def is_w12(w) -> bool:
    """Whether ``w`` is a W12 ``KernelPack`` (else a dense weight tensor)."""
    return isinstance(w, KernelPack)
