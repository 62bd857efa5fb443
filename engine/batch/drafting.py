"""Drafting for a batch of requests: one lattice per request per step.

* ``ngram``: the engine's prompt-lookup drafter, per request on the host (it keeps no state).
* ``self``: the target's first ``layers`` layers (early exit) on the target's own batch cache; all
  requests roll out together, one row each per draft position.
* ``model``: a separate draft model with its own batch cache (same slots as the target's); each
  step first feeds every request the tokens committed since its last draft, then rolls out.

GDN states touched by a rollout are restored afterwards (the rollout tokens are not committed).
"""

from __future__ import annotations

import torch

from specpilot.engine.batch.cache import BatchCache
from specpilot.engine.drafters import Lattice, NGramDrafter
from specpilot.engine.step_input import BatchStepInput, Segment


def kv_len(max_seq: int, n: int) -> int:
    """Cache positions an eager step reads: ``n`` rounded up to 64 (at most the cache)."""
    return min(max_seq, ((n + 63) // 64) * 64)


def feed(model, cache: BatchCache, reqs: list[tuple[int, int, list[int]]], layers: int | None = None) -> torch.Tensor:
    """One step of every request's ``tokens`` (``(slot, start, tokens)``: at cache positions
    ``start..``, causal, attending their slot's positions before them) through ``model``'s first
    ``layers`` layers; the logits of each request's last row [B, V]."""
    dev = model.device
    toks, pos, segs, last = [], [], [], []
    for slot, start, new in reqs:
        segs.append(Segment(slot, len(toks), len(new)))
        pos.extend(range(start, start + len(new)))
        toks.extend(new)
        last.append(len(toks) - 1)
    kv = kv_len(cache.max_seq, max(start + len(new) for _, start, new in reqs))
    p = torch.tensor(pos, device=dev)
    mask = torch.arange(kv, device=dev)[None] <= p[:, None]
    req = torch.tensor([sg.slot for sg in segs for _ in range(sg.rows)], device=dev)
    return model.logits_batch(BatchStepInput(torch.tensor(toks, device=dev), p, p.clone(), req, mask, segs),
                              cache, kv, rows=torch.tensor(last, device=dev), layers=layers)


def _topk(logits: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.float(), -1)
    v, i = lp.topk(k, -1)
    return i, v


@torch.no_grad()
def rollout(model, cache: BatchCache, first_logits: torch.Tensor, slots: list[int], starts: list[int], m: int,
            k: int, layers: int | None = None) -> list[Lattice]:
    """AR rollout of ``m`` positions for every request along its top-1 chain: position 0's
    candidates from ``first_logits`` [B, V], position i+1 fed at cache position ``starts[b] + i``."""
    B = len(slots)
    toks = [[] for _ in range(B)]
    lps = [[] for _ in range(B)]
    logits = first_logits
    for i in range(m):
        idx, val = _topk(logits, k)
        il, vl = idx.tolist(), val.tolist()
        for b in range(B):
            toks[b].append(il[b])
            lps[b].append(vl[b])
        if i == m - 1:
            break
        logits = feed(model, cache, [(s, st + i, [r[0]]) for s, st, r in zip(slots, starts, il)], layers)
    return [Lattice(t, lp, None) for t, lp in zip(toks, lps)]


class BatchDrafting:
    """The engine's drafter for a batch (``kind``: ngram, self, model)."""

    def __init__(self, kind: str, target, cache: BatchCache, *, layers: int | None = None, draft_model=None):
        self.kind, self.target, self.cache, self.layers = kind, target, cache, layers
        self.ngram = NGramDrafter() if kind == "ngram" else None
        self.draft = draft_model
        self.draft_cache = BatchCache(draft_model, cache.slots) if kind == "model" else None
        self.n_done = [0] * cache.slots   # model drafter: tokens of each slot's context in the draft cache

    # slots follow the target cache's
    def admit(self, slot: int) -> None:
        if self.draft_cache is not None:
            self.draft_cache.reset(slot)
            self.n_done[slot] = 0

    def move(self, src: int, dst: int) -> None:
        if self.draft_cache is not None:
            self.draft_cache.move(src, dst)
            self.n_done[dst] = self.n_done[src]

    def clear(self) -> None:
        if self.draft_cache is not None:
            self.draft_cache.clear()
            self.n_done = [0] * len(self.n_done)

    @torch.no_grad()
    def propose(self, reqs: list[tuple[int, list[int], int]], m: int, k: int) -> list[Lattice]:
        """One lattice of up to ``m`` positions x ``k`` candidates per request ``(slot, context,
        n_cache)`` (context ends with the pending token, which sits at cache position n_cache)."""
        if not reqs or m <= 0:
            return [Lattice.empty() for _ in reqs]
        if self.kind == "ngram":
            return [self.ngram.propose(ctx, n, m, k) for _, ctx, n in reqs]
        slots = [s for s, _, _ in reqs]
        if self.kind == "self":
            return self._self(reqs, slots, m, k)
        return self._model(reqs, slots, m, k)

    @torch.no_grad()
    def propose_after(self, reqs: list[tuple[int, list[int], int, list[int]]], m: int, k: int) -> list[Lattice]:
        """TLV's second draft: one lattice per request ``(slot, context, n_cache, chain)`` drafted from
        the end of ``context + chain``. The chain is not committed: its rows go through the drafter's
        cache past the request's context (overwritten later) and its recurrent states are restored."""
        if not reqs or m <= 0:
            return [Lattice.empty() for _ in reqs]
        if self.kind == "ngram":
            return [self.ngram.propose(list(ctx) + list(ch), n, m, k) for _, ctx, n, ch in reqs]
        slots = [s for s, _, _, _ in reqs]
        if self.kind == "self":
            return self._self([(s, list(ctx) + list(ch), n) for s, ctx, n, ch in reqs], slots, m, k)
        if any(self.n_done[s] < len(ctx) for s, ctx, _, _ in reqs):   # the contexts first, committed
            self._feed_context([(s, ctx, n) for s, ctx, n, _ in reqs if self.n_done[s] < len(ctx)])
        d, cache = self.draft, self.draft_cache
        saved = cache.save_states(slots)
        try:
            logits = feed(d, cache, [(s, len(ctx), list(ch)) for s, ctx, _, ch in reqs])
            return rollout(d, cache, logits, slots, [len(ctx) + len(ch) for _, ctx, _, ch in reqs], m, k)
        finally:
            BatchCache.restore_states(saved, slots)

    def _self(self, reqs, slots, m, k):
        """Early exit: each request's rows from its pending token on (``context[n_cache:]``) through the
        first layers at their cache positions, then the rollout; GDN states restored."""
        t, cache = self.target, self.cache
        saved = cache.save_states(slots, self.layers)
        try:
            logits = feed(t, cache, [(s, n, list(ctx[n:])) for s, ctx, n in reqs], self.layers)
            return rollout(t, cache, logits, slots, [len(ctx) for _, ctx, _ in reqs], m, k, self.layers)
        finally:
            BatchCache.restore_states(saved, slots)

    def _feed_context(self, reqs):
        """The draft model takes each request's context past what it has seen (committed)."""
        logits = feed(self.draft, self.draft_cache,
                      [(s, self.n_done[s], list(ctx[self.n_done[s]:])) for s, ctx, _ in reqs])
        for slot, ctx, _ in reqs:
            self.n_done[slot] = len(ctx)
        return logits

    def _model(self, reqs, slots, m, k):
        d, cache = self.draft, self.draft_cache
        logits = self._feed_context(reqs)
        saved = cache.save_states(slots)
        try:
            return rollout(d, cache, logits, slots, [len(ctx) for _, ctx, _ in reqs], m, k)
        finally:
            BatchCache.restore_states(saved, slots)

