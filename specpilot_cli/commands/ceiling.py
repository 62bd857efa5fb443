"""``specpilot ceiling``: byte floors, the floor c(N) curve, and the tau/c ceiling."""

from __future__ import annotations

import click

from specpilot.limits import MAX_BATCH, MAX_CONTEXT, MAX_DRAFT_PASSES, MAX_MS, MAX_ROWS, MAX_TAU, MAX_TBS, MAX_TFLOPS
from specpilot.options import (FiniteRange, dtype_options, positive, refuse_draft_shape_without_drafter, them,
                               typed, NonEmptyPath, not_blank)
from specpilot.output import Report, Section, count, emit, output_options


@click.command("ceiling")
@click.option("--model", "model_name", metavar="NAME|PATH", callback=not_blank,
              help="Target model: catalog name (llama-3.1-8b, qwen3-8b, ...) or config.json / model folder.")
@click.option("--gpu", "gpu_name", default="auto", show_default=True, metavar="NAME",
              help="GPU from the catalog (a100-80gb, b200, h100-sxm, h200, l40s, mi300x, mi325x, "
                   "rtx-pro-6000-blackwell-server; a prefix that names one, such as h100 or a100, works too) or "
                   "'auto' (the NVIDIA GPU NVML sees; without one, name a GPU).")
@click.option("--bandwidth", type=positive(MAX_TBS), metavar="TB/S", help="Measured peak bandwidth, replaces the datasheet.")
@click.option("--flops", type=positive(MAX_TFLOPS), metavar="TFLOP/S",
              help="Measured dense bf16 TFLOP/s, replaces the datasheet.")
@click.option("--fp8-flops", type=positive(MAX_TFLOPS), metavar="TFLOP/S",
              help="Measured dense fp8 TFLOP/s (the floors of GEMMs on fp8 weights).")
@click.option("--rows", default="1", show_default=True, metavar="N[,N...]",
              help=f"Rows verified per request per step, e.g. 1,8,32,64 or 1,2,4,...,256 (1 to {MAX_ROWS}).")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, MAX_BATCH), help="Requests per step (a --rows-probe must be from probe rows --batch with the same B; a --run or "
                   "--check run is of one request per step, so it takes none above 1).")
@click.option("--context", default=2048, show_default=True, type=click.IntRange(0, MAX_CONTEXT),
              help="Committed context tokens per request.")
@dtype_options
@click.option("--drafter", "drafter_name", metavar="NAME|PATH", callback=not_blank, help="Drafter model: adds its step as the drafter class.")
@click.option("--draft-rows", type=click.IntRange(1, MAX_ROWS), help="Drafter rows per request per pass [default: --rows].")
@click.option("--draft-passes", type=click.IntRange(1, MAX_DRAFT_PASSES), default=1, show_default=True,
              help="Drafter passes per step: 1 for a block drafter (DFlash), k for a sequential one (EAGLE).")
@click.option("--tau", type=FiniteRange(1, MAX_TAU), help="Measured tokens accepted per verification pass.")
@click.option("--tau-best", type=FiniteRange(1, MAX_TAU), help="Best reachable tau (any tree; e.g. replay's oracle).")
@click.option("--step-ms", type=positive(MAX_MS), help="Measured step wall time T_step(N), drafting included.")
@click.option("--ar-ms", type=positive(MAX_MS), help="Measured AR step time T_AR in the same engine.")
@click.option("--profile-ms", type=positive(MAX_MS), help="Profiled GPU kernel time per step.")
@click.option("--profile", "profile_file", type=NonEmptyPath(dir_okay=False), metavar="FILE",
              help="specpilot profile JSON: the GPU time per step (kernel busy ms; before a --run's), the step wall "
                   "time (T_step; after a --run's, before a --rows-probe's), the byte floor, and its GPU, rows, batch "
                   "and floor shape, which stand for --gpu, --rows, --batch and (with --model) the shape options not "
                   "given. --step-ms/--profile-ms win over it; inputs of another model, GPU or rows are refused.")
@click.option("--replay", "replay_file", type=NonEmptyPath(dir_okay=False), metavar="FILE",
              help="specpilot replay JSON: tau of --policy (the current system) and the best tau of any tree "
                   "policy or tau(N) curve point (the tree factor); its curves give the by-node table.")
