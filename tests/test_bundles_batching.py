"""batching (library entry): the row-choosing policies."""

from __future__ import annotations

import math
import random

import pytest

from specpilot.bundles import batching


def _lattice(rng, m=4, k=3):
    tokens = [rng.sample(range(100), k) for _ in range(m)]
    logp = []
    for _ in range(m):
        w = [rng.random() + 1e-3 for _ in range(k)]
        z = sum(w)
        logp.append(sorted((math.log(x / z) for x in w), reverse=True))
    return tokens, logp, None


def test_shared_budget_is_spent_on_the_best_paths_and_every_share_is_a_tree():
    pytest.importorskip("specpilot.kernels.tree")
    rng = random.Random(0)
    lattices = [_lattice(rng) for _ in range(3)]
    trees = batching.shared_budget_trees(lattices, 10)
    assert sum(len(t) for t in trees) == 10
    taken = []
    for t in trees:
        for i, p in enumerate(t.parents):
            assert p < i  # prefix-closed, parents first
        taken += list(t.score)
    # nothing left out scores higher than the worst node taken (best-first over all requests)
    more = batching.shared_budget_trees(lattices, 11)
    extra = sorted(s for t in more for s in t.score)[0]
    assert extra <= min(taken) + 1e-12


def test_block_policy_steps_down_with_acceptance():
    pol = batching.BlockPolicy()
    assert pol.choose([]) == 16
    assert pol.choose([12, 11, 10]) == 16       # mean 11 > 0.75 * 12
    assert pol.choose([7, 8, 6]) == 12          # 7 <= 9, but > 0.75 * 8
    assert pol.choose([2, 3, 1]) == 8


def test_prompt_admission_takes_only_short_prompts_that_fit():
    assert batching.admit_prompts([100, 500, 200, 90], free_rows=320) == [0, 2]
    assert batching.admit_prompts([400], free_rows=1000) == []
    assert batching.admit_prompts([], free_rows=10) == []
