"""The passes that sum an Nsight Systems export's GPU activity per (step, range, name, stream).

Rows are summed per group by an UPSERT into a small temporary table keyed by one integer packing
the group, count and duration packed in one column, so Python only sees one row per kernel name
and step (:func:`_aggregate_part`). CUDA graph kernels are summed per (launch, stream, name) in
the pass that finds the graph launches (:class:`_LaunchGroups`); steps keyed by correlation id
then apply to those sums, and the kernel pass reads eager kernels only - or does not run at all
when that pass saw every row and no eager kernel (probed at both ends of the table first). The
groups stay numpy columns up to the output (:mod:`.nsys_groups`): what runs on one core after the
threads is kept small, since on a many-core machine it costs as much as a pass. Rows the packing
cannot hold take a plain GROUP BY and are merged in Python (:func:`_merge_rows`,
:func:`_plain_groups`); overlapping kernels take one more pass (:func:`_split_overlaps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import nsys_groups as gr
from .model import KernelGroup
from .nsys_export import NsysExport, Part, _fetch_ints, _keep, _upsert_table
from .nsys_lookup import _Lookup

PACK_LIMIT = gr.PACK_LIMIT  # packed group keys stay below this (SQLite integers are 64-bit)
STREAM_SLOTS = 4096  # stream ids the packed key holds (0 ..), fewer when steps x names need the bits
EAGER_PROBE = 4096  # rows at each end of the kernel table probed for eager kernels (see _graph_kernels)


@dataclass
class _LaunchGroups:
    """CUDA graph kernels summed per (launch correlation id, stream, name), smallest graph node id
    per group: every kernel of a graph launch shares its correlation id, so this is small, and steps
    and ranges keyed by correlation id apply to it without reading the kernels again. ``eager``:
    whether the table may hold kernels outside graph launches (False only when the pass saw every
    row and found none: then the kernel pass for eager kernels is skipped)."""

    corr: np.ndarray
    stream: np.ndarray
    name: np.ndarray
    n: np.ndarray
    d: np.ndarray
    s0: np.ndarray
    e1: np.ndarray
    g: np.ndarray
    eager: bool = True

    def launches(self) -> list[tuple[int, int]]:
        """(correlation id, smallest graph node id) per graph launch."""
        corr, inv = np.unique(self.corr, return_inverse=True)
        (g,) = gr.reduce_by(inv, len(corr), mins=(self.g,))
        return list(zip(corr.tolist(), g.tolist()))

    def groups(self, step: "_Lookup | None", tag: "_Lookup | None") -> np.ndarray:
        """Groups as :func:`_aggregate_part` gives them, for steps and ranges keyed by correlation id."""
        def value(lk):  # the lookup's value per group; NULL as -2
            if lk is None or not lk.ks:
                return np.full(len(self.corr), gr.NULL_TAG, dtype=np.int64)
            i = np.searchsorted(np.array(lk.ks, dtype=np.int64), self.corr, side="right") - 1
            return np.where(i >= 0, np.array(lk.vs, dtype=np.int64)[np.maximum(i, 0)], gr.NULL_TAG)

        st_v = np.maximum(value(step), -1) if step is not None else np.zeros(len(self.corr), dtype=np.int64)
        tg_v = value(tag) if tag is not None else np.full(len(self.corr), -1, dtype=np.int64)
        keys, inv = gr.unique_rows([st_v, tg_v, self.name, self.stream])
        st_v, tg_v, name, stream = keys.T
        return np.vstack([st_v, tg_v, name, np.zeros_like(name), stream,
                          *gr.reduce_by(inv, len(keys), (self.n, self.d), (self.s0,), (self.e1,))])


def _graph_kernels(ex: NsysExport, part: Part) -> _LaunchGroups | None:
    """The graph kernels of ``part`` (the kernel table) as :class:`_LaunchGroups`, in one UPSERT pass
    keyed by packed (correlation id, stream, name); None when the packing cannot hold them (then
    :func:`_graph_launches` and the plain passes run).

    When the first and last EAGER_PROBE rows hold no eager kernel (graph node or correlation id
    NULL), the pass reads every row and sends eager ones to one row keyed -2 instead of filtering
    them out: if that row stays absent the table has no eager kernel and the kernel pass that would
    look for them is skipped. When the probe finds one, eager kernels exist and are filtered out
    here as before (the kernel pass reads them)."""
    n_lo, n_hi = part.names
    nn, streams = n_hi - n_lo + 1, STREAM_SLOTS
    corr_max = PACK_LIMIT // (streams * nn)
    if corr_max < 1:
        return None
    eager_sql = "a.graphNodeId IS NULL OR a.correlationId IS NULL"
    probe = " UNION ALL ".join(f"SELECT * FROM (SELECT {eager_sql} AS e FROM {part.table} a WHERE 1{part.dev} "
                               f"ORDER BY a.rowid{d} LIMIT {EAGER_PROBE})" for d in ("", " DESC"))
    fold = not ex._q(f"SELECT coalesce(max(e), 0) FROM ({probe})")[0][0]

    def work(con, rows, width):
        bits = max(width, 1).bit_length()
        key = (f"CASE WHEN a.correlationId >= 0 AND a.correlationId < {corr_max} AND a.streamId >= 0 AND "
               f"a.streamId < {streams} AND {part.name} >= {n_lo} AND {part.name} <= {n_hi} THEN "
               f"(a.correlationId * {streams} + a.streamId) * {nn} + {part.name} - {n_lo} ELSE -1 END")
        if fold:
            key = f"CASE WHEN {eager_sql} THEN -2 ELSE {key} END"
            where = f"{rows}{part.dev}"
        else:
            where = f"{rows} AND a.graphNodeId IS NOT NULL AND a.correlationId IS NOT NULL{part.dev}"
        with _upsert_table(con, ex, "lg", "nd, s0, e1, g") as t:
            con.execute(f"INSERT INTO temp.{t} (k, nd, s0, e1, g) SELECT {key}, (a.end - a.start) * {1 << bits} + 1, "
                        f"a.start, a.end, a.graphNodeId FROM {part.table} a WHERE {where} ON CONFLICT(k) DO UPDATE SET "
                        f"nd = nd + excluded.nd, {_keep('s0', '<')}, {_keep('e1', '>')}, {_keep('g', '<')}")
            bad, eager = con.execute(
                f"SELECT count(*) FILTER (WHERE k = -1 OR k >= 0 AND "
                f"(typeof(nd) != 'integer' OR typeof(s0) != 'integer' OR typeof(e1) != 'integer' OR "
                f"typeof(g) != 'integer')), count(*) FILTER (WHERE k = -2) FROM temp.{t}").fetchone()
            if bad:
                return None
            a = _fetch_ints(con, ["k", "nd", "s0", "e1", "g"], f"temp.{t}", lo=0)
            nd = a[:, 1]
            return a[:, 0], nd & ((1 << bits) - 1), nd >> bits, a[:, 2], a[:, 4], a[:, 3], eager > 0

    results = ex.parallel(part.table, work)
    if any(r is None for r in results):
        return None
    eager = not fold or any(r[6] for r in results)
    results = [r[:6] for r in results]
    if not results:
        results = [tuple(np.zeros(0, dtype=np.int64) for _ in range(6))]
    k, n, d, s0, g, e1 = gr.merge_keyed(results, sums=2, mins=2)
    k, name = np.divmod(k, nn)
    corr, stream = np.divmod(k, streams)
    return _LaunchGroups(corr=corr, stream=stream, name=name + n_lo, n=n, d=d, s0=s0, e1=e1, g=g, eager=eager)


def _merge_rows(rows) -> list[tuple]:
    """Rows with the same (step, tag, name, kind, stream) merged: counts and durations summed, the
    earliest start and the latest end kept (NULLs ignored, as SQL aggregates do)."""
    merged: dict[tuple, list] = {}
    for row in rows:
        key, vals = row[:5], row[5:]
        cur = merged.get(key)
        if cur is None:
            merged[key] = list(vals)
            continue
        cur[0] += vals[0]
        for i, op in ((1, None), (2, min), (3, max)):
            v = vals[i]
            if v is not None:
                cur[i] = v if cur[i] is None else (cur[i] + v if op is None else op(cur[i], v))
    return [(*k, *v) for k, v in merged.items()]


def _aggregate_part(ex: NsysExport, part: Part, step: tuple[_Lookup, str] | None,
                    tag: tuple[_Lookup, str] | None) -> tuple[np.ndarray, list[tuple]]:
    """(step, tag, name, kind, stream, count, sum of durations, min start, max end) per group of
    ``part``'s rows, every row included: step is -1 (or None) for rows outside all steps. The groups
    of the slices that took the packed path as :mod:`.nsys_groups` columns (integers, no NULL), those
    of the other slices as plain rows (not merged with the former).

    ``step``/``tag``: a lookup and the column it keys on ("a.correlationId" or "a.start").
    Each row goes into one UPSERT on a temporary table keyed by one integer packing (step, tag,
    stream, name); count and duration share one column (duration x 2**bits + 1). Rows the packing
    cannot hold (a stream id or name outside the assumed ranges, NULLs, sums past 64 bits) send
    their slice to a plain GROUP BY, which gives the same groups, only slower.
    """
    joins, step_v, tag_v = [], "0", "-1"
    if step is not None:
        j, step_v = step[0].sql(step[1], "sbk")
        joins.append(j)
    if tag is not None:
        j, tag_v = tag[0].sql(tag[1], "gbk")
        joins.append(j)
    join = " ".join(joins)
    nst = (step[0].vmax + 2) if step is not None else 2  # step slots: 0 outside (-1 or NULL), v + 1
    nt = (tag[0].vmax + 3) if tag is not None else 2  # tag slots: 0 NULL, 1 for -1, v + 2
    n_lo, n_hi = part.names if part.names is not None else ex._q(
        f"SELECT coalesce(min({part.name}), 0), coalesce(max({part.name}), 0) FROM {part.table} a WHERE 1{part.dev}")[0]
    ok = all(type(x) is int for x in (n_lo, n_hi))
    nn = n_hi - n_lo + 1 if ok else 0
    streams = STREAM_SLOTS
    while ok and streams > 16 and nst * nt * streams * nn >= PACK_LIMIT:
        streams //= 16
    ok = ok and nst * nt * streams * nn < PACK_LIMIT

    def grouped(con, rows):  # plain GROUP BY (sorts every row)
        return con.execute(
            f"SELECT step, tag, name, kind, stream, count(*), sum(end - start), min(start), max(end) FROM ("
            f"SELECT coalesce({step_v}, -1) AS step, {tag_v} AS tag, a.start AS start, a.end AS end, "
            f"a.streamId AS stream, {part.name} AS name, {part.kind} AS kind FROM {part.table} a {join} "
            f"WHERE {rows}{part.dev}) GROUP BY step, tag, name, kind, stream").fetchall()

    def work(con, rows, width):
        if not ok:
            return grouped(con, rows)
        bits = max(width, 1).bit_length()  # a group's count stays below 2**bits
        key = (f"CASE WHEN a.streamId >= 0 AND a.streamId < {streams} AND {part.name} >= {n_lo} AND "
               f"{part.name} <= {n_hi} THEN ((coalesce({step_v} + 1, 0) * {nt} + coalesce({tag_v} + 2, 0)) "
               f"* {streams} + a.streamId) * {nn} + {part.name} - {n_lo} ELSE -1 END")
        # rows in time order, read in rowid order: a group's first row has its earliest start, its last
        # row its latest end (the ORDER BY is the scan's own order: SQLite does not sort)
        keep = ("ORDER BY a.rowid ON CONFLICT(k) DO UPDATE SET nd = nd + excluded.nd, e1 = excluded.e1" if part.ordered
                else f"ON CONFLICT(k) DO UPDATE SET nd = nd + excluded.nd, {_keep('s0', '<')}, {_keep('e1', '>')}")
        with _upsert_table(con, ex, "agg", "nd, s0, e1") as t:
            con.execute(f"INSERT INTO temp.{t} (k, nd, s0, e1) SELECT {key}, (a.end - a.start) * {1 << bits} + 1, "
                        f"a.start, a.end FROM {part.table} a {join} WHERE {rows}{part.dev} {keep}")
            (bad,) = con.execute(f"SELECT count(*) FILTER (WHERE k < 0 OR typeof(nd) != 'integer' OR "
                                 f"typeof(s0) != 'integer' OR typeof(e1) != 'integer') FROM temp.{t}").fetchone()
            if bad:
                return grouped(con, rows)
            a = _fetch_ints(con, ["k", "nd", "s0", "e1"], f"temp.{t}")
            nd = a[:, 1]
            return a[:, 0], nd & ((1 << bits) - 1), nd >> bits, a[:, 2], a[:, 3]

    results = ex.parallel(part.table, work)
    plain = [row for r in results if not isinstance(r, tuple) for row in r]
    packed = [r for r in results if isinstance(r, tuple)]
    if not packed:
        return gr.empty(), plain
    # merge the slices' groups, then unpack (step, tag, stream, name) from the key
    k, n, d, s0, e1 = gr.merge_keyed(packed, sums=2, mins=1)
    k, name = np.divmod(k, nn)
    k, stream = np.divmod(k, streams)
    st_slot, tag_slot = np.divmod(k, nt)
    tags = np.where(tag_slot == 0, gr.NULL_TAG, tag_slot - 2)
    return np.vstack([st_slot - 1, tags, name + n_lo, np.full_like(name, part.kind), stream, n, d, s0, e1]), plain


def _activity_sql(parts: list[Part], step, tag=None, keys: bool = True) -> str:
    """Every GPU activity row of ``parts`` as (step, tag, name, kind, stream, s, e) - (step, s, e)
    without ``keys`` - through the step and tag lookups (step 0 and tag NULL without them)."""
    join, step_sql = step[0].sql(step[1], "sbk") if step is not None else ("", "0")
    tag_sql = "NULL"
    if tag is not None:
        tj, tag_sql = tag[0].sql(tag[1], "gbk")
        join = f"{join} {tj}"

    def cols(p: Part) -> str:
        return f", {tag_sql} AS tag, {p.name} AS name, {p.kind} AS kind, a.streamId AS stream" if keys else ""

    return " UNION ALL ".join(f"SELECT {step_sql} AS step{cols(p)}, a.start AS s, a.end AS e FROM {p.table} a "
                              f"{join} WHERE 1{p.dev}" for p in parts)


def _uncovered_sql(act: str, partition: str, group: str) -> str:
    """Per ``group`` of the rows of ``act`` (steps 0 and up), the sum of each row's time that no
    row before it (start order) in its ``partition`` covers: per step, the union of its intervals;
    per (step, stream), each event's exclusive time."""
    return (f"SELECT {group}, sum(max(0, e - max(s, coalesce(pe, s)))) FROM ("
            f"SELECT *, max(e) OVER (PARTITION BY {partition} ORDER BY s, e "
            f"ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pe FROM ({act})) "
            f"WHERE step >= 0 GROUP BY {group}")


