"""``specpilot probe``: small measurements on this machine (``probe rows``: T_step versus rows)."""

from __future__ import annotations

import click

from specpilot.engine_options import engine_options, spec_from_cli
from specpilot.errors import InputError
from specpilot.limits import MAX_CONTEXT
from specpilot.output import Report, Section, emit, output_options, progress

PROBE_OPTIONS = ("model", "random", "device", "dtype", "threads", "w12", "attn", "head", "decode", "gdn", "deterministic",
                 "batch")


@click.group("probe")
def command():
    """Measure facts the cost model needs on this machine.

    \b
      specpilot probe rows --model llama-3.1-8b --random-weights --rows 1,2,4,...,256 --device cuda
    """


@command.command("rows")
@engine_options(only=PROBE_OPTIONS, spec_option=False, defaults={"device": None},
                default_texts={"device": "cuda when available",
                               "threads": "as run: 1 for a tiny model, else the free physical cores"},
                help_texts={"decode": "Steps of 1..64 rows as in run --decode (fused: cuda, dense and hybrid "
                                      "models); auto times what run takes, so T_AR is the AR step the engine runs.",
                            "batch": "Requests per step: B requests x N rows, each request with its own cache of "
                                     "--context tokens (the batched step of run/serve --batch; c(N) = T(B, N) / "
                                     "T(B, 1))."})
@click.option("--rows", "rows_text", default="1,2,4,8,16,32,64", show_default=True,
              help="Row counts N; '...' continues the series the values before it show, up to the value after "
                   "it, which must be on the series: 1,2,4,...,256 doubles, 8,16,24,...,64 steps by 8. Two "
                   "values that could multiply or step take the rule that reaches the end (1,2,...,6 steps by 1); "
                   "one both reach (1,2,...,16) is refused: give a third value.")
@click.option("--context", type=click.IntRange(1, MAX_CONTEXT), default=1024, show_default=True,
              help="Committed tokens in the KV cache (a probe whose peak memory, caches and what the steps "
                   "make beside them, the device's free memory cannot hold is refused).")
@click.option("--reps", type=click.IntRange(1, 100_000), default=50, show_default=True,
              help="Timed repetitions per N (their median is reported).")
@click.option("--warmup", type=click.IntRange(0, 10_000), default=5, show_default=True,
              help="Untimed steps per N before the timed ones (compilation, caches, clocks); the first N "
                   "always gets at least one (a process's first step pays for allocation).")
@click.option("--qview", type=click.Choice(["w12", "fp8"]), default=None,
              help="Also time TLV's Q pass at each N of 2 rows or more, reading this view of the weights (as a "
                   "TLV run's --qview): qpass_ms and Q/exact per point, which ceiling's TLV cycle then takes.")
@output_options
def rows(rows_text, context, reps, warmup, qview, fmt, out, **kw):
    """T_step(N) for N verification rows and c(N) = T_step(N) / T_AR (JSON for ``ceiling --rows-probe``).

    T_AR is the AR step the engine runs for these options (ar_path: fused or layers); a warning
    says when a faster AR step exists. On a GPU each N is a CUDA graph timed with CUDA events
    (median); on the CPU a wall clock.
    """
    from specpilot.engine.api import resolve_model
    from specpilot.engine.rows import default_device, probe_rows
    from specpilot.options import parse_int_list

    row_list = parse_int_list(rows_text, "--rows")
    # the model is checked as the engine resolves it, before the engine's CPU thread banner and the
    # default device (which asks torch about CUDA: seconds): an unknown name, a catalog config without
    # --random-weights or a bad config is one line alone
    resolve_model(kw["model"], kw["random"])
    if kw["device"] is None:
        kw["device"] = default_device()
    spec = spec_from_cli(kw)
    if out:   # the model's own files are inputs: refused before the measurement
        from specpilot.fileio import check_output_path

        check_output_path(out, "--out", protect=spec.inputs())
    if qview and spec.batch > 1:
        raise InputError("--qview times one request's Q pass; leave out --batch (or --qview)")
    if qview and max(row_list) < 2:
        raise InputError("--qview times the Q pass at N of 2 rows or more; --rows has none")
    if qview:   # the Q pass as a TLV run builds it, or refuses it
        from dataclasses import replace

        try:
            replace(spec, mode="tlv", qview=qview).validate(as_flags=True)
        except InputError as e:
            raise InputError(f"--qview {qview}: {e}") from None
    if spec.batch > 1:
        from specpilot.engine.batch.probe import probe_rows_batched   # torch: after the checks above

        res = probe_rows_batched(spec, row_list, context, reps=reps, warmup=warmup, progress=progress)
    else:
        res = probe_rows(spec, row_list, context, reps=reps, warmup=warmup, progress=progress, qview=qview)
    data = res.to_json()
    w12 = res.extra["w12"]
    hw = res.gpu or f"CPU {res.cpu}"
    label = f", W12 {w12['path']}" if w12 else ""
    for w in res.warnings:
        click.echo(f"specpilot: warning: {w}", err=True)
    batch = f", {spec.batch} requests" if spec.batch > 1 else ""
    q_cols = ["Q pass ms", "Q/exact"] if qview else []
    emit(Report(data=data, sections=[Section(f"{res.model} {res.dtype}{label}, context {context}{batch}, {hw}"
                                             + (f", Q pass {qview}" if qview else ""),
                                             ["rows", "step ms", "c = T(N)/T_AR", "path"] + q_cols,
                                             [[p["rows"], p["step_ms"], p["c"], p.get("path", res.ar_path)]
                                              + ([p.get("qpass_ms", "-"), p.get("q_over_exact", "-")] if qview else [])
                                              for p in res.points],
                                             note=f"{res.method} of {reps} steps; T_AR = {res.ar_ms:.4g} ms, "
                                                  f"the {res.ar_path} AR step")]), fmt, out, protect=spec.inputs())
    return 0
