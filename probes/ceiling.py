"""``specpilot ceiling``: byte floors per row count, and the cost model from measurements.

:func:`compute_ceiling` answers one :class:`~.ceiling_inputs.CeilingRequest` (the inputs:
``ceiling_inputs``) with a :class:`CeilingResult`. Numbers given directly win over figures from
results. Results of different deployments (model, GPU, rows, batch, floor shape) are refused
(``ceiling_checks``); where two results give the same measurement, one is used and a note says
which and why (:func:`passed_over_notes`). A TLV policy's step is its whole cycle (``tlv_cycle``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specpilot.errors import InputError
from specpilot.gpus import GPUSpec
from specpilot.models import ModelSpec

from .ceiling_checks import (check_one_deployment, check_rows_probe_hardware, files_from_other_models,
                             probe_model_mismatch)
from .ceiling_inputs import (CeilingRequest, Measurements, ProfileFigures, ReplayFigures, RowsProbeFigures,
                             RunFigures, run_step_ms)
from .costmodel import CostModel, best_tree_tau, cost_model, mean_over_rows, mean_rows, step_time
from .floors import StepFloor, lm_head_dtype_of
from .tlv_cycle import tlv_cycle

# a profile's floor and --model's at the same rows: rounding in the JSON only
FLOOR_AGREEMENT = 0.005


@dataclass
class CeilingResult:
    model: ModelSpec | None
    gpu: GPUSpec | None
    floors: list[StepFloor]
    ar_floor: StepFloor | None
    cost: CostModel | None
    measurements: Measurements
    rows_for_cost: int | None
    fractions: dict[str, float]
    tau_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    by_nodes: list[dict] = field(default_factory=list)  # predicted speedup tau(N) / c(N) per node budget
    by_nodes_left_out: list[dict] = field(default_factory=list)  # budgets whose rows the rows probe does not cover
    warnings: list[str] = field(default_factory=list)
    cycle: dict | None = None  # TLV: the cycle's terms (tlv_cycle)
    batch: int = 1  # requests per step of the deployment modelled
    c_probe: dict[int, float] = field(default_factory=dict)  # a rows probe's c(N) at the floors' rows it timed
    storage: dict = field(default_factory=dict)  # the floors' LM head and KV dtypes and drafter (the JSON's shape)

    def c_floor(self, f: StepFloor) -> float | None:
        return f.total_floor_ms / self.ar_floor.total_floor_ms if self.ar_floor else None

    def as_dict(self) -> dict:
        by_rows = {}
        for f in self.floors:
            d = f.as_dict()
            d["c_floor"] = self.c_floor(f)
            if self.c_probe:
                d["c_probe"] = self.c_probe.get(f.rows)
            by_rows[str(f.rows)] = d
        first = self.floors[0] if self.floors else None
        return {
            "schema": "specpilot.ceiling/1",
            "model": self.model.name if self.model else None,
            "batch": self.batch,
            "gpu": self.gpu.summary() if self.gpu else None,
            "shape": ({"rows": [f.rows for f in self.floors], "batch": first.batch, "context": first.context,
                       "weight_dtype": first.weight_dtype, **self.storage} if first else None),
            "fractions": self.fractions,
            "ar_floor_ms": self.ar_floor.total_floor_ms if self.ar_floor else None,
            "classes": ({k: v.as_dict() for k, v in first.classes.items()} if first else {}),
            "total_floor_ms": first.total_floor_ms if first else self.measurements.floor_ms,
            "by_rows": by_rows,
            "cost_model": ({**self.cost.as_dict(), "rows": self.rows_for_cost,
                            "sources": self.measurements.sources} if self.cost else None),
            "by_nodes": self.by_nodes,
            "by_nodes_left_out": self.by_nodes_left_out,
            "tlv_cycle": self.cycle,
            "warnings": self.warnings,
        }


def _use_profile(p: ProfileFigures, m: Measurements) -> None:
    """The profile's step wall time and floor (its kernel busy time: ``_use_profile_gpu_time``)."""
    m.set("step_ms", p.step_wall_ms, f"profile {p.source}", p)
    if p.total_floor_ms is not None and m.floor_ms is None:
        m.set("floor_ms", p.total_floor_ms, f"profile {p.source}", p)
        m.floor_peak_ms = p.floor_peak_ms


