"""The Nsight SQLite reader's in-SQL aggregation (bucket lookups, packed UPSERTs, threads, idle-gap
stretches) against a plain reference: every row fetched into Python, steps assigned with bisect,
groups summed in dicts. Same Aggregate and same profile, on the real fixtures and on small synthetic
exports in every step mode, with the fast paths forced on small data."""

from __future__ import annotations

import bisect
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import specpilot.probes.traces.nsys_aggregate as nagg
import specpilot.probes.traces.nsys_export as nexp
import specpilot.probes.traces.nsys_groups as gr
import specpilot.probes.traces.nsys_lookup as nlook
import specpilot.probes.traces.nsys_sqlite as ns
import specpilot.probes.traces.nsys_steps as nstep
from specpilot.errors import InputError
from specpilot.probes import steps as st
from specpilot.probes.classify import load_rules
from specpilot.probes.profile import build_profile
from specpilot.probes.traces import StepRequest
from specpilot.probes.traces.model import KINDS, Aggregate, KernelGroup, StepInfo
from synthetic_traces import SynthSpec, write_nsys_sqlite

LOCAL = Path(__file__).parent / "fixtures"


# ---- the reference ------------------------------------------------------------------------------
def _step_function(intervals):
    """The documented semantics: v at lo, -1 after hi (later intervals win), NULL before the first."""
    points = {}
    for _, hi, _ in intervals:
        points[hi + 1] = -1
    for lo, _, v in intervals:
        points[lo] = v
    ks = sorted(points)

    def f(key):
        if key is None:
            return None
        i = bisect.bisect_right(ks, key) - 1
        return None if i < 0 else points[ks[i]]
    return f


