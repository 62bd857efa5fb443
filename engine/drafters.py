"""Drafters: each proposes a candidate lattice (DESIGN.md) for the next draft positions.

A :class:`Lattice` holds, per draft position i, up to K candidate tokens sorted by score with
their log-probabilities, and optionally parent-conditioned ``transitions[i-1][k][j]``. Rows may
have fewer than K candidates (the n-gram drafter often knows fewer), and a drafter may return
fewer than m positions, or none (the step then verifies the pending token alone: an AR step).

- ``ngram``: prompt lookup. The last n tokens (n from ``n_max`` down to 1) are looked up in the
  context; the continuations after every earlier match vote. Position-i scores are the log of the
  vote share; transitions are the vote share of candidate j at i among the matches whose token at
  i-1 is candidate k (parent conditioning, at no extra cost).
- ``self``: the target's first ``layers`` layers with its final norm and LM head (early exit).
  It reuses the target's KV cache for those layers, which holds exactly the right keys/values
  because a layer's input depends only on the layers below it.
- ``model``: a separate small model sharing the tokenizer, with its own cache.

``propose_after(context, chain, ...)`` drafts the positions after ``context + chain`` where
``chain`` is not committed (TLV's second draft from the end of the commit chain): the drafter's
own state is left as ``propose(context, ...)`` leaves it, since the exact pass may reject part of
the chain.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from specpilot.engine.model import Transformer
from specpilot.engine.step_input import StepInput


@dataclass
class Lattice:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    transitions: list[list[list[float]]] | None = None

    @property
    def m(self) -> int:
        return len(self.tokens)

    def top1(self) -> list[int]:
        return [row[0] for row in self.tokens]

    @staticmethod
    def empty() -> "Lattice":
        return Lattice([], [], None)


class NGramDrafter:
    name = "ngram"

    def __init__(self, n_max: int = 3, n_min: int = 1, max_matches: int = 64):
        self.n_max, self.n_min, self.max_matches = n_max, n_min, max_matches

    def reset(self, model, prompt_ids):
        pass

    def propose(self, context: list[int], n_cache: int, m: int, k: int) -> Lattice:
        L = len(context)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            key = context[L - n:]
            conts = []
            # most recent matches first; a match must leave at least one token after it
            for s in range(L - n - 1, -1, -1):
                if context[s:s + n] == key:
                    conts.append(context[s + n:s + n + m])
                    if len(conts) >= self.max_matches:
                        break
            if conts:
                return self._lattice(conts, m, k)
        return Lattice.empty()

    def propose_after(self, context, chain, n_cache, m, k) -> Lattice:
        return self.propose(list(context) + list(chain), n_cache, m, k)

    @staticmethod
    def _lattice(conts: list[list[int]], m: int, k: int) -> Lattice:
        tokens, logprobs, trans = [], [], []
        for i in range(m):
            col = [c[i] for c in conts if len(c) > i]
            if not col:
                break
            cnt = Counter(col)
            # sort by votes, then by recency (first seen in the most-recent-first list)
            first = {}
            for t in col:
                first.setdefault(t, len(first))
            cands = sorted(cnt, key=lambda t: (-cnt[t], first[t]))[:k]
            tokens.append(cands)
            logprobs.append([math.log(cnt[t] / len(col)) for t in cands])
            if i > 0:
                prev = tokens[i - 1]
                rows = []
                for pk in prev:
                    sub = Counter(c[i] for c in conts if len(c) > i and c[i - 1] == pk)
                    tot = sum(sub.values())
                    # add-one-half smoothing toward the position's vote share keeps every score finite
                    rows.append([math.log((sub.get(t, 0) + 0.5 * cnt[t] / len(col)) / (tot + 0.5)) for t in cands])
                trans.append(rows)
        return Lattice(tokens, logprobs, trans if tokens else None)


def _topk_rows(logits: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.float(), -1)
    v, i = lp.topk(k, -1)
    return i.tolist(), v.tolist()


@torch.no_grad()
def _rollout(model: Transformer, first_logits, n_next: int, m: int, k: int, layers, kv_len_fn) -> Lattice:
    """AR rollout of m positions from ``model`` (its first ``layers`` layers) along the top-1 chain;
    candidates per position are the top-k of each step's distribution. GDN states are restored."""
    gdn = model.gdn_layers(layers)
    saved = [(g.state.clone(), g.conv_state.clone()) for g in gdn]
    tokens, logprobs = [], []
    logits = first_logits
    slot = n_next
    try:
        for i in range(m):
            t, lp = _topk_rows(logits, k)
            tokens.append(t)
            logprobs.append(lp)
            if i == m - 1:
                break
            dev = model.device
            inp = StepInput(tokens=torch.tensor([t[0]], device=dev), pos=torch.tensor([slot], device=dev),
                            slots=torch.tensor([slot], device=dev),
                            mask=torch.arange(kv_len_fn(slot + 1), device=dev)[None] <= slot, gdn_rows="seq")
            logits = model(inp, kv_len=kv_len_fn(slot + 1), layers=layers)[-1]
            slot += 1
    finally:
        for g, (s, c) in zip(gdn, saved):
            g.state.copy_(s)
            g.conv_state.copy_(c)
    return Lattice(tokens, logprobs, None)