def _split_overlaps(ex: NsysExport, parts: list[Part], step, tag, groups: list[KernelGroup], label) -> dict[int, int]:
    """Each group's exclusive time (``KernelGroup.excl_ns``, as :func:`.steps.exclusive_ns` gives it for
    Kineto): every event counted from where the events before it on its stream in its step ended.
    One more pass over the activity tables, a window over (step, stream) in start order; run only
    when some step's durations add up to more than its span. Returns each step's total."""
    rows = ex._q(_uncovered_sql(_activity_sql(parts, step, tag), "step, stream", "step, tag, name, kind, stream"))
    excl: dict[tuple, int] = {}
    per_step: dict[int, int] = {}
    for st_i, tg, nid, kind, stream, ns in rows:
        name, kind_name, tag_name = label(nid, kind, tg if tg is None or tg >= 0 else None)
        key = (int(st_i), name, kind_name, stream, tag_name)
        excl[key] = excl.get(key, 0) + int(ns)
        per_step[int(st_i)] = per_step.get(int(st_i), 0) + int(ns)
    keys = [(g.step, g.name, g.kind, g.stream, g.tag) for g in groups]
    if all(k in excl for k in keys):   # else (a group this pass did not see) the durations stand
        for g, k in zip(groups, keys):
            g.excl_ns = excl[k]
    return per_step


