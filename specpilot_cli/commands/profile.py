"""``specpilot profile``: where a decode/verify step's GPU time goes, class by class, and how far
each class is from its byte floor."""

from __future__ import annotations

import os

import click

from specpilot.errors import InputError
from specpilot.limits import MAX_BATCH, MAX_CONTEXT, MAX_DRAFT_PASSES, MAX_ROWS, MAX_TBS, MAX_TFLOPS
from specpilot.options import (dtype_options, positive, refuse_draft_shape_without_drafter,
                               typed, NonEmptyPath, not_blank)
from specpilot.options import them as them_of
from specpilot.output import Report, Section, count, emit, output_options, progress

STEP_MODES = ["auto", "range", "graph", "gap", "whole"]
# what a --step-mode that reads no --step-range takes for its steps
STEPS_OF_MODE = {"graph": "launches of the most frequent CUDA graph", "gap": "GPU work separated by idle gaps",
                 "whole": "the whole trace, as one step"}


def _gpu_help() -> str:
    from specpilot.gpus import gpu_keys

    return (f"GPU of the floors (with --model) when it is not the trace's: {', '.join(gpu_keys())} (the GPU "
            "catalog; a prefix that names one, such as h100, works too) [default: the one the trace names]. "
            "Example: --gpu h100")


@click.command("profile")
@click.argument("traces", nargs=-1, required=True, type=NonEmptyPath(dir_okay=False))
@click.option("--step-range", metavar="REGEX",
              help="NVTX/annotation ranges that are steps (regex searched in the name), e.g. 'decode_step_.*'. "
                   "[default: the first step family the trace has: decode_step_N, SGLang/vLLM step ranges, "
                   "ProfilerStep#N]")
@click.option("--step-mode", type=click.Choice(STEP_MODES), default="auto", show_default=True,
              help="auto: --step-range or the trace's step annotations, else CUDA graph launches, else idle gaps, "
                   "else the whole trace. Example: --step-mode gap --gap-us 200")
@click.option("--gap-us", type=positive(1e12), metavar="US", help="Idle gap (us) that separates steps in gap mode [default: found]. "
              "Example: --step-mode gap --gap-us 200")
@click.option("--skip-steps", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True, help="Leave out the first N steps (warm-up). "
              "Example: --skip-steps 2")
@click.option("--device", type=click.IntRange(0, 2**16), help="GPU index when the trace holds several [default: the busiest]. Example: --device 1")
@click.option("--include-orphans", is_flag=True,
              help="Keep kernels launched before the trace began (their launch is not in the trace; left out by "
                   "default and counted in a note). Example: --include-orphans")
@click.option("--rules", "rules_files", multiple=True, type=NonEmptyPath(dir_okay=False),
              help="YAML kernel-class rules tried before the defaults (repeatable). Example: --rules my_rules.yaml")
@click.option("--explain", is_flag=True, help="List which rule classified each kernel name. Example: --explain")
@click.option("--top", "top_n", type=click.IntRange(0, 2**31 - 1), default=10, show_default=True,
              help="Kernels listed by time per step (0: none). Example: --top 20")
@click.option("--diff", is_flag=True,
              help="Compare two traces, BASE then CANDIDATE: per class and per top kernel, ms per step, share and "
                   "efficiency. Example: specpilot profile base.sqlite patched.sqlite --diff")
@click.option("--ranks", is_flag=True,
              help="Profile every GPU of one multi-GPU trace as a tensor-parallel rank (several trace files are "
                   "ranks without it). Example: specpilot profile tp4.sqlite --ranks")
@click.option("--link-bandwidth", type=positive(1e6), metavar="GB/S",
              help="GPU-to-GPU bandwidth per direction for the communication floor [default: the GPU catalog's "
                   "NVLink/xGMI figure]. Example: --link-bandwidth 450")
@click.option("--model", "model_name", metavar="NAME|PATH", callback=not_blank, help="Target model for byte floors (catalog name or config.json).")
@click.option("--drafter", "drafter_name", metavar="NAME|PATH", callback=not_blank, help="Drafter model: its step is the drafter floor.")
@click.option("--rows", type=click.IntRange(1, MAX_ROWS), help="Rows verified per request per step [default 1 with --model].")
@click.option("--draft-rows", type=click.IntRange(1, MAX_ROWS), help="Drafter rows per request per pass [default: --rows].")
@click.option("--draft-passes", type=click.IntRange(1, MAX_DRAFT_PASSES), default=1, show_default=True,
              help="Drafter passes per step: 1 for a block drafter, k for a sequential (EAGLE-style) one.")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), default=1, show_default=True, help="Requests per step.")