def reference(path, req: StepRequest) -> Aggregate:
    ex = nexp.NsysExport(path)
    try:
        con = ex.con
        notes = list(ex.notes)
        gpus = ex.gpus()
        devices = {}
        if len(gpus) > 1 or req.device is not None:
            for (d,) in con.execute(f"SELECT deviceId FROM {nexp.KERNEL}"):
                devices[d] = devices.get(d, 0) + 1
        device = req.device
        if device is None and len(devices) > 1:
            device = max(devices, key=devices.get)
            notes.append(f"kernels on {len(devices)} GPUs; profiling device {device} (choose with --device)")
        gpu = gpus.get(device if device is not None else (next(iter(devices)) if devices else 0))
        if gpu is None and gpus:
            gpu = next(iter(gpus.values()))
        if gpu is None:
            notes.append("the trace names no GPU (no TARGET_INFO_GPU): give --gpu for floors")
        # every GPU activity row: (start, end, stream, corr, name id, kind, graphNodeId)
        events = []
        tables = [(nexp.KERNEL, "demangledName", 0), (nexp.MEMCPY, "-1000 - copyKind", 1), (nexp.MEMSET, "-1", 2),
                  (nexp.GRAPH_TRACE, "-2000 - graphExecId", 3)]
        for table, name, kind in tables:
            if table not in ex.tables or (kind == 1 and "copyKind" not in ex.columns(table)):
                continue
            node = "graphNodeId" if kind == 0 and "graphNodeId" in ex.columns(table) else "NULL"
            cols = f"start, end, streamId, correlationId, {name}, deviceId, {node}"
            for s, e, stream, corr, nid, dev, g in con.execute(f"SELECT {cols} FROM {table} ORDER BY rowid"):
                if device is None or dev == device:
                    events.append((s, e, stream, corr, nid, kind, g))
        ranges = ex.ranges()
        runtime = []
        if nexp.RUNTIME in ex.tables:
            launch = {i for i, v in con.execute("SELECT id, value FROM StringIds")
                      if any(w in v.lower() for w in ("launch", "emcpy", "emset"))}
            runtime = [(s, t, c) for s, t, c, n in
                       con.execute(f"SELECT start, globalTid, correlationId, nameId FROM {nexp.RUNTIME}")
                       if (n in launch or not launch) and c is not None]

        def to_corr(intervals, threads):
            tids = {t for t in threads if t is not None}
            f = _step_function(intervals)
            span = {}
            for s, t, c in runtime:
                v = f(s)
                if v is not None and v >= 0 and (not tids or t in tids):
                    lo, hi = span.get(v, (c, c))
                    span[v] = (min(lo, c), max(hi, c))
            return sorted(((lo, hi, v) for v, (lo, hi) in span.items()), key=lambda x: x[0])

        regex, found = req.range_regex, ""
        if req.mode == "auto" and regex is None and st.auto_step_range(ranges):
            regex, found = st.auto_step_range(ranges)
        mode = req.mode if req.mode != "auto" else ("range" if regex else None)
        launches = []
        if mode in (None, "graph"):
            first = {}
            for *_, corr, _, kind, g in events:
                if kind == 0 and g is not None and corr is not None:
                    first[corr] = min(first.get(corr, g), g)
            launches = sorted(first.items())
            whole = []
            if nexp.GRAPH_TRACE in ex.tables:
                where = "" if device is None else f" WHERE deviceId = {device}"
                whole = sorted((c, -1 - g) for c, g in con.execute(
                    f"SELECT correlationId, graphExecId FROM {nexp.GRAPH_TRACE}{where}"))
            if whole:
                launches = sorted(launches + whole)
                notes.append(f"{len(whole)} CUDA graph launches were traced as whole graphs (nsys --cuda-graph-trace="
                             "graph): their kernels are not broken down; profile with --cuda-graph-trace=node for "
                             "per-kernel classes")
        if mode is None:
            mode = "graph" if len(launches) >= 2 else "gap"
        if mode == "graph" and not launches:
            raise InputError("no CUDA graph launches")
        step_ranges, labels, key, intervals, detail = [], [], None, None, ""
        if mode == "range":
            step_ranges = st.select_step_ranges(ranges, regex, path)
            iv = [(r.start, r.end, i) for i, r in enumerate(step_ranges)]
            labels = [r.name for r in step_ranges]
            if nexp.RUNTIME in ex.tables:
                key, intervals = "corr", to_corr(iv, [r.thread for r in step_ranges])
            else:
                key, intervals = "time", iv
            detail = (f"{len(step_ranges)} {found} found in the trace" if found
                      else f"{len(step_ranges)} ranges matching '{regex}'")
        elif mode == "graph":
            starters = st.graph_step_starters(launches)
            bounds = starters + [2 ** 62]
            key, intervals = "corr", [(bounds[i], bounds[i + 1] - 1, i) for i in range(len(starters))]
            labels = [f"graph launch {c}" for c in starters]
            detail = f"{len(starters)} launches of the most frequent CUDA graph ({len(launches)} graph launches)"
        elif mode == "gap":
            s = np.array([e[0] for e in events], dtype=np.int64)
            e = np.array([e[1] for e in events], dtype=np.int64)
            nm = np.array([e[4] for e in events], dtype=np.int64)
            gap = int(req.gap_us * 1e3) if req.gap_us else st.gap_threshold_ns(s, e, nm, sample=nstep.GAP_SAMPLE)
            b = st.gap_boundaries(s, e, gap) if gap is not None and len(s) else []
            if gap is None or not len(s) or (len(b) < 2 and not req.gap_us):
                mode = "whole"
            else:
                bb = b + [int(e.max()) + 1]
                key, intervals = "time", [(bb[i], bb[i + 1] - 1, i) for i in range(len(b))]
                labels = [f"gap step {i}" for i in range(len(b))]
                us = gap / 1e3
                shown = f"{us:.1f}" if us >= 0.1 else f"{us:.3g}"
                detail = f"{len(b)} step{'' if len(b) == 1 else 's'} separated by GPU idle gaps > {shown} us"
        if mode == "whole" and req.mode == "whole":
            labels, detail = ["whole trace"], "the whole trace as one step, as --step-mode whole asks"
        elif mode == "whole":
            labels = ["whole trace"]
            detail = "no step ranges, graph launches or repeating gaps: the whole trace is one step"
            notes.append("steps not found; pass --step-range REGEX to profile per step")
        tag_f, tag_key, tag_names = None, None, []
        if req.tag_regex and ranges:
            rx = st.compile_regex(req.tag_regex, "rule range")
            tagged = [r for r in ranges if r not in set(step_ranges) and rx.search(r.name)]
            if tagged:
                segs = st.innermost_segments(tagged)
                tag_names = sorted({n for _, _, n in segs})
                idx = {n: i for i, n in enumerate(tag_names)}
                if nexp.RUNTIME in ex.tables:
                    per = to_corr([(s, e - 1, i) for i, (s, e, _) in enumerate(segs)], [r.thread for r in tagged])
                    tag_key, tag_f = "corr", _step_function([(a, b, idx[segs[i][2]]) for a, b, i in per])
                else:
                    tag_key, tag_f = "time", _step_function([(s, e - 1, idx[n]) for s, e, n in segs])
        step_f = _step_function(intervals) if intervals is not None else (lambda k: 0)
        groups, spans = {}, {}
        for s, e, stream, corr, nid, kind, _ in events:
            i = step_f(corr if key == "corr" else s)
            if i is None or i < 0:
                continue
            tag = tag_f(corr if tag_key == "corr" else s) if tag_f else None
            g = groups.setdefault((i, tag_names[tag] if tag is not None and tag >= 0 else None, nid, kind, stream),
                                  [0, 0])
            g[0] += 1
            g[1] += e - s
            spans.setdefault(i, []).append((s, e, stream))
        names = dict(con.execute("SELECT id, value FROM StringIds"))
        mnames = ex.memcpy_names()

        def label(nid, kind):
            if kind == 0:
                return names.get(nid, f"<string {nid}>")
            if kind == 1:
                return f"Memcpy {mnames.get(-1000 - nid, 'Unknown')}"
            return "Memset" if kind == 2 else f"CUDA graph exec {-2000 - nid} (whole graph)"

        out_groups = [KernelGroup(step=i, name=label(nid, kind), kind=KINDS[kind], stream=stream, tag=tag, count=n,
                                  total_ns=d) for (i, tag, nid, kind, stream), (n, d) in groups.items()]
        steps, present = [], sorted(spans)
        multi = any(len({x[2] for x in v}) > 1 for v in spans.values())
        for j, i in enumerate(present):
            ss = np.array([x[0] for x in spans[i]], dtype=np.int64)
            ee = np.array([x[1] for x in spans[i]], dtype=np.int64)
            busy = st.union_ns(ss, ee) if multi else int((ee - ss).sum())
            g0, g1 = int(ss.min()), int(ee.max())
            if mode == "range":
                start, end = step_ranges[i].start, max(step_ranges[i].end, g1)
            else:
                start = g0
                end = int(min(x[0] for x in spans[present[j + 1]])) if j + 1 < len(present) else g1
            steps.append(StepInfo(index=i, label=labels[i], start=start, end=end, gpu_start=g0, gpu_end=g1,
                                  busy_ns=busy, events=len(spans[i])))
        if len(labels) - len(steps) > 0:
            notes.append(f"{len(labels) - len(steps)} step(s) launched no GPU work and were left out")

        def locate_last(accept):  # per step, the latest-starting kernel accept() takes, outside tracked ranges
            last = {}
            for s, e, stream, corr, nid, kind, _ in events:
                k = corr if key == "corr" else s
                i = step_f(k)
                tag = tag_f(corr if tag_key == "corr" else s) if tag_f else None
                if kind != 0 or i is None or i < 0 or (tag is not None and tag >= 0) or not accept(label(nid, 0)):
                    continue
                if i not in last or s > last[i][5]:
                    last[i] = (label(nid, 0), "kernel", stream, None, e - s, s)
            return {i: v[:5] for i, v in last.items()}

        return Aggregate(path=str(path), format="nsys-sqlite", format_version=ex.schema_version, gpu=gpu,
                         step_mode=mode, step_detail=detail, steps=steps, groups=out_groups, total_events=len(events),
                         notes=notes, locate_last=locate_last,
                         annotations=st.families(ranges if (req.range_regex or req.tag_regex or req.mode == "auto")
                                                 else []))
    finally:
        ex.close()