@click.option("--rows-probe", "rows_file", type=NonEmptyPath(dir_okay=False), metavar="FILE",
              help="specpilot probe rows JSON: T_AR, and T_step at --rows where no --run or --profile gives one; its "
                   "T_step(N) gives the by-node table's c.")
@click.option("--run", "run_file", type=NonEmptyPath(dir_okay=False),
              help="specpilot run JSON: tau and loop wall ms per step (a tlv run: tau per exact pass and its cycle "
                   "split); on CUDA also GPU ms per step (the outside factor).")
@click.option("--policy", default=None,
              help="Replay policy that is the current system (the others give the best reachable tau) "
                   "[default: the --run/--check run's (chain, best-first:N, tlv:N), else chain].")
@click.option("--check", "check_file", type=NonEmptyPath(dir_okay=False), metavar="RUN.json",
              help="Check the predicted speedup over AR against this run's measured one (--rows-probe for c(N) and "
                   "T_AR, --replay for tau, --ar-run for the measured T_AR); exit 1 beyond --tolerance, naming the "
                   "term that is off.")
@click.option("--ar-run", "ar_run_file", type=NonEmptyPath(dir_okay=False), metavar="AR_RUN.json",
              help="With --check: specpilot run --mode ar JSON on the same prompts (the AR reference).")
@click.option("--tolerance", type=positive(10.0), default=0.10, show_default=True,
              help="With --check: largest |predicted - measured| / measured that passes.")
@click.option("--draft-ms", type=FiniteRange(0.0, MAX_MS),
              help="With --check: drafting ms per pass the model assumes [default: the run's own].")
