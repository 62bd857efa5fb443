"""Best-first draft trees from a drafter's candidate lattice, and what verification needs of them.

A lattice (DESIGN.md) gives, for each draft position i, the drafter's top candidates
``tokens[i][j]`` with scores ``logprobs[i][j]`` and optionally parent-conditioned scores
``transitions[i-1][k][j]`` (candidate j at depth i given candidate k at depth i-1). The best-first
tree keeps the ``n_nodes`` root paths with the highest path score ``sum log p(child | parent)``
(paper 4.2). Because an edge score is a log-probability (<= 0), a child never outscores its
parent, so popping a max-heap yields a prefix-closed tree whose nodes come parent-first.

Rows of the lattice may be ragged (fewer than K candidates at a position); non-finite scores (-inf,
NaN) are never expanded, and a score the builder reads above 0 (past ``SCORE_SLACK``, float rounding)
is refused: it would let a child outscore its parent. Ties are broken deterministically: higher
score, then shallower depth, then the earlier parent node, then the lower candidate index.

Node numbering: node ``i`` of a tree is ``tokens[i]``; ``parents[i] == -1`` means a child of the
root (the last committed token, which the verifier feeds as row 0 before the nodes).
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from specpilot.errors import InputError

if TYPE_CHECKING:
    import torch

# how far above 0 a log-probability may round (the lattice reader's tolerance: a file it reads builds)
SCORE_SLACK = 1e-6


def _whole(v, what: str) -> int:
    """``v`` as an int: an integer or a float of a whole number (not a bool); InputError otherwise."""
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            if isinstance(v, float) and v.is_integer():
                return int(v)
    raise InputError(f"{what} must be a whole number, got {v!r}")


def _sized(v, what: str, shape: str) -> None:
    """Refuse a ``v`` that is no sequence (a lattice's rows are lists: ``shape``)."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or not hasattr(v, "__getitem__"):
        raise InputError(f"{what} must be a list ({shape}), got {type(v).__name__}")


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    cand: tuple[int, ...]
    score: tuple[float, ...]
    children: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if not self.children or len(self.children) != len(self.tokens) + 1:
            kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
            for i, p in enumerate(self.parents):
                kids[p + 1].append(i)
            object.__setattr__(self, "children", tuple(tuple(k) for k in kids))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        """Number of draft positions the tree reaches (0 for an empty tree)."""
        return (max(self.depth) + 1) if self.depth else 0

    def children_of(self, node: int) -> tuple[int, ...]:
        """Children of ``node``; ``-1`` is the root."""
        return self.children[node + 1]

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node`` (inclusive)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "parents": list(self.parents), "depth": list(self.depth),
                "cand": list(self.cand), "score": list(self.score)}


@dataclass
class BatchedTrees:
    """Trees of a batch of requests, fixed shape ``[B, N]`` (:func:`.batched.build_batched`)."""

    tokens: torch.Tensor    # [B, N] int64
    parents: torch.Tensor   # [B, N] int64, -1 = child of the root
    depth: torch.Tensor     # [B, N] int64, 0-based draft position
    cand: torch.Tensor      # [B, N] int64, candidate index at that position
    score: torch.Tensor     # [B, N] float, path score (-inf: no such node)
    valid: torch.Tensor     # [B, N] bool, node kept (budget and existence)
    count: torch.Tensor     # [B] int64, nodes kept per request (valid is a prefix)

    def request(self, b: int):
        """Request ``b``'s kept nodes as a :class:`DraftTree` (host copy)."""
        c = int(self.count[b])
        cut = lambda t: tuple(t[b, :c].tolist())  # noqa: E731
        return DraftTree(cut(self.tokens), cut(self.parents), cut(self.depth), cut(self.cand),
                         tuple(float(x) for x in self.score[b, :c].tolist()))


def _edge_fn(tokens, logprobs, transitions, where: str):
    _sized(tokens, f"{where}: tokens", "[m][K] token ids")
    _sized(logprobs, f"{where}: logprobs", "[m][K] log-probabilities")
    if transitions is not None:
        _sized(transitions, f"{where}: transitions", "[m-1][K][K] log-probabilities, or None")
    try:   # a row that is no list fails len() here
        _check_shapes(tokens, logprobs, transitions, where)
    except TypeError:
        raise InputError(f"{where}: tokens and logprobs must be [m][K] lists (transitions [m-1][K][K] or "
                         "None)") from None
    m = len(tokens)

    def edge(depth: int, parent_cand: int, j: int) -> float:
        if transitions is None or depth == 0:
            return float(logprobs[depth][j])
        return float(transitions[depth - 1][parent_cand][j])

    return m, edge