def _use_profile_gpu_time(p: ProfileFigures, m: Measurements) -> None:
    """The profile's kernel busy time, before a run's GPU time: the floor it is set against is of
    the same trace's steps."""
    m.set("profile_ms", p.kernel_busy_ms, f"profile {p.source}", p)


def policy_nodes(r: ReplayFigures | None, policy: str) -> int | None:
    """The nodes ``policy`` verifies a step besides the pending token (so N + 1 rows): the replay's
    own ``nodes`` for it (a chain's depth, cut to m), else its budget after ':' (a chain's cut to
    the lattice's m, a bare ``chain`` its m); None for ``oracle:K``, which builds no tree."""
    name = r.name_of(policy) if r is not None else None
    if r is not None and name is not None and r.nodes.get(name) is not None:
        return r.nodes[name]
    name = name or policy
    family, _, arg = name.partition(":")
    if family == "oracle":
        return None
    budget = arg.split(",")[-1]
    if family == "chain":
        m = r.positions if r is not None else None
        if budget.isdigit():
            return min(int(budget), m) if m is not None else int(budget)
        return m
    return int(budget) if budget.isdigit() else None


def _use_replay(r: ReplayFigures, m: Measurements, current_policy: str) -> None:
    taus = r.taus
    name = r.name_of(current_policy)
    cur = taus[name] if name is not None else None
    if cur is None:
        raise InputError(f"{r.source}: no policy {current_policy!r} in the replay (has {', '.join(taus)}); "
                         "choose one with --policy")
    m.set("tau", cur, f"replay {r.source} ({current_policy})", r)
    best_name, best = best_tree_tau(taus, r.curves, name)
    m.set("tau_best", best, f"replay {r.source} ({best_name})", r)


def _use_run(r: RunFigures, m: Measurements) -> None:
    if r.tlv_ms:
        m.set("tau", r.tau, f"run {r.source} (tau per exact pass)", r)
        m.set("step_ms", run_step_ms(r), f"run {r.source} (TLV cycle ms: draft 1 + Q pass + draft 2 + "
              "exact pass + append)", r)
    m.set("tau", r.tau, f"run {r.source}", r)
    m.set("step_ms", r.step_wall_ms, f"run {r.source} (decode loop wall ms per step)", r)
    m.set("profile_ms", r.step_gpu_ms, f"run {r.source} (GPU ms per step in the loop, CUDA events)", r)


def _use_rows_probe(p: RowsProbeFigures, m: Measurements, rows: int | None, run: RunFigures | None = None) -> None:
    """T_AR from the probe, and its T_step at ``rows`` where nothing better gave one. Beside a run
    whose verify steps were not all of ``rows`` rows, the probe's point is not the same step
    (``--rows`` defaults to 1), so it is not offered, nor named in a note as the step passed over."""
    m.set("ar_ms", p.ar_ms, f"rows probe {p.source}" + (f" ({p.ar_path} AR step)" if p.ar_path else ""), p)
    other_rows = run is not None and bool(run.verify_by_rows) and set(run.verify_by_rows) != {rows}
    if rows is not None and rows in p.step_ms and not other_rows:
        m.set("step_ms", p.step_ms[rows], f"rows probe {p.source} (rows={rows})", p)


def _ar_on_profile_clock(prof: ProfileFigures, probe: RowsProbeFigures, m: Measurements, rows: int | None) -> bool:
    """T_AR on the profile's clock where T_step is the profile's step: its wall over the probe's
    c(N) at the profile's rows (as ``round`` models it). The profile's step is the engine's whole
    step, host time included, and the probe's T_AR a bare forward: divided by each other, a profile
    of AR itself would have a c above 1. False where the probe did not time those rows."""
    t = probe.step_ms.get(rows) if rows is not None else None
    if t is None and rows == 1:
        t = probe.ar_ms
    if t is None or not probe.ar_ms:
        return False
    m.set("ar_ms", prof.step_wall_ms * probe.ar_ms / t,
          f"profile {prof.source} step wall / rows probe {probe.source} c({rows})", probe)
    return True