@output_options
def command(model_name, gpu_name, bandwidth, flops, fp8_flops, rows, batch, context, weight_dtype, lm_head_dtype,
            kv_dtype, drafter_name, draft_rows, draft_passes, flops_fraction, bw_fraction, tau, tau_best, step_ms, ar_ms,
            profile_ms, profile_file, replay_file, rows_file, run_file, policy, check_file, ar_run_file, tolerance,
            draft_ms, fmt, out):
    """How much faster could this deployment be, and which factor should be attacked?

    \b
    What-if (no GPU needed): bytes, FLOPs and byte floor per kernel class for one
    decode/verify step, and the floor c(N) = floor(N) / floor(AR) curve:
      specpilot ceiling --model llama-3.1-8b --gpu h100 --rows 1,8,32,64 --batch 1 --context 2048
    With measurements: speedup = tau / c, c = T_step / T_AR, and the ceiling
    = speedup x tree x kernel x outside factors, naming the largest:
      specpilot ceiling --model qwen3.5-27b --gpu h100 --rows 32 \\
          --tau 4.25 --tau-best 6.42 --step-ms 23.61 --ar-ms 17.88 --profile-ms 21.2
    Files from other verbs can replace the numbers: --profile, --replay, --rows-probe, --run.
    TLV (--run of a tlv run, or --replay with --policy tlv:N): tau per exact pass over the
    cycle, draft 1 + Q pass + draft 2 + exact pass + append.
    Check the model against a run (exit 1 beyond the tolerance, naming the term that is off):
      specpilot ceiling --check tree.json --replay replay.json --rows-probe rows.json --ar-run ar.json

    Floor of a class = max(FLOPs / (0.60 x peak), bytes / (0.90 x bandwidth)).
    """
    from dataclasses import replace

    from specpilot.errors import InputError
    from specpilot.gpus import custom_gpu, get_gpu, with_overrides
    from specpilot.models import load_model_spec, model_inputs
    from specpilot.options import parse_int_list
    from specpilot.probes.ceiling import compute_ceiling
    from specpilot.probes.ceiling_inputs import CeilingRequest, Measurements
    from specpilot.probes.floors import fp8_gemm_classes
    from specpilot.readers import read_profile, read_replay, read_rows_probe, read_run

    if check_file:
        given = [opt for opt, v in (("--tau", tau), ("--tau-best", tau_best), ("--step-ms", step_ms),
                                    ("--ar-ms", ar_ms), ("--profile-ms", profile_ms)) if v is not None]
        if given:   # --check judges the files' measurements: a what-if number would be ignored
            raise InputError(f"{', '.join(given)}: --check judges the run against its measured files; give "
                             "these without --check for a what-if")
        floors = typed(*FLOOR_OPTIONS, "rows")
        if floors:   # the check's rows are the run's, and it sets no byte floors
            raise InputError(f"{', '.join(floors)}: --check judges the run against its measured files (at the rows "
                             f"its steps verified) and sets no byte floors; leave {them(floors)} out")
        return _check(check_file, run_file, replay_file, rows_file, ar_run_file, profile_file, model_name, batch,
                      policy, tolerance, draft_ms, fmt, out)
    tol_given = bool(typed("tolerance"))
    if tau is not None and tau_best is not None and tau_best < tau:
        raise InputError(f"--tau-best {tau_best:g} is below --tau {tau:g}: the best reachable tau is at least the "
                         "current one")
    if ar_run_file or draft_ms is not None or tol_given:
        raise InputError("--ar-run, --draft-ms and --tolerance go with --check RUN.json")
    _refuse_unread_options(model_name, profile_file, replay_file, rows_file, policy)
    prof = read_profile(profile_file) if profile_file else None
    if prof is not None:   # the shape and GPU of the profiled step, for the options not given
        if not typed("rows") and prof.rows:
            rows = str(prof.rows)
        if not typed("batch") and prof.shape.get("batch"):
            batch = prof.shape["batch"]
        if model_name:
            context, weight_dtype, lm_head_dtype, kv_dtype, flops_fraction, bw_fraction = (
                v if typed(k) or k not in prof.shape else prof.shape[k]
                for k, v in (("context", context), ("weight_dtype", weight_dtype), ("lm_head_dtype", lm_head_dtype),
                             ("kv_dtype", kv_dtype), ("flops_fraction", flops_fraction),
                             ("bw_fraction", bw_fraction)))
            if prof.shape.get("drafter"):   # --drafter given (a path the profile names by its stem) or not
                if not typed("drafter_name"):
                    drafter_name = prof.shape["drafter"]
                draft_rows = draft_rows if typed("draft_rows") else prof.shape.get("draft_rows")
                draft_passes = draft_passes if typed("draft_passes") else prof.shape.get("draft_passes", 1)
    if model_name:
        refuse_draft_shape_without_drafter(drafter_name)
    if model_name and typed("fp8_flops") and not fp8_gemm_classes(weight_dtype, lm_head_dtype):
        raise InputError("--fp8-flops: the fp8 peak sets the floors of fp8 weights only (--weight-dtype or "
                         "--lm-head-dtype fp8); give it with one of them, or leave it out")
    row_list = parse_int_list(rows, "--rows")
    if draft_rows is not None and draft_rows <= 0:
        raise InputError(f"--draft-rows must be positive, got {draft_rows}")
    model = load_model_spec(model_name) if model_name else None
    drafter = _load_drafter(drafter_name, prof) if drafter_name else None
    gpu = None
    if model is not None:
        theirs = _profile_gpu(prof) if prof is not None and not typed("gpu_name") else None
        if theirs is not None:
            gpu = with_overrides(theirs, bandwidth, flops, fp8_flops)
        elif gpu_name == "auto" and bandwidth and flops:
            gpu = custom_gpu(bandwidth, flops, fp8_flops)
            if prof is not None and (prof.gpu or {}).get("name"):   # the profiled card, by these figures
                gpu = replace(gpu, name=prof.gpu["name"])
        elif prof is not None and not typed("gpu_name") and (prof.gpu or {}).get("name"):
            # the profiled step's GPU, not this machine's, sets the floors
            raise InputError(f"--profile {prof.source}: the trace's GPU {prof.gpu['name']!r} is not in the GPU "
                             "catalog; name one with --gpu, or give --bandwidth and --flops")
        else:
            gpu = with_overrides(get_gpu(gpu_name), bandwidth, flops, fp8_flops)
        if gpu.bf16_tflops != gpu.bf16_tflops:  # NaN: detected GPU without catalog FLOPs
            raise InputError(f"{gpu.name} is not in the catalog: give --flops (dense bf16 TFLOP/s)")
    m = Measurements()
    for name, v in (("tau", tau), ("tau_best", tau_best), ("step_ms", step_ms), ("ar_ms", ar_ms),
                    ("profile_ms", profile_ms)):
        m.set(name, v, "command line")
    # a model or drafter given as a config file (its weights and tokenizer beside it) or folder is an input too
    models = [f for n in (model_name, drafter_name) for f in model_inputs(n)]
    protect = [p for p in (profile_file, replay_file, rows_file, run_file) if p] + models
    run = read_run(run_file) if run_file else None   # a batched run is refused as such first
    if run_file and typed("batch"):
        _refuse_batch_with_run("--run", run_file, batch)
    policy = policy or (run.policy if run is not None else None) or "chain"
    # a probe of another batch than the profile's is refused naming both files (compute_ceiling)
    probe_batch = None if prof is not None and prof.shape.get("batch") and not typed("batch") else batch
    req = CeilingRequest(model=model, gpu=gpu, rows=row_list, batch=batch, context=context, weight_dtype=weight_dtype,
                         lm_head_dtype=lm_head_dtype, kv_dtype=kv_dtype, drafter=drafter, draft_rows=draft_rows,
                         draft_passes=draft_passes, flops_fraction=flops_fraction, bw_fraction=bw_fraction,
                         policy=policy, measurements=m, profile=prof,
                         replay=read_replay(replay_file) if replay_file else None,
                         rows_probe=read_rows_probe(rows_file, batch=probe_batch,
                                                    one_request=f"--run {run_file}" if run_file else None)
                         if rows_file else None,
                         run=run)
    res = compute_ceiling(req)
    emit(_report(res, run), fmt, out, protect=protect)
    return 0


