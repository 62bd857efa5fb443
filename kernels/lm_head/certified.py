"""Fast certified INT8 LM head (Triton): prep -> INT8 bounds -> select + exact rescoring -> argmax.

Four kernels (five with the device fallback), no host synchronization (CUDA-graph friendly):
1. ``_lm_head_prep``: per row, two-level int8 quantization of h (``h ~ s1 q1 + s2 q2``), ||h|| and ||h - h~||;
2. ``_lm_head_bounds``: INT8 tensor-core GEMM ``q_W @ q_h^T`` (exact int32), approximate logits, the radius
   ``rho``; writes the upper bounds and each block's best lower bound;
3. ``_lm_head_select``: per (row, vocab block) keeps tokens whose upper bound reaches the best lower bound,
   rescores each survivor exactly (fp64 dot of the bf16 values, rounded to fp32) and folds
   ``(logit, -id)`` into one int64 key with an atomic max (order-independent, so deterministic);
4. ``_lm_head_fallback`` (``argmax_exact`` only): the full head on the device for rows with too many
   survivors or a non-finite h; every other program returns after one load;
5. ``_lm_head_finish``: decodes the key into the argmax, saves the survivor count, resets the state.
The naive reference (``naive.certified_argmax_ref``) defines the same results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import tuning
from ..triton_env import interpreting, tl, triton  # sets TRITON_INTERPRET first on a machine without CUDA
from .naive import MARGIN_REL, Int8Head, exact_argmax, quantize_head

INT64_MIN = -(2 ** 63)


if triton is not None:

    @triton.jit
    def _lm_head_prep(h_ptr, hq_ptr, s_ptr, cnt_ptr, H, stride_hm, M_PAD, CAP, BLOCK_H: tl.constexpr):
        m = tl.program_id(0)
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        h = tl.load(h_ptr + m * stride_hm + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.max(tl.abs(h), axis=0) / 127.0
        s1 = tl.where(s1 > 0, s1, 1.0)
        q1 = tl.minimum(tl.maximum(tl.floor(h / s1 + 0.5), -127.0), 127.0)
        r1 = h - q1 * s1
        s2 = tl.max(tl.abs(r1), axis=0) / 127.0
        s2 = tl.where(s2 > 0, s2, 1.0)
        q2 = tl.minimum(tl.maximum(tl.floor(r1 / s2 + 0.5), -127.0), 127.0)
        e = r1 - q2 * s2
        hn = tl.sqrt(tl.sum(h * h, axis=0))
        en = tl.sqrt(tl.sum(e * e, axis=0))
        tl.store(hq_ptr + m * H + offs, q1.to(tl.int8), mask=mask)
        tl.store(hq_ptr + (M_PAD + m) * H + offs, q2.to(tl.int8), mask=mask)
        # rounding of the fp32 arithmetic above is covered by the factors below
        tl.store(s_ptr + m * 4 + 0, s1)
        tl.store(s_ptr + m * 4 + 1, s2)
        tl.store(s_ptr + m * 4 + 2, hn * (1.0 + 1e-5))
        tl.store(s_ptr + m * 4 + 3, en * (1.0 + 1e-5) + hn * 1e-6)
        # a row with inf/nan has no certificate: mark it for the full head (``_lm_head_fallback``)
        tl.store(cnt_ptr + m, tl.where(hn < float("inf"), 0, CAP + 1))

    @triton.jit
    def _lm_head_bounds(q_ptr, hq_ptr, s_ptr, scale_ptr, resid_ptr, qnorm_ptr, ub_ptr, blk_ptr,
                         M, V, H, M_PAD, NB,
                         BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        pid_v = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        v_mask = offs_v < V
        m_mask = offs_m < M
        acc1 = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.int32)
        acc2 = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.int32)
        for k in range(0, H, BLOCK_K):
            kk = k + offs_k
            kmask = kk < H
            a = tl.load(q_ptr + offs_v[:, None].to(tl.int64) * H + kk[None, :],
                        mask=v_mask[:, None] & kmask[None, :], other=0)
            b1 = tl.load(hq_ptr + offs_m[None, :] * H + kk[:, None], mask=m_mask[None, :] & kmask[:, None], other=0)
            b2 = tl.load(hq_ptr + (M_PAD + offs_m[None, :]) * H + kk[:, None],
                         mask=m_mask[None, :] & kmask[:, None], other=0)
            if UPCAST:
                af = a.to(tl.float32)
                acc1 += tl.dot(af, b1.to(tl.float32), input_precision="ieee").to(tl.int32)
                acc2 += tl.dot(af, b2.to(tl.float32), input_precision="ieee").to(tl.int32)
            else:
                acc1 = tl.dot(a, b1, acc1, out_dtype=tl.int32)
                acc2 = tl.dot(a, b2, acc2, out_dtype=tl.int32)
        s1 = tl.load(s_ptr + offs_m * 4 + 0, mask=m_mask, other=0.0)
        s2 = tl.load(s_ptr + offs_m * 4 + 1, mask=m_mask, other=0.0)
        hn = tl.load(s_ptr + offs_m * 4 + 2, mask=m_mask, other=0.0)
        en = tl.load(s_ptr + offs_m * 4 + 3, mask=m_mask, other=0.0)
        sv = tl.load(scale_ptr + offs_v, mask=v_mask, other=0.0)
        rv = tl.load(resid_ptr + offs_v, mask=v_mask, other=0.0)
        qn = tl.load(qnorm_ptr + offs_v, mask=v_mask, other=0.0)
        t1 = acc1.to(tl.float32) * s1[None, :]
        t2 = acc2.to(tl.float32) * s2[None, :]
        approx = sv[:, None] * (t1 + t2)
        rho = (hn[None, :] * rv[:, None] + en[None, :] * qn[:, None]) * (1.0 + 2e-6) \
            + sv[:, None] * (tl.abs(t1) + tl.abs(t2)) * 1e-6
        ub = approx + rho
        lb = tl.where(v_mask[:, None], approx - rho, -float("inf"))
        ok = v_mask[:, None] & m_mask[None, :]
        tl.store(ub_ptr + offs_m[None, :].to(tl.int64) * V + offs_v[:, None], ub, mask=ok)
        tl.store(blk_ptr + offs_m * NB + pid_v, tl.max(lb, axis=0), mask=m_mask)

    @triton.jit
    def _lm_head_select(h_ptr, w_ptr, ub_ptr, blk_ptr, key_ptr, cnt_ptr, slot_ptr, sidx_ptr, sval_ptr,
                         V, H, NB, stride_hm, CAP,
                         BLOCK_V: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_H: tl.constexpr):
        pid_v = tl.program_id(0)
        m = tl.program_id(1)
        best = tl.full((BLOCK_NB,), -float("inf"), tl.float32)
        for b in range(0, NB, BLOCK_NB):
            ob = b + tl.arange(0, BLOCK_NB)
            best = tl.maximum(best, tl.load(blk_ptr + m * NB + ob, mask=ob < NB, other=-float("inf")))
        best_lb = tl.max(best, axis=0)
        thr = best_lb - tl.abs(best_lb) * MARGIN
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        ub = tl.load(ub_ptr + m.to(tl.int64) * V + offs_v, mask=offs_v < V, other=-float("inf"))
        keep = ub >= thr
        left = tl.sum(keep.to(tl.int32), axis=0)
        if left > 0:
            tl.atomic_add(cnt_ptr + m, left)
        # more than CAP here means more than CAP in the row: it goes to the full head, skip the rescoring
        left = tl.where(left > CAP, 0, left)
        offs_h = tl.arange(0, BLOCK_H)
        while left > 0:
            v = tl.min(tl.where(keep, offs_v, 2147483647), axis=0)
            acc = tl.zeros((BLOCK_H,), dtype=tl.float64)
            for k in range(0, H, BLOCK_H):
                kk = k + offs_h
                w = tl.load(w_ptr + v.to(tl.int64) * H + kk, mask=kk < H, other=0.0).to(tl.float64)
                x = tl.load(h_ptr + m * stride_hm + kk, mask=kk < H, other=0.0).to(tl.float64)
                acc += w * x
            z = tl.sum(acc, axis=0).to(tl.float32)
            bits = z.to(tl.int32, bitcast=True)
            skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = (skey.to(tl.int64) << 32) | (2147483647 - v).to(tl.int64)
            tl.atomic_max(key_ptr + m, key)
            slot = tl.atomic_add(slot_ptr + m, 1)
            if slot < CAP:
                tl.store(sidx_ptr + m * CAP + slot, v)
                tl.store(sval_ptr + m * CAP + slot, z)
            keep = keep & (offs_v != v)
            left -= 1

    @triton.jit
    def _lm_head_fallback(h_ptr, w_ptr, cnt_ptr, key_ptr, V, H, stride_hm, CAP,
                           BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
        """The full head, on the device, for rows whose survivors exceeded CAP (``_lm_head_select`` did not
        rescore them) or whose h is not finite: every token's exact logit (fp64 dot of the bf16
        values, rounded to fp32) folded into the row's key. Other rows return at once, so the
        kernel can sit in a CUDA graph at a cost of one load per program."""
        pid_v = tl.program_id(0)
        m = tl.program_id(1)
        if tl.load(cnt_ptr + m) > CAP:
            offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
            vm = offs_v < V
            offs_h = tl.arange(0, BLOCK_H)
            acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float64)
            for k in range(0, H, BLOCK_H):
                kk = k + offs_h
                w = tl.load(w_ptr + offs_v[:, None].to(tl.int64) * H + kk[None, :],
                            mask=vm[:, None] & (kk < H)[None, :], other=0.0).to(tl.float64)
                x = tl.load(h_ptr + m * stride_hm + kk, mask=kk < H, other=0.0).to(tl.float64)
                acc += w * x[None, :]
            z = tl.sum(acc, axis=1).to(tl.float32)
            bits = z.to(tl.int32, bitcast=True)
            skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = (skey.to(tl.int64) << 32) | (2147483647 - offs_v).to(tl.int64)
            key = tl.where(vm & (z == z), key, -9223372036854775807 - 1)   # NaN never wins (as the reference)
            tl.atomic_max(key_ptr + m, tl.max(key, axis=0))

    @triton.jit
    def _lm_head_finish(key_ptr, cnt_ptr, slot_ptr, out_ptr, count_ptr):
        m = tl.program_id(0)
        key = tl.load(key_ptr + m)
        # no key (every logit NaN; or, without the device fallback, a row left to the host): id 0,
        # as the reference's strict ``>`` leaves it
        tl.store(out_ptr + m, tl.where(key == -9223372036854775807 - 1, 0, (2147483647 - (key & 0xFFFFFFFF))).to(tl.int64))
        tl.store(count_ptr + m, tl.load(cnt_ptr + m))
        tl.store(key_ptr + m, -9223372036854775807 - 1)
        tl.store(cnt_ptr + m, 0)
        tl.store(slot_ptr + m, 0)

    MARGIN = tl.constexpr(MARGIN_REL)


@dataclass
class HeadResult:
    argmax: torch.Tensor          # int64 [M]
    survivors: torch.Tensor       # int64 [M]: tokens rescored exactly per row
    fallback: torch.Tensor        # bool [M]: row answered by the full head (too many survivors)


class CertifiedHead:
    """The certified INT8 head on one device. ``head(h)`` -> :class:`HeadResult`.

    ``argmax_async(h)`` runs the four kernels only (no host sync; CUDA-graph capturable) and returns
    the argmax and survivor-count tensors; ``__call__`` adds the fallback to the full head for rows
    where more than ``max_survivors`` tokens survived (a host sync).
    """

    MIN_BLOCK_V = 64

    def __init__(self, weight: torch.Tensor, max_rows: int = 64, max_survivors: int = 256,
                 block_v: int | None = None, block_k: int = 128, num_warps: int = 4, num_stages: int = 4):
        if triton is None:
            raise RuntimeError("triton is not installed")
        self.head: Int8Head = quantize_head(weight)
        self.vocab, self.hidden = weight.shape
        self.max_rows = max_rows
        self.cap = max_survivors
        dev = weight.device
        self.arch = tuning.device_arch(dev)
        # per-block lower bounds, sized for the narrowest tile any config uses
        self.blk = torch.empty(max_rows, triton.cdiv(self.vocab, self.MIN_BLOCK_V), dtype=torch.float32, device=dev)
        self.fixed = None
        if block_v is not None:
            self.configure(block_v, block_k, num_warps, num_stages)
        self.m_pad = max(16, max_rows)
        self.hq = torch.zeros(2 * self.m_pad, self.hidden, dtype=torch.int8, device=dev)
        self.hs = torch.zeros(self.m_pad, 4, dtype=torch.float32, device=dev)
        self.ub = torch.empty(max_rows, self.vocab, dtype=torch.float32, device=dev)
        self.key = torch.full((max_rows,), INT64_MIN, dtype=torch.int64, device=dev)
        self.cnt = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.slot = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.sidx = torch.zeros(max_rows, max_survivors, dtype=torch.int32, device=dev)
        self.sval = torch.zeros(max_rows, max_survivors, dtype=torch.float32, device=dev)
        self.out = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.count = torch.zeros(max_rows, dtype=torch.int32, device=dev)

    def configure(self, block_v: int = 128, block_k: int = 128, num_warps: int = 4, num_stages: int = 4):
        """Fix the tile of the INT8 bounds GEMM (benchmarks/lm_head.py measures several); ``None``
        returns to the measured table's tile for the row count (:meth:`tile`)."""
        if block_v is None:
            self.fixed = None
            return self
        if block_v < self.MIN_BLOCK_V:
            raise ValueError(f"block_v must be >= {self.MIN_BLOCK_V}")
        self.fixed = (block_v, block_k, num_warps, num_stages)
        return self

    def tile(self, m: int) -> tuple[int, int, int, int]:
        """The bounds-GEMM tile ``(block_v, block_k, num_warps, num_stages)`` used for ``m`` rows: the
        fixed one, else the measured table's (``kernels/lm_head/tuned/<arch>.json``)."""
        if self.fixed is not None:
            return self.fixed
        c = tuning.lookup("lm_head", "bounds", self.arch, rows=m)[0]["config"]
        return c["block_v"], c["block_k"], c["num_warps"], c["num_stages"]

    def nbytes_int8(self) -> int:
        return self.head.q.numel() + 12 * self.vocab

    def argmax_async(self, h: torch.Tensor, exact: bool = False):
        """The argmax and survivor counts as device tensors, no host sync (CUDA-graph capturable).
        With ``exact``, rows with more than ``max_survivors`` survivors (or non-finite h) are
        answered by the full head on the device (:func:`_lm_head_fallback`), so the argmax is the exact
        head's in every row; without it, those rows are left to :meth:`__call__`'s host fallback."""
        m, hd = h.shape
        if hd != self.hidden or m > self.max_rows or m < 1:
            raise ValueError(f"h shape {tuple(h.shape)} does not fit this head "
                             f"({self.hidden} hidden, <= {self.max_rows} rows)")
        if h.stride(1) != 1:
            h = h.contiguous()
        up = interpreting()
        block_h = triton.next_power_of_2(hd)
        _lm_head_prep[(m,)](h, self.hq, self.hs, self.cnt, hd, h.stride(0), self.m_pad, self.cap, BLOCK_H=block_h,
                             num_warps=8 if block_h >= 4096 else 4)
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        block_v, block_k, warps, stages = self.tile(m)
        nb = triton.cdiv(self.vocab, block_v)
        _lm_head_bounds[(nb, triton.cdiv(m, bm))](
            self.head.q, self.hq, self.hs, self.head.scale, self.head.resid, self.head.qnorm,
            self.ub, self.blk, m, self.vocab, hd, self.m_pad, nb,
            BLOCK_V=block_v, BLOCK_M=bm, BLOCK_K=block_k, UPCAST=up,
            num_warps=warps, num_stages=stages)
        sel_v = 1024
        _lm_head_select[(triton.cdiv(self.vocab, sel_v), m)](
            h, self.head.weight, self.ub, self.blk, self.key, self.cnt, self.slot, self.sidx, self.sval,
            self.vocab, hd, nb, h.stride(0), self.cap,
            BLOCK_V=sel_v, BLOCK_NB=1024, BLOCK_H=min(1024, block_h), num_warps=4)
        if exact:
            _lm_head_fallback[(triton.cdiv(self.vocab, 16), m)](
                h, self.head.weight, self.cnt, self.key, self.vocab, hd, h.stride(0), self.cap,
                BLOCK_V=16, BLOCK_H=min(256, block_h), num_warps=4)
        _lm_head_finish[(m,)](self.key, self.cnt, self.slot, self.out, self.count)
        return self.out[:m], self.count[:m]

    def argmax_exact(self, h: torch.Tensor) -> torch.Tensor:
        """The exact head's argmax per row (lowest id on ties), no host sync: ``argmax_async`` with
        the device fallback. For CUDA graphs (the engine's ``head=certified``)."""
        return self.argmax_async(h, exact=True)[0]

    def __call__(self, h: torch.Tensor) -> HeadResult:
        if not bool(torch.isfinite(h).all()):
            arg = exact_argmax(h, self.head.weight)
            return HeadResult(arg, torch.full_like(arg, self.vocab), torch.ones_like(arg, dtype=torch.bool))
        arg, count = self.argmax_async(h)
        arg, count = arg.clone(), count.to(torch.int64).clone()
        fb = count > self.cap
        if bool(fb.any()):
            rows = fb.nonzero().flatten()
            arg[rows] = exact_argmax(h[rows], self.head.weight)
        return HeadResult(arg, count, fb)

    def survivor_logits(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and exact logits rescored for ``row`` in the last call (sorted by id)."""
        n = min(int(self.count[row]), self.cap)
        idx = self.sidx[row, :n].to(torch.int64)
        order = idx.argsort()
        return idx[order], self.sval[row, :n][order]
