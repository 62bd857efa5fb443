"""``specpilot compare``: is a candidate really faster than the base? Paired runs, a confidence
bound, and the paper's approval rule."""

from __future__ import annotations

import click

from specpilot.limits import MAX_RUNS
from specpilot.options import positive, seed_option, typed, NonEmptyPath, not_blank
from specpilot.output import Report, Section, emit, output_options


def _runs(ctx, param, value):
    if value is None or value.strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number or 'auto'") from None
    if n < 2:
        raise click.BadParameter("need at least 2 pairs")
    if n > MAX_RUNS:
        raise click.BadParameter(f"at most {MAX_RUNS} (as --max-runs)")
    return n


@click.command("compare")
@click.option("--base", "base", metavar="SYSTEM", default=None,
              help="Base system: an engine spec (engine:model=smollm2,mode=chain) or a server URL.")
@click.option("--candidate", "candidate", metavar="SYSTEM", default=None, help="Candidate system (as --base).")
@click.option("--base-cmd", default=None, metavar="CMD", help="Base shell command (timed per run).")
@click.option("--candidate-cmd", default=None, metavar="CMD", help="Candidate shell command.")
@click.option("--metric", default="wall", show_default=True, metavar="wall|KEY",
              help="Shell commands: 'wall' times each run; KEY reads a throughput (higher is better) from "
                   "the JSON object the command prints on its last stdout line, e.g. tokens_per_s.")
@click.option("--prompts", type=NonEmptyPath(dir_okay=False), default=None,
              help="Request set for engines/servers (specpilot.prompts/1 or outputs JSONL); same requests, "
                   "same order, every run.")
@click.option("--tokenizer", default=None, metavar="MODEL", callback=not_blank,
              help="Model whose tokenizer turns text prompts into ids [default: the base engine's model].")
@click.option("--max-new-tokens", type=click.IntRange(1, 100000), default=128, show_default=True,
              help="New tokens per prompt in every timed run of an engine or server (greedy).")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=1, show_default=True,
              help="Servers: requests in flight at once (the same set every run; tokens/s of the whole set).")
@click.option("--runs", callback=_runs, default="auto", show_default=True, metavar="N|auto",
              help="Paired samples, an even number (pairs come in blocks of 2). auto: a pilot of 8 pairs, then "
                   "as many as give 80% power to approve a true 3% gain.")
@click.option("--max-runs", type=click.IntRange(2, MAX_RUNS), default=400, show_default=True,
              help="Cap on the pairs --runs auto may plan (even).")
@click.option("--warmup", type=click.IntRange(0, 1000), default=1, show_default=True,
              help="Unmeasured runs of each system first.")
@click.option("--gpus", default=None, metavar="G0,G1", callback=not_blank,
              help="Shell commands on two GPUs: both at once (CUDA_VISIBLE_DEVICES, or {gpu} in the command), "
                   "then swapped.")
@click.option("--noise", type=float, default=None,
              help="Stock noise as a fraction (0.001 = 0.1%) instead of the A/A split measured in this run.")
@click.option("--changes-output", is_flag=True,
              help="The candidate changes outputs: approve only above 3% (engines/servers: set automatically "
                   "when outputs differ).")
@click.option("--timeout", type=positive(1e7), default=None,
              help="Seconds allowed per run (shell commands) or per request (engines, servers). Shell commands "
                   "default to 10 x the slowest base run so far, at least 60 s (1 hour for the first base run); "
                   "engines and servers to 120 s per request. A command past it is ended with its process group.")
@click.option("--partial", "partial_file", type=NonEmptyPath(dir_okay=False), default=None, metavar="FILE",
              help="Keep the paired samples collected so far here while it runs (removed when it finishes) "
                   "[default: with --out timing.json, timing.partial.json beside it; else specpilot-compare.partial.json].")
@click.option("--resume", "resume_file", type=NonEmptyPath(dir_okay=False), default=None, metavar="FILE",
              help="Continue an interrupted run of the same systems from its partial file (kept up to date).")
@seed_option("the bootstrap interval")
@click.option("--from", "from_file", type=NonEmptyPath(dir_okay=False), default=None, metavar="TIMING.json",
              help="Judge the samples of a stored specpilot.timing/1 file again (no runs; with --noise or "
                   "--changes-output to apply a stricter rule; the bootstrap uses the file's seed unless --seed is "
                   "given).")