@click.option("--context", type=click.IntRange(0, MAX_CONTEXT), default=2048, show_default=True,
              help="Committed context tokens per request.")
@click.option("--gpu", "gpu_name", metavar="NAME", help=_gpu_help())
@click.option("--bandwidth", type=positive(MAX_TBS), metavar="TB/S",
              help="Peak bandwidth for floors (with --model; with --flops: a GPU not in the catalog).")
@click.option("--flops", type=positive(MAX_TFLOPS), metavar="TFLOP/S", help="Dense bf16 TFLOP/s for floors (with --model).")
@click.option("--ceiling", "ceiling_file", type=NonEmptyPath(dir_okay=False),
              help="Floors from a specpilot ceiling JSON instead of --model (--rows picks one of its row "
                   "counts; needed when it has several).")
@dtype_options
@click.option("--plot", "plot_file", type=NonEmptyPath(dir_okay=False), help="Draw measured vs floor per class: a .png, .svg or .pdf file (the suffix picks the format).")
@output_options
def command(traces, step_range, step_mode, gap_us, skip_steps, device, include_orphans, rules_files, explain, top_n,
            diff, ranks, link_bandwidth, model_name, drafter_name, rows, draft_rows, draft_passes, batch, context,
            weight_dtype, lm_head_dtype, kv_dtype, gpu_name, bandwidth, flops, ceiling_file, flops_fraction,
            bw_fraction, plot_file, fmt, out):
    """Profile decode/verify steps from a trace: time per kernel class against byte floors.

    \b
    Reads Nsight Systems exports (.sqlite; .nsys-rep through a newer .sqlite beside it, else nsys
    on PATH) and PyTorch profiler traces (.json, .json.gz), also gzip/zstd/xz/bzip2-compressed
    (recognised by content).
    Steps come from --step-range, else the trace's step annotations, else CUDA graph launches,
    else idle gaps; the output says how they were found. Give --model (and --rows/--batch/
    --context) or --ceiling for floors; the floors' GPU is the trace's unless --gpu names another.
    A kernel launched early under programmatic dependent launch counts from where the one before
    it on its stream ended: its wait is that kernel's time.

    \b
    One trace: a profile. Two traces with --diff: BASE vs CANDIDATE. Several traces (or one
    multi-GPU trace with --ranks): tensor-parallel ranks side by side, the slowest rank per step
    and communication against its byte floor.

    \b
      specpilot profile run.sqlite --model llama-3.1-8b --rows 8
      specpilot profile trace.json.gz --step-range '^decode_step_' --explain
      specpilot profile run.sqlite --ceiling ceiling.json --rows 8 --format json --out profile.json --plot profile.png
      specpilot profile base.sqlite patched.sqlite --diff --model llama-3.1-8b
      specpilot profile rank0.json.gz rank1.json.gz rank2.json.gz rank3.json.gz
      specpilot profile tp8.sqlite --ranks --link-bandwidth 450
    """
    from specpilot.probes.classify import load_rules

    if model_name and ceiling_file:
        raise InputError("give --model or --ceiling, not both")
    gpu_opts = typed("gpu_name", "bandwidth", "flops")
    if ceiling_file and gpu_opts:   # the ceiling's floors are its GPU's: another GPU's would not be used
        raise InputError(f"{', '.join(gpu_opts)}: --ceiling brings the floors of the GPU it was made for; give the GPU "
                         "to `specpilot ceiling` instead (or use --model)")
    if step_range == "":
        raise InputError("--step-range is empty: give a REGEX of the step ranges' names, or leave it out to find "
                         "the steps automatically")
    _check_step_options(step_range, step_mode)
    if gap_us is not None and gap_us <= 0:
        raise InputError("--gap-us must be positive")
    if link_bandwidth is not None and link_bandwidth <= 0:
        raise InputError("--link-bandwidth must be positive")
    if top_n < 0:
        raise InputError("--top must be >= 0")
    if plot_file and out and os.path.realpath(plot_file) == os.path.realpath(out):   # ./a.png is a.png
        raise InputError("--plot and --out name the same file")
    from specpilot.fileio import check_output_path
    from specpilot.models import model_inputs

    # a model or drafter given as a config file (its weights and tokenizer beside it) or folder is an input too
    protect = [p for p in (*traces, ceiling_file, *rules_files) if p]
    protect += [f for n in (model_name, drafter_name) for f in model_inputs(n)]
    if out:
        check_output_path(out, "--out", protect=protect)
    if plot_file:
        from specpilot.reports.plots import PLOT_FORMATS, plot_format

        if plot_format(plot_file) is None:
            raise InputError(f"--plot {plot_file}: name a {', '.join('.' + f for f in PLOT_FORMATS)} file (the "
                             "suffix picks the image format)")

        check_output_path(plot_file, "--plot", protect=protect)
    if diff and len(traces) != 2:
        raise InputError(f"--diff compares two traces (BASE CANDIDATE); got {len(traces)}")
    if ranks and len(traces) != 1:
        raise InputError("--ranks reads one multi-GPU trace; several trace files are ranks without it")
    if (diff or len(traces) > 1 or ranks) and (plot_file or explain):
        given = " and ".join(o for o, v in (("--plot", plot_file), ("--explain", explain)) if v)
        raise InputError(f"{given} profile{'s' if ' and ' not in given else ''} one trace; leave "
                         f"{'it' if ' and ' not in given else 'them'} out with --diff, --ranks or several traces")
    if ranks and device is not None:
        raise InputError("--ranks profiles every GPU; leave out --device")
    if (ranks or (len(traces) > 1 and not diff)) and (model_name or ceiling_file):
        # a rank runs its shard of the model: the whole model's floors would be N times too high for it
        raise InputError(f"{'--model' if model_name else '--ceiling'}: tensor-parallel mode (several traces, or "
                         "--ranks) compares the ranks with each other and sets no per-class floors (each rank runs a "
                         "shard of the model, which the byte floors do not split); leave it out")
    tp_mode = ranks or (len(traces) > 1 and not diff)
    if gpu_opts and not model_name:   # (beside --ceiling they are refused above)
        names, them = ", ".join(gpu_opts), them_of(gpu_opts)
        if tp_mode:
            raise InputError(f"{names}: tensor-parallel mode (several traces, or --ranks) sets no byte floors for "
                             f"{them} to shape (the communication floor's link bandwidth is --link-bandwidth); "
                             f"leave {them} out")
        raise InputError(f"{names}: {'it sets' if len(gpu_opts) == 1 else 'they set'} the GPU of the byte floors, "
                         f"which need --model; give --model, or leave {them} out (the communication floor's link "
                         "bandwidth is --link-bandwidth)")
    _check_floor_options(model_name, ceiling_file, tp_mode=tp_mode, drafter_name=drafter_name)
    table = load_rules(rules_files)

    # the model first: a bad --model should fail before a long trace read
    model_spec = drafter_spec = None
    if model_name:
        from specpilot.models import load_model_spec

        model_spec = load_model_spec(model_name)
        drafter_spec = load_model_spec(drafter_name) if drafter_name else None
    elif drafter_name:
        raise InputError("--drafter needs --model")

    from specpilot.gpus import match_gpu_name

    floors_gpu_title = []   # the single profile's title names the floors' GPU where --gpu made it another

    def profile(agg, want_explain=False, n_top=top_n, max_steps=None):
        from specpilot.probes.profile import build_profile, floors_from_ceiling, floors_from_model

        _check_gap_us(agg)
        gpu_info, gpu_spec, gpu_warning = _resolve_gpu(agg, gpu_name, bandwidth, flops, needed=bool(model_spec))
        if gpu_info is not None and gpu_info.get("floors_gpu") and (
                gpu_warning or match_gpu_name(gpu_info.get("name") or "") is None):   # another GPU, or one not known
            floors_gpu_title.append(f"floors for {gpu_info['floors_gpu']}, --gpu")
        floors = note = None
        if model_spec is not None:
            floors = floors_from_model(model_spec, gpu_spec, rows=rows or 1, batch=batch, context=context,
                                       weight_dtype=weight_dtype, lm_head_dtype=lm_head_dtype, kv_dtype=kv_dtype,
                                       drafter=drafter_spec, draft_rows=draft_rows, flops_fraction=flops_fraction,
                                       bw_fraction=bw_fraction, draft_passes=draft_passes)
        elif ceiling_file:
            floors = floors_from_ceiling(ceiling_file, rows)
            if gpu_info is not None and floors.gpu and floors.gpu.get("name"):
                gpu_info["floors_gpu"] = floors.gpu.get("name")
            note = _check_ceiling_gpu(ceiling_file, floors.gpu, agg, gpu_spec)
        link = link_bandwidth or (_link_gbs(gpu_spec.key) if gpu_spec is not None else None)
        if gpu_info is not None and link:
            gpu_info["link_gbs"] = link
        model = model_spec.name if model_spec else (floors.model if floors else None)   # a ceiling names its model
        prof = build_profile(agg, table, floors=floors, vocab=(model_spec.vocab_size if model_spec else None),
                             skip_steps=skip_steps, model=model, gpu=gpu_info, want_explain=want_explain, link_gbs=link,
                             top_n=n_top, max_steps=max_steps)
        if note:
            prof.notes.append(note)
        prof.warnings[:0] = [gpu_warning] if gpu_warning else []   # first: it explains the efficiencies
        prof.warnings += agg.warnings
        floor_warning = _floor_above_busy(prof, floors, "ceiling" if ceiling_file else "model")
        if floor_warning:
            prof.warnings.append(floor_warning)
        return prof

    if diff:
        from specpilot.probes.diff import diff_profiles

        base, cand = (profile(_read(t, device, step_range, step_mode, gap_us, include_orphans, table), n_top=100_000)
                      for t in traces)
        emit(_diff_report(diff_profiles(base, cand, top_n=top_n)), fmt, out, protect=protect)
        return 0
    if ranks or len(traces) > 1:
        from specpilot.probes.ranks import rank_profiles

        _refuse_a_trace_named_twice(traces)

        if ranks:
            from specpilot.probes.traces import StepRequest, read_trace_devices

            req = StepRequest(range_regex=step_range, mode=step_mode, gap_us=gap_us, tag_regex=table.range_regex,
                              include_orphans=include_orphans)
            bar = progress(desc="reading trace", unit="", total=None)
            try:
                aggs = read_trace_devices(traces[0], req, on_read=lambda n: bar.update(n))
            finally:
                bar.close()
            labels = [f"GPU {d}" for d, _ in aggs]
            aggs = [a for _, a in aggs]
        else:
            aggs = [_read(t, device, step_range, step_mode, gap_us, include_orphans, table) for t in traces]
            _refuse_traces_of_no_group(traces, aggs)
            labels = None
        # every rank's figures over the steps all ranks have (a rank with none is refused by its profile)
        counts = [max(len(a.steps) - skip_steps, 0) for a in aggs]
        common = min(counts) if len(set(counts)) > 1 and min(counts) > 0 else None
        profiles = [profile(a, max_steps=common) for a in aggs]
        labels = labels or _rank_labels(traces, profiles)
        d = rank_profiles(profiles, labels, found=counts)
        emit(_ranks_report(d), fmt, out, protect=protect)
        return 0

    prof = profile(_read(traces[0], device, step_range, step_mode, gap_us, include_orphans, table), want_explain=explain)
    if plot_file:
        from specpilot.reports.plots import plot_profile

        plot_profile(prof, plot_file, protect=protect)
        click.echo(f"wrote {plot_file}", err=True)
    emit(_report(prof, floors_gpu_title[0] if floors_gpu_title else None), fmt, out, protect=protect)
    return 0


