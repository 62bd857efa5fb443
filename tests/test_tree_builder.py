"""Best-first tree builder, masks, positions and acceptance (hand answers + properties)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specpilot.errors import InputError
from specpilot.kernels import tree as T
from specpilot.kernels.tree.naive import all_paths, best_scores


def test_hand_example_marginal():
    # position 0: a(-0.1) b(-1.0); position 1: c(-0.2) d(-0.5)
    tokens = [[10, 11], [20, 21]]
    lp = [[-0.1, -1.0], [-0.2, -0.5]]
    t = T.build_best_first(tokens, lp, None, 4)
    # path scores: a -0.1, a-c -0.3, a-d -0.6, b -1.0, b-c -1.2 ...
    assert t.tokens == (10, 20, 21, 11)
    assert t.parents == (-1, 0, 0, -1)
    assert t.depth == (0, 1, 1, 0)
    assert t.cand == (0, 0, 1, 1)
    assert np.allclose(t.score, [-0.1, -0.3, -0.6, -1.0])


def test_hand_example_transitions_change_the_tree():
    tokens = [[10, 11], [20, 21]]
    lp = [[-0.1, -0.2], [-0.2, -0.5]]
    # given parent b, d is almost certain; given a, both children are unlikely
    tr = [[[-3.0, -3.0], [-2.0, -0.01]]]
    t = T.build_best_first(tokens, lp, tr, 3)
    assert t.tokens == (10, 11, 21)
    assert t.parents == (-1, -1, 1)
    assert math.isclose(t.score[2], -0.21)


def test_ties_are_deterministic_and_parent_first():
    tokens = [[1, 2], [3, 4]]
    lp = [[-1.0, -1.0], [0.0, 0.0]]  # zero edges: children tie their parents
    a = T.build_best_first(tokens, lp, None, 6)
    b = T.build_best_first(tokens, lp, None, 6)
    assert a == b
    for i, p in enumerate(a.parents):
        assert p < i
    assert a.tokens == (1, 2, 3, 4, 3, 4)


def test_ragged_and_nonfinite_rows():
    tokens = [[5], [6, 7, 8]]
    lp = [[-0.5], [-0.1, float("-inf"), -2.0]]
    t = T.build_best_first(tokens, lp, None, 10)
    assert sorted(t.tokens) == [5, 6, 8]


def test_empty_and_zero_budget():
    assert len(T.build_best_first([], [], None, 8)) == 0
    assert len(T.build_best_first([[1]], [[-0.1]], None, 0)) == 0
    assert T.ancestor_mask(T.build_best_first([], [], None, 8)).shape == (0, 0)


def test_bad_shapes_raise_input_error():
    with pytest.raises(InputError):
        T.build_best_first([[1, 2]], [[-0.1]], None, 4)
    with pytest.raises(InputError):
        T.build_best_first([[1], [2]], [[-0.1], [-0.2]], [], 4)
    with pytest.raises(InputError):
        T.build_best_first([[1], [2]], [[-0.1], [-0.2]], [[[-0.1, -0.2]]], 4)


def test_mask_positions_paths_hand():
    t = T.DraftTree((10, 20, 21, 11), (-1, 0, 0, -1), (0, 1, 1, 0), (0, 0, 1, 1), (0.0,) * 4)
    m = T.ancestor_mask(t)
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]]
    assert T.positions(t, 7).tolist() == [7, 8, 8, 7]
    assert T.ancestor_paths(t).tolist() == [[0, -1], [0, 1], [0, 2], [3, -1]]


def test_accept_greedy_and_predictions_hand():
    t = T.DraftTree((10, 20, 21, 11), (-1, 0, 0, -1), (0, 1, 1, 0), (0, 0, 1, 1), (0.0,) * 4)
    assert T.accept_greedy(t, [10, 21, 99]) == ([0, 2], [10, 21, 99])
    assert T.accept_greedy(t, [11, 5]) == ([3], [11, 5])
    assert T.accept_greedy(t, [12, 5]) == ([], [12])
    assert T.accept_greedy(t, [10]) == ([0], [10])  # no bonus token available
    # preds: root->10, node0->21, node1->x, node2->77, node3->y
    assert T.accept_predictions(t, [10, 21, 0, 77, 0]) == ([0, 2], [10, 21, 77])
    assert T.accept_predictions(t, [42, 0, 0, 0, 0]) == ([], [42])


def test_chain_tree():
    c = T.chain_tree([4, 5, 6], [-0.5, -0.25, -1.0])
    assert c.parents == (-1, 0, 1) and c.depth == (0, 1, 2)
    assert np.allclose(c.score, [-0.5, -0.75, -1.75])
    assert T.ancestor_mask(c).tolist() == np.tril(np.ones((3, 3), bool)).tolist()
    assert T.accept_greedy(c, [4, 5, 9, 9]) == ([0, 1], [4, 5, 9])


def test_shared_budget_prefix_closed_per_request():
    l1 = ([[1, 2], [3]], [[-0.1, -3.0], [-0.1]], None)
    l2 = ([[7], [8]], [[-1.0], [-1.0]], None)
    a, b = T.build_best_first_shared([l1, l2], 3)
    assert a.tokens == (1, 3) and b.tokens == (7,)


@st.composite
def lattices(draw):
    m = draw(st.integers(0, 4))
    ks = [draw(st.integers(1, 3)) for _ in range(m)]
    score = st.floats(-6.0, -1e-3, allow_nan=False)
    tokens = [list(range(100 * i, 100 * i + k)) for i, k in enumerate(ks)]
    lp = [sorted([draw(score) for _ in range(k)], reverse=True) for k in ks]
    trans = None
    if m > 1 and draw(st.booleans()):
        trans = [[[draw(score) for _ in range(ks[i + 1])] for _ in range(ks[i])] for i in range(m - 1)]
    n = draw(st.integers(0, 20))
    return tokens, lp, trans, n


def _cand_path(t, i):
    return tuple(t.cand[j] for j in t.path(i))


@settings(max_examples=150, deadline=None)
@given(lattices())
def test_properties_budget_prefix_closure_and_brute_force(lat):
    tokens, lp, trans, n = lat
    t = T.build_best_first(tokens, lp, trans, n)
    total = len(all_paths(tokens, lp, trans))
    assert len(t) == min(n, total)  # budget
    for i, p in enumerate(t.parents):  # prefix-closed, parents first, depth consistent
        assert p < i
        assert t.depth[i] == (0 if p < 0 else t.depth[p] + 1)
        assert t.tokens[i] == tokens[t.depth[i]][t.cand[i]]
    paths = {_cand_path(t, i) for i in range(len(t))}
    assert len(paths) == len(t)
    # scores descend in pop order and equal the brute-force best path scores
    assert all(a >= b - 1e-12 for a, b in zip(t.score, t.score[1:]))
    assert np.allclose(list(t.score), best_scores(tokens, lp, trans, n))
    mask = T.ancestor_mask(t)
    for i in range(len(t)):
        assert set(np.nonzero(mask[i])[0].tolist()) == set(t.path(i))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=6), st.lists(st.integers(0, 50), min_size=1, max_size=8))
def test_chain_equivalence_with_single_candidate_lattice(chain, target):
    # a one-candidate lattice gives the chain; acceptance equals the longest common prefix
    lat_t = [[x] for x in chain]
    lat_lp = [[-0.5] for _ in chain]
    bf = T.build_best_first(lat_t, lat_lp, None, len(chain))
    ch = T.chain_tree(chain)
    assert bf.tokens == ch.tokens and bf.parents == ch.parents and bf.depth == ch.depth
    k = 0
    while k < min(len(chain), len(target)) and chain[k] == target[k]:
        k += 1
    path, toks = T.accept_greedy(ch, target)
    assert path == list(range(k))
    assert toks == list(target[:k + 1])


@pytest.mark.parametrize("call,msg", [
    (lambda: T.build_best_first([[1], [2], [3]], [[0.0]] * 3, None, 1.5), "node budget must be a whole number"),
    (lambda: T.build_best_first([[1], [2], [3]], [[0.0]] * 3, None, None), "node budget must be a whole number"),
    (lambda: T.build_best_first([[1]], [[0.0]], None, True), "node budget must be a whole number"),
    (lambda: T.build_best_first([[1]], None, None, 2), "logprobs must be a list"),
    (lambda: T.build_best_first(None, [[0.0]], None, 2), "tokens must be a list"),
    (lambda: T.build_best_first([1], [[0.0]], None, 2), r"must be \[m\]\[K\] lists"),
    (lambda: T.build_best_first([[1], [2]], [[-0.1], [-0.1]], [[5]], 2), r"must be \[m\]\[K\] lists"),
    (lambda: T.build_best_first([[1]], [[2.0]], None, 2), "is 2.0; scores are log-probabilities"),
    (lambda: T.build_best_first([[1]], [[math.inf]], None, 2), "is inf; scores are log-probabilities"),
    (lambda: T.build_best_first([[1], [2]], [[-0.1], [-0.1]], [[[3.0]]], 2), "position 1 is 3.0"),
    (lambda: T.build_best_first([[1]], [["x"]], None, 2), "is no number"),
    (lambda: T.build_best_first_shared([([[1]], [[-0.1]])], 2), r"one \(tokens, logprobs, transitions\)"),
    (lambda: T.accept_predictions(T.chain_tree([1, 2]), [1]), "1 predictions for a tree of 2 nodes"),
    (lambda: T.accept_predictions(T.chain_tree([1, 2]), []), "0 predictions for a tree of 2 nodes"),
    (lambda: T.accept_predictions(T.chain_tree([1, 2]), [1, 2, 3, 4]), "takes one per verified row: 3"),
    (lambda: T.accept_greedy(T.chain_tree([1, 2]), None), "target tokens must be a list"),
    (lambda: T.chain_tree([1, 2], [-0.1]), "chain of 2 tokens but 1 logprobs"),
    (lambda: T.chain_tree([1], [0.5]), "scores are log-probabilities"),
    (lambda: T.truncate(T.chain_tree([1, 2]), None), "must be a whole number"),
])
def test_bad_budgets_scores_and_predictions_raise_input_error(call, msg):
    with pytest.raises(InputError, match=msg):
        call()


def test_whole_budgets_minus_infinity_and_rounding_still_build():
    assert len(T.build_best_first([[1], [2], [3]], [[0.0]] * 3, None, 2.0)) == 2
    assert len(T.build_best_first([[1], [2], [3]], [[0.0]] * 3, None, np.int64(3))) == 3
    assert len(T.build_best_first([[1, 2]], [[5e-7, -math.inf]], None, 4)) == 1   # the lattice reader's tolerance
    assert T.accept_predictions(T.chain_tree([1, 2]), [1, 2, 3]) == ([0, 1], [1, 2, 3])
