"""Plain reference for the best-first tree: enumerate every root path of the lattice, sort by
path score, keep the best ``n_nodes``. Exponential in depth; for tests on small lattices only."""

from __future__ import annotations

import itertools
import math


def all_paths(tokens, logprobs, transitions):
    """Every root path as (candidate-index tuple, path score)."""
    out = []
    for d in range(1, len(tokens) + 1):
        for combo in itertools.product(*[range(len(tokens[i])) for i in range(d)]):
            s = 0.0
            for i, j in enumerate(combo):
                e = logprobs[i][j] if (i == 0 or transitions is None) else transitions[i - 1][combo[i - 1]][j]
                s += e
            if math.isfinite(s):
                out.append((combo, s))
    return out


def best_scores(tokens, logprobs, transitions, n_nodes):
    """The path scores of the ``n_nodes`` best root paths, best first (well defined under ties)."""
    return sorted((s for _, s in all_paths(tokens, logprobs, transitions)), reverse=True)[:n_nodes]
