"""Finding the steps of an Nsight Systems export: NVTX ranges as correlation ids, graph launches, idle gaps.

Ranges become intervals of the correlation ids of the launches made inside them
(:func:`_ranges_to_corr`); graph launches come from :func:`.nsys_aggregate._graph_kernels`, or
from :func:`_graph_launches` when its packing cannot hold them. Idle-gap steps are found without
fetching every row when the tables are stored in time order (Nsight writes them so): a self-join
on rowid + 1 lists the idle gaps, and the busy stretches between them stand in for their kernels
in :func:`steps.gap_boundaries`. That check also lets the kernel pass read such a table in rowid
order and keep a group's first start and last end instead of comparing every row.
"""

from __future__ import annotations

import numpy as np

from .. import steps as st
from .model import StepRequest
from .nsys_export import (KERNEL, RUNTIME, NsysExport, Part, _fetch_array, _fetch_ints, _fetch_rows, _keep,
                          _upsert_table)

GAP_SAMPLE = 200_000  # events (in time order) searched for the repeating idle gap
GAP_FETCH_MAX = 200_000  # gap mode fetches the rows of tables up to this size; larger ones by their idle gaps


def _ranges_to_corr(ex: NsysExport, intervals: list[tuple[int, int, int]], threads) -> list[tuple[int, int, int]]:
    """CPU time intervals -> correlation-id intervals of the launches made inside them."""
    lk = ex.add_lookup("tb", intervals)
    cond = []
    thread_ids = sorted({t for t in threads if type(t) is int})   # damaged rows may hold text or blobs
    if thread_ids:
        cond.append(f"r.globalTid IN ({','.join(str(int(t)) for t in thread_ids)})")
    launch_ids = [i for i, v in ex._q("SELECT id, value FROM StringIds WHERE value LIKE '%Launch%' OR "
                                      "value LIKE '%emcpy%' OR value LIKE '%emset%'")]
    if launch_ids:
        cond.append(f"r.nameId IN ({','.join(str(int(i)) for i in launch_ids)})")
    join, v = lk.sql("r.start", "tbk")

    def work(con, rows, width):
        # min/max correlation id per interval, by an UPSERT keyed by interval + 1 (0: outside all)
        with _upsert_table(con, ex, "rc", "lo, hi") as t:
            con.execute(f"INSERT INTO temp.{t} (k, lo, hi) SELECT coalesce({v} + 1, 0), r.correlationId, "
                        f"r.correlationId FROM {RUNTIME} r {join} WHERE {' AND '.join([rows, *cond])} "
                        f"AND r.correlationId IS NOT NULL "
                        f"ON CONFLICT(k) DO UPDATE SET {_keep('lo', '<')}, {_keep('hi', '>')}")
            return con.execute(f"SELECT k - 1, lo, hi FROM temp.{t} WHERE k > 0").fetchall()

    merged: dict[int, list] = {}
    for part in ex.parallel(RUNTIME, work, alias="r"):
        for v_, lo, hi in part:
            cur = merged.setdefault(v_, [lo, hi])
            cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
    return sorted(((int(a), int(b), int(v_)) for v_, (a, b) in merged.items()), key=lambda x: x[0])


def _graph_launches(ex: NsysExport, device: int | None) -> list[tuple[int, int]]:
    """(correlation id, smallest graph node id) per CUDA graph launch whose kernels were traced."""
    dev = "" if device is None else f" AND a.deviceId = {int(device)}"

    def work(con, rows, width):
        with _upsert_table(con, ex, "gl", "g") as t:
            con.execute(f"INSERT INTO temp.{t} (k, g) SELECT a.correlationId, a.graphNodeId FROM {KERNEL} a "
                        f"WHERE {rows} AND a.graphNodeId IS NOT NULL AND a.correlationId IS NOT NULL{dev} "
                        f"ON CONFLICT(k) DO UPDATE SET {_keep('g', '<')}")
            return con.execute(f"SELECT k, g FROM temp.{t}").fetchall()

    merged: dict[int, int] = {}
    for part in ex.parallel(KERNEL, work):
        for c, g in part:
            merged[c] = g if c not in merged else min(merged[c], g)
    return sorted((int(c), int(g)) for c, g in merged.items())