def _rows_present(ex: NsysExport, parts: list[Part], device: int | None) -> int:
    """Rows of the parts' tables (on ``device``), damaged ones included: the aggregate counts every
    row the parts keep, so the difference is the rows they left out. Without a device filter a
    plain ``count(*)``, which SQLite answers without decoding the rows."""
    dev = "" if device is None else f" WHERE a.deviceId = {int(device)}"
    return sum(int(ex._q(f"SELECT count(*) FROM {p.table} a{dev}")[0][0]) for p in parts)


def _plain_groups(rows: list[tuple], label) -> tuple[list[KernelGroup], np.ndarray, bool]:
    """:func:`nsys_groups.kernel_groups` and :func:`nsys_groups.step_sums` for plain rows (values may
    be NULL or not integers: the slow path of slices the packed UPSERT could not hold)."""
    lab = {k: label(*k) for k in {(r[2], r[3], r[1]) for r in rows}}
    groups = [KernelGroup(int(st_i), *lab[(nid, kind, tg)][:2], stream, lab[(nid, kind, tg)][2], None,
                          int(n), int(dur)) for st_i, tg, nid, kind, stream, n, dur, _, _ in rows]
    per_step: dict[int, list] = {}
    for st_i, _, _, _, _, n, dur, s0, e1 in rows:
        p = per_step.setdefault(int(st_i), [s0, e1, 0, 0])
        p[0], p[1] = min(p[0], s0), max(p[1], e1)
        p[2] += int(dur)
        p[3] += int(n)
    streams_per_step: dict[int, set] = {}
    for st_i, stream in {(int(r[0]), r[4]) for r in rows}:
        streams_per_step.setdefault(st_i, set()).add(stream)
    sums = np.array([[i, *p] for i, p in sorted(per_step.items())], dtype=np.int64).reshape(-1, 5).T
    return groups, sums, any(len(s) > 1 for s in streams_per_step.values())
