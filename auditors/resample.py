"""Cluster bootstrap: resample whole groups (requests, prompts, run blocks), never single items."""

from __future__ import annotations

import numpy as np


def bootstrap_mean_ci(values: np.ndarray, groups: np.ndarray, n_boot: int = 1000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of ``values``, resampling whole groups with replacement."""
    uniq, inv = np.unique(groups, return_inverse=True)
    g = len(uniq)
    sums = np.bincount(inv, weights=values, minlength=g)
    cnts = np.bincount(inv, minlength=g).astype(np.float64)
    if g < 2:
        m = float(values.mean())
        return (m, m)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, g, size=(n_boot, g))
    means = sums[idx].sum(1) / cnts[idx].sum(1)
    a = (1 - level) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    return (float(lo), float(hi))
