"""Step detection and per-step statistics.

Steps are found, in this order of preference (``--step-mode auto``):

1. ``range``: NVTX ranges or profiler annotations whose name matches ``--step-range`` (a Python
   regex searched in the name; anchor it with ``^...$``), or, without ``--step-range``, the first
   family of :data:`STEP_FAMILIES` the trace has (``decode_step_N``, SGLang/vLLM step ranges,
   ``step_N``, ``ProfilerStep#N``). Nested matches keep the outermost. Kernels belong to the range in which
   they were *launched* (CUDA runtime correlation), the way Nsight projects NVTX ranges onto the GPU.
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

# Step annotations engines and users write, most specific first: (what, regex on the range name);
# "{source}" in what is the kind of range the trace holds ("NVTX", "annotation")
STEP_FAMILIES = (
    ("decode/verify step ranges", r"^(decode|verify|spec(ulative)?|target|generation|forward)[_ -]?step([_ #\[]|$)"),
    ("SGLang step ranges", r"^step\["),
    ("{source} step ranges", r"^step[_ #]?\d+$"),
    ("vLLM execute_model ranges", r"^execute_(\d+_)?context_"),
    ("ProfilerStep ranges", r"^ProfilerStep#\d+$"),
)
IMPLAUSIBLE_EVENTS = 5  # median kernels per step below this: steps are probably not decode steps
IMPLAUSIBLE_SPREAD = 100.0  # busy time max / min above this: steps of very different kinds


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` with its noun in the singular or plural: "1 launch", "3 launches"; the default plural
    adds an s ("1 step range", "2 step ranges")."""
    return f"{n} {one if n == 1 else many or one + 's'}"


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
        # nested inside the previous step range, on any thread: the readers map launches to disjoint
        # ranges, so an inner one kept would take the outer one's later launches out of every step
        if kept and r.start >= kept[-1].start and r.end <= kept[-1].end:
            continue
        kept.append(r)
    if not kept:
        common = Counter(_generic(r.name) for r in ranges).most_common(6)
        names = ", ".join(f"{n!r} x{c}" for n, c in common) if common else "none"
        raise InputError(f"{source}: no NVTX/annotation range matches --step-range {pattern!r} "
                         f"(ranges in the trace: {names})")
    return kept


def auto_step_range(ranges: list[Range], source: str = "NVTX") -> tuple[str, str] | None:
    """(regex, what) of the first :data:`STEP_FAMILIES` entry some range matches, or None.
    ``source`` names the kind of range for a family that is not an engine's ("NVTX step ranges")."""
    for what, rx in STEP_FAMILIES:
        pat = re.compile(rx)
        if any(pat.search(r.name) and r.end > r.start for r in ranges):
            return rx, what.format(source=source)
    return None


def families(ranges: list[Range], top: int = 6) -> dict[str, int]:
    """The most common range families ('step_17' -> 'step_N') and their counts."""
    return dict(Counter(_generic(r.name) for r in ranges).most_common(top))


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


def no_gap_steps(path) -> str:
    """Why ``--step-mode gap`` found no steps: no idle gap repeats between equal kernel sequences."""
    return (f"{path}: --step-mode gap found no idle gaps that separate repeating steps; give the gap between steps "
            "with --gap-us US, name the step ranges with --step-range REGEX, or use --step-mode whole")


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


def exclusive_ns(step: np.ndarray, stream: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per event, the part of its interval that no earlier-starting event of its step and stream
    covers. On one stream kernels overlap only under programmatic dependent launch, where a kernel
    starts while the one before it still runs and waits for it: that wait is the earlier kernel's
    time, not its own. Per (step, stream) these sum to the union of the intervals; an event that
    overlaps nothing keeps its whole duration."""
    n = len(starts)
    out = np.zeros(n, dtype=np.int64)
    if n == 0:
        return out
    order = np.lexsort((ends, starts, stream, step))
    st_, sm_, s, e = step[order], stream[order], starts[order], ends[order]
    first = np.ones(n, dtype=bool)
    first[1:] = (st_[1:] != st_[:-1]) | (sm_[1:] != sm_[:-1])
    seg = np.cumsum(first) - 1
    base = s[first][seg]   # each event's (step, stream) first start: ends relative to it are >= 0
    rel = e - base
    big = int(rel.max()) + 1
    # a running maximum per segment: each segment offset above every value of the ones before it
    run = np.maximum.accumulate(rel + seg * big) - seg * big
    prev = np.empty(n, dtype=np.int64)
    prev[1:] = run[:-1]
    prev = np.where(first, s, prev + base)
    out[order] = np.clip(e - np.maximum(s, prev), 0, None)
    return out


def untangle_range_walls(steps) -> str | None:
    """Range-mode steps (in time order) whose range starts before the previous step's window ends
    start at that end instead, and a note saying how many did. A host that queues steps ahead of
    the GPU opens each step's range while the GPU still runs the steps before it; counting from the
    range's start would count that queue as the step's own wall, step after step."""
    moved, prev = 0, None
    for s in steps:
        if prev is not None and s.start < prev:
            s.start = min(prev, s.end)
            moved += 1
        prev = s.end if prev is None else max(prev, s.end)
    if not moved:
        return None
    return (f"{count(moved, 'step range')} began before the previous step's GPU work ended (the host queues "
            "steps ahead of the GPU): each such step's wall counts from the previous step's end")


@dataclass
class Spread:
    median: float
    p10: float
    p90: float
    min: float
    max: float

    def as_dict(self) -> dict:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "min": self.min, "max": self.max}


def plausibility(events: list[int], busy_ns: list[int], annotations: dict[str, int],
                 step_labels: list[str] | None = None) -> list[str]:
    """Warnings when the steps found look like something other than decode steps. ``step_labels``:
    the names of the ranges that are the steps, when steps are annotation ranges (their families
    are not suggested again)."""
    out = []
    used = Counter(_generic(n) for n in step_labels) if step_labels else Counter()
    others = {k: v for k, v in annotations.items() if k not in used}
    fams = lambda d: ", ".join(f"{k!r} x{v}" for k, v in d.items())  # noqa: E731
    if used:
        hint = (f"; the steps are the trace's {', '.join(map(repr, used))} ranges: if they are not whole decode "
                "steps, " + (f"name other annotations with --step-range REGEX (the trace also has {fams(others)})"
                             if others else "try --step-mode graph or gap (the trace has no other annotations)"))
    elif annotations:
        hint = f"; name the step annotations with --step-range REGEX (the trace has {fams(annotations)})"
    else:
        hint = "; give --step-range REGEX (annotate steps with NVTX or torch.profiler.record_function)"
    med = float(np.median(events)) if events else 0.0
    if len(events) > 1 and med < IMPLAUSIBLE_EVENTS:
        out.append(f"steps look implausible: a median of {med:g} kernels per step{hint}")
    busy = [b for b in busy_ns if b > 0]
    if len(busy) > 1 and max(busy) / min(busy) > IMPLAUSIBLE_SPREAD:
        out.append(f"steps look implausible: busy time per step spans {min(busy) / 1e6:.3g}-{max(busy) / 1e6:.3g} ms "
                   f"(x{max(busy) / min(busy):.0f}){hint}")
    return out


def spread(values) -> Spread:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return Spread(0.0, 0.0, 0.0, 0.0, 0.0)
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return Spread(float(med), float(p10), float(p90), float(a.min()), float(a.max()))