def _check_step_options(step_range, step_mode) -> None:
    """Refuse the step options the --step-mode asked for does not read: --step-range beside a mode
    that takes its steps from something else, --gap-us where the steps are not found by gaps (in
    auto mode that is known once the trace is read: :func:`_check_gap_us`)."""
    if step_range is not None and step_mode not in ("auto", "range"):
        raise InputError(f"--step-range: --step-mode {step_mode} does not read step ranges (its steps are "
                         f"{STEPS_OF_MODE[step_mode]}); leave one of them out")
    if not typed("gap_us"):
        return
    if step_range is not None or step_mode == "range":
        raise InputError("--gap-us: the steps are the --step-range ranges, not GPU work between idle gaps; leave it "
                         "out, or give --step-mode gap instead of --step-range")
    if step_mode in ("graph", "whole"):
        raise InputError(f"--gap-us: --step-mode {step_mode} takes {STEPS_OF_MODE[step_mode]}, not GPU work between "
                         "idle gaps; leave it out, or give --step-mode gap")


def _check_gap_us(agg) -> None:
    """--gap-us given in auto mode, where the trace's step annotations or graph launches made the
    steps: it was not read."""
    if typed("gap_us") and agg.step_mode in ("range", "graph"):
        raise InputError(f"--gap-us: the steps of {agg.path} are {agg.step_detail}, not GPU work between idle gaps; "
                         "leave it out, or add --step-mode gap to split the trace at idle gaps")


