"""Every replay policy on hand-made lattices whose answers were worked out by hand."""

import math

import numpy as np
import pytest

from specpilot.auditors.policies import (StepView, accept_length, eagle2_tree, parse_policy, rank_acceptance,
                                         sequoia_shape, tree_is_prefix_closed)
from specpilot.errors import InputError

TOKENS = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
PROBS = [[.6, .3, .1], [.55, .35, .1], [.7, .2, .1]]
TARGET = [11, 21, 30, 99]


def step(target=TARGET, transitions=None, probs=PROBS):
    return StepView(np.array(TOKENS), np.log(np.array(probs)),
                    None if transitions is None else np.log(np.array(transitions)), np.array(target))


def tau(spec, s=None, calib=None):
    p = parse_policy(spec)
    p.calibrate(calib or [s or step()])
    return p.tau(s or step())


def test_chain_takes_top_candidate_per_position():
    assert tau("chain") == 1                       # 10 != 11
    assert tau("chain", step(target=[10, 20, 30, 5])) == 4
    assert tau("chain", step(target=[10, 20, 31, 5])) == 3
    assert tau("chain:1", step(target=[10, 20, 30, 5])) == 2


@pytest.mark.parametrize("k,want", [(1, 1), (2, 4), (3, 4)])
def test_oracle_accepts_while_target_in_top_k(k, want):
    assert tau(f"oracle:{k}") == want


def test_oracle_stops_at_first_miss():
    assert tau("oracle:3", step(target=[12, 99, 30, 1])) == 2


# path probabilities, best first: 10 .6 | 10-20 .33 | 11 .3 | 10-20-30 .231 | 10-21 .21 | 11-20 .165 |
# 10-21-30 .147 | 11-20-30 .1155 | 11-21 .105 | 12 .1 | 11-21-30 .0735
@pytest.mark.parametrize("n,want", [(1, 1), (2, 1), (3, 2), (8, 2), (9, 3), (10, 3), (11, 4), (40, 4)])
def test_best_first_marginal(n, want):
    assert tau(f"best-first:{n}") == want


def test_best_first_parent_conditioned():
    # with transitions, 21 is very likely after 11 (.92) and 30 after 21 (.8)
    trans = [[[.45, .35, .2], [.04, .92, .04], [.3, .3, .4]],
             [[.7, .2, .1], [.8, .1, .1], [.1, .1, .8]]]
    s = step(transitions=trans)
    # order: 10 .6 | 11 .3 | 11-21 .276 | 10-20 .27 | 11-21-30 .2208 | 10-21 .21 | ...
    assert tau("best-first:1", s) == 1
    assert tau("best-first:2", s) == 2
    assert tau("best-first:3", s) == 3
    assert tau("best-first:4", s) == 3
    assert tau("best-first:5", s) == 4   # marginal scores need 11 nodes for this path
    t = parse_policy("best-first:5").tree(s)
    assert list(t.tokens) == [10, 11, 21, 20, 30]
    assert tau("chain", s) == 1           # the chain ignores parent conditioning: 10-20-30


def test_best_first_is_the_engine_builder():
    from specpilot.kernels.tree import build_best_first

    s = step()
    mine = parse_policy("best-first:7").tree(s)
    ref = build_best_first(TOKENS, np.log(np.array(PROBS)), None, 7)
    assert list(mine.tokens) == list(ref.tokens) and list(mine.parents) == list(ref.parents)


@pytest.mark.parametrize("n,want", [(2, 1), (3, 2), (7, 2), (8, 3), (10, 3), (50, 3)])
def test_eagle2_beam_then_rerank(n, want):
    # topk=2: beam {10, 11}; depth 1 pool 10-20 .33, 10-21 .21, 11-20 .165, 11-21 .105, beam {10-20, 10-21};
    # so 11-21-30 is never drafted: tau stays 3 however large N is (best-first reaches 4).
    assert tau(f"eagle2:2,3,{n}") == want