# ---- comparisons --------------------------------------------------------------------------------
def _groups(a):
    # the SQL path may split one group by a NULL/-1 range tag; compare sums per visible key
    acc = {}
    for g in a.groups:
        k = (g.step, g.name, g.kind, g.stream, g.tag)
        c = acc.setdefault(k, [0, 0])
        c[0] += g.count
        c[1] += g.total_ns
    return acc


def check(path, req):
    try:
        ref = reference(path, req)
    except Exception as e:  # the reader must fail the same way
        with pytest.raises(type(e)):
            ns.read_nsys_sqlite(path, req)
        return
    got = ns.read_nsys_sqlite(path, req)
    assert (got.step_mode, got.step_detail, got.total_events) == (ref.step_mode, ref.step_detail, ref.total_events)
    assert got.steps == ref.steps
    assert _groups(got) == _groups(ref)
    assert got.notes == ref.notes
    table = load_rules()
    p1 = build_profile(got, table, want_explain=True).to_json()  # the same profile, --explain included
    p2 = build_profile(ref, table, want_explain=True).to_json()
    assert _approx(p1) == _approx(p2)


def _approx(x):
    """Floats rounded (sums in another group order), explain rows in a fixed order."""
    if isinstance(x, float):
        return round(x, 9)
    if isinstance(x, dict):
        return {k: _approx(v) for k, v in x.items()}
    if isinstance(x, list):
        items = [_approx(v) for v in x]
        return sorted(items, key=repr) if x and isinstance(x[0], dict) and "rule" in x[0] else items
    return x


