"""Nsight Systems SQLite exports (schema 2.x ``EXPORT_META_DATA`` and 3.x ``META_DATA_EXPORT``).

The aggregation runs inside SQLite, in one pass over each GPU activity table and without sorting
it (SQLite has no hash aggregate: a GROUP BY sorts every row, and on millions of kernels that sort
was most of the time):

- steps (and the ranges rules test) are step functions of the CUDA correlation id or the GPU
  start time with a few thousand change points. A row finds its value through one equality join
  on a bucket table (:class:`_Lookup`: each bucket holds its value and up to two change points)
  instead of a search; the tables are built once and copied to each connection;
- rows are summed per (step, range, name, stream) by an UPSERT into a small temporary table keyed
  by one integer packing the group, count and duration packed in one column, so Python only sees
  one row per kernel name and step;
- CUDA graph kernels are summed per (launch, stream, name) in the pass that finds the graph
  launches (:class:`_LaunchGroups`); steps keyed by correlation id then apply to those sums, and
  the kernel pass reads eager kernels only - or does not run at all when that pass saw every row
  and no eager kernel (probed at both ends of the table first);
- idle-gap steps are found without fetching every row when the tables are stored in time order
  (Nsight writes them so): a self-join on rowid + 1 lists the idle gaps, and the busy stretches
  between them stand in for their kernels in :func:`steps.gap_boundaries`. That check also lets
  the kernel pass read such a table in rowid order and keep a group's first start and last end
  instead of comparing every row.

Every fast path checks its preconditions and falls back to the plain query (GROUP BY, or fetching
the rows) when they do not hold, with the same result (``tests/test_traces_nsys_reference.py``
compares with a plain Python reader). Large tables are split by rowid across threads, each on its
own read-only connection; the threads hand their groups (and gap mode's sample of rows) back as
hex strings, not row by row (see :func:`_fetch_ints`), and the groups stay numpy columns up to the
output (:mod:`.nsys_groups`): what runs on one core after the threads is kept small, since on a
many-core machine it costs as much as a pass. The file is opened read-only and never modified.

Tables used: ``StringIds``, ``CUPTI_ACTIVITY_KIND_KERNEL`` (+ ``_MEMCPY``, ``_MEMSET``),
``CUPTI_ACTIVITY_KIND_RUNTIME`` (launch correlation, graph launches), ``NVTX_EVENTS``
(push/pop and start/end ranges, ``text`` or ``textId``), ``TARGET_INFO_GPU``.
"""

from __future__ import annotations

import binascii
import contextlib
import itertools
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote

import numpy as np

from specpilot.errors import InputError

