"""Step functions of an integer key, evaluated inside SQLite (:class:`_Lookup`).

Steps (and the ranges rules test) are step functions of the CUDA correlation id or the GPU start
time with a few thousand change points. A row finds its value through one equality join on a
bucket table (each bucket holds its value and up to two change points) instead of a search; the
tables are built once and copied to each connection (:meth:`.nsys_export.NsysExport.add_lookup`).
"""

from __future__ import annotations

import numpy as np

BUCKETS_PER_POINT = 8  # bucket table rows per change point of a step function, at most BUCKETS_MAX
BUCKETS_MAX = 1 << 20


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
