"""Step detection and per-step statistics.

Steps are found, in this order of preference (``--step-mode auto``):

1. ``range``: NVTX ranges or profiler annotations whose name matches ``--step-range`` (a Python
   regex searched in the name; anchor it with ``^...$``). Nested matches keep the outermost.
   Kernels belong to the range in which they were *launched* (CUDA runtime correlation), the way
   Nsight projects NVTX ranges onto the GPU.
2. ``graph``: CUDA graph launches. Each launch of the graph launched most often starts a step;
   other graphs and eager kernels launched before the next such launch belong to that step.
3. ``gap``: idle gaps on the GPU timeline. A gap longer than ``--gap-us`` (by default found from
   the trace: the widest jump in the sorted gap lengths) separates two steps.
4. ``whole``: the whole trace as one step.

This module holds the pure parts (range selection, gap thresholds, medians) the readers share.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from specpilot.errors import InputError

from .traces.model import Range

STEP_MODES = ("auto", "range", "graph", "gap", "whole")


def compile_regex(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InputError(f"{what}: {pattern!r} is not a valid regular expression ({e})") from None


def select_step_ranges(ranges: list[Range], pattern: str, source: str) -> list[Range]:
    """Ranges whose name matches ``pattern``, outermost only, in time order."""
    rx = compile_regex(pattern, "--step-range")
    hits = sorted((r for r in ranges if rx.search(r.name) and r.end > r.start), key=lambda r: (r.start, -r.end))
    kept: list[Range] = []
    for r in hits:
        if kept and r.start >= kept[-1].start and r.end <= kept[-1].end and r.thread == kept[-1].thread:
            continue  # nested inside the previous step range
        kept.append(r)
    if not kept:
        common = Counter(_generic(r.name) for r in ranges).most_common(6)
        names = ", ".join(f"{n!r} x{c}" for n, c in common) if common else "none"
        raise InputError(f"{source}: no NVTX/annotation range matches --step-range {pattern!r} "
                         f"(ranges in the trace: {names})")
    return kept


def _generic(name: str) -> str:
    """'step_17' -> 'step_N' so the error lists range families, not thousands of names."""
    return re.sub(r"\d+", "N", name)[:60]


def innermost_segments(ranges: list[Range]) -> list[tuple[int, int, str]]:
    """Flatten possibly nested ranges into disjoint (start, end, path) pieces.

    ``path`` joins the names of the enclosing ranges, outermost first: ``draft/lm_head``.
    """
    events = []
    for i, r in enumerate(ranges):
        if r.end > r.start:
            events.append((r.start, 1, i))
            events.append((r.end, 0, i))
    events.sort(key=lambda e: (e[0], e[1]))
    out: list[tuple[int, int, str]] = []
    stack: list[int] = []
    last = None
    for t, is_start, i in events:
        if stack and last is not None and t > last:
            out.append((last, t, "/".join(ranges[j].name for j in stack)))
        if is_start:
            stack.append(i)
        elif i in stack:
            stack.remove(i)
        last = t
    return out


def _gaps(starts: np.ndarray, ends: np.ndarray):
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    return order, s, s[1:] - run_end[:-1]


def gap_threshold_ns(starts: np.ndarray, ends: np.ndarray, names: np.ndarray | None = None,
                     min_gap_ns: int = 1_000, candidates: int = 48, sample: int = 200_000) -> int | None:
    """Idle-gap length that separates steps, found by repetition.

    Every candidate threshold (quantiles of the idle gaps) cuts the timeline into segments; a
    segment's signature is its sequence of event names. The threshold whose most common signature
    covers the most events wins (ties: the larger threshold), provided that signature repeats at
    least twice. Only the first ``sample`` events (in time order) are searched. Returns None when
    nothing repeats.
    """
    if len(starts) < 2:
        return None
    order, s, gaps = _gaps(starts, ends)
    if len(order) > sample:  # the repeating structure shows in the first events; saves time and memory
        order, gaps = order[:sample], gaps[:sample - 1]
    n = len(order)
    nm = (np.zeros(n, dtype=np.int64) if names is None else np.asarray(names, dtype=np.int64)[order])
    # a per-event hash that depends on the name; segment signatures combine it with the position
    h = (nm * np.int64(0x9E3779B1) + np.int64(0x7F4A7C15)) & np.int64(0xFFFFFFFF)
    big = gaps[gaps > min_gap_ns]
    if len(big) == 0:
        return None
    qs = np.unique(np.quantile(big, np.linspace(0.0, 1.0, candidates), method="lower"))
    best, best_cov = None, 0
    for q in qs[::-1]:
        cut = np.nonzero(gaps >= q)[0] + 1
        bounds = np.concatenate([[0], cut])
        lengths = np.diff(np.concatenate([bounds, [n]]))
        if len(bounds) < 2:
            continue
        seg_id = np.repeat(np.arange(len(bounds)), lengths)
        pos = np.arange(n) - bounds[seg_id]
        mix = (h * (pos + 1)) & np.int64(0xFFFFFFFF)
        sig1 = np.add.reduceat(h, bounds)
        sig2 = np.add.reduceat(mix, bounds)
        keys = np.stack([lengths, sig1, sig2], axis=1)
        uniq, inv, cnt = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
        k = int(np.argmax(cnt * uniq[:, 0]))
        if cnt[k] < 2:
            continue
        cov = int(cnt[k] * uniq[k, 0])
        if cov > best_cov:
            best, best_cov = int(q), cov
    return None if best is None else max(best - 1, 0)


def gap_boundaries(starts: np.ndarray, ends: np.ndarray, gap_ns: int) -> list[int]:
    """Start times of the steps: the first event and every event after an idle gap > gap_ns."""
    _, s, gaps = _gaps(starts, ends)
    idx = np.nonzero(gaps > gap_ns)[0] + 1
    return [int(s[0])] + [int(x) for x in s[idx]]


def graph_step_starters(launches: list[tuple[int, int]]) -> list[int]:
    """From (correlation id, graph identity) launches, the correlation ids that start steps."""
    if not launches:
        return []
    counts = Counter(g for _, g in launches)
    top = max(counts.values())
    first_seen: dict[int, int] = {}
    for i, (_, g) in enumerate(launches):
        first_seen.setdefault(g, i)
    key = min((g for g, c in counts.items() if c == top), key=lambda g: first_seen[g])
    return [c for c, g in launches if g == key]


def union_ns(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of intervals (GPU busy time)."""
    if len(starts) == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    prev = np.concatenate([[s[0]], np.maximum.accumulate(e)[:-1]])
    return int(np.clip(e - np.maximum(s, prev), 0, None).sum())


@dataclass
class Spread:
    median: float
    p10: float
    p90: float
    min: float
    max: float

    def as_dict(self) -> dict:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "min": self.min, "max": self.max}


def spread(values) -> Spread:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return Spread(0.0, 0.0, 0.0, 0.0, 0.0)
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return Spread(float(med), float(p10), float(p90), float(a.min()), float(a.max()))