def _check_floor_options(model_name, ceiling_file, tp_mode: bool, drafter_name=None) -> None:
    """Refuse the floors' shape options (--rows, --batch, --context, the drafter's and the dtype
    options) where no floors use them: without --model (a ceiling's floors take --rows alone, to
    pick one of its row counts), in tensor-parallel mode, which sets no floors, and the drafter's
    (--draft-rows, --draft-passes) without --drafter, which sets no drafter floor."""
    given = typed("rows", "batch", "context", "draft_rows", "draft_passes", "weight_dtype", "lm_head_dtype",
                  "kv_dtype", "flops_fraction", "bw_fraction")
    if model_name:
        refuse_draft_shape_without_drafter(drafter_name)
        return
    if not given:
        return
    names, them = ", ".join(given), them_of(given)
    if tp_mode:
        raise InputError(f"{names}: tensor-parallel mode (several traces, or --ranks) sets no byte floors for "
                         f"{them} to shape; leave {them} out")
    if ceiling_file:
        other = [g for g in given if g != "--rows"]
        if other:
            raise InputError(f"{', '.join(other)}: --ceiling brings floors of the shape it was made for (it takes "
                             f"--rows alone, to pick one of its row counts); give {them_of(other)} to "
                             "`specpilot ceiling`, or use "
                             "--model instead of --ceiling")
        return
    raise InputError(f"{names}: {'it shapes' if len(given) == 1 else 'they shape'} the byte floors, which need "
                     f"--model or --ceiling; give one, or leave {them} out")