def _refuse_batch_with_run(option: str, run_file: str, batch: int) -> None:
    """A run is of one request per step (a batched run is refused as a run); --batch above 1 beside
    it would model another deployment."""
    from specpilot.errors import InputError

    if batch != 1:
        raise InputError(f"--batch {batch}: {option} {run_file} is a run of one request per step; model a batched "
                         "deployment with probe rows --batch and ceiling --batch, without a run")


# the options that set the byte floors (and their GPU): read only with --model
FLOOR_OPTIONS = ("gpu_name", "bandwidth", "flops", "fp8_flops", "context", "weight_dtype", "lm_head_dtype", "kv_dtype",
                 "flops_fraction", "bw_fraction", "drafter_name", "draft_rows", "draft_passes")


def _refuse_unread_options(model_name, profile_file, replay_file, rows_file, policy) -> None:
    """Refuse, before any file is read, an option that nothing would read: the floors' options
    without --model, --batch with neither floors nor a file of a batch, --policy with neither a
    replay nor (as tlv:N) a rows probe for the TLV cycle."""
    from specpilot.errors import InputError

    floors = typed(*FLOOR_OPTIONS)
    if floors and not model_name:
        raise InputError(f"{', '.join(floors)}: {'it sets' if len(floors) == 1 else 'they set'} the byte floors, "
                         f"which need --model; give it, or leave {them(floors)} out")
    if typed("batch") and not (model_name or profile_file or rows_file):
        raise InputError("--batch: the requests per step shape the byte floors (--model) and must match a "
                         "--rows-probe's or --profile's; give one of those, or leave it out")
    if typed("policy") and not (replay_file or (rows_file and (policy or "").startswith("tlv:"))):
        raise InputError(f"--policy {policy}: it picks the current system among a --replay's policies (or, as "
                         "tlv:N, the TLV cycle a --rows-probe times); give one of those, or leave it out")


def _profile_gpu(prof):
    """The GPU a profile ran on, as a GPUSpec with the figures its floors used (None where it names
    none the catalog knows and gives no figures): ``ceiling`` takes it when --gpu is not given."""
    from dataclasses import replace

    from specpilot.gpus import custom_gpu, get_gpu, match_gpu_name, with_overrides

    g = prof.gpu or {}
    bw, fl, f8 = g.get("bandwidth_tbs"), g.get("bf16_tflops"), g.get("fp8_tflops")
    key = g.get("key")
    spec = get_gpu(key) if key and key != "custom" and match_gpu_name(key) else match_gpu_name(g.get("name") or "")
    if spec is None:   # not in the catalog: the figures its floors used, under the name the profile gives it
        name = g.get("floors_gpu") or g.get("name")
        return replace(custom_gpu(bw, fl, f8), **({"name": name} if name else {})) if bw and fl else None
    return with_overrides(spec, bw if bw and bw != spec.bandwidth_tbs else None,
                          fl if fl and fl != spec.bf16_tflops else None,
                          f8 if f8 and f8 != spec.fp8_tflops else None)