def _check_shapes(tokens, logprobs, transitions, where: str) -> None:
    m = len(tokens)
    if len(logprobs) != m:
        raise InputError(f"{where}: tokens has {m} positions but logprobs has {len(logprobs)}")
    for i in range(m):
        if len(tokens[i]) != len(logprobs[i]):
            raise InputError(f"{where}: position {i} has {len(tokens[i])} tokens but {len(logprobs[i])} logprobs")
    if transitions is not None:
        if len(transitions) != max(m - 1, 0):
            raise InputError(f"{where}: transitions must have m-1 = {max(m - 1, 0)} entries, got {len(transitions)}")
        for i, t in enumerate(transitions):
            if len(t) != len(tokens[i]) or any(len(r) != len(tokens[i + 1]) for r in t):
                raise InputError(f"{where}: transitions[{i}] must be [{len(tokens[i])}][{len(tokens[i + 1])}]")


def build_best_first_shared(lattices: Sequence[tuple], n_nodes: int) -> list[DraftTree]:
    """One shared node budget over several requests' lattices (paper 4.4).

    ``lattices`` holds ``(tokens, logprobs, transitions)`` per request. Nodes are taken from the
    highest path score over all requests; each request's share is itself a prefix-closed tree.
    """
    n_nodes = _whole(n_nodes, "node budget")
    if n_nodes < 0:
        raise InputError(f"node budget must be >= 0, got {n_nodes}")
    _sized(lattices, "lattices", "(tokens, logprobs, transitions) per request")
    if not all(not isinstance(x, (str, bytes)) and hasattr(x, "__len__") and len(x) == 3 for x in lattices):
        raise InputError("lattices must hold one (tokens, logprobs, transitions) per request")
    edges = [_edge_fn(t, lp, tr, f"lattice {r}") for r, (t, lp, tr) in enumerate(lattices)]
    heap: list = []
    per_req: list[dict] = [{"tokens": [], "parents": [], "depth": [], "cand": [], "score": []} for _ in lattices]

    def push_children(r: int, node: int, depth: int, cand: int, score: float):
        m, edge = edges[r]
        if depth >= m:
            return
        toks = lattices[r][0][depth]
        for j in range(len(toks)):
            try:
                s = edge(depth, cand, j)
            except (TypeError, ValueError):
                raise InputError(f"lattice {r}: the score of candidate {j} at position {depth} is no number") from None
            if s > SCORE_SLACK:   # checked where read: the engine builds a tree per step
                raise InputError(f"lattice {r}: the score of candidate {j} at position {depth} is {s}; scores are "
                                 "log-probabilities (<= 0, or -inf)")
            if not math.isfinite(s):
                continue
            # key: best score first, then shallower, then request, then earlier parent, then lower cand
            heapq.heappush(heap, (-(score + s), depth, r, node, j))

    for r in range(len(lattices)):
        push_children(r, -1, 0, -1, 0.0)
    taken = 0
    while heap and taken < n_nodes:
        neg, depth, r, parent, j = heapq.heappop(heap)
        t = per_req[r]
        idx = len(t["tokens"])
        t["tokens"].append(int(lattices[r][0][depth][j]))
        t["parents"].append(parent)
        t["depth"].append(depth)
        t["cand"].append(j)
        t["score"].append(-neg)
        taken += 1
        push_children(r, idx, depth + 1, j, -neg)
    return [DraftTree(tuple(t["tokens"]), tuple(t["parents"]), tuple(t["depth"]), tuple(t["cand"]),
                      tuple(t["score"])) for t in per_req]


def build_best_first(tokens, logprobs, transitions, n_nodes: int) -> DraftTree:
    """The best-first tree of at most ``n_nodes`` nodes over one lattice (see module doc)."""
    return build_best_first_shared([(tokens, logprobs, transitions)], n_nodes)[0]


def chain_tree(tokens_top1: Sequence[int], logprobs: Sequence[float] | None = None) -> DraftTree:
    """The stock chain: node i is draft position i, child of node i-1."""
    _sized(tokens_top1, "chain tokens", "one token id per draft position")
    n = len(tokens_top1)
    if logprobs is not None:
        _sized(logprobs, "chain logprobs", "one log-probability per draft position")
        if len(logprobs) != n:
            raise InputError(f"chain of {n} tokens but {len(logprobs)} logprobs")
    lp = [0.0] * n if logprobs is None else [float(x) for x in logprobs]
    if any(x > SCORE_SLACK for x in lp):
        raise InputError(f"chain logprobs {lp}: scores are log-probabilities (<= 0, or -inf)")
    score, acc = [], 0.0
    for x in lp:
        acc += x
        score.append(acc)
    return DraftTree(tuple(int(t) for t in tokens_top1), tuple(range(-1, n - 1)), tuple(range(n)),
                     (0,) * n, tuple(score))


