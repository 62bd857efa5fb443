"""Batched best-first draft trees on the GPU, with one node budget shared across requests (paper 4.4).

``build_batched(tokens [B, m, K], logprobs [B, m, K], transitions [B, m-1, K, K] | None, max_nodes,
budget=None)`` returns :class:`BatchedTrees` of fixed shape ``[B, max_nodes]``: per request the
``max_nodes`` best root paths in best-first order (node i's parent is an earlier node, -1 for a
child of the root), exactly what ``specpilot.kernels.tree.build_best_first`` gives for that
request alone. With ``budget`` (an int or a 0-d device tensor) the whole batch shares that many
nodes, taken from the highest path score over all requests; ``valid``/``count`` say which nodes
each request keeps, always a prefix of its best-first list, so each share is a prefix-closed tree.

One Triton program per request runs the engine's heap itself, in registers, exact (the same trees
as the engine's heap for the same float32 scores): the frontier is a [N, K] tile of int64 keys
(score, then depth, parent node, candidate); each of the N steps pops the maximum (one reduction),
records the node and pushes its K children into the frontier row of that node (one K-wide load,
from L1: the request's lattice is prefetched at the start). Parents come out directly (the row a
node was popped from). The shared budget is a second kernel, one program per request: a node is
kept when fewer than ``budget`` nodes of the batch beat it.

No host syncs and fixed shapes, so the whole builder can be captured in a CUDA graph.
:func:`.naive.build_batched_ref` is the plain-torch reference with the same contract (and the
path off CUDA).
"""

from __future__ import annotations

import os
import torch

from specpilot.kernels.triton_env import tl, triton  # None without triton: the torch path still works

from .build import BatchedTrees
from .naive import build_batched_ref


def _check(tokens, logprobs, transitions, max_nodes):
    if tokens.dim() != 3 or logprobs.shape != tokens.shape:
        raise ValueError(f"tokens and logprobs must both be [B, m, K]; got {tuple(tokens.shape)} and "
                         f"{tuple(logprobs.shape)}")
    B, m, K = tokens.shape
    if transitions is not None and tuple(transitions.shape) != (B, m - 1, K, K):
        raise ValueError(f"transitions must be [B, m-1, K, K] = {[B, m - 1, K, K]}, got {list(transitions.shape)}")
    if max_nodes < 1:
        raise ValueError("max_nodes must be >= 1")


def build_batched(tokens: torch.Tensor, logprobs: torch.Tensor, transitions: torch.Tensor | None,
                  max_nodes: int, budget: torch.Tensor | int | None = None, *, backend: str = "auto",
                  out: BatchedTrees | None = None, num_warps: int | None = None) -> BatchedTrees:
    """Best-first trees for a batch of lattices (see module doc). ``backend``: auto|triton|torch.

    ``out`` reuses preallocated outputs (for CUDA-graph capture); the Triton backend needs float32
    scores and runs on CUDA, or anywhere under ``TRITON_INTERPRET=1``.
    """
    _check(tokens, logprobs, transitions, max_nodes)
    use_triton = backend == "triton" or (backend == "auto" and triton is not None and tokens.is_cuda)
    if not use_triton:
        return build_batched_ref(tokens, logprobs, transitions, max_nodes, budget)
    if triton is None:
        raise RuntimeError("triton is not installed")
    return _build_frontier(tokens, logprobs, transitions, max_nodes, budget, out, num_warps)


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def alloc(B: int, n: int, device, dtype=torch.float32) -> BatchedTrees:
    z = lambda dt: torch.empty((B, n), dtype=dt, device=device)  # noqa: E731
    return BatchedTrees(z(torch.long), z(torch.long), z(torch.long), z(torch.long), z(dtype),
                        z(torch.bool), torch.empty((B,), dtype=torch.long, device=device))


# warps per program of the frontier kernel (one program per request, one node popped per step),
# from the compiled code: one warp per 512 frontier slots (at 1 warp a pop is 233 instructions and
# no barrier, at 4 warps 140 per warp and 3 barriers); 8 for the budget kernel
BUDGET_WARPS = 8


