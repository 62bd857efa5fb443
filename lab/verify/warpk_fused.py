"""Lab: the bf16 warp-K GEMM (``kernels/verify/warpk.py``) with the one-row chain's prologues and
epilogue, so that a dense layer of one request's short verify step is seven kernels instead of ten.

The multi-row step runs a row kernel between two GEMMs (``kernels/verify/rows.py``): the residual
add + RMSNorm after the o and down projections, ``silu(gate) * up`` before down. Each is a serial
hop: the GEMM drains, the row kernel reads and writes a few KB, the next GEMM reads them. The
one-row chain (``kernels/decode/gemv.py``) has none of them: its GEMV normalises x as it loads it,
and adds the residual as it stores. Here the warp-K GEMM does the same:

* ``PRO=1`` (norm): after the PDL wait every program sums the squares of its x rows (the rows are a
  few KB each, read from L2), then normalises each x slice as it loads it, rounded where
  ``rms_norm`` rounds (``x * rstd`` to bf16, times gamma to bf16);
* ``PRO=2`` (silu): x slice ``k`` of the down projection is ``bf16(bf16(silu(g)) * u)`` of the
  gate/up product's columns ``k`` and ``inter + k``;
* ``RESID``: the store is ``bf16(res + bf16(x @ W.T))``, the residual add of ``add_rms_norm_rows``.

:func:`hidden_rows` is the dense one-request step through them (``q``/``k``/``v`` RoPE and the
attention as the product runs them); ``lab/verify/step_parts.py --variants product,warpk-fused:8``
times it against the product; :func:`check` compares its GEMMs and whole steps with the product's.
For the measurement below the same kernel ran routed in the engine, where it passed GPU tests
against the row kernels (``silu * up`` and the residual bit for bit, the RMSNorm to the rounding of
its sum's order).

Measured slower, not routed (docs/plans/verify-gemm.md, item 6): on the H100 whole steps of 2 / 4 /
8 rows took 6.71 / 6.86 / 7.27 ms against the product's 5.79 / 5.88 / 6.02 ms, and 16 requests x 1
row 10.26 against 6.57 ms; the row kernels it replaces cost 0.13-0.17 ms a step in all. The sum of
squares is a loop of dependent L2 loads before the first MMA.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_env import pdl_args
from specpilot.kernels.verify import common, warpk as W
from specpilot.kernels.w12.gluon_common import gl, gluon, per_warp, pin

PLAIN, NORM, SILU = 0, 1, 2

if gluon is not None:
    from triton.language.extra.cuda import gdc_wait

    _K = gl.constexpr(W.SLICE_K)

    @gluon.jit
    def _load_xp(px, pg, t, t_end, tx, rstd, inter, PRO: gl.constexpr, L_X: gl.constexpr):
        """x slices ``t`` (one per warp) with the prologue ``PRO`` applied, bf16."""
        off = per_warp(t * _K, L_X)
        ok = tx & per_warp(t < t_end, L_X)
        if PRO == 2:
            g = gl.load(px + off, mask=ok, other=0.0).to(gl.float32)
            u = gl.load(px + off + inter, mask=ok, other=0.0).to(gl.float32)
            s = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16)
            xv = (s.to(gl.float32) * u).to(gl.bfloat16)
        else:
            xv = gl.load(px + off, mask=ok, other=0.0)
            if PRO == 1:
                gm = gl.load(pg + off, mask=ok, other=0.0)
                xn = (xv.to(gl.float32) * rstd).to(gl.bfloat16)
                xv = (gm.to(gl.float32) * xn.to(gl.float32)).to(gl.bfloat16)
        return xv

    @gluon.jit
    def _row_rstd(px, tx, wid, t_end, K, eps, WARPS: gl.constexpr, BM: gl.constexpr, L_X: gl.constexpr):
        """``1 / rms`` of each x row as ``[1, BM, 1]`` in ``L_X``: the warps' slices squared and
        summed, then over the warps."""
        sq = gl.zeros([WARPS, BM, _K], gl.float32, L_X)
        for t in range(0, t_end, WARPS):
            v = gl.load(px + per_warp((t + wid) * _K, L_X), mask=tx & per_warp(t + wid < t_end, L_X),
                        other=0.0).to(gl.float32)
            sq += v * v
        s = gl.sum(gl.sum(sq, axis=2), axis=0)
        rstd = gl.rsqrt(s / K + eps)
        return gl.expand_dims(gl.expand_dims(rstd, 0), 2)

    @gluon.jit
    def _set(acc, w, x, t_next, wid, pw, px, pg, t_end, tx, rstd, inter, PRO: gl.constexpr, WARPS: gl.constexpr,
             ROWS: gl.constexpr, BM: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr,
             B_OP: gl.constexpr):
        acc = W._mma(acc, w, x, WARPS, ROWS, BM, A_OP, B_OP)
        w = W._load_w(pw, t_next + wid, t_end, L_W)
        x = _load_xp(px, pg, t_next + wid, t_end, tx, rstd, inter, PRO, L_X)
        return acc, w, x, pin(wid, True)

    @gluon.jit
    def _fused_kernel(x_ptr, g_ptr, w_ptr, y_ptr, res_ptr, M, N, KT, inter, eps, stride_x, stride_w, stride_y,
                      stride_r, PRO: gl.constexpr, RESID: gl.constexpr,
                      ROWS: gl.constexpr, BM: gl.constexpr, WARPS: gl.constexpr,
                      L_W: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr,
                      A_OP: gl.constexpr, B_OP: gl.constexpr, L_EP: gl.constexpr, PDL: gl.constexpr):
        n0 = gl.program_id(0) * ROWS
        pw, px, tx, wid = W._pointers(x_ptr, w_ptr, n0, M, N, stride_x, stride_w, ROWS, BM, WARPS, L_W, L_X)
        kx = gl.expand_dims(gl.expand_dims(gl.arange(0, _K, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_X))), 0), 1)
        mx = gl.expand_dims(gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_X))), 0), 2)
        pg = g_ptr + mx * 0 + kx
        t_end = KT
        acc = gl.zeros([WARPS, ROWS, BM], gl.float32, MMA)
        w0 = W._load_w(pw, wid, t_end, L_W)
        w1 = W._load_w(pw, WARPS + wid, t_end, L_W)
        w2 = W._load_w(pw, 2 * WARPS + wid, t_end, L_W)
        w3 = W._load_w(pw, 3 * WARPS + wid, t_end, L_W)
        if PDL:
            gdc_wait()
        if PRO == 1:
            rstd = _row_rstd(px, tx, wid, t_end, KT * _K, eps, WARPS, BM, L_X)
        else:
            rstd = gl.full([1, BM, 1], 1.0, gl.float32, L_X)
        x0 = _load_xp(px, pg, wid, t_end, tx, rstd, inter, PRO, L_X)
        x1 = _load_xp(px, pg, WARPS + wid, t_end, tx, rstd, inter, PRO, L_X)
        x2 = _load_xp(px, pg, 2 * WARPS + wid, t_end, tx, rstd, inter, PRO, L_X)
        x3 = _load_xp(px, pg, 3 * WARPS + wid, t_end, tx, rstd, inter, PRO, L_X)
        wid = pin(wid, True)
        for t in range(0, t_end, 4 * WARPS):
            acc, w0, x0, wid = _set(acc, w0, x0, t + 4 * WARPS, wid, pw, px, pg, t_end, tx, rstd, inter, PRO,
                                    WARPS, ROWS, BM, L_W, L_X, A_OP, B_OP)
            acc, w1, x1, wid = _set(acc, w1, x1, t + 5 * WARPS, wid, pw, px, pg, t_end, tx, rstd, inter, PRO,
                                    WARPS, ROWS, BM, L_W, L_X, A_OP, B_OP)
            acc, w2, x2, wid = _set(acc, w2, x2, t + 6 * WARPS, wid, pw, px, pg, t_end, tx, rstd, inter, PRO,
                                    WARPS, ROWS, BM, L_W, L_X, A_OP, B_OP)
            acc, w3, x3, wid = _set(acc, w3, x3, t + 7 * WARPS, wid, pw, px, pg, t_end, tx, rstd, inter, PRO,
                                    WARPS, ROWS, BM, L_W, L_X, A_OP, B_OP)
        part = gl.convert_layout(gl.sum(acc, axis=0), L_EP)
        rn = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_EP))
        rm = gl.arange(0, BM, layout=gl.SliceLayout(0, L_EP))
        ok = (rn < N)[:, None] & (rm < M)[None, :]
        out = part.to(gl.bfloat16)
        if RESID:
            r = gl.load(res_ptr + rm[None, :] * stride_r + rn[:, None], mask=ok, other=0.0)
            out = (r.to(gl.float32) + out.to(gl.float32)).to(gl.bfloat16)
        gl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], out, mask=ok)


def fused_linear(x: torch.Tensor, w: torch.Tensor, pro: int = PLAIN, gamma: torch.Tensor | None = None,
                 eps: float = 0.0, res: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for 1-32 bf16 rows with a prologue on x (``NORM``: ``rms_norm(x, gamma, eps)``;
    ``SILU``: x is a gate/up product ``[M, 2K]``, taken as ``silu(gate) * up``) and, with ``res``, the
    residual added to the product."""
    m = x.shape[0]
    k = w.shape[1]
    n = w.shape[0]
    xin = x[:, :k] if pro == SILU else x
    assert W.supported(xin, w), "shapes"
    bm = W.block_m(m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    l_w, l_x, mma, a_op, b_op, l_ep = W.layouts(W.ROWS, bm, W.WARPS)
    _fused_kernel[(-(-n // W.ROWS),)](x, gamma if gamma is not None else x, w, y, res if res is not None else y,
                                      m, n, k // W.SLICE_K, k, float(eps), x.stride(0), w.stride(0), y.stride(0),
                                      res.stride(0) if res is not None else 0, PRO=pro, RESID=res is not None,
                                      ROWS=W.ROWS, BM=bm, WARPS=W.WARPS, L_W=l_w, L_X=l_x, MMA=mma,
                                      A_OP=a_op, B_OP=b_op, L_EP=l_ep, num_warps=W.WARPS,
                                      **pdl_args(common.USE_PDL, x))
    return y


def takes(model, inp, x, cache, invariant) -> bool:
    """A dense bf16 step of up to 32 rows (one request's, or batched with ``cache``) of a model whose
    layers the one-row chain takes, outside the invariant mode, its weights plain bf16 (no W12)."""
    from specpilot.engine.fused_verify import one_row_chain

    return (not invariant and x.shape[0] <= W.MAX_ROWS and x.dtype == torch.bfloat16 and one_row_chain(model)
            and all(getattr(lin, "weight", None) is not None and getattr(lin, "kp", None) is None
                    for b in model.layers for lin in (b.mixer.wqkv, b.w13)))


def hidden_rows(model, x: torch.Tensor, inp, kv_len: int, layers: int | None = None, cache=None) -> torch.Tensor:
    """``engine.fused_verify.hidden_rows`` for :func:`takes` steps, seven kernels a layer (six in a
    batched step of one row per request, whose RoPE and K/V write the attention's split pass does)."""
    from specpilot.engine import fused_verify as F
    from specpilot.kernels.verify import rows as R

    blocks = model.layers[:layers]
    caches = [None] * len(blocks) if cache is None else cache.layers
    for blk, lc in zip(blocks, caches):
        m = blk.mixer
        qkv = fused_linear(x, m.wqkv.weight, NORM, blk.attn_norm, blk.eps)
        if lc is not None and F._rope_in_attention(m, inp):
            o = F._rope_attend(m, qkv, model, inp, kv_len, lc)
        else:
            kc, vc = (m.k_cache[0], m.v_cache[0]) if lc is None else (lc.k, lc.v)
            q = R.rope_store_rows(qkv, model.cos, model.sin, inp.pos, inp.slots, kc, vc, m.nh, m.nkv,
                                  req=None if lc is None else inp.req)
            o = F._attend(m, q, inp, kv_len, lc)
        x = fused_linear(o, m.wo.weight, res=x)
        gu = fused_linear(x, blk.w13.weight, NORM, blk.mlp_norm, blk.eps)
        x = fused_linear(gu, blk.w2.weight, SILU, res=x)
    return R.rms_norm_rows(x, model.norm, model.spec.rms_norm_eps)


def check(model_name: str = "llama-3.1-8b", rows=(2, 4, 8), ctx: int = 1024) -> list[dict]:
    """Each fused GEMM against its unfused product (row kernel + ``warpk_linear``) on random inputs
    of the model's shapes, then whole steps' final rows against the product's: max |diff| and the
    share of equal values."""
    from lab.verify.step_parts import random_target
    from specpilot.engine import fused_verify as Fv
    from specpilot.engine.rows import step_input
    from specpilot.kernels.verify import rows as R

    model = random_target(model_name, ctx)
    blk = model.layers[0]
    out = []

    def cmp(name, a, b):
        d = (a.float() - b.float()).abs()
        out.append({"check": name, "max_abs": float(d.max()), "equal": float((a == b).float().mean())})
        print(out[-1])

    for n in rows:
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, model.spec.hidden_size, device="cuda", generator=g).bfloat16()
        d = torch.randn(n, model.spec.hidden_size, device="cuda", generator=g).bfloat16()
        s, h = R.add_rms_norm_rows(x, d, blk.mlp_norm, blk.eps)
        cmp(f"{n} rows norm gate/up", fused_linear(s, blk.w13.weight, NORM, blk.mlp_norm, blk.eps),
            W.warpk_linear(h, blk.w13.weight))
        gu = torch.randn(n, 2 * blk.inter, device="cuda", generator=g).bfloat16()
        cmp(f"{n} rows silu down + residual", fused_linear(gu, blk.w2.weight, SILU, res=x),
            R.add_rms_norm_rows(x, W.warpk_linear(R.silu_mul_rows(gu, blk.inter), blk.w2.weight), blk.mlp_norm,
                                blk.eps)[0])
        inp = step_input(model, n, ctx)
        e = model.embed(inp.tokens)
        assert takes(model, inp, e, None, False)
        cmp(f"{n} rows whole step", hidden_rows(model, e, inp, ctx + n), Fv.hidden_rows(model, e, inp, ctx + n))
    return out


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    check()