def truncate(tree: DraftTree, n: int) -> DraftTree:
    """The first ``n`` nodes of a best-first tree (equal to the tree of budget ``n``): nodes come
    parent-first, so any prefix is prefix-closed."""
    n = max(0, min(_whole(n, "truncate's node count"), len(tree)))
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.depth[:n], tree.cand[:n], tree.score[:n])


def within_depth(tree: DraftTree, d: int) -> DraftTree:
    """The nodes of ``tree`` at depths below ``d`` (a path of at most ``d`` drafts), in order: a
    request ``d`` + 1 tokens from its limit accepts nothing deeper that it could use, so those rows
    need not be verified. Ancestors are shallower than their children, so the cut is prefix-closed."""
    keep = [i for i, x in enumerate(tree.depth) if x < d]
    if len(keep) == len(tree):
        return tree
    new = {old: j for j, old in enumerate(keep)}
    return DraftTree(tuple(tree.tokens[i] for i in keep), tuple(-1 if tree.parents[i] < 0 else new[tree.parents[i]]
                                                                for i in keep),
                     tuple(tree.depth[i] for i in keep), tuple(tree.cand[i] for i in keep),
                     tuple(tree.score[i] for i in keep))


def attach(chain: Sequence[int], sub: DraftTree) -> DraftTree:
    """The chain ``chain`` (nodes 0..len-1) with ``sub`` hanging under its last node: TLV's exact
    pass verifies the commit chain C with the second draft's subtree under it (paper 4.3)."""
    c = len(chain)
    if c == 0:
        return sub
    base = chain_tree(chain)
    return DraftTree(base.tokens + sub.tokens, base.parents + tuple(c - 1 if p < 0 else c + p for p in sub.parents),
                     base.depth + tuple(c + d for d in sub.depth), base.cand + sub.cand, base.score + sub.score)


def ancestor_mask(tree: DraftTree) -> np.ndarray:
    """bool [n, n]: ``mask[i, j]`` is True when node j is node i or one of its ancestors."""
    n = len(tree)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(tree.parents):
        if p >= 0:
            mask[i] = mask[p]  # parents come before children
        mask[i, i] = True
    return mask


def positions(tree: DraftTree, start: int) -> np.ndarray:
    """Sequence position of each node, ``start`` being the position of draft position 0
    (one past the root token): ``start + depth``."""
    return np.asarray(tree.depth, dtype=np.int64) + int(start)


def ancestor_paths(tree: DraftTree) -> np.ndarray:
    """int [n, max_depth]: node i's root path (its depth-d ancestor in column d, itself at its
    depth), -1 past its depth. The GDN path verifier walks these rows."""
    n, d = len(tree), tree.max_depth
    out = np.full((n, max(d, 1)), -1, dtype=np.int64)
    for i in range(n):
        p = tree.path(i)
        out[i, :len(p)] = p
    return out


def accept_greedy(tree: DraftTree, target_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Longest root path equal to a prefix of ``target_tokens``, plus the bonus token.

    Returns ``(path, tokens)``: the accepted node indices and the committed tokens (the path's
    tokens followed by ``target_tokens[len(path)]`` when it exists). tau = len(path) + 1.
    """
    _sized(target_tokens, "target tokens", "the target's greedy tokens")
    path: list[int] = []
    node = -1
    while len(path) < len(target_tokens):
        want = int(target_tokens[len(path)])
        nxt = next((c for c in tree.children_of(node) if tree.tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    toks = [tree.tokens[i] for i in path]
    if len(path) < len(target_tokens):
        toks.append(int(target_tokens[len(path)]))
    return path, toks


def accept_predictions(tree: DraftTree, preds: Sequence[int]) -> tuple[list[int], list[int]]:
    """Greedy acceptance from the verifier's own argmaxes: ``preds[0]`` is the target's token
    after the root, ``preds[1 + i]`` the token after node i. Returns ``(path, tokens)`` with the
    bonus token always present (so ``len(tokens) == len(path) + 1``). ``preds`` has one token per
    verified row: ``len(tree) + 1``."""
    _sized(preds, "predictions", "one token per verified row")
    if len(preds) != len(tree) + 1:
        raise InputError(f"{len(preds)} predictions for a tree of {len(tree)} nodes; acceptance takes one per "
                         f"verified row: {len(tree) + 1} (the root's and each node's)")
    path: list[int] = []
    node = -1
    want = int(preds[0])
    while True:
        nxt = next((c for c in tree.children_of(node) if tree.tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
        want = int(preds[1 + nxt])
    return path, [tree.tokens[i] for i in path] + [want]