FIXTURES = [("nsys_h200_linear_softmax_schema3.20.sqlite", r"^step_\d+$", None),
            ("nsys_saxpy_a100_schema2.9.sqlite", ".", None)]
LOCAL_FIXTURES = [("nsys_h200_decode_eager.sqlite", r"^decode_step_\d+$", "draft|lm_head"),
                  ("nsys_h200_decode_graph.sqlite", r"^decode_step_\d+$", "draft|lm_head")]
MODES = [dict(), dict(mode="range"), dict(mode="graph"), dict(mode="gap"), dict(mode="gap", gap_us=50),
         dict(mode="whole")]


@pytest.fixture(params=["default", "forced"])
def fast_paths(request, monkeypatch):
    """'forced': threads on a few hundred rows, the idle-gap path on small tables, tiny bucket tables,
    rows fetched by several threads a few rows at a time."""
    if request.param == "forced":
        monkeypatch.setattr(nexp, "PARALLEL_MIN_ROWS", 40)
        monkeypatch.setattr(nstep, "GAP_FETCH_MAX", 10)
        monkeypatch.setattr(nlook, "BUCKETS_PER_POINT", 0)
        monkeypatch.setattr(nlook, "BUCKETS_MAX", 8)
        monkeypatch.setattr(nexp, "FETCH_ROWS", 3)
        monkeypatch.setattr(nexp, "FETCH_MIN_ROWS", 7)
        monkeypatch.setattr(nexp, "FETCH_MIN_THREADS", 1)
    return request.param


@pytest.mark.parametrize("name,rx,tags", FIXTURES + LOCAL_FIXTURES)
def test_fixtures_match_reference(fixtures_dir, fast_paths, name, rx, tags):
    path = (fixtures_dir if (fixtures_dir / name).exists() else LOCAL) / name
    for m in MODES:
        req = StepRequest(range_regex=rx if m.get("mode") in (None, "range") else None, tag_regex=tags, **m)
        check(path, req)


SYNTH = [dict(), dict(graphs=True), dict(second_stream=True, overlap_ns=3000),
         dict(schema2=True, nvtx_text_ids=True, memcpy=False)]


@pytest.mark.parametrize("kw", SYNTH)
def test_synthetic_matches_reference(tmp_path, fast_paths, kw):
    path = write_nsys_sqlite(tmp_path / "s.sqlite", SynthSpec(steps=6, layers=2, **kw))
    for m in MODES + [dict(mode="auto", tag_regex="decode|rms")]:
        req = StepRequest(range_regex="decode_step" if m.get("mode") in (None, "range") else None, **m)
        check(path, req)


@pytest.mark.parametrize("graphs", [False, True])
def test_unsorted_and_huge_ids_fall_back(tmp_path, monkeypatch, graphs):
    """Rows out of time order (idle gaps found from fetched rows) and stream ids past the packed key's
    range (plain GROUP BY for those slices, graph launches by their own pass) still give the
    reference's answer."""
    monkeypatch.setattr(nexp, "PARALLEL_MIN_ROWS", 40)
    monkeypatch.setattr(nstep, "GAP_FETCH_MAX", 10)
    src = write_nsys_sqlite(tmp_path / "s.sqlite", SynthSpec(steps=5, layers=2, graphs=graphs))
    con = sqlite3.connect(src)
    con.executescript(f"""
        CREATE TABLE k2 AS SELECT * FROM {nexp.KERNEL} ORDER BY (rowid * 7919) % 1009;
        DELETE FROM {nexp.KERNEL}; INSERT INTO {nexp.KERNEL} SELECT * FROM k2; DROP TABLE k2;
        UPDATE {nexp.KERNEL} SET streamId = 1 << 40 WHERE rowid % 7 = 0;""")
    con.commit()
    con.close()
    for req in (StepRequest(mode="gap"), StepRequest(range_regex="decode_step"), StepRequest(mode="whole"),
                StepRequest()):
        check(src, req)