def _read(trace, device, step_range, step_mode, gap_us, include_orphans, table):
    from specpilot.probes.traces import StepRequest, read_trace

    req = StepRequest(range_regex=step_range, mode=step_mode, gap_us=gap_us, tag_regex=table.range_regex,
                      device=device, include_orphans=include_orphans)
    bar = progress(desc="reading trace", unit="", total=None)
    try:
        return read_trace(trace, req, on_read=lambda n: bar.update(n))
    finally:
        bar.close()


def _refuse_a_trace_named_twice(traces) -> None:
    """Each rank is its own trace: one file given twice would be profiled as two ranks that tie."""
    from specpilot.fileio import same_file

    for i, a in enumerate(traces):
        twin = next((b for b in traces[:i] if same_file(a, b)), None)
        if twin is not None:
            raise InputError(f"{a}: given twice (as {twin}); each rank is its own trace file")


def _refuse_traces_of_no_group(traces, aggs) -> None:
    """Traces that say they are not ranks of one group (their distributedInfo): one that ran alone
    (world size 1), or two that claim the same rank. Profiled as ranks they tied or showed another
    workload's difference as imbalance."""
    seen: dict[int, str] = {}
    for t, a in zip(traces, aggs):
        d = a.distributed or {}
        if d.get("world_size") == 1:
            raise InputError(f"{t}: the trace says it ran alone (world size 1), so it is no rank of a tensor-parallel "
                             "group; profile it by itself, or compare two traces with --diff")
        rank = d.get("rank")
        if rank is not None and rank in seen:
            raise InputError(f"{t} and {seen[rank]} both say they are rank {rank}: each rank of a group is its own "
                             "trace; give one trace per rank")
        if rank is not None:
            seen[rank] = t


def _rank_labels(traces, profiles) -> list[str]:  # noqa: ARG001
    """The file names, or 'rank N' in argument order when two files share a name."""
    from pathlib import Path

    names = [Path(t).name for t in traces]
    return names if len(set(names)) == len(names) else [f"rank {i}" for i in range(len(traces))]


def _check_ceiling_gpu(path, floors_gpu: dict | None, agg, trace_spec) -> str | None:
    """Refuse a ceiling made for another GPU than the trace's; a note where they cannot be compared.

    Efficiency = floor / measured, and the floor is the ceiling GPU's bytes / bandwidth (or FLOPs /
    peak): another GPU's floors would make every efficiency, and every model/config mismatch flag,
    off by the ratio of the two GPUs' peaks."""
    from specpilot.gpus import gpu_keys, match_gpu_name

    if not floors_gpu or agg.gpu is None:
        return None
    key, name = floors_gpu.get("key"), floors_gpu.get("name") or floors_gpu.get("key")
    if key not in gpu_keys():   # a GPU detected or given by its figures: its name may still be a catalog one
        found = match_gpu_name(name) if isinstance(name, str) and name != "custom" else None
        key = found.key if found is not None else None
    if key is None or trace_spec is None:
        what = "a GPU given by its figures" if floors_gpu.get("key") == "custom" else repr(name)
        return (f"the floors are {path}'s, for {what}, which the GPU catalog cannot compare with the trace's GPU "
                f"{agg.gpu.name!r}: check that the ceiling was made for this GPU")
    if key != trace_spec.key:
        raise InputError(f"{path}: its floors are for {name} ({key}), the trace {agg.path} ran on {agg.gpu.name} "
                         f"({trace_spec.key}): efficiencies against another GPU's floors mean nothing; make the "
                         f"ceiling with --gpu {trace_spec.key}, or give --model instead of --ceiling")
    return None