def passed_over_notes(m: Measurements) -> list[str]:
    """A note for each measurement two files gave, where the value not used differs: which file's
    is used and why."""
    names = {"step_ms": "T_step", "profile_ms": "the GPU time per step", "tau": "tau", "floor_ms": "the floor",
             "ar_ms": "T_AR", "tau_best": "the best reachable tau"}
    why = {("step_ms", RunFigures): "the run delivered its tau in its own steps, which no profiler slowed",
           ("step_ms", ProfileFigures): "the profile's is the engine's whole step, whose kernel busy and outside "
                                        "times give the kernel and outside factors (a rows probe times a bare "
                                        "forward)",
           ("profile_ms", ProfileFigures): "the profile's floor is of the same trace's steps",
           ("tau", RunFigures): "the run's own tau, over the steps it timed"}
    out = []
    for name, value, origin in m.passed_over:
        used, used_origin = getattr(m, name), m.origins.get(name)
        if used is None or used_origin is None or abs(value - used) <= 5e-3 * abs(used):
            continue
        unit = "" if name in ("tau", "tau_best") else " ms"
        reason = why.get((name, type(used_origin)))
        out.append(f"{names[name]} is {_file_label(used_origin)}'s {used:.4g}{unit}, not {_file_label(origin)}'s "
                   f"{value:.4g}{unit}" + (f": {reason}" if reason else ""))
    return out


def _file_label(f) -> str:
    kind = {ProfileFigures: "profile", RunFigures: "run", RowsProbeFigures: "rows probe",
            ReplayFigures: "replay"}.get(type(f), "file")
    return f"{kind} {getattr(f, 'source', '?')}"


def _refuse_other_floor(p, model: str, rows: int, theirs: float, mine: float) -> None:
    """The kernel factor divides by the profile's floor and the table shows --model's: two floors of
    one step that differ mean a shape the checks cannot see (a profile written before it recorded its
    LM head dtype, or edited), and a factor against a floor the output does not show."""
    if abs(theirs - mine) > FLOOR_AGREEMENT * min(theirs, mine):
        raise InputError(f"--profile {p.source} and --model {model} disagree on the byte floor at {rows} "
                         f"row{'s' if rows != 1 else ''} ({theirs:.4g} against {mine:.4g} ms): the profile's floors "
                         "are of another shape; give the options the profile was made with (its LM head dtype, "
                         "drafter), or profile again")


