"""Nsight Systems SQLite exports (schema 2.x ``EXPORT_META_DATA`` and 3.x ``META_DATA_EXPORT``).

The aggregation runs inside SQLite: kernels, memcpys and memsets are tagged with their step by an
indexed lookup in a small temporary table (keyed by CUDA correlation id or by GPU time) and
grouped per (step, name, stream), so Python only sees one row per kernel name and step. The file
is opened read-only and never modified.

Tables used: ``StringIds``, ``CUPTI_ACTIVITY_KIND_KERNEL`` (+ ``_MEMCPY``, ``_MEMSET``),
``CUPTI_ACTIVITY_KIND_RUNTIME`` (launch correlation, graph launches), ``NVTX_EVENTS``
(push/pop and start/end ranges, ``text`` or ``textId``), ``TARGET_INFO_GPU``.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

import numpy as np

from specpilot.errors import InputError

from .. import steps as st
from .model import KINDS, Aggregate, GPUInfo, KernelGroup, Range, StepInfo, StepRequest

SQLITE_MAGIC = b"SQLite format 3\x00"
META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")  # 3.x, 2.x
KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL"
MEMCPY = "CUPTI_ACTIVITY_KIND_MEMCPY"
MEMSET = "CUPTI_ACTIVITY_KIND_MEMSET"
RUNTIME = "CUPTI_ACTIVITY_KIND_RUNTIME"
GRAPH_TRACE = "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"  # whole-graph records (nsys --cuda-graph-trace=graph)
NVTX = "NVTX_EVENTS"
# ENUM_NSYS_EVENT_TYPE ids used when the export has no enum table (stable since 2.x)
NVTX_RANGE_TYPES = {"NvtxPushPopRange": 59, "NvtxStartEndRange": 60, "NvtxtPushPopRange": 70,
                    "NvtxtStartEndRange": 71}
MEMCPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
                8: "DtoD", 9: "HtoH", 10: "PtoP"}
PARALLEL_MIN_ROWS = 250_000  # split a GROUP BY across threads above this many rows per thread
KERNEL_COLUMNS = ("start", "end", "deviceId", "streamId", "correlationId", "demangledName", "shortName")


def is_sqlite(path: str | os.PathLike) -> bool:
    with open(path, "rb") as fh:
        return fh.read(16) == SQLITE_MAGIC


class NsysExport:
    """An open, validated Nsight Systems SQLite export."""

    def __init__(self, path: str | os.PathLike, on_progress=None):
        self.path = str(path)
        self.on_progress = on_progress  # called now and then during long queries (progress bar)
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{path}: no such file")
        size = p.stat().st_size
        if size == 0:
            raise InputError(f"{path}: empty file")
        if not is_sqlite(p):
            raise InputError(f"{path}: not a SQLite database (expected an Nsight Systems export: "
                             "nsys export --type sqlite)")
        if size < 512 or size % 512:
            raise InputError(f"{path}: truncated SQLite file ({size} bytes is not a whole number of pages)")
        self.uri = f"file:{quote(str(p.resolve()))}?mode=ro&immutable=1"
        self.bounds: dict[str, list[tuple[int, int, int]]] = {}
        try:
            self.con = self._connect()
            self.tables = {r[0] for r in self.con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            pages, page_size = (self.con.execute(f"PRAGMA {k}").fetchone()[0] for k in ("page_count", "page_size"))
            if pages * page_size > size:  # O(1); corrupt pages surface as errors of the queries
                raise InputError(f"{path}: truncated SQLite file ({size} bytes, the header says "
                                 f"{pages * page_size})")
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: unreadable SQLite file ({str(e)[:120]}); is it truncated or corrupt?") from None
        meta = next((t for t in META_TABLES if t in self.tables), None)
        if meta is None:
            raise InputError(f"{path}: SQLite file but not an Nsight Systems export "
                             "(no META_DATA_EXPORT or EXPORT_META_DATA table)")
        self.meta = dict(self._q(f"SELECT name, value FROM {meta}"))
        self.schema_version = str(self.meta.get("EXPORT_SCHEMA_VERSION", "unknown"))
        major = self.schema_version.split(".")[0]
        if major not in ("2", "3"):
            raise InputError(f"{path}: Nsight export schema {self.schema_version} is not supported (2.x and 3.x are)")
        if "StringIds" not in self.tables:
            raise InputError(f"{path}: Nsight export without a StringIds table; re-export with nsys export --type sqlite")
        self.notes: list[str] = []
        self.has_kernels = KERNEL in self.tables
        if self.has_kernels:
            cols = self.columns(KERNEL)
            missing = [c for c in KERNEL_COLUMNS if c not in cols]
            if missing:
                raise InputError(f"{path}: {KERNEL} lacks columns {', '.join(missing)}; unsupported Nsight schema")
        else:
            self.notes.append("no CUDA kernels recorded (CUPTI_ACTIVITY_KIND_KERNEL missing: profile with -t cuda)")
        if RUNTIME not in self.tables:
            self.notes.append("no CUDA runtime table: kernels are attributed to ranges by GPU time, not launch")
        if NVTX not in self.tables:
            self.notes.append("no NVTX_EVENTS table (profile with -t cuda,nvtx for step ranges)")

    # -- helpers ------------------------------------------------------------------------------
    def _connect(self):
        con = sqlite3.connect(self.uri, uri=True, check_same_thread=False)
        con.text_factory = lambda b: b.decode("utf-8", "replace")
        if self.on_progress is not None:
            tick = self.on_progress
            con.set_progress_handler(lambda: tick(1) and 0, 2_000_000)  # every ~2M VM steps; 0 = go on
        # SQLite's default cache (2 MB) and temp store: the GROUP BY sorter spills to temporary
        # files, so memory stays far below the trace's size
        for name, intervals in self.bounds.items():
            _load_bounds(con, name, intervals)
        return con

    def set_bounds(self, name: str, intervals: list[tuple[int, int, int]]) -> None:
        """A lookup table (on every connection) mapping a key to the interval holding it."""
        self.bounds[name] = intervals
        _load_bounds(self.con, name, intervals)

    def grouped(self, table: str, sql: str, nkeys: int, aggs: tuple[str, ...], alias: str | None = None) -> list[tuple]:
        """Run a GROUP BY over ``table`` split by rowid across threads, then merge the groups.

        ``sql`` holds ``{rows}``, a condition on ``table``'s rowid; ``aggs`` says how each value
        column merges ("sum", "min", "max"). SQLite sorts to group, so halving the rows per query
        on separate connections (the sqlite3 module releases the GIL) uses the machine's cores.
        """
        lo, hi = self._q(f"SELECT min(rowid), max(rowid) FROM {table}")[0]
        if lo is None:
            return []
        workers = max(1, min(os.cpu_count() or 1, 8, (hi - lo + 1) // PARALLEL_MIN_ROWS))
        if workers == 1:
            return self._q(sql.format(rows="1"))
        step = (hi - lo + 1 + workers - 1) // workers
        ranges = [(lo + i * step, min(hi, lo + (i + 1) * step - 1)) for i in range(workers)]

        def run(r):
            con = self._connect()
            try:
                return con.execute(sql.format(rows=f"{alias or table}.rowid BETWEEN {r[0]} AND {r[1]}")).fetchall()
            finally:
                con.close()

        from concurrent.futures import ThreadPoolExecutor

        try:
            with ThreadPoolExecutor(workers) as pool:
                parts = list(pool.map(run, ranges))
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            raise InputError(f"{self.path}: unreadable Nsight export ({e})") from None
        merged: dict[tuple, list] = {}
        ops = {"sum": lambda a, b: a + b, "min": min, "max": max}
        for rows in parts:
            for row in rows:
                key, vals = tuple(row[:nkeys]), row[nkeys:]
                cur = merged.get(key)
                if cur is None:
                    merged[key] = list(vals)
                else:
                    for i, (op, v) in enumerate(zip(aggs, vals)):
                        if v is not None:
                            cur[i] = v if cur[i] is None else ops[op](cur[i], v)
        return [(*k, *v) for k, v in merged.items()]

    def _q(self, sql: str, params=()):
        try:
            return self.con.execute(sql, params).fetchall()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            raise InputError(f"{self.path}: unreadable Nsight export ({e})") from None

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self._q(f"PRAGMA table_info({table})")}

    def close(self):
        self.con.close()

    # -- small tables ---------------------------------------------------------------------------
    def gpus(self) -> dict[int, GPUInfo]:
        if "TARGET_INFO_GPU" not in self.tables:
            return {}
        cols = self.columns("TARGET_INFO_GPU")
        want = [c for c in ("id", "name", "smCount", "memoryBandwidth", "totalMemory", "l2CacheSize") if c in cols]
        out = {}
        for row in self._q(f"SELECT {', '.join(want)} FROM TARGET_INFO_GPU"):
            d = dict(zip(want, row))
            bw = d.get("memoryBandwidth")
            out[int(d.get("id") or 0)] = GPUInfo(
                name=str(d.get("name") or "unknown"), sm_count=d.get("smCount"),
                bandwidth_tbs=(bw / 1e12 if bw else None),
                memory_gb=(d["totalMemory"] / 1e9 if d.get("totalMemory") else None),
                l2_mb=(d["l2CacheSize"] / 2**20 if d.get("l2CacheSize") else None), source="TARGET_INFO_GPU")
        return out

    def ranges(self) -> list[Range]:
        if NVTX not in self.tables:
            return []
        cols = self.columns(NVTX)
        types = dict(NVTX_RANGE_TYPES)
        if "ENUM_NSYS_EVENT_TYPE" in self.tables:
            enum = dict(self._q("SELECT name, id FROM ENUM_NSYS_EVENT_TYPE"))
            types.update({k: enum[k] for k in NVTX_RANGE_TYPES if k in enum})
        ids = ",".join(str(int(v)) for v in types.values())
        name = "n.text"
        join = ""
        if "textId" in cols:
            name = "coalesce(n.text, s.value)" if "text" in cols else "s.value"
            join = "LEFT JOIN StringIds s ON s.id = n.textId"
        tid = "n.globalTid" if "globalTid" in cols else "NULL"
        rows = self._q(f"SELECT n.start, n.end, {name}, {tid} FROM {NVTX} n {join} "
                       f"WHERE n.eventType IN ({ids}) AND n.end IS NOT NULL AND n.end >= n.start")
        return [Range(name=str(r[2] or ""), start=int(r[0]), end=int(r[1]), thread=r[3]) for r in rows]

    def kernel_devices(self) -> dict[int, int]:
        if not self.has_kernels:
            return {}
        return {int(d): int(n) for d, n in self._q(f"SELECT deviceId, count(*) FROM {KERNEL} GROUP BY deviceId")}

    def strings(self, ids) -> dict[int, str]:
        ids = sorted({int(i) for i in ids if i is not None and i >= 0})
        out: dict[int, str] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            q = ",".join("?" * len(chunk))
            out.update({int(k): v for k, v in self._q(f"SELECT id, value FROM StringIds WHERE id IN ({q})", chunk)})
        return out

    def memcpy_names(self) -> dict[int, str]:
        names = dict(MEMCPY_KINDS)
        if "ENUM_CUDA_MEMCPY_OPER" in self.tables:
            cols = self.columns("ENUM_CUDA_MEMCPY_OPER")
            if {"id", "label"} <= cols:
                names.update({int(i): str(lbl) for i, lbl in self._q("SELECT id, label FROM ENUM_CUDA_MEMCPY_OPER")})
        return names

    # -- the GPU activity as one relation -------------------------------------------------------
    def activity_parts(self, device: int | None) -> list[tuple[str, str]]:
        """(table, SELECT) per GPU activity table: start, end, stream, corr, name, kind.

        Each SELECT has a ``{rows}`` placeholder (a rowid condition, "1" for all rows).
        Aggregating each table on its own (not through a UNION ALL) lets SQLite scan it directly.
        """
        dev = "" if device is None else f" AND deviceId = {int(device)}"
        parts = []
        if self.has_kernels:
            parts.append((KERNEL, f"SELECT start, end, streamId AS stream, correlationId AS corr, demangledName AS name, "
                                  f"0 AS kind FROM {KERNEL} WHERE {{rows}}{dev}"))
        if MEMCPY in self.tables and {"copyKind", "streamId", "correlationId"} <= self.columns(MEMCPY):
            parts.append((MEMCPY, f"SELECT start, end, streamId AS stream, correlationId AS corr, -1000 - copyKind AS name, "
                                  f"1 AS kind FROM {MEMCPY} WHERE {{rows}}{dev}"))
        if MEMSET in self.tables and {"streamId", "correlationId"} <= self.columns(MEMSET):
            parts.append((MEMSET, f"SELECT start, end, streamId AS stream, correlationId AS corr, -1 AS name, 2 AS kind "
                                  f"FROM {MEMSET} WHERE {{rows}}{dev}"))
        if GRAPH_TRACE in self.tables and {"graphExecId", "correlationId"} <= self.columns(GRAPH_TRACE):
            parts.append((GRAPH_TRACE, f"SELECT start, end, streamId AS stream, correlationId AS corr, "
                                       f"-2000 - graphExecId AS name, 3 AS kind FROM {GRAPH_TRACE} WHERE {{rows}}{dev}"))
        return parts


def _fetch_array(ex: NsysExport, sql: str, ncols: int, chunk: int = 262_144) -> np.ndarray:
    """Rows of integers into one int64 array, fetched in chunks (no list of millions of tuples)."""
    try:
        cur = ex.con.execute(sql)
        parts = []
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                break
            parts.append(np.array(rows, dtype=np.int64).reshape(-1, ncols))
    except (sqlite3.DatabaseError, UnicodeDecodeError, TypeError, OverflowError) as e:
        raise InputError(f"{ex.path}: unreadable Nsight export ({e})") from None
    return np.concatenate(parts) if parts else np.zeros((0, ncols), dtype=np.int64)


def _seek(table: str, key: str) -> str:
    return f"(SELECT v FROM temp.{table} WHERE k <= {key} ORDER BY k DESC LIMIT 1)"


def _load_bounds(con, table: str, intervals: list[tuple[int, int, int]]) -> None:
    """Temp table (k PRIMARY KEY, v): v at each interval start, -1 just after each end."""
    con.execute(f"DROP TABLE IF EXISTS temp.{table}")
    con.execute(f"CREATE TEMP TABLE {table} (k INTEGER PRIMARY KEY, v INTEGER NOT NULL)")
    con.executemany(f"INSERT OR REPLACE INTO temp.{table} VALUES (?, -1)", [(e + 1,) for _, e, _ in intervals])
    con.executemany(f"INSERT OR REPLACE INTO temp.{table} VALUES (?, ?)", [(s, v) for s, _, v in intervals])


def _ranges_to_corr(ex: NsysExport, intervals: list[tuple[int, int, int]], threads) -> list[tuple[int, int, int]]:
    """CPU time intervals -> correlation-id intervals of the launches made inside them."""
    ex.set_bounds("tb", intervals)
    cond = []
    thread_ids = sorted({t for t in threads if t is not None})
    if thread_ids:
        cond.append(f"r.globalTid IN ({','.join(str(int(t)) for t in thread_ids)})")
    launch_ids = [i for i, v in ex._q("SELECT id, value FROM StringIds WHERE value LIKE '%Launch%' OR "
                                      "value LIKE '%emcpy%' OR value LIKE '%emset%'")]
    if launch_ids:
        cond.append(f"r.nameId IN ({','.join(str(int(i)) for i in launch_ids)})")
    where = " AND ".join(["{rows}"] + cond)
    rows = ex.grouped(RUNTIME, f"SELECT v, min(c), max(c) FROM (SELECT {_seek('tb', 'r.start')} AS v, r.correlationId AS c "
                               f"FROM {RUNTIME} r WHERE {where}) "
                               f"WHERE v >= 0 AND c IS NOT NULL GROUP BY v", 1, ("min", "max"), alias="r")
    return sorted(((int(a), int(b), int(v)) for v, a, b in rows), key=lambda x: x[0])


def read_nsys_sqlite(path: str | os.PathLike, req: StepRequest | None = None, on_progress=None) -> Aggregate:
    req = req or StepRequest()
    ex = NsysExport(path, on_progress)
    try:
        return _aggregate(ex, req)
    finally:
        ex.close()


def _aggregate(ex: NsysExport, req: StepRequest) -> Aggregate:
    notes = list(ex.notes)
    gpus = ex.gpus()
    devices = ex.kernel_devices() if (len(gpus) > 1 or req.device is not None) else {}
    device = req.device
    if device is not None and devices and device not in devices:
        raise InputError(f"{ex.path}: no kernels on device {device} (devices with kernels: "
                         f"{', '.join(map(str, sorted(devices)))})")
    if device is None and len(devices) > 1:
        device = max(devices, key=devices.get)
        notes.append(f"kernels on {len(devices)} GPUs; profiling device {device} (choose with --device)")
    gpu = gpus.get(device if device is not None else (next(iter(devices)) if devices else 0))
    if gpu is None and gpus:
        gpu = next(iter(gpus.values()))
    if gpu is None:
        notes.append("the trace names no GPU (no TARGET_INFO_GPU): give --gpu for floors")
    parts = ex.activity_parts(device)
    act = " UNION ALL ".join(sql.format(rows="1") for _, sql in parts)
    if not parts:
        raise InputError(f"{ex.path}: the trace has no GPU activity (no kernel, memcpy or memset tables)")
    has_runtime = RUNTIME in ex.tables

    ranges = ex.ranges()
    mode = req.mode
    if mode == "auto":
        mode = "range" if req.range_regex else None
    graph_launches: list[tuple[int, int]] = []
    if mode in (None, "graph") and ex.has_kernels and "graphNodeId" in ex.columns(KERNEL):
        dev = "" if device is None else f" AND deviceId = {int(device)}"
        graph_launches = sorted((int(c), int(g)) for c, g in ex.grouped(
            KERNEL, f"SELECT correlationId, min(graphNodeId) FROM {KERNEL} WHERE {{rows}} AND graphNodeId IS NOT NULL{dev} "
                    f"GROUP BY correlationId", 1, ("min",)))
    if mode in (None, "graph") and GRAPH_TRACE in ex.tables:
        dev = "" if device is None else f" WHERE deviceId = {int(device)}"
        whole = ex._q(f"SELECT correlationId, -1 - graphExecId FROM {GRAPH_TRACE}{dev} ORDER BY correlationId")
        if whole:
            graph_launches = sorted(graph_launches + [(int(c), int(g)) for c, g in whole])
            notes.append(f"{len(whole)} CUDA graph launches were traced as whole graphs (nsys --cuda-graph-trace=graph):"
                         " their kernels are not broken down; profile with --cuda-graph-trace=node for per-kernel classes")
    if mode is None:
        mode = "graph" if len(graph_launches) >= 2 else "gap"
    if mode == "range" and not req.range_regex:
        raise InputError("--step-mode range needs --step-range REGEX")
    if mode == "graph" and len(graph_launches) < 1:
        raise InputError(f"{ex.path}: no CUDA graph launches in the trace; use --step-range or --step-mode gap")

    step_ranges: list[Range] = []
    step_key = None  # ("corr"|"time", intervals)
    labels: list[str] = []
    detail = ""
    if mode == "range":
        step_ranges = st.select_step_ranges(ranges, req.range_regex, ex.path)
        intervals = [(r.start, r.end, i) for i, r in enumerate(step_ranges)]
        labels = [r.name for r in step_ranges]
        if has_runtime:
            step_key = ("corr", _ranges_to_corr(ex, intervals, [r.thread for r in step_ranges]))
        else:
            step_key = ("time", intervals)
        detail = f"{len(step_ranges)} ranges matching '{req.range_regex}'"
    elif mode == "graph":
        starters = st.graph_step_starters(graph_launches)
        bounds = starters + [2 ** 62]  # the last step runs to the end of the trace
        step_key = ("corr", [(bounds[i], bounds[i + 1] - 1, i) for i in range(len(starters))])
        labels = [f"graph launch {c}" for c in starters]
        detail = f"{len(starters)} launches of the most frequent CUDA graph ({len(graph_launches)} graph launches)"
    elif mode == "gap":
        se = _fetch_array(ex, f"SELECT start, end, name FROM ({act})", 3)
        gap_ns = int(req.gap_us * 1e3) if req.gap_us else st.gap_threshold_ns(se[:, 0], se[:, 1], se[:, 2])
        if gap_ns is None or len(se) == 0:
            mode = "whole"
        else:
            b = st.gap_boundaries(se[:, 0], se[:, 1], gap_ns)
            if len(b) < 2 and not req.gap_us:
                mode = "whole"
            else:
                end = int(se[:, 1].max())
                bb = b + [end + 1]
                step_key = ("time", [(bb[i], bb[i + 1] - 1, i) for i in range(len(b))])
                labels = [f"gap step {i}" for i in range(len(b))]
                detail = f"{len(b)} steps separated by GPU idle gaps > {gap_ns / 1e3:.1f} us"
    if mode == "whole":
        step_key = None
        labels = ["whole trace"]
        detail = "no step ranges, graph launches or repeating gaps: the whole trace is one step"
        notes.append("steps not found; pass --step-range REGEX to profile per step")

    # tags: ranges that rules test with range: (drafter, lm_head ...), outside the step ranges
    tag_key = None
    tag_names: list[str] = []
    if req.tag_regex and ranges:
        rx = st.compile_regex(req.tag_regex, "rule range")
        step_set = set(step_ranges)
        tagged = [r for r in ranges if r not in step_set and rx.search(r.name)]
        if tagged:
            segs = st.innermost_segments(tagged)
            tag_names = sorted({n for _, _, n in segs})
            idx = {n: i for i, n in enumerate(tag_names)}
            if has_runtime:
                per_seg = _ranges_to_corr(ex, [(s, e - 1, i) for i, (s, e, _) in enumerate(segs)],
                                          [r.thread for r in tagged])
                tag_key = ("corr", [(a, b, idx[segs[i][2]]) for a, b, i in per_seg])
            else:
                tag_key = ("time", [(s, e - 1, idx[n]) for s, e, n in segs])

    step_expr = "0"
    if step_key is not None:
        ex.set_bounds("sb", step_key[1])
        step_expr = _seek("sb", "a.corr" if step_key[0] == "corr" else "a.start")
    tag_expr = "-1"
    if tag_key is not None:
        ex.set_bounds("gb", tag_key[1])
        tag_expr = _seek("gb", "a.corr" if tag_key[0] == "corr" else "a.start")

    rows = []
    total_events = 0
    for table, part in parts:
        tagged = f"SELECT {step_expr} AS step, {tag_expr} AS tag, a.start, a.end, a.stream, a.name, a.kind FROM ({part}) a"
        rows += ex.grouped(table, f"SELECT step, tag, name, kind, stream, count(*), sum(end - start), min(start), max(end) "
                                  f"FROM ({tagged}) WHERE step >= 0 GROUP BY step, tag, name, kind, stream",
                           5, ("sum", "sum", "min", "max"))
        total_events += ex._q(f"SELECT count(*) FROM ({part.format(rows='1')})")[0][0]
    tagged_sql = (f"SELECT {step_expr} AS step, a.start, a.end FROM ({act}) a")

    names = ex.strings(r[2] for r in rows if r[3] == 0)
    mnames = ex.memcpy_names()

    def _name(nid, kind):
        if kind == 0:
            return names.get(int(nid), f"<string {nid}>")
        if kind == 1:
            return f"Memcpy {mnames.get(-1000 - int(nid), 'Unknown')}"
        if kind == 3:
            return f"CUDA graph exec {-2000 - int(nid)} (whole graph)"
        return "Memset"

    groups: list[KernelGroup] = []
    per_step: dict[int, dict] = {}
    streams_per_step: dict[int, set] = {}
    for step, tag, nid, kind, stream, n, dur, s0, e1 in rows:
        step = int(step)
        groups.append(KernelGroup(step=step, name=_name(nid, kind), kind=KINDS[int(kind)],
                                  stream=stream, tag=(tag_names[int(tag)] if tag is not None and tag >= 0 else None),
                                  count=int(n), total_ns=int(dur)))
        p = per_step.setdefault(step, {"s": s0, "e": e1, "busy": 0, "n": 0})
        p["s"], p["e"] = min(p["s"], s0), max(p["e"], e1)
        p["busy"] += int(dur)
        p["n"] += int(n)
        streams_per_step.setdefault(step, set()).add(stream)

    if any(len(s) > 1 for s in streams_per_step.values()):
        # several streams: busy time is the union of intervals, not the sum of durations
        union = ex._q(
            f"SELECT step, sum(max(0, end - max(start, coalesce(pe, start)))) FROM ("
            f"SELECT step, start, end, max(end) OVER (PARTITION BY step ORDER BY start "
            f"ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pe FROM ({tagged_sql})) "
            f"WHERE step >= 0 GROUP BY step")
        for step, busy in union:
            if int(step) in per_step:
                per_step[int(step)]["busy"] = int(busy)

    steps = _build_steps(mode, labels, step_ranges, per_step)
    empty = len(labels) - len(steps)
    if empty > 0:
        notes.append(f"{empty} step(s) launched no GPU work and were left out")
    return Aggregate(path=ex.path, format="nsys-sqlite", format_version=ex.schema_version, gpu=gpu,
                     step_mode=mode, step_detail=detail, steps=steps, groups=groups,
                     total_events=int(total_events), notes=notes)


def _build_steps(mode: str, labels: list[str], step_ranges: list[Range], per_step: dict[int, dict]) -> list[StepInfo]:
    """StepInfo per step with GPU work; wall windows as documented in :class:`StepInfo`."""
    present = sorted(per_step)
    steps = []
    for j, i in enumerate(present):
        p = per_step[i]
        if mode == "range":
            r = step_ranges[i]
            start, end = r.start, max(r.end, p["e"])
        else:
            start = p["s"]
            end = per_step[present[j + 1]]["s"] if j + 1 < len(present) else p["e"]
        steps.append(StepInfo(index=i, label=labels[i] if i < len(labels) else str(i), start=int(start),
                              end=int(end), gpu_start=int(p["s"]), gpu_end=int(p["e"]), busy_ns=int(p["busy"]),
                              events=int(p["n"])))
    return steps


def describe(path: str | os.PathLike) -> dict:
    """What the export holds: schema version, GPUs, counts, and what is missing."""
    ex = NsysExport(path)
    try:
        counts = {}
        for t in (KERNEL, MEMCPY, MEMSET, NVTX, RUNTIME):
            counts[t] = ex._q(f"SELECT count(*) FROM {t}")[0][0] if t in ex.tables else None
        return {"format": "nsys-sqlite", "schema_version": ex.schema_version,
                "product": ex.meta.get("EXPORT_PRODUCT_VERSION"), "gpus": [g.__dict__ for g in ex.gpus().values()],
                "counts": counts, "notes": ex.notes}
    finally:
        ex.close()