def _link_gbs(key: str) -> float | None:
    """The catalog's GPU-to-GPU bandwidth per direction (NVLink/xGMI), GB/s."""
    from importlib import resources

    import yaml

    doc = yaml.safe_load((resources.files("specpilot") / "gpu_catalog.yaml").read_text()) or {}
    entry = (doc.get("gpus") or {}).get(key) or {}
    v = entry.get("link_gbs")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def _resolve_gpu(agg, gpu_name, bandwidth, flops, needed: bool):
    """(gpu dict for the profile, GPUSpec for floors or None, warning or None).

    The dict names the GPU the trace was taken on (``name``, ``source``, ``sm_count``,
    ``trace_bandwidth_tbs``) and the catalog entry of the floors (``key``, ``bandwidth_tbs``,
    ``bf16_tflops``, ``fp8_tflops``); ``--gpu`` adds ``floors_gpu``, that entry's name, and a warning where the
    trace names another catalog GPU."""
    from specpilot.gpus import custom_gpu, get_gpu, match_gpu_name, with_overrides

    for v, name in ((bandwidth, "--bandwidth"), (flops, "--flops")):
        if v is not None and v <= 0:
            raise InputError(f"{name} must be positive")
    info = None
    trace_spec = match_gpu_name(agg.gpu.name) if agg.gpu is not None else None
    if agg.gpu is not None:
        info = {"name": agg.gpu.name, "source": agg.gpu.source, "sm_count": agg.gpu.sm_count,
                "trace_bandwidth_tbs": agg.gpu.bandwidth_tbs}
    spec = warning = None
    if gpu_name:
        spec = get_gpu(gpu_name)
        info = {**(info or {}), "floors_gpu": spec.name}
        if trace_spec is not None and trace_spec.key != spec.key:
            warning = (f"the floors are for another GPU than the trace's: {spec.name} (--gpu {gpu_name}), the trace "
                       f"{agg.path} ran on {agg.gpu.name} ({trace_spec.key}); efficiencies and the kernel factor "
                       f"set this trace against that GPU's peaks (leave out --gpu for its own)")
    elif agg.gpu is not None:
        spec = trace_spec
    if spec is None and bandwidth is not None and flops is not None:
        spec = custom_gpu(bandwidth, flops)
        if info is not None:
            info["key"] = "custom"
    elif spec is not None and (bandwidth is not None or flops is not None):
        spec = with_overrides(spec, bandwidth_tbs=bandwidth, bf16_tflops=flops)
    if spec is None and needed:
        if agg.gpu is not None:
            raise InputError(f"the trace's GPU {agg.gpu.name!r} is not in the GPU catalog; name one with --gpu, "
                             "or give --bandwidth and --flops")
        raise InputError("the trace names no GPU; give --gpu (or --bandwidth and --flops) for floors")
    if spec is not None:
        # fp8 floors take the fp8 peak (the bf16 one where the entry has none): ceiling compares it too
        info = {**(info or {}), "key": spec.key, "bandwidth_tbs": spec.bandwidth_tbs, "bf16_tflops": spec.bf16_tflops,
                "fp8_tflops": spec.fp8_tflops}
    return info, spec, warning