def _gap_events(ex: NsysExport, parts: list[Part], device: int | None):
    """What gap mode needs from the activity: (sample, reduced, total) or None (use every row).

    ``sample``: (start, end, name) rows holding the first GAP_SAMPLE events in time order;
    ``reduced``: start and end arrays in which each large table's kernels are replaced by its busy
    stretches (runs of activity with no idle gap above the threshold) - the same step boundaries
    come out of :func:`steps.gap_boundaries`. Needs each large table stored in time order with
    contiguous rowids and ends in order too (Nsight exports are); returns None otherwise.
    """
    if device is not None:
        return None
    info = []
    for p in parts:
        n = ex._q(f"SELECT count(*) FROM {p.table}")[0][0]
        lo = ex._q(f"SELECT min(rowid) FROM {p.table}")[0][0]
        hi = ex._q(f"SELECT max(rowid) FROM {p.table}")[0][0]
        big = n > GAP_FETCH_MAX
        if big and hi - lo + 1 != n:
            return None
        info.append((p, n, lo, hi, big))
    if not any(big for *_, big in info):
        return None
    sample = [_fetch_rows(ex, p, ["a.start", "a.end", p.name], lo, min(hi, lo + GAP_SAMPLE - 1) if big else hi)
              for p, n, lo, hi, big in info]
    return info, np.concatenate(sample)


def _idle_gaps(ex: NsysExport, p: Part, lo: int, hi: int, gap_ns: int | None):
    """Busy stretches (starts, ends) of table ``p`` split at idle gaps > gap_ns, or None when the
    table is not in time order (start and end non-decreasing in rowid order)."""
    gap = (1 << 62) if gap_ns is None else int(gap_ns)

    def work(con, r):
        return _fetch_ints(con, ["a.rowid", "a.end", "b.start", "coalesce(b.start < a.start OR b.end < a.end, 1)"],
                           f"{p.table} a JOIN {p.table} b ON b.rowid = a.rowid + 1",
                           f"coalesce(b.start < a.start OR b.end < a.end OR b.start - a.end > {gap}, 1)", *r)

    found = ex.map_slices(ex.slices(p.table, (lo, hi)), work)
    if any(f is None or f[:, 3].any() for f in found):  # out of order, or NULL times
        return None
    found = np.concatenate(found)  # slices in rowid order, each sorted
    first = ex._q(f"SELECT start FROM {p.table} WHERE rowid = {lo}")[0][0]
    last = ex._q(f"SELECT end FROM {p.table} WHERE rowid = {hi}")[0][0]
    starts = np.concatenate([np.array([first], dtype=np.int64), found[:, 2]])
    ends = np.concatenate([found[:, 1], np.array([last], dtype=np.int64)])
    return starts, ends


def _gap_steps(ex: NsysExport, parts: list[Part], req: StepRequest, device: int | None):
    """Gap mode: (step start times, end of the last step, gap ns, tables checked to be in time
    order), or None (the whole trace)."""
    fast = _gap_events(ex, parts, device)
    if fast is not None:
        info, sample = fast
        gap_ns = int(req.gap_us * 1e3) if req.gap_us else st.gap_threshold_ns(sample[:, 0], sample[:, 1],
                                                                               sample[:, 2], sample=GAP_SAMPLE)
        starts, ends, ok, ordered = [], [], True, set()
        i = 0
        for p, n, lo, hi, big in info:
            if big:
                stretches = _idle_gaps(ex, p, lo, hi, gap_ns)
                if stretches is None:
                    ok = False
                    break
                ordered.add(p.table)
                starts.append(stretches[0])
                ends.append(stretches[1])
            else:
                starts.append(sample[i:i + n, 0])
                ends.append(sample[i:i + n, 1])
            i += min(n, GAP_SAMPLE) if big else n
        if ok:
            if gap_ns is None:
                return None
            s, e = np.concatenate(starts), np.concatenate(ends)
            b = st.gap_boundaries(s, e, gap_ns)
            if len(b) < 2 and not req.gap_us:
                return None
            return b, int(e.max()), gap_ns, ordered
    act = " UNION ALL ".join(p.select() for p in parts)
    se = _fetch_array(ex, f"SELECT start, end, name FROM ({act})", 3)
    gap_ns = int(req.gap_us * 1e3) if req.gap_us else st.gap_threshold_ns(se[:, 0], se[:, 1], se[:, 2],
                                                                           sample=GAP_SAMPLE)
    if gap_ns is None or len(se) == 0:
        return None
    b = st.gap_boundaries(se[:, 0], se[:, 1], gap_ns)
    if len(b) < 2 and not req.gap_us:
        return None
    return b, int(se[:, 1].max()), gap_ns, set()
