"""Build a profile: per step, where GPU time goes by kernel class, and how far each class is
from its byte floor.

Per step the trace gives the wall window, the GPU busy time (union of kernel/memcpy/memset
intervals) and each class's kernel time: the sum of its kernels' durations, each kernel counted
from where the one before it on its stream ended (under programmatic dependent launch a kernel
starts early and waits; the wait is the earlier kernel's time; the readers set
``KernelGroup.excl_ns``). The profile reports the median over steps of each (so a warm-up step
does not move it) with the spread, and

- ``outside_ms`` = step wall ms - kernel busy ms (time the GPU sits idle inside a step)
- ``kernel_factor`` = kernel busy ms / total floor ms (how far kernels are from the floor)
- ``outside_factor`` = step wall ms / kernel busy ms

which ``specpilot ceiling --profile`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from specpilot.errors import InputError

from . import steps as st
from .classify import FLOOR_CLASSES, Classifier, ExplainRow, RuleTable, explain
from .traces.model import Aggregate, KernelGroup

SCHEMA = "specpilot.profile/1"
# the input most likely wrong when a class runs faster than its floor allows at the GPU's peak
LIKELY_FIELD = {
    "linear": "--weight-dtype (quantized weights read fewer bytes) or the model's hidden/intermediate sizes",
    "lm_head": "--lm-head-dtype or the model's vocab_size (or the LM head was not in the step)",
    "attention": "--context (fewer cached tokens) or --kv-dtype",
    "moe": "--batch/--rows (fewer experts touched) or the model's num_experts_per_tok and --weight-dtype",
    "gdn": "--rows/--batch or the model's linear-attention sizes",
    "norm": "--rows/--batch or the model's hidden_size",
    "drafter": "--drafter, --draft-rows or --draft-passes",
    "communication": "--link-bandwidth or the message sizes (tensor-parallel size)",
}


@dataclass
class Floors:
    """Per-class floors from ``step_floor`` or a ceiling JSON."""

    source: str
    classes: dict[str, dict]  # name -> {"bytes", "flops", "floor_ms", "bound"?}
    total_floor_ms: float
    gpu: dict | None = None
    shape: dict = field(default_factory=dict)
    model: str | None = None  # the model the floors are for (a ceiling JSON's ``model``)


@dataclass
class ClassRow:
    name: str
    ms: float  # median per step: each kernel's time that no earlier kernel of its stream covers
    ms_mean: float
    share: float  # of the summed class time
    calls: float  # median kernels per step
    bytes: float | None = None
    flops: float | None = None
    floor_ms: float | None = None
    efficiency: float | None = None  # floor / measured
    flag: str | None = None  # why the efficiency cannot be trusted (model/config mismatch)
    duration_ms: float | None = None  # median per step of the kernels' summed durations (waits included)

    def as_dict(self) -> dict:
        d = {"ms": self.ms, "share": self.share, "bytes": self.bytes, "flops": self.flops,
             "floor_ms": self.floor_ms, "efficiency": self.efficiency, "ms_mean": self.ms_mean,
             "calls": self.calls, "duration_ms": self.duration_ms}
        if self.flag:
            d["flag"] = self.flag
        return d


@dataclass
class Profile:
    trace: dict
    gpu: dict | None
    model: str | None
    shape: dict
    steps: int
    step_mode: str
    step_detail: str
    step_wall: st.Spread
    kernel_busy: st.Spread
    outside_ms: float
    total_floor_ms: float | None
    kernel_factor: float | None
    outside_factor: float | None
    classes: dict[str, ClassRow]
    per_step: list[dict]
    floor_source: str | None
    notes: list[str]
    explain: list[ExplainRow] | None = None
    events: st.Spread | None = None  # kernels per step
    top: list[dict] = field(default_factory=list)  # the kernels taking the most time per step
    warnings: list[str] = field(default_factory=list)
    distributed: dict | None = None   # the multi-GPU job the trace is one rank of (:func:`rank_of_job`)
    floor_peak_ms: float | None = None   # total_floor_ms at the GPU's full peak (:func:`floor_at_peak`)

    def to_json(self) -> dict[str, Any]:
        d = {
            "schema": SCHEMA,
            "gpu": self.gpu,
            "model": self.model,
            "shape": self.shape,
            "steps": self.steps,
            "step_wall_ms": self.step_wall.median,
            "kernel_busy_ms": self.kernel_busy.median,
            "outside_ms": self.outside_ms,
            "kernel_factor": self.kernel_factor,
            "outside_factor": self.outside_factor,
            "total_floor_ms": self.total_floor_ms,
            "floor_peak_ms": self.floor_peak_ms,
            "classes": {k: v.as_dict() for k, v in self.classes.items()},
            "trace": self.trace,
            "step_mode": self.step_mode,
            "step_detail": self.step_detail,
            "floor_source": self.floor_source,
            "distributed": self.distributed,
            "spread": {"step_wall_ms": self.step_wall.as_dict(), "kernel_busy_ms": self.kernel_busy.as_dict(),
                       **({"events": self.events.as_dict()} if self.events else {})},
            "per_step": self.per_step,
            "top_kernels": self.top,
            "warnings": self.warnings,
            "notes": self.notes,
        }
        if self.explain is not None:
            d["explain"] = [{"name": r.name, "kind": r.kind, "range": r.tag, "class": r.cls, "rule": r.rule,
                             "per_step": r.per_step, "ms_per_step": r.ms_per_step} for r in self.explain]
        return d


def peak_limit(floors: Floors, cls: str) -> float:
    """The efficiency a class can reach at most: its floor counts a fraction of the GPU's peak
    bandwidth (or dense FLOPs, where those bind), so kernels may beat it by up to 1 / fraction (111%
    at the default 0.9 of the bandwidth); faster than that, the floor assumed more work than the
    kernels did. 1 where the fractions are not known."""
    f = floors.classes.get(cls) or {}
    frac = floors.shape.get("flops_fraction" if f.get("bound") == "flops" else "bw_fraction")
    return 1.0 / frac if isinstance(frac, (int, float)) and 0 < frac <= 1 else 1.0


def floor_at_peak(floors: Floors | None, total_floor_ms: float | None) -> float | None:
    """The step's byte floor at the GPU's full peak, below which no kernel can run: each class's
    floor without its fraction of the peak (:func:`peak_limit`), plus what ``total_floor_ms``
    holds beyond the floors' classes (a link floor of the trace's collectives, which assumes no
    fraction). None without floors or a floor. ``profile`` and ``ceiling`` (through the profile
    JSON's ``floor_peak_ms``) judge a model/config mismatch by it alike."""
    if floors is None or not total_floor_ms:
        return None
    return (sum((f.get("floor_ms") or 0.0) / peak_limit(floors, c) for c, f in floors.classes.items())
            + (total_floor_ms - floors.total_floor_ms))


def apply_positions(groups: list[KernelGroup], clf: Classifier, agg: Aggregate, notes: list[str]) -> list[KernelGroup]:
    """Split off, per step, the kernel each ``position: last`` rule names (the last launched among
    its candidates), as a group of its own with ``position="last"``. A rule whose class some other
    rule already found (an LM head by range, name or shape) is skipped."""
    rules = [r for r in clf.table.rules if r.position]
    if not rules:
        return groups
    found = {clf.classify(g).cls for g in groups}
    for rule in rules:
        if rule.cls in found:
            continue
        cand = {g.name for g in groups if clf.position_candidate(rule, g)}
        if not cand:
            continue
        if agg.locate_last is None:
            notes.append(f"rule {rule.describe()} needs the kernels' order, which this trace reader does not keep")
            continue
        last = agg.locate_last(lambda n: n in cand)
        index: dict[tuple, KernelGroup] = {}
        for g in groups:
            if g.tag is None and g.position is None and g.name in cand:
                index.setdefault((g.step, g.name, g.stream), g)
        added = []
        for step_i, (name, kind, stream, dims, dur, *excl) in last.items():
            g = index.get((step_i, name, stream))
            if g is None:
                continue
            if g.count == 1:  # runs once in the step: the whole group, if the step has other candidates
                if sum(x.count for x in groups if x.step == step_i and x.name in cand and x.tag is None) > 1:
                    g.position = "last"
                continue
            g.count -= 1
            g.total_ns -= dur
            ex = None
            if g.excl_ns is not None:   # a reader that gives no exclusive time here: its duration, at most the group's
                ex = excl[0] if excl else min(dur, g.excl_ns)
                g.excl_ns -= ex
            added.append(KernelGroup(step=step_i, name=name, kind=kind, stream=stream, tag=None, dims=g.dims,
                                     count=1, total_ns=dur, position="last", excl_ns=ex))
        groups = groups + added
        clf._cache.clear()
        found = {clf.classify(g).cls for g in groups}
    return groups


def build_profile(agg: Aggregate, table: RuleTable, floors: Floors | None = None, vocab: int | None = None,
                  skip_steps: int = 0, model: str | None = None, gpu: dict | None = None,
                  want_explain: bool = False, link_gbs: float | None = None, top_n: int = 10,
                  max_steps: int | None = None) -> Profile:
    """The profile of ``agg``'s steps after the first ``skip_steps`` (at most ``max_steps`` of them:
    tensor-parallel ranks are compared over the steps every rank has)."""
    if skip_steps < 0:
        raise InputError("--skip-steps must be >= 0")
    notes = list(agg.notes)
    steps = agg.steps[skip_steps:][:max_steps]
    if not steps:
        raise InputError(f"{agg.path}: no steps left to profile ({len(agg.steps)} found, {skip_steps} skipped)")
    keep = {s.index for s in steps}
    kept_groups = [KernelGroup(**g.__dict__) for g in agg.groups if g.step in keep]
    agg_kept = Aggregate(**{**agg.__dict__, "steps": steps, "groups": kept_groups})
    clf = Classifier(table, vocab=vocab).fit(agg_kept)
    agg_kept.groups = apply_positions(agg_kept.groups, clf, agg, notes)

    per_class: dict[str, dict[int, float]] = {}   # exclusive time where the reader gives it
    durations: dict[str, dict[int, float]] = {}   # summed durations
    calls: dict[str, dict[int, int]] = {}
    comm_bytes: dict[int, int] = {}
    per_kernel: dict[tuple, dict[int, float]] = {}
    for g in agg_kept.groups:
        c = clf.classify(g).cls
        t = (g.total_ns if g.excl_ns is None else g.excl_ns) / 1e6
        per_class.setdefault(c, {}).setdefault(g.step, 0.0)
        per_class[c][g.step] += t
        durations.setdefault(c, {}).setdefault(g.step, 0.0)
        durations[c][g.step] += g.total_ns / 1e6
        calls.setdefault(c, {}).setdefault(g.step, 0)
        calls[c][g.step] += g.count
        k = per_kernel.setdefault((g.name, c), {})
        k[g.step] = k.get(g.step, 0.0) + t
        if c == "communication" and g.comm_bytes:
            comm_bytes[g.step] = comm_bytes.get(g.step, 0) + g.comm_bytes
    idx = [s.index for s in steps]
    order = [c for c in table.classes if c in per_class] + [c for c in per_class if c not in table.classes]
    if floors:
        order += [c for c in floors.classes if c not in order and (floors.classes[c].get("floor_ms") or 0) > 0]
    meds = {c: median([per_class.get(c, {}).get(i, 0.0) for i in idx]) for c in order}
    total = sum(meds.values())
    classes: dict[str, ClassRow] = {}
    unfloored = None   # the drafter's row where its kernels ran with no floor (no --drafter)
    for c in order:
        vals = [per_class.get(c, {}).get(i, 0.0) for i in idx]
        row = ClassRow(name=c, ms=meds[c], ms_mean=sum(vals) / len(vals), share=(meds[c] / total if total else 0.0),
                       calls=float(median([calls.get(c, {}).get(i, 0) for i in idx])),
                       duration_ms=median([durations.get(c, {}).get(i, 0.0) for i in idx]))
        unknown = c == "drafter" and floors and not (floors.classes.get(c) or {}).get("floor_ms")
        if floors and c in floors.classes and not unknown:
            f = floors.classes[c]
            row.bytes, row.flops, row.floor_ms = f.get("bytes"), f.get("flops"), f.get("floor_ms")
        elif unknown and row.ms > 0:   # a drafter's floor needs the drafter's model, not a floor of 0
            unfloored = row
        if c == "communication" and comm_bytes:
            row.bytes = float(median([comm_bytes.get(i, 0) for i in idx]))
            if link_gbs:
                row.flops, row.floor_ms = 0.0, row.bytes / (link_gbs * 1e9) * 1e3
        if row.floor_ms is not None and row.ms > 0:
            row.efficiency = row.floor_ms / row.ms
            limit = peak_limit(floors, c) if floors else 1.0
            # a class with under 1% of the step's floor is often fused into other kernels (an RMSNorm
            # into the GEMV after it), which then carry its work: running faster than it is no mismatch
            small = floors is not None and row.floor_ms < 0.01 * floors.total_floor_ms
            if row.efficiency > limit and not small:
                below = (f"the {row.floor_ms / limit:.4g} ms it needs at the GPU's full peak (its floor: "
                         f"{row.floor_ms:.4g} ms)" if limit > 1 else f"its floor of {row.floor_ms:.4g} ms")
                row.flag = (f"model/config mismatch: {c} takes {row.ms:.4g} ms, below {below}; "
                            f"check {LIKELY_FIELD.get(c, 'the model and shape options')}")
        classes[c] = row
    whole_graphs = any(g.kind == "graph" for g in agg_kept.groups)
    if whole_graphs:
        notes.append("whole-graph records count as busy for their whole span (gaps between the graph's kernels "
                     "included) and as class 'other'")
    if floors and not whole_graphs:
        for c in FLOOR_CLASSES:
            # no kernel of the class in most steps (a zero-length one is a kernel classified all the same)
            if c in floors.classes and (floors.classes[c].get("floor_ms") or 0) > 0 and \
                    median([calls.get(c, {}).get(i, 0) for i in keep]) == 0:
                notes.append(f"class {c!r} has a floor but no kernels were classified as {c}; "
                             "check the rules (--explain) or add a --rules file")
    comm = classes.get("communication")
    if comm is not None and comm.ms > 0 and comm.floor_ms is None:
        notes.append("communication has no byte floor: " + ("the trace records no message sizes (Kineto "
                     "record_param_comms)" if not comm_bytes else "no link bandwidth for this GPU; give --link-bandwidth"))
    warnings = [f"{c}: {r.flag}" for c, r in classes.items() if r.flag]

    # steps split at graph launches or idle gaps end where the next one starts: the last has no next
    # step, so its window is only its GPU span and its wall is left out of the wall figures
    by = {"graph": "CUDA graph launches", "gap": "idle gaps"}.get(agg.step_mode)
    open_last = by is not None and steps[-1] is agg.steps[-1]
    if open_last and len(steps) == 1 and len(agg.steps) > 1:
        raise InputError(f"{agg.path}: the only step left after --skip-steps {skip_steps} is the trace's last, "
                         f"whose wall is unknown (steps split at {by} end where the next one starts); "
                         f"skip at most {len(agg.steps) - 2}")
    if open_last and len(steps) == 1:
        open_last = False
        notes.append(f"the trace holds one step (split at {by}): its wall is its GPU span, as no next step ends "
                     "it, so the time outside its kernels is not measured")
    elif open_last:
        notes.append(f"the last step's wall is left out of the wall figures: steps split at {by} end where the "
                     "next one starts, and it has no next step")
    wall = st.spread(s.wall_ns / 1e6 for s in (steps[:-1] if open_last else steps))
    busy = st.spread(s.busy_ns / 1e6 for s in steps)
    events = st.spread(s.events for s in steps)
    outside = wall.median - busy.median
    total_floor = floors.total_floor_ms if floors else None
    if total_floor is not None and comm is not None and comm.floor_ms and "communication" not in floors.classes:
        total_floor += comm.floor_ms
    summed = sum(r.duration_ms or 0.0 for r in classes.values())
    if summed > 1.05 * total > 0:
        # programmatic dependent launch: a kernel starts while the one before it on its stream runs
        # and waits for it; the wait is counted once, as the earlier kernel's time
        notes.append(f"kernels overlap the one before them on their stream (programmatic dependent launch): "
                     f"each counts from where the one before it ended, {total:.4g} ms per step in all against "
                     f"{summed:.4g} ms of summed durations, whose excess is their waits (JSON: duration_ms)")
    if total > 0 and busy.median > 0 and total > 1.05 * busy.median:
        # concurrent streams (or, from a reader that does not split overlaps, PDL waits too): busy
        # time is the union, so it is right
        notes.append(f"the classes' kernel times add up to {total:.4g} ms per step, "
                     f"{total / busy.median - 1:.0%} more than the busy time ({busy.median:.4g} ms): kernels "
                     "overlap (concurrent streams; in Nsight exports also programmatic dependent launch, where a "
                     "kernel's duration includes its wait for the one before); shares are of the summed kernel time")
    kf = busy.median / total_floor if total_floor else None
    if unfloored is not None:
        warnings.append(unfloored_drafter_warning(unfloored.ms, unfloored.share, kf))
    of = wall.median / busy.median if busy.median > 0 else None
    at_peak = floor_at_peak(floors, total_floor)
    if kf is not None and at_peak and busy.median < at_peak:
        warnings.append("model/config mismatch: kernel busy time is below the byte floor at the GPU's full peak; "
                        "check --rows/--batch/--context and the model")
    distributed = rank_of_job(agg, classes)
    if distributed is not None and floors is not None:
        distributed["floors"] = "whole model"
        warnings.insert(0, whole_model_floors_warning(distributed))   # first: it may explain the mismatches
    # a whole-graph record is one event for a graph's many kernels: the kernel count says nothing then
    warnings += st.plausibility([] if whole_graphs else [s.events for s in steps], [s.busy_ns for s in steps],
                                agg.annotations, [s.label for s in steps] if agg.step_mode == "range" else None)
    per_step = [{"index": s.index, "label": s.label, "wall_ms": None if open_last and k == len(steps) - 1 else
                 s.wall_ns / 1e6, "busy_ms": s.busy_ns / 1e6, "events": s.events} for k, s in enumerate(steps)]
    top = sorted(((median([v.get(i, 0.0) for i in idx]), n, c) for (n, c), v in per_kernel.items()), reverse=True)
    top_rows = [{"name": n, "class": c, "ms": ms, "share": (ms / total if total else 0.0),
                 "steps": len(per_kernel[(n, c)])} for ms, n, c in top[:top_n]]
    trace = {"path": agg.path, "format": agg.format, "format_version": agg.format_version,
             "events": agg.total_events, "steps_found": len(agg.steps), "steps_skipped": skip_steps,
             "rules": table.sources, "orphans": {"events": agg.orphans[0], "ms": agg.orphans[1] / 1e6}}
    return Profile(trace=trace, gpu=gpu, model=model, shape=(floors.shape if floors else {}), steps=len(steps),
                   step_mode=agg.step_mode, step_detail=agg.step_detail, step_wall=wall, kernel_busy=busy,
                   outside_ms=outside, total_floor_ms=total_floor, floor_peak_ms=at_peak, kernel_factor=kf, outside_factor=of,
                   classes=classes, per_step=per_step, floor_source=(floors.source if floors else None), notes=notes,
                   explain=(explain(agg_kept, clf) if want_explain else None), events=events, top=top_rows,
                   warnings=warnings, distributed=distributed)


def rank_of_job(agg: Aggregate, classes: dict) -> dict | None:
    """What shows the trace to be one rank of a multi-GPU job, or None: the trace's own word
    (``Aggregate.distributed``: rank and world size, the group its collectives ran over, other GPUs'
    kernels) and collectives in its steps (``collectives_ms`` per step). A trace that says it is
    the only process (world size 1, no larger group) is not one, whatever it launched."""
    d = dict(agg.distributed)
    comm = classes.get("communication")
    if comm is not None and comm.ms > 0:
        d["collectives_ms"] = comm.ms
    return d if is_one_rank(d) else None


def is_one_rank(d: dict) -> bool:
    """Whether the evidence ``d`` (:func:`rank_of_job`'s keys) shows one rank of several: a world,
    group or GPU count above one, or collectives in a trace that does not say it ran alone."""
    many = any((d.get(k) or 1) > 1 for k in ("world_size", "group_size", "gpus"))
    alone = d.get("world_size") == 1 and (d.get("group_size") or 1) == 1 and (d.get("gpus") or 1) == 1
    return bool(many or (d.get("collectives_ms") and not alone))


def rank_evidence(d: dict) -> tuple[str, str]:
    """What shows a trace to be one rank (``Profile.distributed``, as :func:`rank_of_job` gives it),
    in words, and how far that puts floor-based figures off: ``("rank 1 of 2, ...", "2x")``."""
    said = []
    if d.get("world_size", 1) > 1:
        said.append(f"rank {d['rank']} of {d['world_size']}" if "rank" in d else f"world size {d['world_size']}")
    if d.get("group_size", 1) > 1:
        said.append(f"collectives over {d['group_size']} ranks")
    if d.get("gpus", 1) > 1:
        said.append(f"kernels on {d['gpus']} GPUs")
    if d.get("collectives_ms"):
        said.append(f"{d['collectives_ms']:.4g} ms of collectives per step")
    n = next((v for v in (d.get("group_size"), d.get("world_size"), d.get("gpus")) if v and v > 1), None)
    by = f"{n}x" if n else "the tensor-parallel size"
    return ", ".join(said), by


def whole_model_floors_warning(d: dict) -> str:
    """The warning for floors set beside one rank's trace: the floors are the whole model's on one
    GPU, and no rule here splits them by rank (which weights a tensor-parallel rank holds whole,
    whether the KV heads split, how experts are placed), so they are not scaled."""
    said, by = rank_evidence(d)
    return (f"the floors are the whole model's on one GPU, and this trace is one rank of a multi-GPU job "
            f"({said}): a tensor-parallel rank reads only its shard of the weights and KV cache, which "
            f"the floors do not split, so efficiencies read up to {by} high and the kernel factor up to {by} low "
            "(mismatch flags may come from this); profile the ranks' traces side by side instead")


def unfloored_drafter_warning(ms: float, share: float | None, kernel_factor: float | None) -> str:
    """The warning for drafter kernels profiled with no floor (no ``--drafter``): the floor the
    kernel factor divides by leaves the drafter out, while the busy time counts its kernels."""
    kf = f" ({kernel_factor:.4g})" if kernel_factor else ""
    part = f", {share:.0%} of the kernel time" if share else ""
    return (f"drafter kernels ran ({ms:.4g} ms a step{part}) but have no floor without --drafter MODEL: the "
            f"kernel factor{kf} sets them against a floor without the drafter, so it reads high")


def floors_from_model(model_spec, gpu_spec, rows: int, batch: int, context: int, weight_dtype: str = "bf16",
                      lm_head_dtype: str | None = None, kv_dtype: str = "bf16", drafter=None,
                      draft_rows: int | None = None, flops_fraction: float = 0.6, bw_fraction: float = 0.9,
                      draft_passes: int = 1) -> Floors:
    from .floors import step_floor

    f = step_floor(model_spec, gpu_spec, rows=rows, batch=batch, context=context, weight_dtype=weight_dtype,
                   lm_head_dtype=lm_head_dtype, kv_dtype=kv_dtype, drafter=drafter, draft_rows=draft_rows,
                   flops_fraction=flops_fraction, bw_fraction=bw_fraction, draft_passes=draft_passes)
    classes = {k: {"bytes": v.bytes, "flops": v.flops, "floor_ms": v.floor_ms, "bound": v.bound}
               for k, v in f.classes.items()}
    from .floors import lm_head_dtype_of

    shape = {"rows": rows, "batch": batch, "context": context, "weight_dtype": weight_dtype,
             "lm_head_dtype": lm_head_dtype_of(weight_dtype, lm_head_dtype), "kv_dtype": kv_dtype,
             "flops_fraction": flops_fraction, "bw_fraction": bw_fraction}
    if drafter is not None:
        shape.update({"drafter": drafter.name, "draft_rows": draft_rows or rows, "draft_passes": draft_passes})
    # a GPU whose catalog figures --bandwidth or --flops replaced says so (its key alone would not)
    from specpilot.gpus import get_gpu

    try:
        cat = get_gpu(gpu_spec.key)
        same = (cat.bandwidth_tbs, cat.bf16_tflops) == (gpu_spec.bandwidth_tbs, gpu_spec.bf16_tflops)
    except Exception:   # a GPU given by its figures alone
        same = False
    peaks = "" if same else f", {gpu_spec.bandwidth_tbs:g} TB/s, {gpu_spec.bf16_tflops:g} TFLOP/s"
    return Floors(source=f"step_floor({model_spec.name}, {gpu_spec.key}{peaks})", classes=classes,
                  total_floor_ms=f.total_floor_ms, shape=shape)


def floors_from_ceiling(path: str, rows: int | None = None) -> Floors:
    """Per-class floors from a ``specpilot.ceiling/1`` JSON (``by_rows`` entry or ``classes``)."""
    from specpilot.fileio import read_json

    doc = read_json(path, kind="ceiling")
    block, shape = doc, {}
    by_rows = doc.get("by_rows") or {}
    if not isinstance(by_rows, dict):
        by_rows = {}
    if rows is None and len(by_rows) > 1:
        raise InputError(f"{path}: ceiling has floors for several rows ({', '.join(by_rows)}); choose one with --rows")
    if rows is not None and by_rows:
        if str(rows) not in by_rows:
            raise InputError(f"{path}: ceiling has no floors for --rows {rows} (it has rows "
                             f"{', '.join(sorted(by_rows, key=lambda x: int(x) if x.isdigit() else 0))})")
        block = by_rows[str(rows)]
        shape = {k: block.get(k) for k in ("rows", "batch", "context") if k in block}
    elif len(by_rows) == 1:
        shape = {k: v for k, v in next(iter(by_rows.values())).items() if k in ("rows", "batch", "context")}
    classes = block.get("classes") if isinstance(block, dict) else None
    if not isinstance(classes, dict) or not classes:
        raise InputError(f"{path}: ceiling has no per-class floors ('classes'); run specpilot ceiling with --model")
    from specpilot.fileio import is_int, is_num

    out = {}
    for name, c in classes.items():
        if not isinstance(c, dict) or not (is_num(c.get("floor_ms")) and c["floor_ms"] >= 0):
            raise InputError(f"{path}: class {name!r} needs a 'floor_ms' of a finite number >= 0")
        for k in ("bytes", "flops"):
            if c.get(k) is not None and not (is_num(c[k]) and c[k] >= 0):
                raise InputError(f"{path}: class {name!r}: {k!r} must be a finite number >= 0 (or null)")
        out[name] = {"bytes": c.get("bytes"), "flops": c.get("flops"), "floor_ms": float(c["floor_ms"]),
                     "bound": c.get("bound")}
    fr = doc.get("fractions")
    if isinstance(fr, dict):
        shape.update({k: fr[f] for k, f in (("bw_fraction", "bandwidth"), ("flops_fraction", "flops"))
                      if isinstance(fr.get(f), (int, float))})
    doc_shape = doc.get("shape") if isinstance(doc.get("shape"), dict) else {}
    # the floors are of these weights, LM head, KV cache and drafter: ceiling --profile --model takes them
    for key in ("weight_dtype", "lm_head_dtype", "kv_dtype", "drafter"):
        name = doc_shape.get(key)
        if name is None:
            continue
        if not isinstance(name, str) or not name:
            raise InputError(f"{path}: ceiling's shape {key!r} must be a name")
        shape[key] = name
    if "drafter" in shape:
        for key in ("draft_rows", "draft_passes"):
            n = doc_shape.get(key)
            if not (is_int(n) and n > 0):
                raise InputError(f"{path}: ceiling's shape {key!r} must be a positive whole number (with a drafter)")
            shape[key] = n
    total = block.get("total_floor_ms")
    if total is None:
        total = sum(c["floor_ms"] for c in out.values())
    elif not (is_num(total) and total >= 0):
        raise InputError(f"{path}: 'total_floor_ms' must be a finite number >= 0 (or absent)")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise InputError(f"{path}: ceiling's 'model' must be a name")
    return Floors(source=f"ceiling {path}", classes=out, total_floor_ms=float(total), shape=shape,
                  gpu=doc.get("gpu") if isinstance(doc.get("gpu"), dict) else None,
                  model=model or None)
