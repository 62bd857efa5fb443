"""``specpilot profile``: where a decode/verify step's GPU time goes, class by class, and how far
each class is from its byte floor."""

from __future__ import annotations

import click

from specpilot.errors import InputError
from specpilot.output import Report, Section, emit, output_options, progress

DTYPES = ["bf16", "fp16", "fp8", "w12", "int8", "int4"]
STEP_MODES = ["auto", "range", "graph", "gap", "whole"]


@click.command("profile")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--step-range", metavar="REGEX",
              help="NVTX/annotation ranges that are steps (regex searched in the name, e.g. 'decode_step_.*').")
@click.option("--step-mode", type=click.Choice(STEP_MODES), default="auto", show_default=True,
              help="auto: --step-range if given, else CUDA graph launches, else idle gaps, else the whole trace.")
@click.option("--gap-us", type=float, metavar="US", help="Idle gap (us) that separates steps in gap mode [default: found].")
@click.option("--skip-steps", type=int, default=0, show_default=True, help="Leave out the first N steps (warm-up).")
@click.option("--device", type=int, help="GPU index when the trace holds several [default: the busiest].")
@click.option("--rules", "rules_files", multiple=True, type=click.Path(dir_okay=False),
              help="YAML kernel-class rules tried before the defaults (repeatable).")
@click.option("--explain", is_flag=True, help="List which rule classified each kernel name.")
@click.option("--model", "model_name", metavar="NAME|PATH", help="Target model for byte floors (catalog name or config.json).")
@click.option("--drafter", "drafter_name", metavar="NAME|PATH", help="Drafter model: its step is the drafter floor.")
@click.option("--rows", type=int, help="Rows verified per request per step [default 1 with --model].")
@click.option("--draft-rows", type=int, help="Drafter rows per request per pass [default: --rows].")
@click.option("--draft-passes", type=int, default=1, show_default=True,
              help="Drafter passes per step: 1 for a block drafter, k for a sequential (EAGLE-style) one.")
@click.option("--batch", type=int, default=1, show_default=True, help="Requests per step.")
@click.option("--context", type=int, default=2048, show_default=True, help="Committed context tokens per request.")
@click.option("--weight-dtype", type=click.Choice(DTYPES), default="bf16", show_default=True)
@click.option("--lm-head-dtype", type=click.Choice(DTYPES), default=None)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp16", "fp8"]), default="bf16", show_default=True)
@click.option("--gpu", "gpu_name", metavar="NAME", help="GPU for floors [default: the one the trace names].")
@click.option("--bandwidth", type=float, metavar="TB/S", help="Peak bandwidth for floors (with --flops: a GPU not in the catalog).")
@click.option("--flops", type=float, metavar="TFLOP/S", help="Dense bf16 TFLOP/s for floors.")
@click.option("--ceiling", "ceiling_file", type=click.Path(dir_okay=False),
              help="Floors from a specpilot ceiling JSON instead of --model.")
@click.option("--flops-fraction", type=float, default=0.60, show_default=True)
@click.option("--bw-fraction", type=float, default=0.90, show_default=True)
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Draw measured vs floor per class (PNG).")
@output_options
def command(trace, step_range, step_mode, gap_us, skip_steps, device, rules_files, explain, model_name, drafter_name,
            rows, draft_rows, draft_passes, batch, context, weight_dtype, lm_head_dtype, kv_dtype, gpu_name, bandwidth, flops, ceiling_file,
            flops_fraction, bw_fraction, plot_file, fmt, out):
    """Profile decode/verify steps from a trace: time per kernel class against byte floors.

    \b
    Reads Nsight Systems exports (.sqlite; .nsys-rep when nsys is on PATH) and PyTorch
    profiler traces (.json, .json.gz). Steps come from NVTX/annotation ranges (--step-range),
    else CUDA graph launches, else idle gaps. Give --model (and --rows/--batch/--context) or
    --ceiling for floors; the GPU comes from the trace unless --gpu says otherwise.

    \b
      specpilot profile run.sqlite --step-range 'decode_step_.*' --model llama-3.1-8b --rows 8
      specpilot profile trace.json.gz --explain
      specpilot profile run.sqlite --step-range '^step' --ceiling ceiling.json --rows 8 \\
          --format json --out profile.json --plot profile.png
    """
    from specpilot.probes.classify import load_rules
    from specpilot.probes.profile import build_profile, floors_from_ceiling, floors_from_model
    from specpilot.probes.traces import StepRequest, read_trace

    if model_name and ceiling_file:
        raise InputError("give --model or --ceiling, not both")
    if gap_us is not None and gap_us <= 0:
        raise InputError("--gap-us must be positive")
    if plot_file and out and plot_file == out:
        raise InputError("--plot and --out name the same file")
    table = load_rules(rules_files)

    # the model first: a bad --model should fail before a long trace read
    model_spec = drafter_spec = None
    if model_name:
        from specpilot.models import load_model_spec

        model_spec = load_model_spec(model_name)
        drafter_spec = load_model_spec(drafter_name) if drafter_name else None
    elif drafter_name:
        raise InputError("--drafter needs --model")

    req = StepRequest(range_regex=step_range, mode=step_mode, gap_us=gap_us, tag_regex=table.range_regex,
                      device=device)
    bar = progress(desc="reading trace", unit="", total=None)
    try:
        agg = read_trace(trace, req, on_read=lambda n: bar.update(n))
    finally:
        bar.close()

    gpu_info, gpu_spec = _resolve_gpu(agg, gpu_name, bandwidth, flops, needed=bool(model_spec))
    floors = None
    if model_spec is not None:
        floors = floors_from_model(model_spec, gpu_spec, rows=rows or 1, batch=batch, context=context,
                                   weight_dtype=weight_dtype, lm_head_dtype=lm_head_dtype, kv_dtype=kv_dtype,
                                   drafter=drafter_spec, draft_rows=draft_rows, flops_fraction=flops_fraction,
                                   bw_fraction=bw_fraction, draft_passes=draft_passes)
    elif ceiling_file:
        floors = floors_from_ceiling(ceiling_file, rows)
        if gpu_info is not None and floors.gpu and floors.gpu.get("name"):
            gpu_info["floors_gpu"] = floors.gpu.get("name")
    vocab = model_spec.vocab_size if model_spec else None
    prof = build_profile(agg, table, floors=floors, vocab=vocab, skip_steps=skip_steps,
                         model=(model_spec.name if model_spec else None), gpu=gpu_info, want_explain=explain)
    protect = [p for p in (trace, ceiling_file, *rules_files) if p]
    if plot_file:
        from specpilot.reports.plots import plot_profile

        plot_profile(prof, plot_file, protect=protect)
        click.echo(f"wrote {plot_file}", err=True)
    emit(_report(prof), fmt, out, protect=protect)
    return 0