def _load_drafter(name, prof):
    """--drafter's model; one the profile's floors name (not given here) must load by that name."""
    from specpilot.errors import InputError
    from specpilot.models import load_model_spec

    try:
        return load_model_spec(name)
    except InputError:
        if prof is None or typed("drafter_name"):
            raise
        raise InputError(f"--profile {prof.source}: its floor counts the drafter {name}, which does not load by "
                         "that name here; give --drafter (its catalog name, config.json or folder)") from None


def _run_rows(res, run) -> dict | None:
    """The rows of the verify steps behind the cost model's step time when it is a run's
    (``min``, ``max``, ``mean`` over its steps), else None."""
    step_from = res.measurements.sources.get("step_ms", "")
    if run is None or not run.verify_by_rows or not step_from.startswith(f"run {run.source}"):
        return None
    steps = sum(n for n, _ in run.verify_by_rows.values())
    return {"min": min(run.verify_by_rows), "max": max(run.verify_by_rows),
            "mean": sum(r * n for r, (n, _) in run.verify_by_rows.items()) / steps}


def _cost_title(res, run) -> str:
    """Where the cost model's step time was measured. ``--rows`` (default 1) names it only when the
    step is of that row count: a run's mean step spans the rows its verify passes used."""
    step_from = res.measurements.sources.get("step_ms", "")
    floor_from = res.measurements.sources.get("floor_ms", "")
    parts = []
    if run is not None and step_from.startswith(f"run {run.source}"):
        head = f"Cost model of run {run.source}"
        what = [(run.mode or "") + (f" at {count(run.nodes, 'node')}" if run.nodes and run.mode != "chain" else "")]
        vr = _run_rows(res, run)
        if vr:
            what.append(f"verify steps of {vr['min']}-{vr['max']} rows, {vr['mean']:.3g} on average"
                        if vr["max"] > vr["min"] else f"verify steps of {count(vr['min'], 'row')}")
        parts.append(", ".join(w for w in what if w))
    elif step_from.startswith("TLV cycle") and res.cycle:
        head = f"Cost model over the TLV cycle at {count(res.cycle['nodes'], 'node')}"
    else:
        return "Cost model" + (f" at {count(res.rows_for_cost, 'row')}" if res.rows_for_cost else "") + (
            f"{' per request' if res.rows_for_cost else ''}, batch {res.batch}" if res.batch > 1 else "")
    if res.rows_for_cost and floor_from.startswith("byte floor"):
        parts.append(f"byte floor at {count(res.rows_for_cost, 'row')}")
    parts = [p for p in parts if p]
    return head + (": " + "; ".join(parts) if parts else "")


