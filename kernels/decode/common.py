"""Pieces shared by the fused one-row decode kernels (:mod:`.gemv`, :mod:`.gemv_w12`,
:mod:`.gemv_w12_gluon`): the epilogue kinds, the ``NORM`` prologue's x (:func:`x_at`,
:func:`row_rstd`), a program's rows (:func:`program_rows`), the Triton epilogues
(:func:`epilogue`) and their operands (:func:`epilogue_operands`)."""

from __future__ import annotations

from specpilot.kernels.triton_env import tl, triton

EPI_RESID, EPI_SILU, EPI_ROPE, EPI_PLAIN = 1, 2, 3, 4
EPI_NAMES = {EPI_RESID: "resid", EPI_SILU: "silu", EPI_ROPE: "rope", EPI_PLAIN: "plain"}


def epilogue_operands(x, res, cos, sin, pos, slot, k_cache, v_cache) -> tuple[tuple, tuple]:
    """The fused kernels' epilogue pointers ``(res, cos, sin, pos, slot, k_cache, v_cache)``, ``x``
    standing in for those an epilogue does not use, and their strides ``(stride_ch, stride_cs,
    stride_dh, stride_ds, stride_rot)``."""
    ptrs = tuple(t if t is not None else x for t in (res, cos, sin, pos, slot, k_cache, v_cache))
    cs = k_cache.stride() if k_cache is not None else (0, 0, 0)
    vs = v_cache.stride() if v_cache is not None else (0, 0, 0)
    return ptrs, (cs[0], cs[1], vs[0], vs[1], cos.stride(0) if cos is not None else 0)


if triton is not None:

    @triton.jit
    def x_at(x_ptr, gamma_ptr, kk, K, rstd, NORM: tl.constexpr):
        """x[kk] (offsets of any shape, 0 from K on) in fp32; with ``NORM`` RMS-normalised and scaled
        by gamma, rounded to x's dtype at the two points ``rms_norm`` rounds."""
        km = kk < K
        xv = tl.load(x_ptr + kk, mask=km, other=0.0)
        if NORM:
            g = tl.load(gamma_ptr + kk, mask=km, other=0.0)
            xn = (xv.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
            xv = (g.to(tl.float32) * xn.to(tl.float32)).to(x_ptr.dtype.element_ty)
        return xv.to(tl.float32)

    @triton.jit
    def program_rows(pid, INTER, EPI: tl.constexpr, HD: tl.constexpr, B: tl.constexpr):
        """The program's two row groups ``rows_a``/``rows_b`` (B rows each) and, for the epilogues,
        the gate/up index ``p``, the RoPE dim ``d`` and the head ``head``."""
        i = tl.arange(0, B)
        p = pid * B + i
        d = p
        head = pid
        if EPI == 2:      # gate row p, up row INTER + p
            rows_a = p
            rows_b = INTER + p
        elif EPI == 3:    # dims d and d + HD/2 of head h
            HALF: tl.constexpr = HD // 2
            head = (pid * B) // HALF
            d = p % HALF
            rows_a = head * HD + d
            rows_b = rows_a + HALF
        else:             # rows pid*2B .. +B and +B .. +2B
            rows_a = pid * (2 * B) + i
            rows_b = rows_a + B
        return rows_a, rows_b, p, d, head

    @triton.jit
    def row_rstd(x_ptr, K, eps, NORM: tl.constexpr, XP: tl.constexpr):
        """1/RMS of the row for ``NORM`` (the whole row in one load: a few KB, L2-resident), else 1."""
        if NORM:
            kx = tl.arange(0, XP)
            xr = tl.load(x_ptr + kx, mask=kx < K, other=0.0).to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xr * xr, axis=0) / K + eps)
        else:
            rstd = 1.0
        return rstd

    @triton.jit
    def epilogue(ya, yb, rows_a, rows_b, p, d, head, y_ptr, res_ptr,
                  cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, NH, NKV,
                  stride_ch, stride_cs, stride_dh, stride_ds, stride_rot,
                  EPI: tl.constexpr, HD: tl.constexpr):
        """The fused epilogues on the row groups' outputs ``ya``/``yb`` (already in y's dtype)."""
        dt = y_ptr.dtype.element_ty
        HALF: tl.constexpr = HD // 2
        if EPI == 1:
            ra = tl.load(res_ptr + rows_a).to(tl.float32)
            rb = tl.load(res_ptr + rows_b).to(tl.float32)
            tl.store(y_ptr + rows_a, (ra + ya.to(tl.float32)).to(dt))
            tl.store(y_ptr + rows_b, (rb + yb.to(tl.float32)).to(dt))
        elif EPI == 4:
            tl.store(y_ptr + rows_a, ya)
            tl.store(y_ptr + rows_b, yb)
        elif EPI == 2:
            gf = ya.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(dt)
            tl.store(y_ptr + p, (s.to(tl.float32) * yb.to(tl.float32)).to(dt))
        else:
            pos = tl.load(pos_ptr)
            slot = tl.load(slot_ptr)
            c1 = tl.load(cos_ptr + pos * stride_rot + d).to(dt).to(tl.float32)
            c2 = tl.load(cos_ptr + pos * stride_rot + d + HALF).to(dt).to(tl.float32)
            s1 = tl.load(sin_ptr + pos * stride_rot + d).to(dt).to(tl.float32)
            s2 = tl.load(sin_ptr + pos * stride_rot + d + HALF).to(dt).to(tl.float32)
            a = ya.to(tl.float32)
            b = yb.to(tl.float32)
            # rotate-half: [a, b] -> [a c - b s, b c + a s], each product rounded as the layer does
            ra = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
            rb = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
            is_q = rows_a < NH * HD
            is_k = (rows_a >= NH * HD) & (rows_a < (NH + NKV) * HD)
            is_v = rows_a >= (NH + NKV) * HD
            tl.store(y_ptr + rows_a, ra, mask=is_q)
            tl.store(y_ptr + rows_b, rb, mask=is_q)
            kh = head - NH
            kbase = kc_ptr + kh * stride_ch + slot * stride_cs
            tl.store(kbase + d, ra, mask=is_k)
            tl.store(kbase + d + HALF, rb, mask=is_k)
            vh = head - NH - NKV
            vbase = vc_ptr + vh * stride_dh + slot * stride_ds
            tl.store(vbase + d, ya, mask=is_v)
            tl.store(vbase + d + HALF, yb, mask=is_v)