@pytest.mark.parametrize("probe", [1, 4096])
def test_graph_trace_with_eager_kernels_inside(tmp_path, monkeypatch, probe):
    """Eager kernels (no graph node or no correlation id) only in the middle of a graph trace: with a
    one-row probe the graph-launch pass reads every row and must notice them (the eager pass runs);
    with a large probe they are found first and filtered out of that pass."""
    monkeypatch.setattr(nexp, "PARALLEL_MIN_ROWS", 40)
    monkeypatch.setattr(nagg, "EAGER_PROBE", probe)
    src = write_nsys_sqlite(tmp_path / "s.sqlite", SynthSpec(steps=6, layers=2, graphs=True, second_stream=True,
                                                             overlap_ns=2000))
    con = sqlite3.connect(src)
    n = con.execute(f"SELECT max(rowid) FROM {nexp.KERNEL}").fetchone()[0]
    con.execute(f"UPDATE {nexp.KERNEL} SET graphNodeId = NULL WHERE rowid BETWEEN {n // 3} AND {n // 3 + 4}")
    con.execute(f"UPDATE {nexp.KERNEL} SET correlationId = NULL WHERE rowid = {n // 2}")
    con.commit()
    con.close()
    for req in (StepRequest(), StepRequest(mode="graph", tag_regex="decode"), StepRequest(mode="gap")):
        check(src, req)


def test_unique_rows_matches_numpy():
    rng = np.random.default_rng(3)
    for trial in range(50):
        n = int(rng.integers(1, 200))
        cols = [rng.integers(-3, int(rng.integers(-2, 40)), n) for _ in range(4)]
        if trial % 5 == 0:
            cols[1] = rng.integers(-(1 << 60), 1 << 60, n)  # too wide to pack: numpy's own path
        keys, inv = gr.unique_rows(cols)
        want, want_inv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
        assert (keys == want).all() and (inv == want_inv.reshape(-1)).all()


@pytest.mark.parametrize("graphs", [False, True])
def test_without_runtime_table_ranges_by_gpu_time(tmp_path, fast_paths, graphs):
    spec = SynthSpec(steps=5, layers=2, second_stream=True, overlap_ns=2000, graphs=graphs)
    src = write_nsys_sqlite(tmp_path / "s.sqlite", spec)
    con = sqlite3.connect(src)
    con.execute(f"DROP TABLE {nexp.RUNTIME}")
    con.commit()
    con.close()
    for req in (StepRequest(range_regex="decode_step", tag_regex="decode"), StepRequest(mode="gap", tag_regex="dec"),
                StepRequest(mode="auto"), StepRequest(mode="auto", tag_regex="dec")):
        check(src, req)


def test_lookup_matches_bisect(monkeypatch):
    """The bucket table (two changes per bucket, searches past it) equals the plain step function."""
    rng = np.random.default_rng(5)
    for trial in range(20):
        monkeypatch.setattr(nlook, "BUCKETS_MAX", 4 if trial % 2 else 1 << 20)
        starts = np.sort(rng.choice(10_000, size=int(rng.integers(1, 60)), replace=False))
        iv = [(int(s), int(s + rng.integers(0, 400)), i) for i, s in enumerate(starts)]
        if trial % 4 == 0:
            iv.append((int(starts[-1]) + 5000, 2 ** 62, len(iv)))  # a last interval to "the end"
        lk = nlook._Lookup("t", iv)
        con = sqlite3.connect(":memory:")
        con.execute("ATTACH ':memory:' AS lk")
        lk.fill(con, "lk")
        keys = [None, -5, *rng.integers(-100, 16_000, size=400).tolist(), *[k for k in lk.ks], 2 ** 62 + 1]
        con.execute("CREATE TABLE q (x INTEGER)")
        con.executemany("INSERT INTO q VALUES (?)", [(k,) for k in keys])
        join, value = lk.sql("a.x", "b")
        got = [r[0] for r in con.execute(f"SELECT {value} FROM q a {join} ORDER BY a.rowid")]
        f = _step_function(iv)
        assert got == [f(k) for k in keys]