def test_eagle2_pool_and_prefix_closure():
    t = eagle2_tree(step(), 2, 3, 100)
    assert len(t) == 10 and tree_is_prefix_closed(t)
    assert sorted(round(math.exp(x), 4) for x in t.score)[-3:] == [0.3, 0.33, 0.6]
    assert tau("eagle2:3,1,3") == 2       # depth 1: only first-position candidates
    assert tau("eagle2:1,3,3", step(target=[10, 20, 30, 0])) == 4   # topk 1 = chain


def test_sequoia_rank_acceptance_and_shape():
    s = step()
    # target ranks along its path: 11 rank 1, 21 rank 1, 30 rank 0
    assert np.allclose(rank_acceptance([s]), [1 / 3, 2 / 3, 0])
    shape = sequoia_shape(np.array([1 / 3, 2 / 3, 0]), 3, 3)
    assert shape == [(1,), (1, 1), (0,)]
    assert tau("sequoia:1") == 2
    assert tau("sequoia:2") == 3
    assert tau("sequoia:3") == 3


def test_sequoia_calibration_from_other_steps():
    chain_like = [step(target=[10, 20, 30, 0])] * 5
    # calibrated on steps where rank 0 always wins, the 3-node tree is the chain
    assert tau("sequoia:3", step(target=[10, 20, 30, 0]), calib=chain_like) == 4
    assert tau("sequoia:3", step(), calib=chain_like) == 1


def test_sequoia_shape_is_one_for_every_step():
    """The shape comes from the calibration's deepest step (m=3 here), not from each step's own
    depth: a 1-position step keeps the shape's depth-0 node and drops the rest."""
    short = StepView(np.array([[5, 6]]), np.array([[-0.1, -0.2]]), None, np.array([6, 9]))
    deep = StepView(np.array([[5, 6], [7, 8], [9, 10]]), np.array([[-0.1, -0.2]] * 3), None, np.array([5, 7, 9, 1]))
    p = parse_policy("sequoia:2")
    p.calibrate([short, deep])
    assert np.allclose(p.rank_accept, [0.75, 0.25]) and p.shape_depth == 3
    assert p.tree(short).tokens == [5] and p.verify(short) == (1, 1)
    assert p.tree(deep).tokens == [5, 7] and p.verify(deep) == (3, 2)
    # 4 nodes: (0), (0, 0), (0, 0, 0), then (1) (0.25), not (0, 0, 0, 0) (0.32), past m
    assert p.with_nodes(4).tree(short).tokens == [5, 6] and len(p.with_nodes(4).tree(deep)) == 4
    p.calibrate([short, deep], depth=1)   # a shape one position deep
    assert p.tree(deep).tokens == [5, 6]


def test_sequoia_rank_acceptance_skips_minus_infinity_candidates():
    s = step(target=[10, 20, 30, 0])
    s.logprobs[1, 0] = -np.inf
    # 20 scores -inf: not accepted, although it sits among the candidates
    assert np.allclose(rank_acceptance([s]), [0.5, 0, 0])


def test_accept_length_uses_tree_paths():
    t = parse_policy("best-first:40").tree(step())
    assert accept_length(t, [12, 20, 31, 0]) == 3
    assert accept_length(t, [13]) == 0


@pytest.mark.parametrize("bad", ["", "tree:3", "best-first", "best-first:0", "best-first:x", "eagle2:4,4",
                                 "oracle:", "sequoia:-1", "chain:0", "eagle2:a,2,3"])
def test_parse_rejects(bad):
    with pytest.raises(InputError):
        parse_policy(bad)


def test_parse_roundtrip():
    for spec in ["chain", "chain:4", "best-first:32", "shared:8", "eagle2:4,6,16", "sequoia:63", "oracle:16"]:
        assert parse_policy(spec).spec == spec
    assert parse_policy(" Best-First:8 ").spec == "best-first:8"