def compute_ceiling(req: CeilingRequest) -> CeilingResult:
    m, model, gpu, rows = req.measurements, req.model, req.gpu, req.rows
    if req.batch <= 0:
        raise InputError(f"--batch must be positive, got {req.batch}")
    if req.context < 0:
        raise InputError(f"--context must be >= 0, got {req.context}")
    # measured analysis happens at one row count
    cost_rows = rows[0] if len(rows) == 1 else None
    if req.profile and cost_rows is None and req.profile.rows in rows:
        cost_rows = req.profile.rows
    if req.run:
        files_from_other_models(req.run, req.rows_probe)
    check_one_deployment(req, cost_rows)
    # the step a run's tau was delivered in before a profile's (a profiler slows the step it
    # traces), and the profile's GPU time before the run's (the profile's floor is of its steps)
    if req.profile:
        _use_profile_gpu_time(req.profile, m)
    if req.run:
        _use_run(req.run, m)
    if req.profile:
        _use_profile(req.profile, m)
    curves = {}
    if req.replay:
        _use_replay(req.replay, m, req.policy)
        curves = req.replay.curves
    cycle = tlv_cycle(req)
    if cycle is not None and cycle["cycle_ms"]:
        m.set("step_ms", cycle["cycle_ms"], f"TLV cycle ({cycle['source']})",
              req.run if cycle["source"].startswith("run ") else req.rows_probe)
    step_curve = {}
    warning = check_rows_probe_hardware(req.rows_probe, gpu if model is not None else None)
    clocks_differ = False
    if req.rows_probe:
        if req.profile is not None and m.origins.get("step_ms") is req.profile and m.ar_ms is None:
            clocks_differ = not _ar_on_profile_clock(req.profile, req.rows_probe, m, cost_rows)
        _use_rows_probe(req.rows_probe, m, cost_rows, req.run)
        step_curve = req.rows_probe.step_ms

    floors: list[StepFloor] = []
    ar_floor = None
    if model is not None and gpu is not None:
        floors = [req.step_floor(n) for n in rows]
        ar_floor = req.step_floor(1, drafter=False)
        if not all(math.isfinite(f.total_floor_ms) for f in (*floors, ar_floor)):
            raise InputError("the byte floors overflow: the GPU's bandwidth or FLOP/s, or a fraction of them, is too "
                             "small a number (--bandwidth, --flops, --bw-fraction, --flops-fraction)")
        if cost_rows is not None:
            f = next(f for f in floors if f.rows == cost_rows)
            if m.floor_ms is None:
                m.set("floor_ms", f.total_floor_ms, f"byte floor of {model.name} at {cost_rows} rows")
                m.floor_peak_ms = req.step_floor(cost_rows, at_peak=True).total_floor_ms
            elif m.origins.get("floor_ms") is req.profile:
                _refuse_other_floor(req.profile, model.name, cost_rows, m.floor_ms, f.total_floor_ms)

    cost = rank = None
    measured = {k: v for k, v in m.sources.items() if k != "floor_ms"}
    replay_only = bool(measured) and all(src.startswith("replay") for src in measured.values())
    # a rows probe beside floors, no tau: its c(N) stands next to the floor's, no cost model
    probe_only = bool(measured) and m.tau is None and all(src.startswith("rows probe") for src in measured.values())
    if m.any and not ((replay_only or probe_only) and model is not None):
        if len(rows) > 1 and cost_rows is None:
            raise InputError("measurements apply to one row count: give a single --rows N with --tau/--step-ms/...")
        missing = [n for n, v in (("--tau (or --replay)", m.tau), ("--step-ms (or --profile)", m.step_ms),
                                  ("--ar-ms (or --rows-probe)", m.ar_ms)) if v is None]
        if m.step_ms is None and req.rows_probe is not None and cost_rows is not None:
            timed = ",".join(str(n) for n in sorted(req.rows_probe.step_ms))
            raise InputError(f"--rows-probe {req.rows_probe.source} has no point at {cost_rows} rows (timed at "
                             f"{timed}): give one of those --rows, or --step-ms")
        if missing:
            raise InputError("the cost model needs " + ", ".join(missing))
        rank = one_rank_profile(req.profile, m) if m.profile_ms is not None and m.floor_ms is not None else None
        drafter = unfloored_drafter(req.profile, m)
        cost = cost_model(m.tau, m.step_ms, m.ar_ms, m.tau_best, m.profile_ms, m.floor_ms,
                          floor_peak_ms=m.floor_peak_ms, one_rank=rank is not None)
        cost.notes[:0] = passed_over_notes(m)
        # paper 3.2: T_step includes drafting (a TLV cycle says itself what it leaves out)
        if cycle is None and req.rows_probe is not None and m.origins.get("step_ms") is req.rows_probe and m.tau > 1:
            cost.notes.append(f"T_step is rows probe {req.rows_probe.source}'s verify forward alone: drafting and "
                              "the host's share of a step are not in it, so c reads low and the speedup high by "
                              "their share; give --step-ms (drafting included) or --run for a whole step")
    elif model is None:
        raise InputError("give --model for byte floors, or measurements (--tau, --step-ms, --ar-ms, --profile ...)")
    res = CeilingResult(model=model, gpu=gpu, floors=floors, ar_floor=ar_floor, cost=cost, measurements=m,
                        rows_for_cost=cost_rows, fractions={"flops": req.flops_fraction, "bandwidth": req.bw_fraction},
                        tau_curve=curves, batch=req.batch)
    if floors:   # what else shaped the floors: a profile made against this file records it (profile --ceiling)
        res.storage = {"lm_head_dtype": lm_head_dtype_of(req.weight_dtype, req.lm_head_dtype),
                       "kv_dtype": req.kv_dtype}
        if req.drafter is not None:
            res.storage.update({"drafter": req.drafter.name, "draft_rows": req.draft_rows or floors[0].rows,
                                "draft_passes": req.draft_passes})
    res.cycle = cycle
    p = req.rows_probe
    if p is not None and floors and p.ar_ms:
        res.c_probe = {f.rows: p.step_ms[f.rows] / p.ar_ms for f in floors if f.rows in p.step_ms}
    if cycle is not None and cost is not None:
        cycle["tau"], cycle["speedup"] = cost.tau, cost.speedup
    res.by_nodes = predict_by_nodes(req, curves, step_curve, res)
    if req.rows_probe:
        res.warnings = rows_probe_warnings(req.rows_probe)
    if warning:
        res.warnings.append(warning)
    if p is not None and floors and p.ar_ms and not res.c_probe:   # it would vanish from the table without a word
        res.warnings.append(f"--rows-probe {p.source} timed none of --rows {','.join(str(f.rows) for f in floors)} "
                            f"(it timed {','.join(str(n) for n in sorted(p.step_ms))}): give --rows it timed for its "
                            "c(N) beside the floors'")
    between = ((cycle or {}).get("probe_ms") or {}).get("interpolated")
    if between:
        want = cycle["probe_ms"]["rows"]
        res.warnings.append(f"the TLV cycle's probe passes at {want} rows are linear from --rows-probe "
                            f"{req.rows_probe.source}'s {between[0]}- and {between[1]}-row steps (it timed no "
                            f"{want}-row step): time {want} rows with specpilot probe rows for measured ones")
    if clocks_differ and cost is not None:
        timed = ",".join(str(n) for n in sorted(req.rows_probe.step_ms))
        res.warnings.append(f"T_step is --profile {req.profile.source}'s whole engine step (host time included) "
                            f"and T_AR --rows-probe {req.rows_probe.source}'s bare forward, so c counts the "
                            f"outside time: the probe timed {timed} rows, not the profile's {cost_rows}; time "
                            "those rows with probe rows to put T_AR on the profile's clock")
    other = probe_model_mismatch(req.rows_probe, model)
    if other:
        res.warnings.append(other)
    mismatch = (rows_mismatch(req.policy, cost_rows, m, req.rows_probe, res.by_nodes,
                              policy_nodes(req.replay, req.policy))
                if cost is not None and req.replay else None)
    if mismatch:
        res.warnings.append(mismatch)
    if cost is not None:   # before the files' warnings: a factor taken as 1 changes the ceiling
        res.warnings[:0] = cost.warnings
        if drafter:
            res.warnings.insert(0, drafter)
        if rank:
            res.warnings.insert(0, rank)   # first, as profile puts it: it may explain the kernel factor
    return res


