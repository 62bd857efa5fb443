"""The level-sort batched tree kernel: the same trees as :func:`specpilot.kernels.tree.build_batched`
(whose frontier kernel replaced it), kept for side-by-side runs.

Per depth it scores the K children of the N nodes kept one level up, packs (score, tie index) into
int64 keys and keeps the N best by a bitonic sort in registers; then it takes the N best of the
m*N kept nodes and resolves parents. A second one-program kernel sorts the batch for the shared
budget. One program per request; no host syncs, fixed shapes.

    from lab.tree.levels import build_batched_levels
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_env import tl, triton  # noqa: I001 (first: it chooses the interpreter off CUDA)
from specpilot.kernels.tree.batched import _check, alloc

# warps per program of the per-request kernel (one program sorts BN x BK keys per depth): 8 fastest
# on the H200 (lab/tree/warps.py: 62 us vs 72-100 us with 4, 64 with 16)
LEVEL_WARPS = 8


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def build_batched_levels(tokens: torch.Tensor, logprobs: torch.Tensor, transitions: torch.Tensor | None,
                         max_nodes: int, budget: torch.Tensor | int | None = None, *, out=None,
                         num_warps: int | None = None):
    """:func:`specpilot.kernels.tree.build_batched` (Triton backend) with the level-sort kernel."""
    _check(tokens, logprobs, transitions, max_nodes)
    return _build_triton(tokens, logprobs, transitions, max_nodes, budget, out, num_warps)


def _build_triton(tokens, logprobs, transitions, max_nodes, budget, out, num_warps=None):
    B, m, K = tokens.shape
    n = int(max_nodes)
    dev = tokens.device
    lp = logprobs.contiguous().to(torch.float32)
    tok = tokens.contiguous()
    tr = lp if transitions is None else transitions.contiguous().to(torch.float32)
    BN, BK, BM = _pow2(n), _pow2(K), _pow2(m)
    if out is None:
        out = alloc(B, n, dev)
    lv_s = torch.empty((B, BM, BN), dtype=torch.float32, device=dev)
    lv_c = torch.empty((B, BM, BN), dtype=torch.int32, device=dev)
    lv_p = torch.empty((B, BM, BN), dtype=torch.int32, device=dev)
    _tree_levels_kernel[(B,)](tok, lp, tr, lv_s, lv_c, lv_p, out.tokens, out.parents, out.depth, out.cand,
                              out.score, out.valid, out.count,
                              M=m, K=K, N=n, BM=BM, BK=BK, BN=BN, HAS_TR=transitions is not None,
                              num_warps=num_warps or LEVEL_WARPS)
    if budget is not None:
        b = budget if isinstance(budget, torch.Tensor) else torch.full((), int(budget), dtype=torch.int64, device=dev)
        BB = _pow2(B)
        _shared_budget_kernel[(1,)](out.score, out.valid, out.count, b.reshape(1).to(torch.int64),
                                    B=B, N=n, BB=BB, BN=BN, num_warps=8)
    return out


if triton is not None:
    @triton.jit
    def _key(score, tie, TIE_MAX: tl.constexpr):
        """int64 key ordering by score (desc) and then by smaller tie index."""
        bits = score.to(tl.int32, bitcast=True)
        k32 = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return (k32.to(tl.int64) << 32) | (TIE_MAX - tie).to(tl.int64)

    @triton.jit
    def _unkey(key, TIE_MAX: tl.constexpr):
        k32 = (key >> 32).to(tl.int32)
        bits = tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF)
        score = bits.to(tl.float32, bitcast=True)
        low = key - ((key >> 32) << 32)          # the low 32 bits, in int64 arithmetic only
        tie = TIE_MAX - low.to(tl.int32)
        return score, tie

    @triton.jit
    def _top_rows(keys2d, ROWS: tl.constexpr, COLS: tl.constexpr):
        """The COLS largest keys of a [ROWS, COLS] tensor, descending, as [COLS]."""
        flat = tl.reshape(keys2d, [ROWS * COLS])
        srt = tl.sort(flat, descending=True)
        srt2 = tl.reshape(srt, [ROWS, COLS])
        r = tl.arange(0, ROWS)[:, None]
        lowest = -9223372036854775807 - 1
        return tl.max(tl.where(r == 0, srt2, lowest), axis=0)

    @triton.jit
    def _store_tree(o_tok, o_par, o_dep, o_cand, o_score, o_valid, o_count, b, o, mask, tokv, par, dep, cand,
                    score, valid, kept):
        """One request's N node slots and its node count (``kept``: the valid slots inside N)."""
        tl.store(o_tok + o, tokv, mask=mask)
        tl.store(o_par + o, par.to(tl.int64), mask=mask)
        tl.store(o_dep + o, dep.to(tl.int64), mask=mask)
        tl.store(o_cand + o, cand.to(tl.int64), mask=mask)
        tl.store(o_score + o, score, mask=mask)
        tl.store(o_valid + o, valid.to(tl.int1), mask=mask)
        tl.store(o_count + b, tl.sum(kept.to(tl.int64), axis=0))

    @triton.jit
    def _tree_levels_kernel(tok_ptr, lp_ptr, tr_ptr, lvs_ptr, lvc_ptr, lvp_ptr,
                            o_tok, o_par, o_dep, o_cand, o_score, o_valid, o_count,
                            M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
                            BK: tl.constexpr, BN: tl.constexpr, HAS_TR: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BK)
        NEG = float("-inf")
        TIE1: tl.constexpr = BN * BK
        lvs = lvs_ptr + b * BM * BN
        lvc = lvc_ptr + b * BM * BN
        lvp = lvp_ptr + b * BM * BN
        # depth 0: the root is the only parent (slot 0)
        e0 = tl.load(lp_ptr + b * M * K + rk, mask=rk < K, other=NEG)
        child = tl.where((rn == 0)[:, None], 0.0, NEG) + e0[None, :]
        child = tl.where((rn < N)[:, None] & (rk < K)[None, :], child, NEG)
        keys = _key(child, rn[:, None] * BK + rk[None, :], TIE1)
        top = _top_rows(keys, BK, BN)
        ps, tie = _unkey(top, TIE1)
        ps = tl.where(rn < N, ps, NEG)
        pc = tie % BK
        tl.store(lvs + rn, ps)
        tl.store(lvc + rn, pc)
        tl.store(lvp + rn, tl.full([BN], -1, tl.int32))
        for d in range(1, M):
            if HAS_TR:
                eptr = tr_ptr + ((b * (M - 1) + d - 1) * K + pc[:, None]) * K + rk[None, :]
                edge = tl.load(eptr, mask=(rn < N)[:, None] & (rk < K)[None, :], other=NEG)
            else:
                e = tl.load(lp_ptr + (b * M + d) * K + rk, mask=rk < K, other=NEG)
                edge = tl.broadcast_to(e[None, :], [BN, BK])
            child = ps[:, None] + edge
            child = tl.where((rn < N)[:, None] & (rk < K)[None, :], child, NEG)
            keys = _key(child, rn[:, None] * BK + rk[None, :], TIE1)
            top = _top_rows(keys, BK, BN)
            ps, tie = _unkey(top, TIE1)
            ps = tl.where(rn < N, ps, NEG)
            pc = tie % BK
            tl.store(lvs + d * BN + rn, ps)
            tl.store(lvc + d * BN + rn, pc)
            tl.store(lvp + d * BN + rn, tie // BK)
        tl.debug_barrier()
        # the N best of the m*N kept nodes; ties: shallower, then level rank
        rm = tl.arange(0, BM)
        s_all = tl.load(lvs + rm[:, None] * BN + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :],
                        other=NEG)
        TIE2: tl.constexpr = BM * BN
        keys = _key(s_all, rm[:, None] * BN + rn[None, :], TIE2)
        top = _top_rows(keys, BM, BN)
        score, flat = _unkey(top, TIE2)
        dep = flat // BN
        cand = tl.load(lvc + flat, mask=score > NEG, other=0)
        prank = tl.load(lvp + flat, mask=score > NEG, other=0)
        pflat = (dep - 1) * BN + prank
        eq = flat[None, :] == pflat[:, None]                               # [node, other]
        pidx = tl.max(tl.where(eq, rn[None, :], -1), axis=1)
        parent = tl.where(dep > 0, pidx, -1)
        valid = (score > NEG) & (rn < N)
        tokv = tl.load(tok_ptr + b * M * K + dep * K + cand, mask=valid, other=0)
        _store_tree(o_tok, o_par, o_dep, o_cand, o_score, o_valid, o_count, b, b * N + rn, rn < N, tokv,
                    parent, dep, cand, score, valid, valid)

    @triton.jit
    def _shared_budget_kernel(score_ptr, valid_ptr, count_ptr, budget_ptr, B: tl.constexpr, N: tl.constexpr,
                              BB: tl.constexpr, BN: tl.constexpr):
        rb = tl.arange(0, BB)
        rn = tl.arange(0, BN)
        m = (rb < B)[:, None] & (rn < N)[None, :]
        offs = rb[:, None] * N + rn[None, :]
        s = tl.load(score_ptr + offs, mask=m, other=float("-inf"))
        v = tl.load(valid_ptr + offs, mask=m, other=0).to(tl.int1)
        s = tl.where(v, s, float("-inf"))
        TIE: tl.constexpr = BB * BN
        keys = _key(s, rb[:, None] * BN + rn[None, :], TIE)
        srt = tl.sort(tl.reshape(keys, [BB * BN]), descending=True)
        budget = tl.load(budget_ptr)
        pos = tl.arange(0, BB * BN)
        lowest = -9223372036854775807 - 1
        thr = tl.max(tl.where(pos == budget - 1, srt, lowest), axis=0)
        keep = v & (keys >= thr) & (budget > 0)
        tl.store(valid_ptr + offs, keep.to(tl.int1), mask=m)
        tl.store(count_ptr + rb, tl.sum(keep.to(tl.int64), axis=1), mask=rb < B)
