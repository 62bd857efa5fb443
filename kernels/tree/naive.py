"""Plain references of the tree builders (tests compare the fast ones against them).

* :func:`all_paths`, :func:`best_scores`: the best-first tree by enumerating every root path of the
  lattice, sorting by path score and keeping the best ``n_nodes``. Exponential in depth; for tests
  on small lattices only.
* :func:`build_batched_ref`: :func:`.batched.build_batched` in plain torch, the same contract
  (shapes, node order, ties) with ordinary torch ops (``torch.sort(stable=True)``), so it runs on
  any device, in any float dtype, and is CUDA-graph capturable too (no host syncs, fixed shapes);
  ``build_batched`` takes it off CUDA.

  Algorithm (level-wise best-first): the best N root paths of a lattice tree, taken together, hold
  at most N nodes per depth, each a child of one of the best N nodes one level up (edge scores are
  log-probabilities, so a child never outscores its parent). So keep, per depth, the N best
  children of the previous depth's N kept nodes, then take the N best of those m*N nodes. Ties
  break as the engine's heap does: higher score, then shallower, then the earlier parent, then the
  lower candidate index.
"""

from __future__ import annotations

import itertools
import math

import torch

from .build import BatchedTrees


def all_paths(tokens, logprobs, transitions):
    """Every root path as (candidate-index tuple, path score)."""
    out = []
    for d in range(1, len(tokens) + 1):
        for combo in itertools.product(*[range(len(tokens[i])) for i in range(d)]):
            s = 0.0
            for i, j in enumerate(combo):
                e = logprobs[i][j] if (i == 0 or transitions is None) else transitions[i - 1][combo[i - 1]][j]
                s += e
            if math.isfinite(s):
                out.append((combo, s))
    return out


def best_scores(tokens, logprobs, transitions, n_nodes):
    """The path scores of the ``n_nodes`` best root paths, best first (well defined under ties)."""
    return sorted((s for _, s in all_paths(tokens, logprobs, transitions)), reverse=True)[:n_nodes]



def _levels(tokens, logprobs, transitions, n):
    """Per depth, the n best children of the previous depth's n best: scores, cands, parent ranks."""
    B, m, K = tokens.shape
    dt = logprobs.dtype
    dev = logprobs.device
    neg = torch.full((), float("-inf"), dtype=dt, device=dev)
    # depth 0: the root's children
    s0 = logprobs[:, 0, :]
    if K < n:
        s0 = torch.cat([s0, neg.expand(B, n - K)], 1)
    s0, o0 = torch.sort(s0, dim=1, descending=True, stable=True)
    ps, pc = s0[:, :n], o0[:, :n]
    pc = torch.where(pc < K, pc, torch.zeros_like(pc))
    scores, cands, pars = [ps], [pc], [torch.full_like(pc, -1)]
    for d in range(1, m):
        if transitions is None:
            edge = logprobs[:, d, :].unsqueeze(1).expand(B, n, K)
        else:
            edge = torch.gather(transitions[:, d - 1], 1, pc.unsqueeze(-1).expand(B, n, K))
        child = ps.unsqueeze(-1) + edge                     # [B, n, K], parent-major
        flat = child.reshape(B, n * K)
        s, o = torch.sort(flat, dim=1, descending=True, stable=True)
        ps = s[:, :n]
        par = torch.div(o[:, :n], K, rounding_mode="floor")
        pc = o[:, :n] % K
        scores.append(ps)
        cands.append(pc)
        pars.append(par)
    return torch.stack(scores, 1), torch.stack(cands, 1), torch.stack(pars, 1)   # [B, m, n]


def build_batched_ref(tokens: torch.Tensor, logprobs: torch.Tensor, transitions: torch.Tensor | None,
                      max_nodes: int, budget: torch.Tensor | int | None = None):
    """Best-first trees for a batch; see :func:`.batched.build_batched`."""
    B, m, K = tokens.shape
    n = int(max_nodes)
    lv_s, lv_c, lv_p = _levels(tokens, logprobs, transitions, n)
    flat = lv_s.reshape(B, m * n)                             # depth-major: ties favour shallower
    s, o = torch.sort(flat, dim=1, descending=True, stable=True)
    sel = o[:, :n]
    score = s[:, :n]
    depth = torch.div(sel, n, rounding_mode="floor")
    cand = torch.gather(lv_c.reshape(B, m * n), 1, sel)
    par_rank = torch.gather(lv_p.reshape(B, m * n), 1, sel)
    par_flat = (depth - 1) * n + par_rank
    # output index of each selected node's parent
    inv = torch.full((B, m * n), -1, dtype=torch.long, device=tokens.device)
    inv.scatter_(1, sel, torch.arange(n, device=tokens.device).expand(B, n))
    parents = torch.where(depth > 0, torch.gather(inv, 1, par_flat.clamp_min(0)), torch.full_like(sel, -1))
    tok = torch.gather(tokens.reshape(B, m * K), 1, depth * K + cand)
    valid = torch.isfinite(score)
    if budget is not None:
        valid = valid & _shared_mask(score, depth, valid, budget)
    count = valid.sum(1)
    return BatchedTrees(tok, parents, depth, cand, score, valid, count)


def _shared_mask(score: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor, budget) -> torch.Tensor:
    """Keep the ``budget`` best nodes over all requests, in the engine heap's order (ties: shallower,
    then earlier request, then rank)."""
    B, n = score.shape
    flat = torch.where(valid, score, torch.full_like(score, float("-inf"))).reshape(B * n)
    # stable sorts, least significant key first: depth (ties: request, rank), then score
    by_depth = torch.sort(depth.reshape(B * n), stable=True).indices
    o = by_depth[torch.sort(flat[by_depth], descending=True, stable=True).indices]
    pos = torch.empty_like(o)
    pos[o] = torch.arange(B * n, device=score.device)
    b = budget if isinstance(budget, torch.Tensor) else torch.full((), int(budget), device=score.device)
    return (pos < b).reshape(B, n)