def _report(res, run=None) -> Report:
    sections = []
    lines = []
    if res.floors:
        f0 = res.floors[0]
        g = res.gpu
        title = (f"Byte floors: {res.model.name} on {g.name} ({g.bandwidth_tbs:g} TB/s, {g.bf16_tflops:g} bf16 TFLOP/s"
                 f"{', measured ' + '+'.join(g.measured) if g.measured else ''}), batch {f0.batch}, context {f0.context}, "
                 f"weights {f0.weight_dtype}")
        rows = []
        for f in res.floors:
            for name, c in f.classes.items():
                if c.bytes == 0 and c.flops == 0:
                    continue
                rows.append([f.rows, name, c.bytes / 1e9, c.flops / 1e9, c.floor_ms, c.bound])
        sections.append(Section(title, ["rows", "class", "GB", "GFLOP", "floor ms", "bound"], rows))
        curve = []
        for f in res.floors:
            cf = res.c_floor(f)
            probe = [res.c_probe.get(f.rows)] if res.c_probe else []
            curve.append([f.rows, f.total_bytes / 1e9, f.total_floor_ms, cf, f.rows * f.batch / (f.total_floor_ms / 1e3)]
                         + probe)
        sections.append(Section("Floor per step and floor c(N) = floor(N) / floor(AR, 1 row)"
                                + (" beside the rows probe's c(N)" if res.c_probe else ""),
                                ["rows", "GB", "floor ms", "c floor", "rows/s at floor"]
                                + (["c probe"] if res.c_probe else []), curve,
                                note=f"AR floor (1 row, no drafter): {_ar_floor_text(res.ar_floor)}; "
                                     f"fractions {res.fractions['flops']:.2f} of peak FLOP/s, "
                                     f"{res.fractions['bandwidth']:.2f} of peak bandwidth."))
    if res.cost is None and res.measurements.ar_ms is not None and res.measurements.tau is None:
        lines.append("note: no cost model: it needs tau (--tau or --replay) at one row count (--rows N)")
    left_out = by_nodes_left_out(res)
    if res.by_nodes:
        best = max(res.by_nodes, key=lambda r: r["speedup"])
        sections.append(Section("Predicted speedup by node budget N: tau(N) / c at the rows its steps verify",
                                ["policy", "nodes", "rows", "tau", "c", "c from", "speedup"],
                                [[r["policy"], r["nodes"], r["rows"], r["tau"], r["c"], r["c_source"], r["speedup"]]
                                 for r in res.by_nodes],
                                note=f"Best in this table: {best['policy']} at {best['nodes']} nodes "
                                     f"({best['speedup']:.3g}x over AR)." + (f" {left_out}" if left_out else "")))
    elif left_out:
        lines.append(f"note: no node budget's speedup is predicted: {left_out[0].lower()}{left_out[1:]}")
    if res.cycle:
        cy = res.cycle
        names = {"draft1": "draft 1", "qpass": "Q pass", "draft2": "draft 2", "exact": "exact pass",
                 "append": "append"}
        probe = cy.get("probe_ms") or {}
        total = cy["cycle_ms"]
        rows = [[names[k], v if v is not None else "unknown", (v / total if v is not None and total else None),
                 probe.get(k)] for k, v in cy["terms_ms"].items()]
        rows.append(["cycle", total, 1.0 if total else None, None])
        note = f"From {cy['source']}."
        if cy.get("tau") is not None:
            note += f" tau {cy['tau']:.4g} per exact pass over the cycle: {cy['speedup']:.3g}x over AR."
        if cy["unknown"]:
            note += " Unknown, left out of the cycle: " + ", ".join(names[k] for k in cy["unknown"]) + "."
        if probe and not probe.get("qpass_timed") and cy["source"].startswith("rows probe"):
            note += f" The probe's exact step stands in for the Q pass: {probe.get('qpass_note')}."
        elif probe and probe.get("qpass_timed") and probe.get("qpass_note"):
            note += f" Note: {probe['qpass_note']}."
        sections.append(Section(f"TLV cycle at {cy['nodes']} nodes (ms per exact pass)",
                                ["term", "ms", "share",
                                 (f"probe ms ({probe['rows']} rows"
                                  + (f", Q pass {probe['qview']}" if probe.get("qpass_timed") and probe.get("qview")
                                     else "") + ")") if probe else "probe ms"], rows, note=note))
    if res.cost:
        c = res.cost
        rows = [["current speedup (tau / c)", c.speedup, f"tau {c.tau:.4g}, c {c.c:.4g} = {c.step_ms:.4g} / {c.ar_ms:.4g} ms"]]
        desc = {"tree": "best reachable tau / tau", "kernel": "profiled GPU ms / byte floor ms",
                "outside": "step wall ms / profiled GPU ms"}
        for k in ("tree", "kernel", "outside"):
            v = c.factors[k]
            how = desc[k]
            if v is not None and v < 1:   # the inputs contradict each other: a warning says how
                how += " -> below 1: taken as 1 (see the warning)"
            elif v is not None:
                how += f" -> {c.if_removed[k]:.3g}x if removed"
            rows.append([f"{k} factor", v if v is not None else "unknown", how])
        below = any(v is not None and v < 1 for v in c.factors.values())
        rows.append(["ceiling", c.ceiling, "speedup x known factors" + (" (below 1 taken as 1)" if below else "")])
        sections.append(Section(_cost_title(res, run), ["", "value", "how"], rows))
        from specpilot.probes.costmodel import largest_factor_line

        line = largest_factor_line(c.largest, c.factors_used)
        if line:
            lines.append(line)
        lines.extend(f"note: {n}" for n in c.notes)
    lines.extend(f"warning: {w}" for w in res.warnings)
    data = res.as_dict()
    if data.get("cost_model") and _run_rows(res, run):
        # a run's step is a mean over its verify passes: ``rows`` is then the byte floor's
        data["cost_model"]["run_verify_rows"] = _run_rows(res, run)
    return Report(data=data, sections=sections, lines=lines)


