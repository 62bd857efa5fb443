"""A model drafter's rollout as one CUDA graph (the ``self`` and ``model`` drafters on a GPU).

Eager, a rollout of m draft positions is m one-row forwards with a host round trip after each
(the top-k goes to the host, the top-1 comes back as the next input): launch-bound, several
times the cost of its kernels (docs/tlv.md has the figures). Here the whole rollout is one
graph per (m, k): the first forward takes the last context token at its slot, each forward's
top-k (of the fp32 log-softmax, as the eager drafter takes it) lands in a device buffer and its
top-1 feeds the next forward in the graph; the GDN layers' states are saved at the start and
restored at the end inside the graph, so the drafter leaves them as it found them. One copy to
the host at the end.

The forwards read the whole static cache under a mask, like the engine's other graphs, so a
draft may round differently from the eager drafter's (which reads a cache prefix); drafts only
propose, verification decides.
"""

from __future__ import annotations

import torch

from specpilot.engine.model import Transformer
from specpilot.engine.step_input import StepInput


class RolloutGraphs:
    """Captured rollouts of ``model``'s first ``layers`` layers (all when None), one per (m, k)."""

    def __init__(self, model: Transformer, layers: int | None = None, warmup: int = 2):
        self.model, self.layers, self.warmup = model, layers, warmup
        self.graphs: dict[tuple[int, int], tuple] = {}

    def _capture(self, m: int, k: int):
        from specpilot.engine.graphs import capture_in_place

        md, dev, S = self.model, self.model.device, self.model.max_seq
        inp = StepInput(torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                        torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, S, dtype=torch.bool, device=dev),
                        "seq")
        slot0 = torch.zeros(1, dtype=torch.long, device=dev)
        token0 = torch.zeros(1, dtype=torch.long, device=dev)
        tok = torch.zeros(m, k, dtype=torch.long, device=dev)
        lp = torch.zeros(m, k, dtype=torch.float32, device=dev)
        ar = torch.arange(S, device=dev)
        live = [t for g in md.gdn_layers(self.layers) for t in (g.state, g.conv_state)]
        kept = [torch.empty_like(t) for t in live]

        def fn():
            for t, s in zip(live, kept):
                s.copy_(t)
            inp.tokens.copy_(token0)
            for i in range(m):
                torch.add(slot0, i, out=inp.pos)
                inp.slots.copy_(inp.pos)
                torch.le(ar, inp.pos, out=inp.mask[0])
                logits = md(inp, kv_len=S, layers=self.layers)[-1]
                v, idx = torch.log_softmax(logits.float(), -1).topk(k, -1)
                tok[i].copy_(idx)
                lp[i].copy_(v)
                inp.tokens.copy_(idx[:1])
            for t, s in zip(live, kept):
                t.copy_(s)
            return tok

        g, _ = capture_in_place(md, fn, self.warmup, m)
        # the graph holds raw pointers: every buffer it reads or writes lives as long as it does
        self.graphs[(m, k)] = (g, token0, slot0, tok, lp, (inp, ar, kept))
        return self.graphs[(m, k)]

    def rollout(self, token: int, slot: int, m: int, k: int):
        """Top-k tokens and log-probabilities ([m][k] host lists) of draft positions 0..m-1, the
        first predicted from ``token`` at cache slot ``slot`` (its position too)."""
        g, token0, slot0, tok, lp, _ = self.graphs.get((m, k)) or self._capture(m, k)
        token0.fill_(token)
        slot0.fill_(slot)
        g.replay()
        return tok.tolist(), lp.tolist()
