"""An open Nsight Systems SQLite export (:class:`NsysExport`), its GPU activity tables (:class:`Part`)
and how their rows are read.

The file is opened read-only and never modified. Large tables are split by rowid across threads,
each on its own read-only connection; the threads hand their groups (and gap mode's sample of
rows) back as hex strings, not row by row (see :func:`_fetch_ints`). The passes of
:mod:`.nsys_steps` and :mod:`.nsys_aggregate` sum rows by UPSERTs into temporary tables
(:func:`_upsert_table`). Tables used: ``StringIds``, ``CUPTI_ACTIVITY_KIND_KERNEL`` (+ ``_MEMCPY``,
``_MEMSET``), ``CUPTI_ACTIVITY_KIND_RUNTIME`` (launch correlation, graph launches), ``NVTX_EVENTS``
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
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np

from specpilot.errors import InputError
from specpilot.fileio import require_file

from .model import GPUInfo, Range
from .nsys_lookup import _Lookup

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
FETCH_ROWS = 1 << 14  # rows per string of _fetch_ints (about 1 MB of hex for 4 columns)
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
        require_file(p)
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
        bad = next((r for r in rows if not (type(r[0]) is int and type(r[1]) is int and 0 <= r[0] <= r[1] < 2 ** 62)),
                   None)
        if bad is not None:   # a time past any capture's clock (2**62 ns) or not a whole number: a damaged export
            raise InputError(f"{self.path}: NVTX range {str(bad[2] or '')[:60]!r} spans {bad[0]!r}..{bad[1]!r} ns, "
                             "not times of a capture (a damaged export)")
        return [Range(name=str(r[2] or ""), start=r[0], end=r[1], thread=r[3]) for r in rows]

    def kernel_devices(self) -> dict[int, int]:
        """Each device with kernels and their summed duration (ns): the busiest is the one profiled."""
        if not self.has_kernels:
            return {}
        rows = self._q(f"SELECT deviceId, total(max(end - start, 0)) FROM {KERNEL} GROUP BY deviceId")
        return {int(d): int(n) for d, n in rows}

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
