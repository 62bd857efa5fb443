"""TLV cycles in the batch decoder (paper 4.3): every decoding request's cycle in the same step.

Per step, for the requests that draft: draft 1 (the batched drafter's lattices, a best-first tree
of ``nodes`` nodes each), one **Q pass** over all of their trees with the 8-bit view of the
projections (``engine/tlv.py`` ``QView``), run in scratch so every request's KV slots and
recurrent state end as they were; each request's commit chain C (the Q pass's argmax path plus its
bonus token); draft 2 from the end of C for all of them (``BatchDrafting.propose_after``),
truncated to ``nodes - |C|`` and attached under C. The scheduler's verify step is then the **exact
pass** over those trees: the only pass that accepts and writes state, so each request's output is
its AR output, as in the one-request cycle (:class:`specpilot.engine.tlv.TLVDecoder`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specpilot.engine.batch.cache import BatchCache
from specpilot.engine.batch.step import assemble, verify_rows
from specpilot.engine.drafters import Lattice
from specpilot.engine.tlv import TLVStats, cycle_record, q_agreement
from specpilot.kernels import tree as treelib
from specpilot.kernels.gdn.path import row_paths


@dataclass
class Cycle:
    """One request's cycle up to its exact pass: the Q pass's argmax at the root and after every node
    of the draft-1 tree, C's path through that tree (node indices), C's tokens and draft 2."""

    q_argmax: list[int]
    q_path: list[int]
    chain: list[int]
    draft2: Lattice

    def count(self, stats: TLVStats, exact: list[int], accepted: int) -> None:
        """This cycle into ``stats``, its exact pass's argmax ``exact`` accepting ``accepted`` tokens."""
        stats.count(len(self.chain), accepted, q_agreement(self.q_argmax, self.q_path, exact))

    def record(self, nodes: int, first: Lattice) -> dict:
        """The lattice row's ``tlv`` field and ``_m`` (``engine.tlv.cycle_record``)."""
        return cycle_record(nodes, self.q_argmax, self.chain, self.draft2, first)


@contextmanager
def scratch(cache: BatchCache, spans: list[tuple[int, int, int]]):
    """Run a pass whose rows of slot ``s`` sit at cache positions ``start .. start + rows - 1`` for each
    ``(s, start, rows)`` without leaving a trace: those K/V entries are restored afterwards and the GDN
    layers' stashes of the slots are dropped (the pass runs its GDN rows as trees or chains, which
    never advance a state)."""
    saved = []
    for lc in cache.layers:
        if lc.k is not None:
            for s, a, n in spans:
                b = min(a + n, cache.max_seq)
                saved.append((lc, s, a, b, lc.k[s, :, a:b].clone(), lc.v[s, :, a:b].clone()))
    try:
        yield
    finally:
        for lc, s, a, b, k, v in saved:
            lc.k[s, :, a:b] = k
            lc.v[s, :, a:b] = v
        for lc in cache.layers:
            if lc.state is not None:
                for s, _, _ in spans:
                    lc.stash.pop(s, None)


@torch.no_grad()
def q_pass(model, cache: BatchCache, qview, reqs: list[tuple[int, int, int, object]]) -> list[list[int]]:
    """The Q pass of every ``(slot, pending, n_cache, tree)`` in one batched step: the argmax after the
    pending token and after every node of the tree, under the 8-bit view, in scratch."""
    blocks = []
    for slot, pending, n, tree in reqs:
        kind = "tree" if len(tree) else "chain"
        paths = row_paths([-1] + [p + 1 for p in tree.parents]) if kind == "tree" else None
        blocks.append(verify_rows(slot, pending, tree, n, kind, paths))
    inp, kv, need = assemble(blocks, cache.max_seq, model.device)
    flat = [i for nd in need for i in nd]
    with qview.active(), scratch(cache, [(b.slot, b.cslots[0], len(b)) for b in blocks]):
        preds = model.greedy_batch(inp, cache, kv, rows=torch.tensor(flat, device=model.device)).tolist()
    at = dict(zip(flat, preds))
    return [[at[i] for i in nd] for nd in need]


def cycles(dec, decoding, idx: list[int], lats: list[Lattice], trees: list, seconds: dict) -> dict[int, Cycle]:
    """Draft-1 trees, the Q pass, C and draft 2 for the requests ``decoding[b]``, b in ``idx``, whose
    draft-1 lattices are ``lats``; ``trees[b]`` becomes C + the truncated draft-2 subtree (the exact
    pass's tree). ``seconds`` accumulates the phases' wall time."""
    import time

    t0 = time.perf_counter()
    first = [treelib.build_best_first(lt.tokens, lt.logprobs, lt.transitions, dec.nodes) for lt in lats]
    t1 = time.perf_counter()
    reqs = [decoding[b] for b in idx]
    qpreds = q_pass(dec.model, dec.cache, dec.qview,
                    [(r.slot, r.full[-1], r.n_cache, tr) for r, tr in zip(reqs, first)])
    picked = [treelib.accept_predictions(tr, qp) for tr, qp in zip(first, qpreds)]
    t2 = time.perf_counter()
    second = dec.drafting.propose_after([(r.slot, r.prompt_ids + r.full, r.n_cache, chain)
                                         for r, (_, chain) in zip(reqs, picked)], dec.depth, dec.topk)
    out = {}
    for b, qp, (qpath, chain), lat2 in zip(idx, qpreds, picked, second):
        sub = treelib.truncate(treelib.build_best_first(lat2.tokens, lat2.logprobs, lat2.transitions, dec.nodes),
                               dec.nodes - len(chain))
        # no node deeper than the request can take (C is verified whole: its counts compare every node)
        trees[b] = treelib.attach(chain, treelib.within_depth(sub, decoding[b].room() - 1 - len(chain)))
        out[b] = Cycle([int(x) for x in qp], list(qpath), [int(x) for x in chain], lat2)
    t3 = time.perf_counter()
    seconds["draft1"] += t1 - t0
    seconds["qpass"] += t2 - t1
    seconds["draft2"] += t3 - t2
    return out