@output_options
def command(base, candidate, base_cmd, candidate_cmd, metric, prompts, tokenizer, max_new_tokens, concurrency, runs, max_runs, warmup,
            gpus, noise, changes_output, timeout, partial_file, resume_file, seed, from_file, fmt, out):
    """Time a candidate against a base with paired runs and approve it only when it is faster.

    Runs are interleaved ABBA (same requests, same order), or with --gpus both systems at once on
    two GPUs, then swapped. gain = geometric mean of paired speed ratios; 95% interval by paired
    bootstrap over blocks (a t-interval on log ratios as a check). Approved when both lower bounds
    exceed 1% + 2 x stock noise (A/A split of the base runs), or 3% with --changes-output, and
    at least two blocks (4 paired samples) were measured.
    Exit 0 approved, 1 not approved, 2 bad input, 3 missing environment. The samples collected
    so far are kept in a partial file after every block; after SIGINT/SIGTERM/SIGHUP, a failed or
    timed-out command, rerun with --resume FILE to continue (each command runs in its own process
    group and is ended with it).

    \b
    Examples:
      specpilot compare --base-cmd "python bench.py --old" --candidate-cmd "python bench.py --new"
      specpilot compare --base-cmd "./serve_bench --tree 0" --candidate-cmd "./serve_bench --tree 32" \\
          --metric tokens_per_s --runs 20 --out timing.json --format json
      specpilot compare --base engine:model=smollm2,mode=chain \\
          --candidate engine:model=smollm2,mode=tree,nodes=32 --prompts prompts.jsonl
      specpilot compare --from timing.json --changes-output     # re-judge stored samples
      specpilot compare --base-cmd ... --candidate-cmd ... --resume specpilot-compare.partial.json
    """
    from specpilot.auditors.pairing import (PairRun, RunTimeout, check_metric, check_system, even_pairs,
                                           make_system, paired_compare, parse_gpus, recorded_as)
    from specpilot.auditors.timing import (PARTIAL_SCHEMA, partial_doc, partial_samples,
                                          read_partial, workload_of)
    from specpilot.errors import InputError
    from specpilot.output import progress
    from specpilot.resume import StateKeeper

    if from_file is not None:
        given = [o for o, x in (("--base", base), ("--candidate", candidate), ("--base-cmd", base_cmd),
                                ("--candidate-cmd", candidate_cmd), ("--prompts", prompts), ("--gpus", gpus),
                                ("--resume", resume_file)) if x is not None]
        if given:
            raise InputError(f"--from judges a stored timing file; leave out {', '.join(given)}")
        live = typed("runs", "max_runs", "warmup", "partial_file", "timeout", "max_new_tokens", "concurrency",
                     "tokenizer", "metric")
        if live:
            raise InputError(f"--from judges the stored samples as they are; {', '.join(live)} go with a live run")
        if noise is not None and not 0 <= noise < 1:
            raise InputError(f"--noise {noise}: a fraction in [0, 1), e.g. 0.001 for 0.1%")
        from specpilot.auditors.timing import rejudge

        # the stored run's seed unless one is typed: the same samples then give the same interval
        result = rejudge(from_file, noise=noise, changes_output=changes_output or None,
                         seed=seed if typed("seed") else None)
        emit(report(result), fmt, out, protect=[from_file])
        return 0 if result.verdict.approved else 1

    if (base is None) == (base_cmd is None):
        raise InputError("give exactly one of --base SYSTEM and --base-cmd CMD")
    if (candidate is None) == (candidate_cmd is None):
        raise InputError("give exactly one of --candidate SYSTEM and --candidate-cmd CMD")
    if (base_cmd is None) != (candidate_cmd is None):
        raise InputError("compare like with like: two shell commands, or two systems")
    check_metric(metric, shell=base_cmd is not None)   # before any run
    if base_cmd is not None:   # what engines and servers are sent; a shell command's work is its own
        # typed, not only away from the default: --concurrency 1 or --max-new-tokens 128 does nothing here either
        idle = typed("max_new_tokens", "prompts", "tokenizer", "concurrency")
        if concurrency > 1 and "--concurrency" not in idle:
            idle.append("--concurrency")
        at_once = "--concurrency" in idle
        if idle == ["--concurrency"]:
            what = "--concurrency sets how many requests servers (--base/--candidate) are sent at once"
        else:
            what = (f"{', '.join(idle)} {'sets' if len(idle) == 1 else 'set'} what engines and servers "
                    f"(--base/--candidate) are sent{' and how many at once' if at_once else ''}")
        if idle:
            give = list(dict.fromkeys({"--max-new-tokens": "the limit", "--concurrency": "the concurrency"}
                                      .get(o, "the request set") for o in idle))
            give = give[0] if len(give) == 1 else f"{', '.join(give[:-1])} and {give[-1]}"
            raise InputError(f"{what}; a shell command does its own work, so {'it' if len(idle) == 1 else 'they'} "
                             f"would change nothing: give {give} in --base-cmd and --candidate-cmd")
    if noise is not None and not 0 <= noise < 1:
        raise InputError(f"--noise {noise}: a fraction in [0, 1), e.g. 0.001 for 0.1%")
    # only the auto plan uses --max-runs: an odd cap beside a fixed --runs is not an error
    even_pairs("--runs", runs) if runs is not None else even_pairs("--max-runs", max_runs)
    if gpus is not None and base_cmd is None:   # before the GPUs are looked for: the option is the error
        raise InputError("--gpus runs shell commands on two GPUs; for engines/servers start each on its own GPU")
    gpu_pair = parse_gpus(gpus)
    from specpilot.models import model_inputs

    inputs = [p for p in (prompts, resume_file) if p] + model_inputs(tokenizer)
    vocabs = {}
    for role, spec in (("--base", base), ("--candidate", candidate)):
        if spec and spec.strip().startswith("engine"):   # refused before the base's model loads
            from specpilot.engine.api import EngineSpec, model_vocab

            try:
                parsed = EngineSpec.parse(spec, strict=True)
                vocabs[role] = model_vocab(parsed)
            except InputError as e:
                raise InputError(f"{role} {spec}: {e}") from None
            inputs += parsed.inputs()
    if out:   # an input named as --out (a prompts file, an engine's model) is refused now, not after every run
        from specpilot.fileio import check_output_path

        check_output_path(out, "--out", protect=inputs)
    if len(set(vocabs.values())) > 1:   # one request set, one tokenizer: the other engine's ids are not its text
        raise InputError(f"--base {base} has a vocabulary of {vocabs['--base']} tokens, --candidate {candidate} "
                         f"{vocabs['--candidate']}: compare runs both on the same token ids, so they must share the "
                         "tokenizer")
    prompt_rows = None
    if prompts:
        from specpilot.auditors.outputs import read_prompts_tokenized

        if tokenizer is None and base and base.strip().startswith("engine"):
            from specpilot.engine.api import EngineSpec

            tokenizer = EngineSpec.parse(base).model
        from specpilot.auditors.systems import check_engine_prompts

        prompt_rows = read_prompts_tokenized(prompts, tokenizer)
        check_engine_prompts([(f"{role} {spec}", spec) for role, spec in (("--base", base), ("--candidate", candidate))],
                             prompt_rows, max_new_tokens)
    elif base_cmd is None:
        raise InputError("timing engines or servers needs --prompts FILE (the request set)")
    workload = workload_of(prompt_rows, max_new_tokens, concurrency)
    schedule = f"GPU swap on {gpu_pair[0]},{gpu_pair[1]}" if gpu_pair else "ABBA"
    if resume_file:   # refused before any system starts: the file says how many pairs it holds
        held = partial_samples(resume_file)
        cap, option = (runs, "--runs") if runs is not None else (max_runs, "--max-runs")
        if held > cap:  # refused, not cut: which samples to drop is not ours to choose
            raise InputError(f"--resume {resume_file}: it already holds {held} paired samples, more than "
                             f"{option} {cap}; resume with {option} {held} or more")
        # of these systems, then of this request set: checked before either one starts (an engine's
        # model loads for seconds)
        (base_label, metric_label), (cand_label, _) = (recorded_as(base, base_cmd, metric),
                                                       recorded_as(candidate, candidate_cmd, metric))
        resumed = read_partial(resume_file, base=base_label, candidate=cand_label, metric=metric_label,
                               schedule=schedule, workload=workload)
    keeper = StateKeeper(partial_file or resume_file or _default_partial(out), "--partial",
                         what=lambda doc: f"{doc['runs']} paired samples", resuming=resume_file,
                         schema=PARTIAL_SCHEMA)
    keeper.check({"--out": out, "--prompts": prompts})
    if base_cmd is None:   # both systems' specs, before the base's model loads
        for role, spec in (("base", base), ("candidate", candidate)):
            check_system(spec, role, metric=metric, prompts=prompt_rows, max_new_tokens=max_new_tokens,
                         concurrency=concurrency)
    limit = RunTimeout(timeout)  # both shell commands share it: derived from the base runs
    a = make_system(base, base_cmd, "base", metric=metric, timeout=limit, prompts=prompt_rows,
                    max_new_tokens=max_new_tokens, concurrency=concurrency)
    try:
        b = make_system(candidate, candidate_cmd, "candidate", metric=metric, timeout=limit, prompts=prompt_rows,
                        max_new_tokens=max_new_tokens, concurrency=concurrency)
    except BaseException:
        a.close()
        raise
    bar = progress(total=runs or 8, desc="paired runs", unit="pair")
    try:
        prior = PairRun(*resumed) if resume_file else None

        def keep(run):
            keeper.save(partial_doc(a.label, b.label, a.metric, a.unit, a.higher_is_better, schedule, run.samples,
                                    run.aa, workload, run.outputs))

        if prior:
            keep(prior)  # the partial file holds them from now on, wherever it is

        def set_total(n):
            bar.total = n
            bar.refresh()

        result = paired_compare(a, b, runs=runs, warmup=warmup, gpus=gpu_pair, noise=noise,
                                changes_output=changes_output, max_runs=max_runs, seed=seed,
                                tick=bar.update, set_total=set_total, prior=prior, on_block=keep)
    except BaseException as e:
        keeper.note(e)
        raise
    finally:
        bar.close()
        a.close()
        b.close()
    emit(report(result), fmt, out, protect=inputs)
    keeper.finished()
    return 0 if result.verdict.approved else 1


