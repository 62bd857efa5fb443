"""The draft side of a batched verify step: from the requests' lattices to their trees.

Each request verifies at most its block of draft positions (``block=adaptive``: 100/75/50% of
the depth, picked on the GPU from its recent accepted lengths and its draft's confidence), and the
step's node budget is filled by the batched tree builder (``budget``: shared best-first over all
requests, or equal per request; :mod:`.rules`). The recent accepted lengths are a ring per cache
slot, kept here and moved with the slots (:class:`DraftPlanner`).
"""

from __future__ import annotations

import torch

from specpilot.engine.batch import rules
from specpilot.engine.batch.graphs import bucket
from specpilot.engine.drafters import Lattice


class DraftPlanner:
    """Trees for the drafting requests of a batch of ``batch`` slots (``mode`` chain, tree or tlv;
    ``nodes`` the node budget per request, ``depth`` and ``topk`` the drafter's lattice shape)."""

    def __init__(self, mode: str, nodes: int, depth: int, topk: int, batch: int, budget: str, block: str,
                 device):
        self.mode, self.nodes, self.depth, self.topk = mode, nodes, depth, topk
        self.batch, self.budget, self.block = batch, budget, block
        self.sizes = rules.block_sizes(depth)
        self.recent = torch.full((batch, rules.BLOCK_WINDOW), float("nan"), device=device)
        self.recent_at = [0] * batch

    # ---- the slots' rings of recent accepted lengths ------------------------------------
    def reset(self) -> None:
        """Every slot's ring empty (after warm-up)."""
        self.recent.fill_(float("nan"))
        self.recent_at = [0] * self.batch

    def admit(self, slot: int) -> None:
        """A new request in ``slot``: its ring starts empty."""
        self.recent[slot] = float("nan")
        self.recent_at[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """The request in slot ``src`` moves to ``dst`` (a finished request's hole)."""
        self.recent[dst] = self.recent[src]
        self.recent_at[dst] = self.recent_at[src]

    def note_accepted(self, accepted: list[tuple[int, int]]) -> None:
        """Each verifying request's accepted draft length ``(slot, length)`` into its ring (one
        indexed write on the device; AR steps draft nothing, so there is nothing to note)."""
        if not accepted or self.mode == "ar":
            return
        slots = [s for s, _ in accepted]
        cols = [self.recent_at[s] % rules.BLOCK_WINDOW for s in slots]
        dev = self.recent.device
        self.recent[torch.tensor(slots, device=dev), torch.tensor(cols, device=dev)] = \
            torch.tensor([float(n) for _, n in accepted], device=dev)
        for s in slots:
            self.recent_at[s] += 1

    # ---- trees ----------------------------------------------------------------------------
    def build(self, lats: list, slots: list[int]) -> tuple[list | None, int, int]:
        """Trees for the lattices ``lats`` of the requests in ``slots`` (block rule, node budget; a
        chain keeps each position's first candidate): the host trees (None where no lattice drafted
        anything), the draft positions proposed and those kept inside the requests' blocks."""
        if self.mode == "chain":
            lats = [type(lt)([row[:1] for row in lt.tokens], [row[:1] for row in lt.logprobs], None) for lt in lats]
        drafted = sum(lt.m for lt in lats)
        if max((lt.m for lt in lats), default=0) == 0:
            return None, drafted, 0
        host, kept = self.trees(lats, slots)
        return [host.request(j) for j in range(len(lats))], drafted, kept

    def trees(self, lats: list, slots: list[int]):
        """The batched builder's trees (on the host) for lattices of the requests in ``slots``, and
        the draft positions kept. The builder's kernels see one shape per request bucket: lattices
        pad to the decoder's depth and top-k, the requests to their bucket (empty lattices, no
        nodes), so a step never compiles what warm-up did not."""
        dev = self.recent.device
        n = len(lats)
        m = max([self.depth] + [lt.m for lt in lats])
        k = max([self.topk] + [len(row) for lt in lats for row in lt.tokens])
        pad = bucket(n, self.batch) - n
        tok, lp, tr = rules.pack_lattices(list(lats) + [Lattice.empty()] * pad, m, k, dev)
        if self.block == "adaptive" and len(self.sizes) > 1:
            where = torch.tensor(list(slots) + [slots[0]] * pad, device=dev)
            blocks = rules.choose_blocks(self.recent[where], rules.draft_confidence(lp), self.sizes)
            lp, tr = rules.cut_blocks(lp, tr, blocks)
            kept = int(torch.minimum(blocks[:n].cpu(), torch.tensor([lt.m for lt in lats])).sum())
        else:
            kept = sum(min(lt.m, self.depth) for lt in lats)
        # a chain is the tree of a one-candidate lattice: its node budget is the draft length
        out = rules.build_trees(tok, lp, tr, self.depth if self.mode == "chain" else self.nodes, self.budget,
                                requests=n)
        return type(out)(*(t.cpu() for t in (out.tokens, out.parents, out.depth, out.cand, out.score, out.valid,
                                              out.count))), kept