def _resolve_gpu(agg, gpu_name, bandwidth, flops, needed: bool):
    """(gpu dict for the profile, GPUSpec for floors or None)."""
    from specpilot.gpus import custom_gpu, get_gpu, match_gpu_name, with_overrides

    for v, name in ((bandwidth, "--bandwidth"), (flops, "--flops")):
        if v is not None and v <= 0:
            raise InputError(f"{name} must be positive")
    info = None
    if agg.gpu is not None:
        info = {"name": agg.gpu.name, "source": agg.gpu.source, "sm_count": agg.gpu.sm_count,
                "trace_bandwidth_tbs": agg.gpu.bandwidth_tbs}
    spec = None
    if gpu_name:
        spec = get_gpu(gpu_name)
        trace_name = info["name"] if info else None
        info = {**(info or {}), "name": spec.name, "source": "--gpu"}
        if trace_name:
            info["trace_name"] = trace_name
    elif agg.gpu is not None:
        spec = match_gpu_name(agg.gpu.name)
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
        info = {**(info or {}), "key": spec.key, "bandwidth_tbs": spec.bandwidth_tbs, "bf16_tflops": spec.bf16_tflops}
    return info, spec


def _report(p) -> Report:
    g = p.gpu or {}
    title = (f"Profile: {p.steps} step{'s' if p.steps != 1 else ''} ({p.step_detail}) on {g.get('name', 'an unnamed GPU')}"
             + (f", {p.model} rows {p.shape.get('rows')} batch {p.shape.get('batch')} context {p.shape.get('context')}"
                if p.model else ""))
    has_floor = p.total_floor_ms is not None
    headers = ["class", "ms/step", "share", "kernels/step"] + (["GB", "GFLOP", "floor ms", "efficiency"] if has_floor else [])
    rows = []
    for c in p.classes.values():
        r = [c.name, c.ms, f"{100 * c.share:.1f}%", c.calls]
        if has_floor:
            r += [None if c.bytes is None else c.bytes / 1e9, None if c.flops is None else c.flops / 1e9, c.floor_ms,
                  None if c.efficiency is None else f"{100 * c.efficiency:.1f}%"]
        rows.append(r)
    sections = [Section("Kernel time per class (median per step)", headers, rows)]
    tot = [["step wall ms", p.step_wall.median, p.step_wall.p10, p.step_wall.p90],
           ["kernel busy ms", p.kernel_busy.median, p.kernel_busy.p10, p.kernel_busy.p90],
           ["outside ms (wall - busy)", p.outside_ms, None, None],
           ["outside factor (wall / busy)", p.outside_factor, None, None]]
    if has_floor:
        tot += [["total floor ms", p.total_floor_ms, None, None], ["kernel factor (busy / floor)", p.kernel_factor, None, None]]
    sections.append(Section("Per step", ["", "median", "p10", "p90"], tot,
                            note=f"floors: {p.floor_source}" if p.floor_source else
                            "no floors: give --model (with --rows/--batch/--context) or --ceiling"))
    if p.explain is not None:
        sections.append(Section("Classification (--explain)", ["class", "ms/step", "per step", "kind", "range", "rule", "kernel"],
                                [[r.cls, r.ms_per_step, r.per_step, r.kind, r.tag or "", r.rule, _short(r.name)]
                                 for r in p.explain]))
    lines = [f"note: {n}" for n in p.notes]
    return Report(data=p.to_json(), sections=sections, lines=lines, title=title)


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."
