"""``specpilot check``: the CI gate against a round's baseline (regression beyond the noise, failed audit)."""

from __future__ import annotations

from pathlib import Path

import click

from specpilot.errors import InputError
from specpilot.limits import MAX_RUNS
from specpilot.options import seed_option, typed, NonEmptyPath, not_blank
from specpilot.output import Report, Section, emit, fmt_num, output_options, progress


@click.command("check")
@click.option("--baseline", "baseline_path", required=True, type=NonEmptyPath(), metavar="ROUND_OR_FILE",
              help="A round's folder (its baseline.json) or a baseline.json file.")
@click.option("--system", default=None, help="Engine spec to check (default: the baseline's system).")
@click.option("--runs", type=click.IntRange(2, MAX_RUNS), default=None,
              help=f"Timed runs, 2 to {MAX_RUNS} (default: as many as the baseline has samples, at least 4).")
@click.option("--scorer", default=None, callback=not_blank,
              help="Audit scorer: smollm2, tiny, tiny-hybrid (the engine's built-in models), a HF folder or a .gguf "
                   "(default: the stock engine's target, FP32 head).")
@click.option("--no-audit", is_flag=True, help="Timing only.")
@click.option("--no-timing", is_flag=True,
              help="Audit only (needed for a baseline without timing samples: its round timed no candidate).")
@click.option("--tolerance", type=float, default=0.0, show_default=True,
              help="Extra slowdown allowed, as a fraction (0.2 = 20%), on runners whose speed drifts between sessions "
                   "(a shared CPU); GPU runners need none.")
@seed_option("the bootstrap intervals of the timing and the audit")
@output_options
def command(baseline_path, system, runs, scorer, no_audit, no_timing, tolerance, seed, fmt, out):
    """Re-measure the current system and compare it with a stored baseline; exit 1 on a regression
    beyond the measured noise or on a failed token-forcing audit.

    The system runs the baseline's prompts; its tokens/s must not be below the baseline's by more
    than 1% + 2 x noise (95% bound), and its outputs must pass the audit against the baseline's
    stock outputs.

    \b
    Example (commit a round's baseline.json, gate every change on it):
      specpilot check --baseline examples/rounds/smollm2-cpu/baseline.json
    """
    from specpilot.auditors.round import read_baseline
    from specpilot.auditors.round.check import run_check

    if system is not None and not system.strip():   # an empty spec would check the baseline's system unasked
        raise InputError("--system: give an engine spec, or leave --system out to check the baseline's system")
    for flag, on, given in (("--no-audit", no_audit, typed("scorer")), ("--no-timing", no_timing, typed("runs", "tolerance"))):
        if on and given:   # an option the run would ignore
            raise InputError(f"{given[0]} does nothing with {flag}; leave one of them out")
    if not 0 <= tolerance < 1:
        raise InputError("--tolerance must be a fraction in [0, 1)")
    if scorer and not no_audit:   # before the timed runs, not after them
        from specpilot.auditors.scorer import check_scorer_spec

        check_scorer_spec(scorer)
    base = read_baseline(baseline_path)
    from specpilot.models import model_inputs

    # the baseline (a round's folder whole where it is named; its round.json beside a named baseline.json,
    # which check reads too), a scorer and a --system model given as paths
    beside = Path(base["_path"]).parent / "round.json"
    inputs = [baseline_path, base["_path"]] + ([str(beside)] if beside.is_file() else [])
    from specpilot.engine.spec import EngineSpec

    inputs += model_inputs(scorer) + EngineSpec.inputs_of(system)
    if out:   # before the timed runs, not after them
        from specpilot.fileio import check_output_path

        check_output_path(out, "--out", protect=inputs)

    def notify(stage, message):
        click.echo(f"[{stage}] {message}", err=True)

    res = run_check(base, system=system, runs=runs, scorer=scorer, audit=not no_audit, timing=not no_timing,
                    seed=seed, tolerance=tolerance, progress=progress, notify=notify)
    import statistics

    rows = [["system", res.system],
            ["baseline", f"{res.baseline} ({res.baseline_machine})"],
            ["tokens/s now (median of runs)", f"{fmt_num(statistics.median(res.fresh))} ({res.runs} runs, {res.machine})"
             if res.fresh else f"- (--no-timing; {res.machine})"],
            ["tokens/s baseline (median)", fmt_num(statistics.median(res.reference)) if res.reference else "-"],
            ["now / baseline", f"{fmt_num(res.gain)} 95% CI [{fmt_num(res.ci[0])}, {fmt_num(res.ci[1])}]"
             if res.ci else "-"],
            ["noise, threshold", f"{res.noise:.2%}; a regression when the CI's upper end is below "
                                 f"{1 - res.threshold:.4f}" if res.threshold else "-"],
            ["timing", res.timing.upper()],
            ["outputs identical to the baseline's", {True: "yes", False: "no"}.get(res.outputs_identical, "-")],
            ["audit against stock", res.audit_verdict.upper()]]
    if res.audit:
        sysrow = next((s for s in res.audit["systems"] if s["role"] == "system"), {})
        stock = next((s for s in res.audit["systems"] if s["role"] == "stock"), {})
        rows.append(["mismatch rate (stock)", f"{sysrow.get('mismatch_rate', 0):.2%} ({stock.get('mismatch_rate', 0):.2%}), "
                     f"{sysrow.get('events')} events on {sysrow.get('tokens')} tokens"])
    lines = [f"FAIL: {r}" for r in res.reasons] + [f"warning: {w}" for w in res.warnings]
    lines.append(f"gate: {'PASS' if res.passed else 'FAIL'}")
    emit(Report(data=res.to_json(), title="specpilot check", sections=[Section(None, ["measure", "value"], rows)],
                lines=lines),
         fmt, out, protect=inputs)
    return 0 if res.passed else 1