def unfloored_drafter(p: ProfileFigures | None, m: Measurements) -> str | None:
    """The warning for a kernel factor whose GPU time, from a profile, counts drafter kernels that
    the floor beside it leaves out (the profile had no --drafter; a floor of ``--model`` must be of
    the profile's shape, so it has none either); None otherwise."""
    if p is None or p.unfloored_drafter is None or m.sources.get("profile_ms") != f"profile {p.source}":
        return None
    from .profile import unfloored_drafter_warning

    ms, share = p.unfloored_drafter
    kf = m.profile_ms / m.floor_ms if m.floor_ms else None
    return (f"--profile {p.source}: {unfloored_drafter_warning(ms, share, kf)}, and the ceiling with it; profile "
            "with --drafter MODEL")


def one_rank_profile(p: ProfileFigures | None, m: Measurements) -> str | None:
    """The warning for a kernel factor of one rank's profile against a floor of the whole model
    (the profile's own floors or ``--model``'s: neither is split by rank, and neither is scaled
    here), or None when the profile is not a rank's or gave neither side of the factor."""
    from .profile import is_one_rank, rank_evidence

    if p is None or not p.distributed or not is_one_rank(p.distributed):
        return None
    mine = f"profile {p.source}"
    if mine not in (m.sources.get("profile_ms"), m.sources.get("floor_ms")):
        return None

    said, by = rank_evidence(p.distributed)
    floor = "the profile's own" if m.sources.get("floor_ms") == mine else m.sources.get("floor_ms")
    return (f"--profile {p.source} is one rank's trace of a multi-GPU job ({said}), and the floor beside it "
            f"({floor}) is the whole model's on one GPU, not split by rank and not scaled here: the kernel factor "
            f"reads up to {by} low and the ceiling with it")


