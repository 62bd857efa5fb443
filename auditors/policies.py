"""Draft-tree policies for exact tau replay over a candidate lattice.

A policy turns one lattice step (the drafter's top-K candidates per draft position, their scores,
optional parent-conditioned transitions) into the set of nodes a target would verify, and the
target's greedy continuation decides how many of them are accepted (tau = accepted + 1).

Policies (``parse_policy`` spells them the way the CLI does):

``chain`` / ``chain:N``
    Stock's chain: the drafter's top candidate at each of the first N positions (all positions when
    N is omitted).
``best-first:N``
    The N nodes with the highest path score sum log p(child | parent) (parent-conditioned when the
    lattice has transitions, marginal otherwise). Built by ``specpilot.kernels.tree``, the same
    builder the engine runs.
``shared:N``
    Batched serving with one node budget shared across requests (paper 4.4): the rows of one
    ``batch_step`` (else of one ``step`` index) form one batch, which gets N nodes per request in
    total, filled from the highest path score over all its requests, each request's share at most
    2 x N nodes, as the batch engine builds it with ``block=fixed``
    (``specpilot.engine.batch.rules.build_trees``). Compare with ``best-first:N`` (the same nodes
    split equally). Replayed by ``specpilot.auditors.replay`` (it needs the whole batch, not one
    step).
``adaptive:N``
    The batch engine's default (``budget=shared``, ``block=adaptive``): as ``shared:N``, after each
    request's drafter block (the lattice's m positions, 3/4 or 1/2 of them) is chosen from its
    recent accepted lengths and its draft's confidence by the engine's own rule
    (``specpilot.engine.batch.rules``) and the positions past it are cut. Replayed by
    ``specpilot.auditors.replay`` (it needs each request's history).
``eagle2:TOPK,DEPTH,N``
    EAGLE-2: per depth, every beam node expands its TOPK best children, the TOPK best of those by
    path score form the next beam; after DEPTH levels every scored node is reranked globally and
    the N best are kept.
``sequoia:N``
    A Sequoia-style static tree: acceptance probability by sibling rank is measured on a lattice
    (``calibrate``), and the N rank-paths with the highest product of acceptance probabilities, at
    most as deep as that lattice's m positions, form one fixed tree shape. Every step instantiates
    it with its own candidates: the nodes its draft has (a node past the step's own positions or
    candidates, or on a ``-inf`` edge, is dropped with its subtree).
``oracle:K``
    Accept while the target's token is among the drafter's top K candidates at that position (an
    upper bound for any tree drawn from the top K).
``marginal:N``
    DDTree-style marginal scoring: the best-first tree of N nodes whose path score sums each
    position's own log-probability, ignoring the lattice's parent-conditioned transitions. Beside
    ``best-first:N`` on a lattice with transitions it shows what parent conditioning buys.
``tlv:N``
    The engine's TLV cycle (paper 4.3) at budget N, replayed from a lattice recorded with
    ``run --mode tlv --nodes N`` (rows with ``"tlv"``): the best-first tree of N nodes, the
    recorded Q-pass argmax picks the commit chain C, the recorded second draft's best-first tree
    truncated to N - |C| nodes hangs under C, and the target accepts the longest matching path of
    that tree. Only the recorded N replays (the Q pass and the second draft were run for it).

Trees are plain :class:`Tree` objects with the field names of ``specpilot.kernels.tree.DraftTree``
(``tokens``, ``parents``, ``depth``, ``cand``, ``score``); a node's parent index is -1 for a child
of the root, and parents always come before their children.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specpilot.errors import InputError

FAMILIES = ("chain", "best-first", "marginal", "shared", "adaptive", "eagle2", "sequoia", "oracle", "tlv")
MAX_NODES = 4096


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]
    depth: list[int]
    cand: list[int]
    score: list[float]

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class StepView:
    """What a policy sees of one lattice step (numpy arrays)."""

    tokens: np.ndarray          # [m, K] int64
    logprobs: np.ndarray        # [m, K] float64
    transitions: np.ndarray | None  # [m-1, K, K] float64 or None
    target: np.ndarray          # [>= m+1] int64

    @property
    def m(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    def edge_scores(self, depth: int, parent_cand: int) -> np.ndarray:
        """Scores of the K candidates at ``depth`` as children of candidate ``parent_cand``."""
        if depth == 0 or self.transitions is None:
            return self.logprobs[depth]
        return self.transitions[depth - 1, parent_cand]


def accept_length(tree, target: Sequence[int]) -> int:
    """Number of draft tokens accepted: the longest root path equal to a prefix of ``target``."""
    children: dict[int, dict[int, int]] = {}
    toks, pars = list(map(int, tree.tokens)), list(map(int, tree.parents))
    for i, (t, p) in enumerate(zip(toks, pars)):
        children.setdefault(p, {}).setdefault(t, i)
    node, accepted = -1, 0
    while accepted < len(target):
        nxt = children.get(node, {}).get(int(target[accepted]))
        if nxt is None:
            break
        node, accepted = nxt, accepted + 1
    return accepted


@dataclass
class Policy:
    family: str
    nodes: int | None = None       # N (chain: positions; oracle: None)
    topk: int | None = None        # eagle2
    depth: int | None = None       # eagle2
    k: int | None = None           # oracle
    rank_accept: np.ndarray | None = field(default=None, repr=False)  # sequoia calibration
    shape_depth: int | None = None  # sequoia: the depth its one shape may reach (the replayed drafts' m)
    _shape: list | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def spec(self) -> str:
        if self.family == "chain":
            return "chain" if self.nodes is None else f"chain:{self.nodes}"
        if self.family == "oracle":
            return f"oracle:{self.k}"
        if self.family == "eagle2":
            return f"eagle2:{self.topk},{self.depth},{self.nodes}"
        return f"{self.family}:{self.nodes}"

    @property
    def curve_key(self) -> str | None:
        """The family name a tau(N) curve is filed under (None: the policy has no node budget)."""
        if self.family in ("best-first", "marginal", "sequoia", "shared", "adaptive"):
            return self.family
        if self.family == "eagle2":
            return f"eagle2:{self.topk},{self.depth}"
        if self.family == "chain":
            return "chain"
        return None

    def with_nodes(self, n: int) -> "Policy":
        return Policy(self.family, n, self.topk, self.depth, self.k, self.rank_accept, self.shape_depth)

    def node_count(self, m: int) -> int | None:
        if self.family == "chain":
            return m if self.nodes is None else min(self.nodes, m)
        if self.family == "oracle":
            return None
        return self.nodes

    # ---- the work ----
    def tau(self, step: StepView) -> int:
        return self.verify(step)[0]

    def verify(self, step: StepView) -> tuple[int, int | None]:
        """(tau, nodes of the tree the policy built) for one step: fewer than its budget N where
        the step's lattice has fewer candidates (or an eagle2 depth beyond its positions); None
        for ``oracle``, which builds no tree."""
        if self.family == "oracle":
            return oracle_tau(step, self.k), None
        if self.family in ("shared", "adaptive"):   # replay runs them over the whole batch; alone in its
            # batch and without a history, the request keeps its whole draft: a best-first tree
            tree = best_first_tree(step, self.nodes)
        else:
            tree = self.tree(step)
        return accept_length(tree, step.target) + 1, len(tree)

    def tree(self, step: StepView) -> Tree:
        if self.family == "chain":
            return chain_tree(step, self.nodes)
        if self.family == "best-first":
            return best_first_tree(step, self.nodes)
        if self.family == "marginal":
            return marginal_tree(step, self.nodes)
        if self.family == "tlv":
            return tlv_tree(step, self.nodes)
        if self.family == "eagle2":
            return eagle2_tree(step, self.topk, self.depth, self.nodes)
        if self.family == "sequoia":
            if self.rank_accept is None:
                raise InputError("sequoia policy used before calibration (call Policy.calibrate)")
            if self._shape is None:   # one shape for every step, not one per step's own depth
                depth = self.nodes if self.shape_depth is None else self.shape_depth   # N nodes reach N deep at most
                self._shape = sequoia_shape(self.rank_accept, self.nodes, depth)
            return sequoia_tree(step, self._shape)
        raise InputError(f"policy {self.spec} does not build a tree")

    def calibrate(self, steps: Sequence[StepView], depth: int | None = None) -> None:
        """sequoia: measure acceptance by rank on ``steps``; its shape reaches ``depth`` positions
        (default: the most any of ``steps`` has)."""
        if self.family == "sequoia":
            self.rank_accept = rank_acceptance(steps)
            self.shape_depth = max(s.m for s in steps) if depth is None else depth
            self._shape = None


def _int(text: str, what: str, spec: str, lo: int = 1, hi: int = MAX_NODES) -> int:
    try:
        v = int(text)
    except ValueError:
        raise InputError(f"policy {spec!r}: {what} must be an integer, got {text!r}") from None
    if not lo <= v <= hi:
        raise InputError(f"policy {spec!r}: {what} must be between {lo} and {hi}, got {v}")
    return v


def split_policies(text: str) -> list[str]:
    """``best-first:32,marginal:32`` -> the two policies: a comma starts a new policy where a
    family name follows it (eagle2's own commas separate numbers)."""
    names = "|".join(re.escape(f) for f in sorted(FAMILIES, key=len, reverse=True))
    return [p for p in re.split(rf",\s*(?=(?:{names})(?::|$|,))", text.strip(), flags=re.I) if p.strip()]


def parse_policy(spec: str) -> Policy:
    """``chain``, ``chain:N``, ``best-first:N``, ``marginal:N``, ``shared:N``, ``adaptive:N``,
    ``eagle2:TOPK,DEPTH,N``, ``sequoia:N``, ``oracle:K``, ``tlv:N``."""
    text = spec.strip()
    name, _, arg = text.partition(":")
    name = name.strip().lower()
    hint = ("chain, chain:N, best-first:N, marginal:N, shared:N, adaptive:N, eagle2:TOPK,DEPTH,N, sequoia:N, oracle:K, "
            "tlv:N")
    if name not in FAMILIES:
        raise InputError(f"unknown policy {spec!r}; use one of {hint}")
    if name == "chain":
        return Policy("chain", _int(arg, "N", spec) if arg else None)
    if not arg:
        raise InputError(f"policy {spec!r} needs a parameter; use one of {hint}")
    if name == "eagle2":
        parts = arg.split(",")
        if len(parts) != 3:
            raise InputError(f"policy {spec!r}: eagle2 takes TOPK,DEPTH,N (e.g. eagle2:4,6,16)")
        return Policy("eagle2", nodes=_int(parts[2], "N", spec), topk=_int(parts[0], "TOPK", spec),
                      depth=_int(parts[1], "DEPTH", spec))
    if name == "oracle":
        return Policy("oracle", k=_int(arg, "K", spec))
    return Policy(name, nodes=_int(arg, "N", spec))


# --------------------------------------------------------------------------------------------
# policies

def chain_tree(step: StepView, n: int | None = None) -> Tree:
    """Each position's first candidate, up to the first whose score is not finite (never expanded,
    as in the tree policies)."""
    m = step.m if n is None else min(n, step.m)
    scores = []
    for d in range(m):
        sc = float(step.edge_scores(d, 0)[0])
        if not np.isfinite(sc):
            break
        scores.append(sc)
    m = len(scores)
    return Tree(tokens=[int(step.tokens[d, 0]) for d in range(m)], parents=[d - 1 for d in range(m)],
                depth=list(range(m)), cand=[0] * m, score=list(np.cumsum(scores)))


def oracle_tau(step: StepView, k: int) -> int:
    """Accepted positions + 1 where the target's token is each position's among its first ``k``
    candidates of finite score (a candidate no policy expands is none)."""
    accepted = 0
    for d in range(step.m):
        finite = np.isfinite(step.logprobs[d, :k])
        if int(step.target[d]) in set(map(int, step.tokens[d, :k][finite])):
            accepted += 1
        else:
            break
    return accepted + 1


def best_first_tree(step: StepView, n: int):
    """The engine's best-first builder (``specpilot.kernels.tree.build_best_first``)."""
    from specpilot.kernels.tree import build_best_first

    return build_best_first(step.tokens, step.logprobs, step.transitions, n)


def marginal_tree(step: StepView, n: int):
    """Best-first over marginal path scores (each position's own log-probabilities; DDTree)."""
    from specpilot.kernels.tree import build_best_first

    return build_best_first(step.tokens, step.logprobs, None, n)


def tlv_tree(step, n: int):
    """The tree TLV's exact pass verified at budget ``n`` (see ``tlv:N`` above), rebuilt from the
    step's recorded cycle; refuses a step without one or recorded at another budget."""
    from specpilot.kernels.tree import accept_predictions, attach, build_best_first, truncate

    rec = getattr(step, "tlv", None)
    src = getattr(step, "source", None)   # the row's file:line, where the step came from a file
    where = (f"{src}: " if src else "") + (f"policy tlv:{n}: request {getattr(step, 'request', '?')!r} "
                                           f"step {getattr(step, 'step', '?')}")
    if rec is None:
        raise InputError(f"{where} has no TLV cycle; record the lattice with "
                         f"specpilot run --mode tlv --nodes {n} --lattice-out FILE")
    if rec.nodes != n:
        raise InputError(f"{where} was recorded with --nodes {rec.nodes}; the Q pass and the "
                         f"second draft ran for that budget only, so replay tlv:{rec.nodes}")
    tree1 = best_first_tree(step, n)
    if len(rec.q_argmax) != 1 + len(tree1):
        raise InputError(f"{where} records {len(rec.q_argmax)} Q-pass tokens for a tree of "
                         f"{len(tree1)} nodes (it needs one per node plus the root)")
    _, chain = accept_predictions(tree1, rec.q_argmax)
    if chain != rec.commit:
        raise InputError(f"{where}: the Q-pass argmax gives the commit chain {chain}, the row "
                         f"records {rec.commit}")
    d2 = rec.draft2
    sub = truncate(build_best_first(d2.tokens, d2.logprobs, d2.transitions, n), n - len(chain))
    return attach(chain, sub)


def _order_key(score: float, depth: int, seq: int):
    return (-score, depth, seq)


def eagle2_tree(step: StepView, topk: int, depth: int, n: int) -> Tree:
    """EAGLE-2's dynamic tree: per-depth beam of TOPK, then a global rerank to N nodes."""
    depth = min(depth, step.m)
    if depth == 0:
        return Tree([], [], [], [], [])
    pool: list[tuple] = []  # (score, depth, seq, parent_pool_idx, cand)
    seq = 0
    # depth 0: the root's TOPK children
    s0 = step.edge_scores(0, 0)
    # a node has as many children as its position drafted (up to TOPK); the beam keeps TOPK nodes
    # whatever the step's width, or a ragged step's narrow positions would narrow every level
    beam = []
    for j in _topk_idx(s0, topk):
        pool.append((float(s0[j]), 0, seq, -1, int(j)))
        beam.append(len(pool) - 1)
        seq += 1
    for d in range(1, depth):
        cands = []
        for b in beam:
            ps, _, _, _, pc = pool[b]
            es = step.edge_scores(d, pc)
            for j in _topk_idx(es, topk):
                cands.append((ps + float(es[j]), d, seq, b, int(j)))
                seq += 1
        pool.extend(cands)
        base = len(pool) - len(cands)
        order = sorted(range(len(cands)), key=lambda i: _order_key(cands[i][0], d, cands[i][2]))
        beam = [base + i for i in order[:topk]]
    keep = sorted(range(len(pool)), key=lambda i: _order_key(pool[i][0], pool[i][1], pool[i][2]))[:n]
    return _compact(pool, keep, step)


def _topk_idx(scores: np.ndarray, k: int) -> list[int]:
    # stable: equal scores keep candidate order
    order = np.argsort(-np.asarray(scores), kind="stable")[:k]
    return [int(j) for j in order if np.isfinite(scores[j])]


def _compact(pool, keep, step: StepView) -> Tree:
    """Renumber the kept pool entries (parents first) into a Tree."""
    keep_sorted = sorted(keep, key=lambda i: (pool[i][1], _order_key(pool[i][0], pool[i][1], pool[i][2])))
    index = {}
    tree = Tree([], [], [], [], [])
    for i in keep_sorted:
        score, d, _, parent, c = pool[i]
        if parent != -1 and parent not in index:  # cannot happen: rerank keeps parents first
            raise AssertionError("tree not prefix-closed")
        index[i] = len(tree.tokens)
        tree.tokens.append(int(step.tokens[d, c]))
        tree.parents.append(-1 if parent == -1 else index[parent])
        tree.depth.append(d)
        tree.cand.append(c)
        tree.score.append(score)
    return tree


def rank_acceptance(steps: Sequence[StepView]) -> np.ndarray:
    """P(target's token has sibling rank r | its parent was accepted), r = 0..K-1, measured.

    Walks each step's target path while it stays inside the lattice; at each reached position
    records the rank of the target's token among the candidates ordered by the edge score under
    the accepted parent (K means: not among the candidates, or there on a ``-inf`` edge, which
    no tree expands).
    """
    if not steps:
        raise InputError("sequoia: no lattice steps to measure acceptance by rank")
    k = max(s.k for s in steps)
    counts = np.zeros(k + 1)
    for s in steps:
        parent = 0
        for d in range(s.m):
            es = s.edge_scores(d, parent)
            order = np.argsort(-es, kind="stable")
            hit = np.nonzero((s.tokens[d, order] == s.target[d]) & np.isfinite(es[order]))[0]
            if hit.size == 0:
                counts[k] += 1
                break
            counts[int(hit[0])] += 1
            parent = int(order[hit[0]])
    reached = counts.sum()
    return counts[:k] / reached if reached else np.zeros(k)


def sequoia_shape(rank_accept: np.ndarray, n: int, max_depth: int) -> list[tuple[int, ...]]:
    """The N rank-paths with the highest product of acceptance-by-rank, best first.

    Under Sequoia's position-independent model a node's value is the probability that it is
    reached and accepted: the product of the acceptance probabilities of the ranks on its path.
    That value never grows along a path, so the best-first fill over rank-paths is the optimal
    size-N tree of depth <= ``max_depth``. Ranks never seen accepted get a tiny floor so the
    budget is still spent (those nodes come last).
    """
    p = np.maximum(np.asarray(rank_accept, dtype=np.float64), 1e-12)
    logp = np.log(p)
    heap = [(-logp[r], 1, r, (r,)) for r in range(len(p))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < n:
        negs, d, _, path = heapq.heappop(heap)
        out.append(path)
        if d < max_depth:
            for r in range(len(p)):
                heapq.heappush(heap, (negs - logp[r], d + 1, r, path + (r,)))
    return out


def sequoia_tree(step: StepView, shape: list[tuple[int, ...]]) -> Tree:
    index: dict[tuple[int, ...], int] = {}
    tree = Tree([], [], [], [], [])
    for path in sorted(shape, key=len):
        d = len(path) - 1
        if d >= step.m or path[-1] >= step.k:
            continue
        parent = index.get(path[:-1], -1) if d else -1
        if d and path[:-1] not in index:
            continue
        pc = tree.cand[parent] if parent >= 0 else 0
        es = step.edge_scores(d, pc)
        c = int(np.argsort(-es, kind="stable")[path[-1]])
        if not np.isfinite(es[c]):  # a padded (missing) candidate or an impossible edge
            continue
        index[path] = len(tree.tokens)
        tree.tokens.append(int(step.tokens[d, c]))
        tree.parents.append(parent)
        tree.depth.append(d)
        tree.cand.append(c)
        tree.score.append((tree.score[parent] if parent >= 0 else 0.0) + float(es[c]))
    return tree


def tree_is_prefix_closed(tree) -> bool:
    pars = list(map(int, tree.parents))
    depth = list(map(int, tree.depth))
    for i, p in enumerate(pars):
        if p == -1:
            if depth[i] != 0:
                return False
        elif not (0 <= p < i and depth[p] == depth[i] - 1):
            return False
    return True

