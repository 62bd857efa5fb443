"""Nsight Systems SQLite exports (schema 2.x ``EXPORT_META_DATA`` and 3.x ``META_DATA_EXPORT``).

The aggregation runs inside SQLite, in one pass over each GPU activity table and without sorting
it (SQLite has no hash aggregate: a GROUP BY sorts every row, and on millions of kernels that sort
was most of the time). :func:`read_nsys_sqlite` chooses the step mode and puts the parts together:
the export, its threads and its fetches (:mod:`.nsys_export`); steps and ranges as step functions
evaluated inside SQLite (:mod:`.nsys_lookup`); steps from NVTX ranges, CUDA graph launches and
idle gaps (:mod:`.nsys_steps`); the passes that sum each activity table per group
(:mod:`.nsys_aggregate`).

Every fast path checks its preconditions and falls back to the plain query (GROUP BY, or fetching
the rows) when they do not hold, with the same result (``tests/test_traces_nsys_reference.py``
compares with a plain Python reader).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import numpy as np

from specpilot.errors import InputError

from .. import steps as st
from . import nsys_groups as gr
from .model import KINDS, Aggregate, Range, StepRequest
from .nsys_aggregate import (_activity_sql, _aggregate_part, _graph_kernels, _merge_rows, _plain_groups,
                             _rows_present, _split_overlaps, _uncovered_sql)
from .nsys_export import GRAPH_TRACE, KERNEL, MEMCPY, MEMSET, NVTX, RUNTIME, NsysExport
from .nsys_steps import _gap_steps, _graph_launches, _ranges_to_corr


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
    if mode == "range" and (note := st.untangle_range_walls(steps)):
        notes.append(note)
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


def _as_int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


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