def _floor_above_busy(p, floors, source: str) -> str | None:
    """A warning where the kernels ran faster than the whole step's byte floor (kernel factor below
    1) but not faster than the floor at the GPU's full peak (that is already a model/config
    mismatch warning): the kernels reach more of the peak than the floor's fractions assume, or the
    floors' model and shape are not this trace's; either way the efficiencies above 100% come from
    it. Worded as ``specpilot ceiling`` words a kernel factor below 1."""
    kf, floor, busy, at_peak = p.kernel_factor, p.total_floor_ms, p.kernel_busy.median, p.floor_peak_ms
    if kf is None or kf >= 1 or floors is None or at_peak is None:
        return None
    if busy < at_peak:   # build_profile's model/config mismatch warning
        return None
    labels = ((("bw_fraction", "bandwidth"), ("flops_fraction", "FLOP/s")) if source == "ceiling" else
              (("bw_fraction", "--bw-fraction"), ("flops_fraction", "--flops-fraction")))
    fr = [f"{opt} {p.shape[k]:g}" for k, opt in labels if isinstance(p.shape.get(k), (int, float))]
    fractions = f" ({', '.join(fr)})" if fr else ""
    what = ("the ceiling's model and shape" if source == "ceiling" else
            "the model, shape or GPU options (--model, --rows, --batch, --context, the dtypes, --gpu, --bandwidth)")
    return (f"kernel busy time {busy:.4g} ms is below the byte floor {floor:.4g} ms (kernel factor {kf:.4g}) but not "
            f"below it at the GPU's full peak ({at_peak:.4g} ms): the kernels reach more of the peak than the floor's "
            f"fractions assume{fractions}, or {what} do not describe "
            "this trace; efficiencies above 100% follow from it")


def _pct(x):
    """A share as a percentage; None (a table prints it as '-') when unknown."""
    return None if x is None else f"{100 * x:.1f}%"


def _report(p, floors_gpu: str | None = None) -> Report:
    g = p.gpu or {}
    title = (f"Profile: {p.steps} step{'s' if p.steps != 1 else ''} ({p.step_detail}) on {g.get('name') or 'an unnamed GPU'}"
             + (f" ({floors_gpu})" if floors_gpu else "")
             + (f", {p.model} rows {p.shape.get('rows')} batch {p.shape.get('batch')} context {p.shape.get('context')}"
                if p.model else ""))
    has_floor = p.total_floor_ms is not None or any(c.floor_ms for c in p.classes.values())
    headers = ["class", "ms/step", "share", "kernels/step"] + (["GB", "GFLOP", "floor ms", "efficiency"] if has_floor else [])
    rows = []
    for c in p.classes.values():
        r = [c.name, c.ms, f"{100 * c.share:.1f}%", c.calls]
        if has_floor:
            eff = _pct(c.efficiency)
            r += [None if c.bytes is None else c.bytes / 1e9, None if c.flops is None else c.flops / 1e9, c.floor_ms,
                  f"{eff} (!)" if c.flag else eff]
        rows.append(r)
    class_notes = []
    if any(c.flag for c in p.classes.values()):
        class_notes.append("(!): faster than its floor allows at the GPU's peak: a model/config mismatch (see the warnings)")
    summed = sum(c.ms for c in p.classes.values())
    if p.steps > 1 and summed < 0.95 * p.kernel_busy.median:
        # each median is taken alone: over steps that differ (gap mode cutting a step apart) they do not add up
        class_notes.append(f"medians over steps, each taken alone: the classes' add up to {summed:.4g} ms per step "
                           f"against a busy-time median of {p.kernel_busy.median:.4g} ms, as the steps differ (a class "
                           "in fewer than half of them has a median of 0; the JSON's ms_mean gives the means)")
    sections = [Section("Kernel time per class (median per step)", headers, rows,
                        note="\n".join(class_notes) or None)]
    tot = [["step wall ms", p.step_wall.median, p.step_wall.p10, p.step_wall.p90],
           ["kernel busy ms", p.kernel_busy.median, p.kernel_busy.p10, p.kernel_busy.p90]]
    if p.events is not None:
        tot.append(["kernels per step", p.events.median, p.events.p10, p.events.p90])
    tot += [["outside ms (wall - busy)", p.outside_ms, None, None],
            ["outside factor (wall / busy)", p.outside_factor, None, None]]
    if p.total_floor_ms is not None:
        tot += [["total floor ms", p.total_floor_ms, None, None], ["kernel factor (busy / floor)", p.kernel_factor, None, None]]
    sections.append(Section("Per step", ["", "median", "p10", "p90"], tot,
                            note=f"floors: {p.floor_source}" if p.floor_source else
                            "no floors: give --model (with --rows/--batch/--context) or --ceiling"))
    if p.top:
        rare = any(t["ms"] == 0 and 2 * t.get("steps", 0) < p.steps for t in p.top)
        empty = any(t["ms"] == 0 and 2 * t.get("steps", 0) >= p.steps for t in p.top)
        why = " or ".join(x for x in ("the kernel runs in fewer than half of the steps (medians per step)" if rare
                                      else "", "its records last no time (zero-length in the trace)" if empty else "")
                          if x)
        note = f"0 ms: {why}; the kernels at 0 ms are in no particular order" if why else None
        sections.append(Section(f"Top {len(p.top)} kernels (median ms per step)", ["ms/step", "share", "class", "kernel"],
                                [[t["ms"], f"{100 * t['share']:.1f}%", t["class"], _short(t["name"])] for t in p.top],
                                note=note))
    if p.explain is not None:
        sections.append(Section("Classification (--explain)", ["class", "mean ms/step", "per step", "kind", "range", "rule", "kernel"],
                                [[r.cls, r.ms_per_step, r.per_step, r.kind, r.tag or "", r.rule, _short(r.name)]
                                 for r in p.explain]))
    lines = [f"warning: {w}" for w in p.warnings] + [f"note: {n}" for n in p.notes]
    return Report(data=p.to_json(), sections=sections, lines=lines, title=title)


