"""Bundle ``batching`` (library only): the row-choosing rules of paper 4.4.

They only choose which rows are drafted and verified, so they are lossless. Not hooked into
SGLang's scheduler yet (the memory entry says so); these are the policies a hook would call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def shared_budget_trees(lattices: Sequence[tuple], budget: int):
    """One node budget over all requests of a step, filled from the highest path score; each
    request's share is a prefix-closed best-first tree (``specpilot.kernels.tree``)."""
    from specpilot.kernels.tree import build_best_first_shared

    return build_best_first_shared(lattices, budget)


@dataclass
class BlockPolicy:
    """Per-request draft block: the largest size whose expected accepted length needs it.

    ``sizes`` largest first; a request keeps the largest block while its recent mean accepted
    length exceeds ``fraction`` of the next smaller size, else steps down.
    """

    sizes: Sequence[int] = (16, 12, 8)
    fraction: float = 0.75

    def choose(self, recent_accepted: Sequence[int]) -> int:
        if not recent_accepted:
            return self.sizes[0]
        mean = sum(recent_accepted) / len(recent_accepted)
        for bigger, smaller in zip(self.sizes, self.sizes[1:]):
            if mean > self.fraction * smaller:
                return bigger
        return self.sizes[-1]


def admit_prompts(waiting: Sequence[int], free_rows: int, max_prompt: int = 384) -> list[int]:
    """Which waiting prompts (by length) enter the verify step: only prompts that would wait
    anyway, each up to ``max_prompt`` tokens, while rows remain (paper 4.4). Returns indices."""
    chosen, rows = [], free_rows
    for i, n in enumerate(waiting):
        if n <= max_prompt and n <= rows:
            chosen.append(i)
            rows -= n
    return chosen