def _default_partial(out: str | None) -> str:
    if out:
        from pathlib import Path

        p = Path(out)
        return str(p.with_suffix(".partial.json")) if p.suffix else f"{out}.partial.json"
    return "specpilot-compare.partial.json"


def report(result) -> Report:
    v = result.verdict
    pct = lambda r: f"{(r - 1) * 100:+.2f}%"  # noqa: E731
    rows = [
        ["gain (geometric mean of paired speed ratios)", f"{v.gain:.4f}x ({pct(v.gain)})"],
        ["95% CI, paired bootstrap over blocks", f"[{v.ci_low:.4f}, {v.ci_high:.4f}]"],
        ["95% CI, t on log ratios (check)", f"[{v.t_ci[0]:.4f}, {v.t_ci[1]:.4f}]"],
        ["stock noise", f"{v.noise * 100:.3f}% ({v.noise_source})"],
        ["threshold on the lower bound", f"{v.threshold * 100:+.2f}%" + ("  (changes output)" if result.changes_output else "")],
        ["pairs / blocks", f"{v.pairs} / {v.blocks} ({result.schedule}, warm-up {result.warmup})"],
        ["sd of log ratio per pair", f"{v.sd_log_ratio * 100:.3f}%"],
    ]
    if result.plan:
        p = result.plan
        rows.append(["run count (power plan)", f"{p['pairs']} pairs for {p['power'] * 100:.0f}% power at a true "
                     f"{(p['target_gain'] - 1) * 100:.0f}% gain" + ("  (capped by --max-runs)" if p.get("capped") else "")])
    from specpilot.auditors.timing import median

    unit = result.unit
    med_b = median(s.base for s in result.samples)
    med_c = median(s.candidate for s in result.samples)
    rows.insert(0, ["median base / candidate", f"{med_b:.6g} / {med_c:.6g} {unit}"])
    lines = [f"verdict: {v.verdict.upper()}: {v.reason}"]
    if result.extra.get("changes_output_reason"):
        lines.insert(0, f"note: {result.extra['changes_output_reason']}")
    return Report(data=result.to_json(), sections=[Section(f"{result.candidate}  vs  {result.base}",
                                                           ["measure", "value"], rows)], lines=lines)