def _diff_report(d: dict) -> Report:
    b, c = d["base"], d["candidate"]
    title = f"Diff: {b['trace']} ({count(b['steps'], 'step')}) -> {c['trace']} ({count(c['steps'], 'step')})"
    totals = [[t["what"], t["base"], t["candidate"], t["delta"], _pct(t["relative"])] for t in d["totals"]]
    classes = [[r["class"], r["base_ms"], r["candidate_ms"], r["delta_ms"], _pct(r["relative"]),
                f"{100 * r['base_share']:.1f}% -> {100 * r['candidate_share']:.1f}%",
                (f"{_pct(r['base_efficiency']) or '-'}{' (!)' if r.get('base_flag') else ''} -> "
                 f"{_pct(r['candidate_efficiency']) or '-'}{' (!)' if r.get('candidate_flag') else ''}"
                 if r["base_efficiency"] is not None or r["candidate_efficiency"] is not None else None)]
               for r in d["classes"]]
    kernels = [[k["base_ms"], k["candidate_ms"], k["delta_ms"], _pct(k["relative"]), k["class"], _short(k["name"], 70)]
               for k in d["kernels"]]
    sections = [Section("Per step (medians)", ["", "base", "candidate", "delta", "relative"], totals),
                Section("Kernel time per class (ms per step)", ["class", "base", "candidate", "delta", "relative", "share",
                                                                "efficiency"], classes),
                Section("Top kernels (ms per step)", ["base", "candidate", "delta", "relative", "class", "kernel"], kernels)]
    if not kernels:   # --top 0
        sections.pop()
    return Report(data=d, sections=sections,
                  lines=[f"warning: {w}" for w in d.get("warnings", [])] + [f"note: {n}" for n in d["notes"]],
                  title=title)


def _ranks_report(d: dict) -> Report:
    title = (f"Tensor-parallel profile: {len(d['ranks'])} ranks, {count(d['steps'], 'step')}; the group's busy time per step "
             f"{d['group_busy_ms']:.4g} ms (median), imbalance {100 * d['imbalance']:.1f}%")
    ranks = d["ranks"]
    headers = ["class"] + [r["rank"] for r in ranks]
    rows = [[c] + [r["classes"].get(c, 0.0) for r in ranks] for c in d["classes"]]
    rows += [["kernel busy ms"] + [r["kernel_busy_ms"] for r in ranks],
             ["step wall ms"] + [r["step_wall_ms"] for r in ranks]]
    comm = [["message GB"] + [None if r["communication_bytes"] is None else r["communication_bytes"] / 1e9 for r in ranks],
            ["floor ms"] + [r["communication_floor_ms"] for r in ranks],
            ["efficiency"] + [_pct(r["communication_efficiency"]) for r in ranks]]
    slow = [[k, v, f"{100 * v / d['steps']:.0f}%"] for k, v in d["slowest"].items()]
    sections = [Section("Kernel time per class and rank (median ms per step)", headers, rows)]
    if any(v is not None for r in comm for v in r[1:]):   # no message sizes, no floor: nothing to show
        sections.append(Section("Communication (NCCL/RCCL, custom all-reduce) against its byte floor",
                                [""] + headers[1:], comm,
                                note="floor = bytes each rank sends (ring algorithms) / link bandwidth per direction"))
    sections.append(Section("Slowest rank per step", ["rank", "steps", "share"], slow))
    return Report(data=d, sections=sections,
                  lines=[f"warning: {w}" for w in d.get("warnings", [])] + [f"note: {n}" for n in d["notes"]],
                  title=title)


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."