from .. import steps as st
from . import nsys_groups as gr
from .model import KINDS, Aggregate, GPUInfo, KernelGroup, Range, StepRequest

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
PARALLEL_MIN_ROWS = 125_000  # split a pass across threads above this many rows per thread
FETCH_MIN_ROWS = 25_000  # ... and a fetch of rows (formatting them costs SQLite more per row than a pass),
FETCH_MIN_THREADS = 4  # ... when it gets this many threads (see _fetch_rows)
# threads of a pass at most (and no more than the CPUs this process may use): on 16 cores, 16 threads
# read 2 M kernels 0.14-0.23 s faster than 8 threads, for 0.1-0.35 CPU-s more
MAX_THREADS = 16
WORKER_CACHE_KB = 256  # page cache of the main database on each worker's connection
BUCKETS_PER_POINT = 8  # bucket table rows per change point of a step function, at most BUCKETS_MAX
BUCKETS_MAX = 1 << 20
GAP_SAMPLE = 200_000  # events (in time order) searched for the repeating idle gap
GAP_FETCH_MAX = 200_000  # gap mode fetches the rows of tables up to this size; larger ones by their idle gaps
PACK_LIMIT = gr.PACK_LIMIT  # packed group keys stay below this (SQLite integers are 64-bit)
STREAM_SLOTS = 4096  # stream ids the packed key holds (0 ..), fewer when steps x names need the bits
FETCH_ROWS = 1 << 14  # rows per string of _fetch_ints (about 1 MB of hex for 4 columns)
EAGER_PROBE = 4096  # rows at each end of the kernel table probed for eager kernels (see _graph_kernels)
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
        self.lookups: dict[str, _Lookup] = {}
        self._lk_image: bytes | None = None
        self._tmp = 0
        self._tmp_lock = threading.Lock()
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
        # SQLite's default cache (2 MB) and temp store: temporary tables beyond it spill to
        # temporary files, so memory stays far below the trace's size
        self._attach_lookups(con)
        return con

    def _attach_lookups(self, con) -> None:
        """The lookups' tables as schema ``lk`` of ``con`` (a copy of one in-memory database)."""
        if not any(r[1] == "lk" for r in con.execute("PRAGMA database_list")):
            con.execute("ATTACH ':memory:' AS lk")
        if self._lk_image is not None:
            con.deserialize(self._lk_image, name="lk")
        else:
            for name in [r[0] for r in con.execute("SELECT name FROM lk.sqlite_master WHERE type = 'table'")]:
                con.execute(f"DROP TABLE lk.{name}")
            for lk in self.lookups.values():
                lk.fill(con, "lk")

    def add_lookup(self, name: str, intervals: list[tuple[int, int, int]]) -> "_Lookup":
        """A step function (on every connection): key -> the v of the interval (lo, hi, v) holding it."""
        self.lookups[name] = _Lookup(name, intervals)
        self._publish_lookups()
        return self.lookups[name]

    def drop_lookup(self, name: str) -> None:
        if self.lookups.pop(name, None) is not None:
            self._publish_lookups()

    def _publish_lookups(self) -> None:
        self._lk_image = None
        if self.lookups and hasattr(self.con, "serialize"):  # build once, copy the database to each connection
            mem = sqlite3.connect(":memory:")
            try:
                for lk in self.lookups.values():
                    lk.fill(mem, "main")
                mem.commit()
                self._lk_image = mem.serialize()
            finally:
                mem.close()
        self._attach_lookups(self.con)

    def temp_name(self, stem: str) -> str:
        with self._tmp_lock:
            self._tmp += 1
            return f"{stem}_{self._tmp}"

    def slices(self, table: str, bounds: tuple[int, int] | None = None,
               min_rows: int | None = None) -> list[tuple[int, int]]:
        """Rowid ranges splitting ``table`` (its rowids ``bounds``, or all) across threads, at least
        ``min_rows`` (PARALLEL_MIN_ROWS) rowids each (one range: no split)."""
        lo, hi = bounds or (self._q(f"SELECT min(rowid) FROM {table}")[0][0],
                            self._q(f"SELECT max(rowid) FROM {table}")[0][0])
        if lo is None or hi < lo:
            return []
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = max(1, min(cpus, MAX_THREADS, (hi - lo + 1) // (min_rows or PARALLEL_MIN_ROWS)))
        step = (hi - lo + 1 + workers - 1) // workers
        return [(lo + i * step, min(hi, lo + (i + 1) * step - 1)) for i in range(workers)]

    def parallel(self, table: str, work, alias: str = "a") -> list:
        """``work(con, rows, width)`` over slices of ``table``'s rowids: ``rows`` is a condition on
        ``alias.rowid``, ``width`` the number of rowids in it (an upper bound on its rows); one
        result per slice (see :meth:`map_slices`)."""
        slices = self.slices(table)
        if len(slices) <= 1:
            return [self.guard(work, self.con, "1", s[1] - s[0] + 1) for s in slices]
        return self.map_slices(slices, lambda con, r: work(con, f"{alias}.rowid BETWEEN {r[0]} AND {r[1]}",
                                                           r[1] - r[0] + 1))

    def map_slices(self, slices: list[tuple[int, int]], fn) -> list:
        """``fn(con, (lo, hi))`` per rowid range, in order. Several ranges run on their own connections
        and threads (the sqlite3 module releases the GIL while SQLite works); one, on this thread."""
        if len(slices) <= 1:
            return [self.guard(fn, self.con, r) for r in slices]

        def run(r):
            con = self._connect()
            # a slice is read once, in rowid order: a small page cache reads it as fast as the default
            # 2 MB, and with a connection per core that is tens of MB less at the peak
            con.execute(f"PRAGMA main.cache_size = -{WORKER_CACHE_KB}")
            try:
                return fn(con, r)
            finally:
                con.close()

        with ThreadPoolExecutor(len(slices)) as pool:
            return self.guard(lambda: list(pool.map(run, slices)))

    def guard(self, fn, *args):
        try:
            return fn(*args)
        except (sqlite3.DatabaseError, UnicodeDecodeError, TypeError, OverflowError) as e:
            raise InputError(f"{self.path}: unreadable Nsight export ({str(e)[:200]})") from None

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
            # CAST: a damaged export's BLOB (or number) reads as text, decoded as the connection decodes text
            name = "CAST(coalesce(n.text, s.value) AS TEXT)" if "text" in cols else "CAST(s.value AS TEXT)"
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
        ids = sorted({i for i in ids if type(i) is int and i >= 0})   # damaged rows may hold NULL, text, reals
        out: dict[int, str] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            q = ",".join("?" * len(chunk))
            # CAST as in ranges(); a NULL value gives no name (the group keeps a placeholder)
            out.update({int(k): v for k, v in self._q(f"SELECT id, CAST(value AS TEXT) FROM StringIds "
                                                       f"WHERE id IN ({q}) AND value IS NOT NULL", chunk)})
        return out

    def memcpy_names(self) -> dict[int, str]:
        names = dict(MEMCPY_KINDS)
        if "ENUM_CUDA_MEMCPY_OPER" in self.tables:
            cols = self.columns("ENUM_CUDA_MEMCPY_OPER")
            if {"id", "label"} <= cols:
                names.update({int(i): str(lbl) for i, lbl in self._q("SELECT id, label FROM ENUM_CUDA_MEMCPY_OPER")})
        return names

    # -- the GPU activity ------------------------------------------------------------------------
    def activity_parts(self, device: int | None) -> list["Part"]:
        """The GPU activity tables, each as a :class:`Part` (kernels, memcpy, memset, whole graphs).

        Each table is aggregated on its own (not through a UNION ALL) so SQLite scans it directly.
        """
        # a row without both times as numbers, or ending before it starts, is damage (no export writes
        # one): it is left out everywhere, and _aggregate notes how many were. SQLite orders NULL <
        # numbers < text < blobs, so the two comparisons keep numeric start and end only.
        ok = f" AND a.end >= a.start AND a.end < {2 ** 63 - 1}"
        dev = ok if device is None else f" AND a.deviceId = {int(device)}{ok}"
        parts = []
        if self.has_kernels:
            top = self._q("SELECT max(id) FROM StringIds")[0][0]
            parts.append(Part(KERNEL, "a.demangledName", 0, dev, (0, top if type(top) is int else 0)))
        if MEMCPY in self.tables and {"copyKind", "streamId", "correlationId"} <= self.columns(MEMCPY):
            parts.append(Part(MEMCPY, "-1000 - a.copyKind", 1, dev, (-1255, -1000)))
        if MEMSET in self.tables and {"streamId", "correlationId"} <= self.columns(MEMSET):
            parts.append(Part(MEMSET, "-1", 2, dev, (-1, -1)))
        if GRAPH_TRACE in self.tables and {"graphExecId", "correlationId"} <= self.columns(GRAPH_TRACE):
            parts.append(Part(GRAPH_TRACE, "-2000 - a.graphExecId", 3, dev))
        return parts


@dataclass(frozen=True)
class Part:
    """One GPU activity table read as (start, end, stream, corr, name, kind); the table's alias is ``a``.

    ``name`` is the kernel's StringIds id; copies are -1000 - copyKind, fills -1, whole graphs
    -2000 - graphExecId.
    """

    table: str
    name: str
    kind: int
    dev: str = ""  # " AND a.deviceId = N" or ""
    names: tuple[int, int] | None = None  # the range of ``name`` when known without reading the table
    ordered: bool = False  # start and end non-NULL and non-decreasing in rowid order (checked by _idle_gaps)

    def select(self, rows: str = "1", extra: str = "") -> str:
        return (f"SELECT a.start AS start, a.end AS end, a.streamId AS stream, a.correlationId AS corr, "
                f"{self.name} AS name, {self.kind} AS kind{extra} FROM {self.table} a WHERE {rows}{self.dev}")


class _Lookup:
    """A step function over integer keys (correlation ids or GPU times), evaluated inside SQLite.

    Built from intervals (lo, hi, v): the value is v at lo, -1 just after hi (later intervals win
    where points coincide), and NULL below the first point - a key maps to the value of the
    greatest point at or below it. ``sql(key, alias)`` gives the value expression and its join.

    The points go to ``lk.<name>`` (k INTEGER PRIMARY KEY, v), where a key's value is one
    ``k <= key ORDER BY k DESC LIMIT 1`` search. Faster, most keys find it through one equality
    join on ``lk.<name>_bk``: keys are cut into buckets of 2**shift from the first point, and each
    bucket holds its value at its start (s1) and up to two change points inside it (nb1 -> s2,
    nb2 -> s3), or NULL when more fall in it (then the search runs). The bucket width is the 10 %
    quantile of the distance between every other point, so most buckets hold at most two changes;
    the table has at most 1024 + BUCKETS_PER_POINT x points rows (BUCKETS_MAX at most), wider
    buckets when needed; keys beyond the buckets search, except past the last two points (their
    values are constants of the expression). ``lk.<name>`` stays empty when no key can search
    (``search`` False: filling it was most of the serial time of building the tables).
    """

    def __init__(self, name: str, intervals):
        points: dict[int, int] = {}
        for _, hi, _ in intervals:
            points[int(hi) + 1] = -1
        for lo, _, v in intervals:
            points[int(lo)] = int(v)
        self.name = name
        self.ks = sorted(points)
        self.vs = [points[k] for k in self.ks]
        self.vmax = max(self.vs, default=-1)
        self.buckets: tuple[np.ndarray, ...] | None = None  # b, s1, nb1, s2, nb2, s3, more
        self.shift = 0
        self.search = len(self.ks) > 2  # whether some key may search lk.<name>
        if len(self.ks) < 2:
            return
        ks = np.array(self.ks, dtype=np.int64)
        vs = np.array(self.vs, dtype=np.int64)
        base, last = int(ks[0]), int(ks[-1])
        two = ks[2:] - ks[:-2] if len(ks) > 2 else ks[1:] - ks[:1]
        self.shift = max(int(np.quantile(two, 0.1, method="lower")).bit_length() - 1, 0)
        cap = min(1024 + BUCKETS_PER_POINT * len(ks), BUCKETS_MAX)
        gaps = np.diff(ks)
        if len(ks) > 2 and gaps[-1] > 64 * max(int(np.median(gaps[:-1])), 1):
            last = int(ks[-2]) + 1  # a far last point (graph steps end at 2**62): keys past the one before search
        while (((last - 1 - base) >> self.shift) + 1 > cap and self.shift < 61
               and (two >= (1 << (self.shift + 1))).mean() > 0.5):
            self.shift += 1  # wider buckets while most of them still hold at most two changes
        n = min(cap, ((last - 1 - base) >> self.shift) + 1)
        w = 1 << self.shift
        b = np.arange(n, dtype=np.int64)
        b0 = base + (b << self.shift)
        i0 = np.searchsorted(ks, b0, side="right") - 1  # the point at or below the bucket's start
        changes = np.searchsorted(ks, b0 + (w - 1), side="right") - 1 - i0
        top = len(ks) - 1
        i1, i2 = np.minimum(i0 + 1, top), np.minimum(i0 + 2, top)
        past = b0 + w  # a point past the bucket: never reached
        nb1 = np.where(changes >= 1, ks[i1], past)
        s2 = np.where(changes >= 1, vs[i1], vs[i0])
        nb2 = np.where(changes >= 2, ks[i2], past)
        s3 = np.where(changes >= 2, vs[i2], s2)
        self.buckets = (b, vs[i0], nb1, s2, nb2, s3, changes > 2)
        # keys from the first point to the one before the last find a bucket (or are past it)
        self.search = bool(self.buckets[6].any()) or base + (n << self.shift) < int(ks[-2])

    def fill(self, con, schema: str) -> None:
        """Create and fill this lookup's two tables in ``schema``."""
        con.execute(f"CREATE TABLE {schema}.{self.name} (k INTEGER PRIMARY KEY, v INTEGER NOT NULL)")
        con.execute(f"CREATE TABLE {schema}.{self.name}_bk (b INTEGER PRIMARY KEY, s1 INTEGER, nb1 INTEGER, "
                    f"s2 INTEGER, nb2 INTEGER, s3 INTEGER)")
        if self.search:
            con.executemany(f"INSERT INTO {schema}.{self.name} VALUES (?, ?)", zip(self.ks, self.vs))
        if self.buckets is None:
            return
        for i in range(0, len(self.buckets[0]), 65_536):
            b, s1, nb1, s2, nb2, s3, more = (x[i:i + 65_536].tolist() for x in self.buckets)
            con.executemany(f"INSERT INTO {schema}.{self.name}_bk VALUES (?, ?, ?, ?, ?, ?)",
                            zip(b, s1, [None if m else z for z, m in zip(nb1, more)], s2, nb2, s3))

    def sql(self, key: str, alias: str) -> tuple[str, str]:
        """(LEFT JOIN clause, value expression) for the key expression ``key``."""
        if not self.ks:
            return "", "NULL"
        search = f"(SELECT v FROM lk.{self.name} WHERE k <= {key} ORDER BY k DESC LIMIT 1)"
        past = "".join(f"WHEN {key} >= {k} THEN {v} " for k, v in zip(self.ks[:-3:-1], self.vs[:-3:-1]))
        slow = f"(CASE {past}WHEN {key} >= {self.ks[0]} THEN {search} END)"
        if self.buckets is None:
            return "", slow
        join = f"LEFT JOIN lk.{self.name}_bk {alias} ON {alias}.b = (({key}) - {self.ks[0]}) >> {self.shift}"
        value = (f"(CASE WHEN {alias}.nb1 IS NULL THEN {slow} WHEN {key} < {alias}.nb1 THEN {alias}.s1 "
                 f"WHEN {key} < {alias}.nb2 THEN {alias}.s2 ELSE {alias}.s3 END)")
        return join, value


def _fetch_array(ex: NsysExport, sql: str, ncols: int) -> np.ndarray:
    """Rows of integers into one int64 array (straight from the cursor, no list of tuples)."""
    try:
        flat = np.fromiter(itertools.chain.from_iterable(ex.con.execute(sql)), dtype=np.int64)
    except (sqlite3.DatabaseError, UnicodeDecodeError, TypeError, OverflowError, ValueError) as e:
        raise InputError(f"{ex.path}: unreadable Nsight export ({e})") from None
    return flat.reshape(-1, ncols)


def _fetch_ints(con, cols: list[str], source: str, where: str = "1", lo: int | None = None,
                hi: int | None = None) -> np.ndarray | None:
    """The rows of ``SELECT cols FROM source WHERE where`` with ``lo <= cols[0] <= hi`` as an int64
    array ordered by ``cols[0]`` (a unique integer key: a rowid or INTEGER PRIMARY KEY, which
    ``where`` must not bound: SQLite seeks with one lower bound and filters by the others); None
    when a value is not an integer.

    The rows come as hex strings of FETCH_ROWS rows each (one ``group_concat`` call into SQLite per
    string, handed over as a BLOB, parsed by numpy), not row by row: formatting them is SQLite's
    work, on the calling thread without the GIL, and fetching rows one by one from several threads
    hands the GIL back and forth at every row. Where thread switches are slow (a 16-core gVisor
    machine), a worker fetching its groups that way made the other workers' passes 5x slower than
    their SQL alone.
    """
    alias = [f"c{i}" for i in range(len(cols))]
    inner = ", ".join(f"{c} AS {a}" for c, a in zip(cols, alias))
    ints = " AND ".join(f"typeof({a}) = 'integer'" for a in alias)
    hexes = f"printf('{'%016x' * len(cols)}', {', '.join(alias)})"  # 16 hex digits per value, negatives too
    upper = "" if hi is None else f" AND {cols[0]} <= {hi}"
    out = []
    while True:
        lower = "" if lo is None else f" AND {cols[0]} >= {lo}"
        blob, bad = con.execute(
            f"SELECT CAST(group_concat({hexes}, '') AS BLOB), count(*) FILTER (WHERE NOT ({ints})) FROM "
            f"(SELECT {inner} FROM {source} WHERE ({where}){lower}{upper} ORDER BY {cols[0]} LIMIT {FETCH_ROWS})"
        ).fetchone()
        if bad:
            return None
        if not blob:
            break
        out.append(np.frombuffer(binascii.unhexlify(blob), dtype=">i8").astype(np.int64).reshape(-1, len(cols)))
        if len(out[-1]) < FETCH_ROWS:
            break
        lo = int(out[-1][:, 0].max()) + 1
    a = np.concatenate(out) if out else np.zeros((0, len(cols)), dtype=np.int64)
    return a if np.all(a[1:, 0] > a[:-1, 0]) else a[np.argsort(a[:, 0], kind="stable")]


def _fetch_rows(ex: NsysExport, p: "Part", cols: list[str], lo: int, hi: int) -> np.ndarray:
    """Integer columns ``cols`` (over alias ``a``) of ``p``'s rows with rowids lo..hi, in rowid
    order: fetched by FETCH_MIN_THREADS threads or more in parallel (:func:`_fetch_ints`), else
    (or when a value is not an integer) through Python (:func:`_fetch_array`): the hex strings cost
    SQLite about 1.5x the CPU time of fetching the rows one by one, which a few threads do not
    win back."""
    if lo is None:  # an empty table
        return np.zeros((0, len(cols)), dtype=np.int64)
    slices = ex.slices(p.table, (lo, hi), FETCH_MIN_ROWS)
    if len(slices) >= FETCH_MIN_THREADS:
        parts = ex.map_slices(slices, lambda con, r: _fetch_ints(con, ["a.rowid", *cols], f"{p.table} a",
                                                                 f"1{p.dev}", *r))
        if all(a is not None for a in parts):
            return np.concatenate(parts)[:, 1:]
    return _fetch_array(ex, f"SELECT {', '.join(cols)} FROM {p.table} a WHERE a.rowid BETWEEN {lo} AND {hi}"
                            f"{p.dev} ORDER BY a.rowid", len(cols))


def _keep(col: str, op: str) -> str:
    """UPSERT update keeping the smaller (op "<") or larger (">") value: a CASE, not min()/max() - the
    function call per row costs more than the rest of the update. Unlike min() it does not carry a
    NULL; the callers check for NULLs in the packed sums instead."""
    return f"{col} = CASE WHEN excluded.{col} {op} {col} THEN excluded.{col} ELSE {col} END"


@contextlib.contextmanager
def _upsert_table(con, ex: "NsysExport", prefix: str, cols: str):
    """A TEMP table keyed by one INTEGER PRIMARY KEY ``k`` (UPSERT aggregation), dropped on exit."""
    name = ex.temp_name(prefix)
    con.execute(f"DROP TABLE IF EXISTS temp.{name}")
    con.execute(f"CREATE TEMP TABLE {name} (k INTEGER PRIMARY KEY, {cols})")
    try:
        yield name
    finally:
        con.execute(f"DROP TABLE temp.{name}")


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
    if not parts:
        raise InputError(f"{ex.path}: the trace has no GPU activity (no kernel, memcpy or memset tables)")
    has_runtime = RUNTIME in ex.tables

    # NVTX ranges matter to range steps and tags only (reading them is serial Python work)
    ranges = ex.ranges() if req.range_regex or req.tag_regex or req.mode == "auto" else []
    annotations = st.families(ranges)
    mode, regex, found = req.mode, req.range_regex, ""
    asked = req.mode
    if mode == "auto":
        if regex is None:
            auto = st.auto_step_range(ranges)
            if auto is not None:
                regex, found = auto
        mode = "range" if regex else None
    graph_launches: list[tuple[int, int]] = []
    launch_groups = None  # graph kernels per launch, when steps turn out keyed by correlation id
    if mode in (None, "graph") and ex.has_kernels and "graphNodeId" in ex.columns(KERNEL):
        launch_groups = _graph_kernels(ex, parts[0])
        graph_launches = launch_groups.launches() if launch_groups is not None else _graph_launches(ex, device)
        if launch_groups is not None and len(launch_groups.corr) == 0:
            launch_groups = None  # no graph kernels: nothing to split off the kernel pass
    if mode in (None, "graph") and GRAPH_TRACE in ex.tables:
        dev = "" if device is None else f" WHERE deviceId = {int(device)}"
        whole = ex._q(f"SELECT correlationId, -1 - graphExecId FROM {GRAPH_TRACE}{dev} ORDER BY correlationId")
        if whole:
            graph_launches = sorted(graph_launches + [(int(c), int(g)) for c, g in whole])
            notes.append(f"{len(whole)} CUDA graph launches were traced as whole graphs (nsys --cuda-graph-trace=graph):"
                         " their kernels are not broken down; profile with --cuda-graph-trace=node for per-kernel classes")
    if mode is None:
        mode = "graph" if len(graph_launches) >= 2 else "gap"
    if mode == "range" and not regex:
        raise InputError("--step-mode range needs --step-range REGEX")
    if mode == "graph" and len(graph_launches) < 1:
        raise InputError(f"{ex.path}: no CUDA graph launches in the trace; use --step-range or --step-mode gap")

    step_ranges: list[Range] = []
    step_key = None  # ("corr"|"time", intervals)
    labels: list[str] = []
    detail = ""
    if mode == "range":
        step_ranges = st.select_step_ranges(ranges, regex, ex.path)
        intervals = [(r.start, r.end, i) for i, r in enumerate(step_ranges)]
        labels = [r.name for r in step_ranges]
        if has_runtime:
            step_key = ("corr", _ranges_to_corr(ex, intervals, [r.thread for r in step_ranges]))
        else:
            step_key = ("time", intervals)
        detail = (f"{st.count(len(step_ranges), found.removesuffix('s'), found)} found in the trace" if found else
                  f"{st.count(len(step_ranges), 'range')} matching '{regex}'")
    elif mode == "graph":
        starters = st.graph_step_starters(graph_launches)
        bounds = starters + [2 ** 62]  # the last step runs to the end of the trace
        step_key = ("corr", [(bounds[i], bounds[i + 1] - 1, i) for i in range(len(starters))])
        labels = [f"graph launch {c}" for c in starters]
        detail = (f"{st.count(len(starters), 'launch', 'launches')} of the most frequent CUDA graph "
                  f"({st.count(len(graph_launches), 'graph launch', 'graph launches')})")
    elif mode == "gap":
        found = _gap_steps(ex, parts, req, device)
        if found is None and asked == "gap":   # asked for, it finds steps or says why not (as graph mode does)
            raise InputError(st.no_gap_steps(ex.path))
        if found is None:
            mode = "whole"
        else:
            b, end, gap_ns, ordered = found
            parts = [replace(p, ordered=True) if p.table in ordered else p for p in parts]
            bb = b + [end + 1]
            step_key = ("time", [(bb[i], bb[i + 1] - 1, i) for i in range(len(b))])
            labels = [f"gap step {i}" for i in range(len(b))]
            us = gap_ns / 1e3
            shown = f"{us:.1f}" if us >= 0.1 else f"{us:.3g}"
            detail = f"{len(b)} step{'' if len(b) == 1 else 's'} separated by GPU idle gaps > {shown} us"
    if mode == "whole":
        step_key = None
        labels = ["whole trace"]
        if asked == "whole":
            detail = "the whole trace as one step, as --step-mode whole asks"
        else:
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
    ex.drop_lookup("tb")  # launch ranges are done with: worker connections need not copy them

    column = {"corr": "a.correlationId", "time": "a.start"}
    step = (ex.add_lookup("sb", step_key[1]), column[step_key[0]]) if step_key is not None else None
    tag = (ex.add_lookup("gb", tag_key[1]), column[tag_key[0]]) if tag_key is not None else None

    if launch_groups is not None and not ((step is None or step[1] == column["corr"])
                                          and (tag is None or tag[1] == column["corr"])):
        launch_groups = None  # steps or ranges by GPU time: every kernel goes through the plain pass
    packed, plain = [], []  # groups as nsys_groups columns; plain rows of the slices that took a GROUP BY
    for part in parts:
        if part.kind == 0 and launch_groups is not None:
            g = launch_groups.groups(step[0] if step else None, tag[0] if tag else None)
            if launch_groups.eager:  # else the graph-launch pass saw every row: no eager kernel
                eager = replace(part, dev=part.dev + " AND (a.graphNodeId IS NULL OR a.correlationId IS NULL)")
                g_eager, p_rows = _aggregate_part(ex, eager, step, tag)
                g, plain = gr.merge(np.hstack([g, g_eager])), plain + p_rows
        else:
            g, p_rows = _aggregate_part(ex, part, step, tag)
            plain += p_rows
        packed.append(g)
    g = np.hstack(packed)
    if plain:  # values may be NULL or not integers: groups and sums in Python
        rows = _merge_rows(itertools.chain(gr.as_rows(g), plain))
        total_events = sum(r[5] for r in rows)
        rows = [r for r in rows if r[0] is not None and r[0] >= 0]
        names = ex.strings(r[2] for r in rows if r[3] == 0)
    else:
        total_events = int(g[gr.N].sum())
        g = g[:, g[gr.STEP] >= 0]
        names = ex.strings(np.unique(g[gr.NAME][g[gr.KIND] == 0]).tolist())
    mnames = ex.memcpy_names()

    def label(nid, kind, tg):  # (name, kind name, tag name) of a group
        i = _as_int(nid)      # NULL or not an integer in a damaged export: the group keeps a placeholder
        if kind == 0:
            name = names.get(i, f"<string {nid}>") if i is not None else "<no name>"
        elif kind == 1:
            name = f"Memcpy {mnames.get(-1000 - i, 'Unknown') if i is not None else 'Unknown'}"
        elif kind == 3:
            name = f"CUDA graph exec {-2000 - i if i is not None else '?'} (whole graph)"
        else:
            name = "Memset"
        return name, KINDS[int(kind)], tag_names[int(tg)] if tg is not None and tg >= 0 else None

    if plain:
        groups, per_step, several_streams = _plain_groups(rows, label)
    else:
        groups = gr.kernel_groups(g, label)
        per_step, several_streams = gr.step_sums(g)

    # kernels on one stream overlap under programmatic dependent launch (one starts while the one
    # before it runs, and waits): a step whose durations add up to more than its span has some
    overlapped = int(np.count_nonzero(per_step[3] > per_step[2] - per_step[1]))
    if overlapped:
        per_step_excl = _split_overlaps(ex, parts, step, tag, groups, label)
        if not several_streams:   # one stream: the exclusive times add up to the union
            per_step[3] = [per_step_excl.get(int(i), 0) for i in per_step[0].tolist()]
    if several_streams:
        # several streams: busy time is the union of intervals, not the sum of durations
        union = ex._q(_uncovered_sql(_activity_sql(parts, step, keys=False), "step", "step"))
        pos = {i: j for j, i in enumerate(per_step[0].tolist())}
        for st_i, busy in union:
            if int(st_i) in pos:
                per_step[3, pos[int(st_i)]] = int(busy)

    damaged = _rows_present(ex, parts, device) - int(total_events)
    if damaged > 0:
        notes.append(f"{damaged} GPU activity row(s) without a start and end, or ending before they start, were "
                     "left out (a damaged export)")
    steps = gr.build_steps(mode, labels, step_ranges, per_step)
    empty = len(labels) - len(steps)
    if empty > 0:
        notes.append(f"{empty} step(s) launched no GPU work and were left out")
    kernel_part = next((p for p in parts if p.kind == 0), None)

    def locate_last(accept) -> dict[int, tuple]:
        """One more pass over the kernel table, for the names ``accept`` takes: per step the kernel
        that started last, outside any tracked range."""
        wanted = sorted(i for i, n in names.items() if accept(n))
        if kernel_part is None or not wanted:
            return {}
        again = NsysExport(ex.path)
        try:
            join, step_v = (again.add_lookup("sb", step_key[1]).sql(column[step_key[0]], "sbk") if step_key is not None
                            else ("", "0"))
            tag_cond = ""
            if tag_key is not None:
                tj, tag_v = again.add_lookup("gb", tag_key[1]).sql(column[tag_key[0]], "gbk")
                join, tag_cond = f"{join} {tj}", f" AND coalesce({tag_v}, -1) < 0"
            rows = again._q(
                f"SELECT step, max(s), name, stream, d FROM (SELECT {step_v} AS step, a.demangledName AS name, "
                f"a.streamId AS stream, a.end - a.start AS d, a.start AS s FROM {KERNEL} a {join} WHERE "
                f"a.demangledName IN ({','.join(map(str, wanted))}){kernel_part.dev}{tag_cond}) "
                "WHERE step >= 0 GROUP BY step")
            nm = again.strings(r[2] for r in rows)
            return {int(r[0]): (nm.get(int(r[2]), str(r[2])), "kernel", r[3], None, int(r[4])) for r in rows}
        finally:
            again.close()

    return Aggregate(path=ex.path, format="nsys-sqlite", format_version=ex.schema_version, gpu=gpu,
                     step_mode=mode, step_detail=detail, steps=steps, groups=groups,
                     total_events=int(total_events), notes=notes, locate_last=locate_last,
                     annotations=annotations, distributed={"gpus": len(devices)} if len(devices) > 1 else {})


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


def _as_int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


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