def rows_mismatch(policy: str, cost_rows: int | None, m: Measurements, probe: RowsProbeFigures | None = None,
                  by_nodes: list[dict] | None = None, nodes: int | None = None) -> str | None:
    """A warning when the cost model divides the tau of ``policy`` (a replay policy with a node
    budget) by a step of another row count taken from a rows probe (``--rows``, default 1). Its
    advice is what works here: ``--rows N + 1`` where the probe timed N + 1 rows; else the step
    linear between the probe's counts around it (as ``ceiling --check`` interpolates) for
    ``--step-ms``, and the ``probe rows`` command that times it; the by-node table's row only
    where that table is printed with it. ``nodes``: the nodes the policy verifies (``policy_nodes``:
    a chain's depth too); by default its budget after ':'."""
    if nodes is None:
        nodes = policy_nodes(None, policy)
    if nodes is None or cost_rows is None or nodes + 1 == cost_rows \
            or not m.sources.get("step_ms", "").startswith("rows probe"):
        return None
    budget, want = nodes, nodes + 1
    head = (f"the cost model pairs {policy}'s tau with the {cost_rows}-row step (--rows {cost_rows}); the policy "
            f"verifies {budget} nodes and the pending token a step, {want} rows: ")
    table = any(r["nodes"] == budget and r["policy"] in (policy, policy.partition(":")[0])
                for r in by_nodes or [])
    if probe is None or want in probe.step_ms:
        return head + f"give --rows {want}" + (", or read its row of the by-node table" if table else "")
    timed = sorted(probe.step_ms)
    rows_arg = ",".join(str(n) for n in sorted(set(timed) | {want}))
    model = f" --model {probe.model}" if probe.model else ""
    advice = [f"the probe timed {','.join(str(n) for n in timed)} rows, not {want}"]
    if timed[0] < want < timed[-1]:
        lo, hi = max(n for n in timed if n < want), min(n for n in timed if n > want)
        ms = step_time(want, probe.step_ms)
        advice.append(f"linear between its {lo}- and {hi}-row steps (as ceiling --check interpolates) T_step({want}) "
                      f"is {ms:.4g} ms: give --rows {want} --step-ms {ms:.4g}")
    advice.append(f"or time {want} rows with specpilot probe rows{model} --rows {rows_arg} (and the probe's other "
                  f"options), then give --rows {want}")
    if table:
        advice.append("or read its row of the by-node table")
    return head + "; ".join(advice)


def rows_probe_warnings(p: RowsProbeFigures) -> list[str]:
    """What a rows probe says against its own T_AR (c(N) = T_step(N) / T_AR is only as honest as
    the AR step it divides by)."""
    out = [f"rows probe {p.source}: {w}" for w in p.warnings]
    if p.ar_path is None:
        out.append(f"rows probe {p.source} does not say which AR step its T_AR is (no ar_path); c(N) may be "
                   "against a slower AR step than the engine runs: re-run specpilot probe rows")
    return out


def predict_by_nodes(req: CeilingRequest, curves: dict[str, dict[int, float]], step_curve: dict[int, float],
                     res: CeilingResult) -> list[dict]:
    """Speedup tau(N) / c for every node budget N of the replay's tau(N) curves, c the mean over
    the replay's steps of their cost at the rows each verified (the tree's nodes and the pending
    token they hang from: ``curve_rows``; N + 1 for every step in a replay that does not record it).

    c is measured (rows probe: T_step(rows) / T_AR, linear between two timed row counts:
    ``interpolated``) when a rows probe is given (budgets with rows outside the probe's range are
    left out, never mixed with floors), else the model's floor c (the regime where every kernel
    sits at its byte floor). The budgets a rows probe leaves out go to ``res.by_nodes_left_out``
    (``policy``, ``nodes``, ``rows``: their mean rows), which the report names.
    """
    m = res.measurements
    # the probe's steps over its own T_AR (a bare forward, as they are) where T_AR is the probe's,
    # also when the cost model put it on a profile's clock
    ar_ms = req.rows_probe.ar_ms if req.rows_probe is not None and m.origins.get("ar_ms") is req.rows_probe \
        else m.ar_ms
    verified = req.replay.curve_rows if req.replay is not None else {}
    lo, hi = (min(step_curve), max(step_curve)) if step_curve else (None, None)
    out = []
    for policy, pts in curves.items():
        for n, tau in sorted(pts.items()):
            hist = (verified.get(policy) or {}).get(n) or {n + 1: 1}
            if step_curve:
                # rows the probe timed, else linear between two it timed (as the round's model); never
                # beyond them, nor mixed with floors
                got = mean_over_rows(hist, lambda r: step_time(r, step_curve) if lo <= r <= hi else None) \
                    if ar_ms else None
                if got is None:
                    res.by_nodes_left_out.append({"policy": policy, "nodes": n, "rows": mean_rows(hist)})
                    continue
                c, rows = got[0] / ar_ms, got[1]
                source = "measured" if all(r in step_curve for r in hist) else "interpolated"
            elif req.model is not None and req.gpu is not None and res.ar_floor is not None:
                ms, rows = mean_over_rows(hist, lambda r: req.step_floor(r).total_floor_ms)
                c, source = ms / res.ar_floor.total_floor_ms, "floor"
            else:
                continue
            out.append({"policy": policy, "nodes": n, "rows": rows, "tau": tau, "c": c, "c_source": source,
                        "speedup": tau / c})
    return out
