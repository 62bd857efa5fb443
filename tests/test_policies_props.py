"""Invariants of every tree policy on random lattices (hypothesis): prefix closure, budget,
monotone tau in the budget, the oracle as an upper bound, agreement with the exhaustive reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.auditors.policies import StepView, parse_policy, tree_is_prefix_closed


@st.composite
def lattices(draw):
    m = draw(st.integers(1, 5))
    k = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    cond = draw(st.booleans())
    rng = np.random.default_rng(seed)
    toks = np.stack([rng.choice(100, size=k, replace=False) for _ in range(m)])
    lp = np.log(rng.dirichlet(np.ones(k), size=m))
    lp = -np.sort(-lp, axis=1)
    tr = np.log(rng.dirichlet(np.ones(k), size=(m - 1, k))) if cond and m > 1 else None
    # target follows the lattice for a random number of positions, then leaves it
    target = [int(toks[d, rng.integers(k)]) if d < m and rng.random() < 0.7 else 1000 + d for d in range(m + 1)]
    if draw(st.booleans()):  # ragged rows, as the n-gram drafter writes them, through the file reader
        from specpilot.auditors.replay import parse_row

        w = [int(rng.integers(1, k + 1)) for _ in range(m)]
        row = {"request": 0, "step": 0, "tokens": [toks[i, :w[i]].tolist() for i in range(m)],
               "logprobs": [lp[i, :w[i]].tolist() for i in range(m)],
               "transitions": None if tr is None else [tr[i, :w[i], :w[i + 1]].tolist() for i in range(m - 1)],
               "target": target}
        return parse_row(row, "strategy")
    return StepView(toks, lp, tr, np.array(target))


TREE_POLICIES = ["chain", "chain:2", "best-first:1", "best-first:5", "best-first:17", "eagle2:2,3,6",
                 "eagle2:3,5,20", "sequoia:4", "sequoia:12"]


@settings(max_examples=60, deadline=None)
@given(lattices())
def test_trees_prefix_closed_and_within_budget(s):
    for spec in TREE_POLICIES:
        p = parse_policy(spec)
        p.calibrate([s])
        t = p.tree(s)
        assert tree_is_prefix_closed(t), spec
        assert len(t) <= (p.node_count(s.m) or 10**9), spec
        assert max(t.depth, default=-1) < s.m
        # distinct root paths: no two children of one parent carry the same candidate
        seen = set(zip(t.parents, t.cand, t.depth))
        assert len(seen) == len(t)
        tau = p.tau(s)
        assert 1 <= tau <= s.m + 1
        assert tau <= parse_policy(f"oracle:{s.k}").tau(s)


@settings(max_examples=40, deadline=None)
@given(lattices())
def test_tau_monotone_in_budget(s):
    for fam in ["best-first:{}", "eagle2:2,4,{}", "sequoia:{}"]:
        prev = 0
        for n in [1, 2, 4, 8, 16]:
            p = parse_policy(fam.format(n))
            p.calibrate([s])
            t = p.tau(s)
            assert t >= prev, (fam, n)
            prev = t


@settings(max_examples=40, deadline=None)
@given(lattices(), st.integers(1, 30))
def test_best_first_keeps_best_paths(s, n):
    from specpilot.kernels.tree.naive import best_scores

    t = parse_policy(f"best-first:{n}").tree(s)
    ref = best_scores(s.tokens.tolist(), s.logprobs.tolist(),
                      None if s.transitions is None else s.transitions.tolist(), n)
    assert np.allclose(sorted(t.score, reverse=True), ref)


@settings(max_examples=40, deadline=None)
@given(lattices())
def test_full_trees_reach_the_oracle(s):
    """A best-first tree holding every root path accepts exactly what oracle:K accepts."""
    full = sum(s.k ** d for d in range(1, s.m + 1)) or 1
    assert parse_policy(f"best-first:{full}").tau(s) == parse_policy(f"oracle:{s.k}").tau(s)
