"""The Nsight SQLite reader's groups as int64 columns, and the Aggregate's groups and steps built from them.

The SQL passes hand back one row per (step, tag, name, kind, stream) group: tens of thousands on a
trace with thousands of steps. They stay one ``(9, m)`` int64 array (rows in the order of
``FIELDS``) from the packed keys to the output: merging the threads' slices, the per-step sums and
the :class:`KernelGroup` list are numpy and C loops (``map``), not a Python loop per group. That
work runs after the threads, on one core, so on a many-core machine it weighs as much as a pass.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from .model import KernelGroup, Range, StepInfo

FIELDS = ("step", "tag", "name", "kind", "stream", "n", "dur", "s0", "e1")
STEP, TAG, NAME, KIND, STREAM, N, DUR, S0, E1 = range(len(FIELDS))
KEY = 5  # the first KEY fields are a group's key; n and dur are summed, s0 is the minimum, e1 the maximum
NULL_TAG = -2  # the tag field of a group whose tag lookup gave NULL (before the first range)
PACK_LIMIT = 1 << 62  # packed keys stay below this (SQLite integers are 64-bit)
I64 = np.iinfo(np.int64)
CHUNK = 8192  # groups turned into KernelGroups at a time


def empty() -> np.ndarray:
    return np.zeros((len(FIELDS), 0), dtype=np.int64)


def reduce_by(inv: np.ndarray, m: int, sums=(), mins=(), maxs=()) -> list[np.ndarray]:
    """Per group ``0 .. m-1`` (``inv``: each row's group): the sum of each array of ``sums``, then
    the minimum of each of ``mins``, then the maximum of each of ``maxs``."""
    out = []
    for cols, ufunc, init in ((sums, np.add, 0), (mins, np.minimum, I64.max), (maxs, np.maximum, I64.min)):
        for c in cols:
            acc = np.full(m, init, dtype=np.int64)
            ufunc.at(acc, inv, c)
            out.append(acc)
    return out


def merge_keyed(slices: list[tuple[np.ndarray, ...]], sums: int, mins: int) -> list[np.ndarray]:
    """The threads' slices of (key, ``sums`` arrays to sum, ``mins`` to take the minimum of, the rest
    the maximum of) joined, with the rows of one key (split between slices) merged."""
    cols = [np.concatenate(x) for x in zip(*slices)]
    if len(slices) <= 1:
        return cols
    key, inv = np.unique(cols[0], return_inverse=True)
    return [key, *reduce_by(inv, len(key), cols[1:1 + sums], cols[1 + sums:1 + sums + mins], cols[1 + sums + mins:])]


def unique_rows(cols: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)`` (rows in lexicographic
    order), through one packed int64 key when the columns' ranges allow: several times faster."""
    if len(cols[0]) and all(len(c) == len(cols[0]) for c in cols):
        los = [int(c.min()) for c in cols]
        widths = [int(c.max()) - lo + 1 for c, lo in zip(cols, los)]
        total = 1
        for w in widths:
            total *= w
        if total < PACK_LIMIT:
            key = np.zeros(len(cols[0]), dtype=np.int64)
            for c, lo, w in zip(cols, los, widths):
                key = key * w + (c - lo)
            key, inv = np.unique(key, return_inverse=True)
            out = np.empty((len(key), len(cols)), dtype=np.int64)
            for j in range(len(cols) - 1, -1, -1):
                key, out[:, j] = np.divmod(key, widths[j])
                out[:, j] += los[j]
            return out, inv.reshape(-1)
    keys, inv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
    return keys, inv.reshape(-1)


def merge(g: np.ndarray) -> np.ndarray:
    """Groups with the same key merged (the same group from two passes over one table)."""
    keys, inv = unique_rows(list(g[:KEY]))
    return np.vstack([keys.T, *reduce_by(inv, len(keys), g[N:S0], g[S0:E1], g[E1:])])


def as_rows(g: np.ndarray) -> list[tuple]:
    """Tuples (step, tag or None, name, kind, stream, n, dur, s0, e1), as the plain GROUP BY gives them."""
    cols = [c.tolist() for c in g]
    cols[TAG] = [None if t == NULL_TAG else t for t in cols[TAG]]
    return list(zip(*cols))


def kernel_groups(g: np.ndarray, label) -> list[KernelGroup]:
    """One KernelGroup per column of ``g``; ``label(name, kind, tag)`` -> (name, kind name, tag name)
    is called once per distinct (name, kind, tag)."""
    keys, inv = unique_rows([g[NAME], g[KIND], g[TAG]])
    labels = [np.array(col, dtype=object) for col in zip(*map(label, *keys.T.tolist()))] or [np.zeros(0, object)] * 3
    out: list[KernelGroup] = []
    for i in range(0, g.shape[1], CHUNK):  # a chunk at a time: the Python lists of one chunk, not of all
        c, j = g[:, i:i + CHUNK], inv[i:i + CHUNK]
        names, kinds, tags = (lb[j].tolist() for lb in labels)
        # positional KernelGroup(step, name, kind, stream, tag, dims, count, total_ns), built by map in C
        out += map(KernelGroup, c[STEP].tolist(), names, kinds, c[STREAM].tolist(), tags, repeat(None),
                   c[N].tolist(), c[DUR].tolist())
    return out


def step_sums(g: np.ndarray) -> tuple[np.ndarray, bool]:
    """Per step with groups: a (5, steps) array of step index, first start, last end, summed
    durations, events; and whether some step has work on more than one stream."""
    idx, inv = np.unique(g[STEP], return_inverse=True)
    n, dur, s0, e1 = reduce_by(inv, len(idx), (g[N], g[DUR]), (g[S0],), (g[E1],))
    pairs = unique_rows([g[STEP], g[STREAM]])[0]  # distinct (step, stream), sorted by step
    return np.vstack([idx, s0, e1, dur, n]), bool(np.any(pairs[1:, 0] == pairs[:-1, 0]))


def build_steps(mode: str, labels: list[str], step_ranges: list[Range], per_step: np.ndarray) -> list[StepInfo]:
    """StepInfo per step with GPU work (``per_step`` as :func:`step_sums` gives it, index ascending);
    wall windows as documented in :class:`StepInfo`."""
    idx, s0, e1, busy, n = (per_step[i] for i in range(5))
    if mode == "range":
        start = np.array([step_ranges[i].start for i in idx.tolist()], dtype=np.int64)
        end = np.maximum(np.array([step_ranges[i].end for i in idx.tolist()], dtype=np.int64), e1)
    else:  # from this step's first GPU work to the next one's
        start, end = s0, np.append(s0[1:], e1[-1:])
    names = [labels[i] if i < len(labels) else str(i) for i in idx.tolist()]
    # positional: StepInfo(index, label, start, end, gpu_start, gpu_end, busy_ns, events)
    return list(map(StepInfo, idx.tolist(), names, start.tolist(), end.tolist(), s0.tolist(), e1.tolist(),
                    busy.tolist(), n.tolist()))