def _frontier_warps(BN: int, BK: int) -> int:
    return max(1, min(4, BN * BK // 512))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _build_frontier(tokens, logprobs, transitions, max_nodes, budget, out, num_warps=None, prefetch=None):
    B, m, K = tokens.shape
    n = int(max_nodes)
    dev = tokens.device
    lp = logprobs.contiguous().to(torch.float32)
    tok = tokens.contiguous()
    has_tr = transitions is not None and m > 1
    tr = transitions.contiguous().to(torch.float32) if has_tr else lp
    BK, BN = _pow2(K), _pow2(n)
    if out is None:
        out = alloc(B, n, dev)
    if prefetch is None:
        prefetch = tokens.is_cuda and not _interpreting()
    # L1 prefetch of the request's lattice: one address per 128-byte line (32 floats, 16 int64)
    PF_TR = _pow2((m - 1) * K * K // 32 + 2) if has_tr else 1
    PF_LP = _pow2(m * K // 32 + 2)
    PF_TOK = _pow2(m * K // 16 + 2)
    _frontier_kernel[(B,)](tok, lp, tr, out.tokens, out.parents, out.depth, out.cand, out.score, out.valid,
                           out.count, M=m, K=K, N=n, BK=BK, BN=BN, LOG_BK=BK.bit_length() - 1,
                           LOG_BN=BN.bit_length() - 1, HAS_TR=has_tr, PREFETCH=bool(prefetch),
                           PF_TR=PF_TR, PF_LP=PF_LP, PF_TOK=PF_TOK, num_warps=num_warps or _frontier_warps(BN, BK))
    if budget is not None:
        b = budget if isinstance(budget, torch.Tensor) else torch.full((), int(budget), dtype=torch.int64, device=dev)
        total = B * n
        CH = min(_pow2(total), max(32, 32768 // BN))          # nodes of the batch compared per step
        _budget_rank_kernel[(B,)](out.score, out.depth, out.valid, out.count, b.reshape(1).to(torch.int64),
                                  TOTAL=total, N=n, BN=BN, CH=CH, NCH=-(-total // CH), num_warps=BUDGET_WARPS)
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
    def _prefetch_l1(ptrs):
        """Hint: bring the lines at ``ptrs`` into L1 (no result; compiled only on CUDA)."""
        return tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _frontier_kernel(tok_ptr, lp_ptr, tr_ptr, o_tok, o_par, o_dep, o_cand, o_score, o_valid, o_count,
                         M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                         LOG_BK: tl.constexpr, LOG_BN: tl.constexpr, HAS_TR: tl.constexpr,
                         PREFETCH: tl.constexpr, PF_TR: tl.constexpr, PF_LP: tl.constexpr, PF_TOK: tl.constexpr):
        """The engine's heap, in registers: N steps, each pops the best frontier child and pushes its
        K children. Frontier slot [row, j] holds child j of row ``row`` (row 0: the root, row q + 1:
        node q); its key orders by score, then depth, then parent node, then candidate, exactly as
        specpilot.kernels.tree's heap does (tie index depth * BN * BK + row * BK + j)."""
        b = tl.program_id(0).to(tl.int64)
        TIE: tl.constexpr = M * BN * BK
        NEG = float("-inf")
        EMPTY = -9223372036854775807 - 1
        if PREFETCH:
            if HAS_TR:
                q = tl.minimum(tl.arange(0, PF_TR) * 32, (M - 1) * K * K - 1)
                _prefetch_l1(tr_ptr + b * (M - 1) * K * K + q)
            q = tl.minimum(tl.arange(0, PF_LP) * 32, M * K - 1)
            _prefetch_l1(lp_ptr + b * M * K + q)
            q = tl.minimum(tl.arange(0, PF_TOK) * 16, M * K - 1)
            _prefetch_l1(tok_ptr + b * M * K + q)
        rk = tl.arange(0, BK)
        rows = tl.arange(0, BN)[:, None]
        cols = rk[None, :]
        # depth 0: the root's children, row 0
        e0 = tl.load(lp_ptr + b * M * K + rk, mask=rk < K, other=NEG)
        k0 = tl.where(tl.abs(e0) < float("inf"), _key(tl.where(e0 == 0.0, 0.0, e0), rk, TIE), EMPTY)
        front = tl.where(rows == 0, k0[None, :], EMPTY)
        rn = tl.arange(0, BN)
        o_s = tl.full([BN], NEG, tl.float32)
        o_d = tl.zeros([BN], tl.int32)
        o_c = tl.zeros([BN], tl.int32)
        o_p = tl.full([BN], -1, tl.int32)
        for n in range(N):
            best = tl.max(front)
            ok = best != EMPTY
            score, tie = _unkey(best, TIE)
            depth = tie >> (LOG_BN + LOG_BK)
            prow = (tie >> LOG_BK) & (BN - 1)
            cj = tie & (BK - 1)
            here = tl.where(ok, rn == n, False)
            o_s = tl.where(here, score, o_s)
            o_d = tl.where(here, depth, o_d)
            o_c = tl.where(here, cj, o_c)
            o_p = tl.where(here, prow - 1, o_p)
            # push node n's children into row n + 1 (node N - 1's are never popped); pop the best
            cd = depth + 1
            grow = ok & (cd < M) & (n + 1 < N)
            mk = tl.where(grow, rk < K, False)        # (a where: the interpreter rejects tensor & scalar masks)
            if HAS_TR:
                e = tl.load(tr_ptr + ((b * (M - 1) + depth) * K + cj) * K + rk, mask=mk, other=NEG)
            else:
                e = tl.load(lp_ptr + (b * M + cd) * K + rk, mask=mk, other=NEG)
            cs = score + e
            nk = _key(tl.where(cs == 0.0, 0.0, cs), (cd << (LOG_BN + LOG_BK)) + ((n + 1) << LOG_BK) + rk, TIE)
            nk = tl.where(tl.abs(e) < float("inf"), nk, EMPTY)
            front = tl.where((rows == prow) & (cols == cj), EMPTY, front)
            front = tl.where(rows == n + 1, nk[None, :], front)
        valid = o_s > NEG
        om = rn < N
        tokv = tl.load(tok_ptr + b * M * K + o_d * K + o_c, mask=valid & om, other=0)
        _store_tree(o_tok, o_par, o_dep, o_cand, o_score, o_valid, o_count, b, b * N + rn, om, tokv,
                    o_p, o_d, o_c, o_s, valid, valid & om)

    @triton.jit
    def _budget_rank_kernel(score_ptr, depth_ptr, valid_ptr, count_ptr, budget_ptr, TOTAL: tl.constexpr,
                            N: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr):
        """Shared budget, one program per request: a node is kept when fewer than ``budget`` nodes of
        the whole batch beat it, in the engine heap's order (higher score, then shallower, then
        earlier request, then earlier rank). A node is valid when its score is > -inf (``valid`` is
        only written, so programs never race)."""
        b = tl.program_id(0)
        rn = tl.arange(0, BN)
        own = b * N + rn
        om = rn < N
        s = tl.load(score_ptr + own, mask=om, other=float("-inf"))
        d = tl.load(depth_ptr + own, mask=om, other=0)
        v = s > float("-inf")
        rank = tl.zeros([BN], tl.int32)
        for c in tl.static_range(NCH):
            q = c * CH + tl.arange(0, CH)
            S = tl.load(score_ptr + q, mask=q < TOTAL, other=float("-inf"))
            D = tl.load(depth_ptr + q, mask=q < TOTAL, other=0)
            tie = (S[None, :] == s[:, None]) & ((D[None, :] < d[:, None])
                                                | ((D[None, :] == d[:, None]) & (q[None, :] < own[:, None])))
            beats = (S[None, :] > s[:, None]) | tie
            rank += tl.sum(beats.to(tl.int32), axis=1)
        budget = tl.load(budget_ptr)
        keep = v & om & (rank < budget)
        tl.store(valid_ptr + own, keep.to(tl.int1), mask=om)
        tl.store(count_ptr + b, tl.sum(keep.to(tl.int64), axis=0))