def by_nodes_left_out(res) -> str | None:
    """The sentence naming the replay's budgets left out of the by-node table because the rows
    probe did not time their N + 1 rows (None when none is)."""
    if not res.by_nodes_left_out:
        return None
    by_policy: dict[str, list[dict]] = {}
    for r in res.by_nodes_left_out:
        by_policy.setdefault(r["policy"], []).append(r)
    parts = [f"{p} at {', '.join(str(r['nodes']) for r in rs)} nodes "
             f"({', '.join(format(r['rows'], '.4g') for r in rs)} rows)" for p, rs in by_policy.items()]
    origin = res.measurements.origins.get("ar_ms")
    probe = f"rows probe {origin.source}" if getattr(origin, "source", None) else "the rows probe"
    return (f"Left out, {probe} did not time their rows (or counts on both sides of them): {'; '.join(parts)} "
            "(probe rows --rows with those counts times them).")


def _check(check_file, run_file, replay_file, rows_file, ar_run_file, profile_file, model_name, batch, policy,
           tolerance, draft_ms, fmt, out) -> int:
    """``ceiling --check RUN.json``: predicted against measured speedup, exit 1 beyond the tolerance."""
    from specpilot.errors import InputError
    from specpilot.probes.costcheck import UNITS, check_run, verdict_line
    from specpilot.readers import read_replay, read_rows_probe, read_run

    if run_file or profile_file or model_name:
        raise InputError("--check RUN.json takes --replay, --rows-probe, --ar-run (not --run, --profile or --model)")
    run = read_run(check_file)   # a batched run is refused as such first
    _refuse_batch_with_run("--check", check_file, batch)
    res = check_run(run, replay=read_replay(replay_file) if replay_file else None,
                    probe=read_rows_probe(rows_file, one_request=f"--check {check_file}") if rows_file else None,
                    ar_run=read_run(ar_run_file) if ar_run_file else None, tolerance=tolerance, policy=policy,
                    draft_ms=draft_ms)
    rows = [[t.name, t.predicted, t.measured, UNITS[t.name], t.speedup_if_measured, t.predicted_from]
            for t in res.terms]
    sections = [Section(f"Cost model check: {res.mode or 'run'}"
                        + (f" at {res.nodes} nodes" if res.nodes else "") + f" ({res.run})",
                        ["term", "predicted", "measured", "unit", "speedup if measured", "predicted from"], rows,
                        note=f"predicted {res.predicted:.4g}x = tau x T_AR / (verify + drafting{' + Q pass' if res.cycle else ''} + host) per pass; "
                             f"measured {res.measured:.4g}x = T_AR / decode ms per token.")]
    if res.cycle:
        cy = res.cycle
        sections.append(Section("TLV cycle (the run's, ms per exact pass)",
                                ["draft 1", "Q pass", "draft 2", "exact pass", "append", "cycle"],
                                [[cy["draft1"], cy["qpass"], cy["draft2"], cy["exact"], cy["append"], cy["cycle"]]]))
    lines = [verdict_line(res)] + [f"note: {n}" for n in res.notes] + [f"warning: {w}" for w in res.warnings]
    protect = [p for p in (check_file, replay_file, rows_file, ar_run_file) if p]
    emit(Report(data=res.as_dict(), sections=sections, lines=lines), fmt, out, protect=protect)
    return 0 if res.passed else 1


def _ar_floor_text(f) -> str:
    """The AR step's floor: per token for one request; a step of several requests gives one token
    to each, so its time per step and per token both."""
    if f.batch == 1:
        return f"{f.total_floor_ms:.4g} ms/token"
    return (f"{f.total_floor_ms:.4g} ms/step of {f.batch} requests, "
            f"{f.total_floor_ms / f.batch:.4g} ms/token")