def _seq_input(model: Transformer, context, start: int, end: int, kv_len_fn) -> StepInput:
    """``context[start:end]`` as consecutive rows at cache slots (and positions) start..end-1."""
    dev = model.device
    slots = torch.arange(start, end, device=dev)
    return StepInput(tokens=torch.tensor(context[start:end], device=dev), pos=slots, slots=slots,
                     mask=torch.arange(kv_len_fn(end), device=dev)[None] <= slots[:, None], gdn_rows="seq")


def _fill(model: Transformer, context, start: int, end: int, kv_len_fn, layers=None) -> None:
    """``context[start:end]`` through ``model`` (its first ``layers`` layers) into cache slots
    start..end-1, GDN states advanced; no logits (a captured rollout starts after them)."""
    if end > start:
        model.hidden(_seq_input(model, context, start, end, kv_len_fn), kv_len=kv_len_fn(end), layers=layers)


class SelfDrafter:
    """Early exit from the target's first ``layers`` layers (shares the target's cache)."""

    name = "self"

    def __init__(self, target: Transformer, layers: int):
        self.target, self.layers = target, layers
        self.graphs = None   # CUDA: RolloutGraphs (engine/draft_graph.py), set where the engine captures graphs

    def reset(self, model, prompt_ids):
        pass

    @torch.no_grad()
    def propose(self, context, n_cache, m, k) -> Lattice:
        """``context[n_cache:]`` (the pending token, and a TLV commit chain after it) is not in the
        cache yet: its rows run through the first layers into the slots after the committed
        prefix, which the verification pass overwrites. With graphs the last of them starts the
        captured rollout."""
        t = self.target
        L = len(context)
        if m <= 0 or L + m > t.max_seq:
            return Lattice.empty()
        kv = _kv_len_fn(t.max_seq, t.device)
        gdn = t.gdn_layers(self.layers)
        saved = [(g.state.clone(), g.conv_state.clone()) for g in gdn]
        try:
            if self.graphs is not None:
                _fill(t, context, n_cache, L - 1, kv, self.layers)
                return Lattice(*self.graphs.rollout(context[-1], L - 1, m, k))
            logits = t(_seq_input(t, context, n_cache, L, kv), kv_len=kv(L), layers=self.layers)[-1]
            return _rollout(t, logits, L, m, k, self.layers, kv)
        finally:
            for g, (s, c) in zip(gdn, saved):
                g.state.copy_(s)
                g.conv_state.copy_(c)

    def propose_after(self, context, chain, n_cache, m, k) -> Lattice:
        return self.propose(list(context) + list(chain), n_cache, m, k)


class ModelDrafter:
    """A separate (small) model sharing the target's tokenizer, with its own cache."""

    name = "model"

    def __init__(self, draft: Transformer):
        self.draft = draft
        self.n_done = 0
        self.graphs = None   # CUDA: RolloutGraphs of the draft model (engine/draft_graph.py)

    def reset(self, model, prompt_ids):
        self.draft.reset()
        self.n_done = 0

    def _feed(self, context, start: int):
        """Run ``context[start:]`` through the draft model (cache slots start..); last row's logits."""
        d, L = self.draft, len(context)
        kv = _kv_len_fn(d.max_seq, d.device)
        return d(_seq_input(d, context, start, L, kv), kv_len=kv(L))[-1]

    @torch.no_grad()
    def propose(self, context, n_cache, m, k) -> Lattice:
        d = self.draft
        L = len(context)
        if m <= 0 or L + m + 1 > d.max_seq:
            return Lattice.empty()
        kv = _kv_len_fn(d.max_seq, d.device)
        if self.graphs is not None:   # the rollout's graph runs the last token (and restores GDN states)
            _fill(d, context, self.n_done, L - 1, kv)
            self.n_done = L - 1
            return Lattice(*self.graphs.rollout(context[-1], L - 1, m, k))
        logits = self._feed(context, self.n_done)
        self.n_done = L
        return _rollout(d, logits, L, m, k, None, kv)

    @torch.no_grad()
    def propose_after(self, context, chain, n_cache, m, k) -> Lattice:
        d = self.draft
        L, full = len(context), list(context) + list(chain)
        if not chain:
            return self.propose(context, n_cache, m, k)
        if m <= 0 or len(full) + m + 1 > d.max_seq:
            return Lattice.empty()
        if self.n_done < L:
            self._feed(context, self.n_done)
            self.n_done = L
        gdn = d.gdn_layers()
        saved = [(g.state.clone(), g.conv_state.clone()) for g in gdn]
        try:
            kv = _kv_len_fn(d.max_seq, d.device)
            if self.graphs is not None:
                _fill(d, full, L, len(full) - 1, kv)
                return Lattice(*self.graphs.rollout(full[-1], len(full) - 1, m, k))
            logits = self._feed(full, L)
            return _rollout(d, logits, len(full), m, k, None, kv)
        finally:
            # the chain's KV lies past n_done and is overwritten by the next feed
            for g, (s, c) in zip(gdn, saved):
                g.state.copy_(s)
                g.conv_state.copy_(c)


def _kv_len_fn(max_seq: int, device):
    """Attention reads only the used part of the cache, rounded up to 64 slots (CPU/eager path)."""
    def f(n: int) -> int:
        return min(max_seq, ((n + 63) // 64) * 64)
    return f
