"""Batched best-first draft trees on the GPU, with one node budget shared across requests (paper 4.4).

``build_batched(tokens [B, m, K], logprobs [B, m, K], transitions [B, m-1, K, K] | None, max_nodes,
budget=None)`` returns :class:`BatchedTrees` of fixed shape ``[B, max_nodes]``: per request the
``max_nodes`` best root paths in best-first order (node i's parent is an earlier node, -1 for a
child of the root), exactly what ``specpilot.kernels.tree.build_best_first`` gives for that
request alone. With ``budget`` (an int or a 0-d device tensor) the whole batch shares that many
nodes, taken from the highest path score over all requests; ``valid``/``count`` say which nodes
each request keeps, always a prefix of its best-first list, so each share is a prefix-closed tree.

The Triton kernel runs one program per request: per depth it scores the K children of the N nodes
kept one level up (transitions gathered by parent candidate), packs (score, tie index) into int64
keys and keeps the N best by a bitonic sort in registers; then it takes the N best of the m*N kept
nodes and resolves parents. A second one-program kernel applies the shared budget. No host syncs
and fixed shapes, so the whole builder can be captured in a CUDA graph. ``tree_batched_ref`` is
the plain-torch reference with the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing: the torch path still works
    triton = None
    tl = None


@dataclass
class BatchedTrees:
    tokens: torch.Tensor    # [B, N] int64
    parents: torch.Tensor   # [B, N] int64, -1 = child of the root
    depth: torch.Tensor     # [B, N] int64, 0-based draft position
    cand: torch.Tensor      # [B, N] int64, candidate index at that position
    score: torch.Tensor     # [B, N] float, path score (-inf: no such node)
    valid: torch.Tensor     # [B, N] bool, node kept (budget and existence)
    count: torch.Tensor     # [B] int64, nodes kept per request (valid is a prefix)

    def request(self, b: int):
        """Request ``b``'s kept nodes as a ``specpilot.kernels.tree.DraftTree`` (host copy)."""
        from .tree import DraftTree

        c = int(self.count[b])
        cut = lambda t: tuple(t[b, :c].tolist())  # noqa: E731
        return DraftTree(cut(self.tokens), cut(self.parents), cut(self.depth), cut(self.cand),
                         tuple(float(x) for x in self.score[b, :c].tolist()))


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
        from .tree_batched_ref import build_batched_ref

        return build_batched_ref(tokens, logprobs, transitions, max_nodes, budget)
    if triton is None:
        raise RuntimeError("triton is not installed")
    return _build_triton(tokens, logprobs, transitions, max_nodes, budget, out, num_warps)


# warps per program of the per-request kernel (one program sorts BN x BK keys per depth): 8 was
# fastest on the H200 (benchmarks/results/tree_builder_warps.json: 62 us vs 72-100 us with 4, 64 with 16)
LEVEL_WARPS = 8


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def alloc(B: int, n: int, device, dtype=torch.float32) -> BatchedTrees:
    z = lambda dt: torch.empty((B, n), dtype=dt, device=device)  # noqa: E731
    return BatchedTrees(z(torch.long), z(torch.long), z(torch.long), z(torch.long), z(dtype),
                        z(torch.bool), torch.empty((B,), dtype=torch.long, device=device))


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
        o = b * N + rn
        mask = rn < N
        tl.store(o_tok + o, tokv, mask=mask)
        tl.store(o_par + o, parent.to(tl.int64), mask=mask)
        tl.store(o_dep + o, dep.to(tl.int64), mask=mask)
        tl.store(o_cand + o, cand.to(tl.int64), mask=mask)
        tl.store(o_score + o, score, mask=mask)
        tl.store(o_valid + o, valid.to(tl.int1), mask=mask)
        tl.store(o_count + b, tl.sum(valid.to(tl.int64), axis=0))

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
