"""``specpilot round``: the paper's procedure as one command (re-measure, model, propose, approve, remember)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from specpilot.errors import InputError
from specpilot.options import seed_option, typed, NonEmptyPath, not_blank
from specpilot.output import Report, Section, emit, fmt_num, output_options, progress


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise InputError("--candidates: name at least one candidate, e.g. --candidates chain,tree")
    if not all(names):
        raise InputError(f"--candidates: an empty name between commas in {text!r}")
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup:
        raise InputError(f"--candidates: {dup!r} is named twice in {text!r}")
    return names


def _warn_short_prompts(path: str, n_prompts: int) -> None:
    """--n-prompts above what the --prompts file holds: the round runs the file's prompts (one line)."""
    from specpilot.auditors.outputs import read_prompt_rows

    try:
        rows = read_prompt_rows(path)
    except InputError:   # the round's own checks say what is wrong with the file
        return
    if rows and n_prompts > len(rows):
        click.echo(f"specpilot: warning: --n-prompts {n_prompts}: {path} holds {len(rows)} prompt"
                   f"{'s' if len(rows) > 1 else ''}; the round runs {'those ' + str(len(rows)) if len(rows) > 1 else 'it'}",
                   err=True)


@click.command("round")
@click.argument("deployment", required=False, callback=not_blank)
@click.option("--budget", "budget", type=float, default=None, metavar="MINUTES",
              help="Minutes the round may take (default 20); runs are planned to fit where they can (--dry-run says "
                   "when the smallest plan does not) and a stage that runs out stops cleanly, recording what it "
                   "skipped.")
@click.option("--out-dir", "out_dir", type=NonEmptyPath(file_okay=False), default="specpilot-round", show_default=True,
              help="Folder for the round's files (must not exist or be empty).")
@click.option("--resume", "resume_dir", type=NonEmptyPath(file_okay=False), default=None, metavar="DIR",
              help="Continue the round in DIR where it stopped (with --budget: that many more minutes).")
@click.option("--dry-run", is_flag=True, help="Show the plan and its time estimate; run nothing.")
@click.option("--prompts", "prompts", type=NonEmptyPath(dir_okay=False), default=None,
              help="Prompts (specpilot.prompts/1 text or token ids, or one per line); default: built-in chat prompts.")
@click.option("--n-prompts", type=int, default=None, help="Prompts per timed run (default: planned from the budget).")
@click.option("--max-new-tokens", type=int, default=None, help="New tokens per prompt (default: planned).")
@click.option("--candidates", "candidates", default=None, metavar="A,B",
              help="Only these candidates (chain, tree, w12, no-op, ...).")
@click.option("--control", is_flag=True, help="Add a no-op candidate (the current system loaded again): it must be refused.")
@click.option("--scorer", default=None, callback=not_blank,
              help="Audit scorer (smollm2, tiny, tiny-hybrid, a HF folder, a .gguf); default: the stock "
                   "engine's target with an FP32 LM head.")
@click.option("--memory-dir", type=NonEmptyPath(file_okay=False), default=None,
              help="Memory entries to propose from (default: the packaged memory).")
@click.option("--records", "records_dir", type=NonEmptyPath(file_okay=False), default=None,
              help="Deployment records folder (default: $SPECPILOT_RECORDS or ~/.cache/specpilot/deployments).")
@click.option("--fresh", is_flag=True, help="Start from DEPLOYMENT even when its record has a later system.")
@click.option("--no-remember", "no_remember", is_flag=True, help="Do not write the deployment record.")
@seed_option("the bootstrap intervals and of token-id prompts")
@output_options
def command(deployment, budget, out_dir, resume_dir, dry_run, prompts, n_prompts, max_new_tokens, candidates, control,
            scorer, memory_dir, records_dir, fresh, no_remember, seed, fmt, out):
    """Run one round of the paper's procedure on DEPLOYMENT and write its report.

    DEPLOYMENT is an embedded-engine spec (engine:model=smollm2,mode=ar,threads=1; 'engine' or
    nothing: the real SmolLM2 on the CPU, random Llama-3.1-8B shapes on a GPU) or an SGLang
    deployment file (specpilot.deployment/1 YAML: docs/round.md).

    \b
    1. re-measure: T_AR and T_step(N), a profile of the decode steps (GPU), tau(N) by replay
    2. model: the three factors of the ceiling, the largest, tau(N)/c(N) per node budget
    3. propose: memory mechanisms that fit, retuned here; the others listed with the reason
    4. approve: paired runs against the current system + token-forcing audit against stock
    5. remember: the deployment record; the next round starts from its final system
    Every stage writes into --out-dir; report.md and report.html render it (specpilot report DIR).

    \b
    Examples:
      specpilot round engine:model=smollm2,mode=ar,threads=1 --budget 20 --out-dir smollm2-round
      specpilot round --dry-run
      specpilot round --resume smollm2-round --budget 5
    """
    from specpilot.auditors.round import RoundConfig, plan_round, run_round

    if n_prompts is not None and n_prompts < 1:
        raise InputError("--n-prompts must be >= 1")
    if max_new_tokens is not None and max_new_tokens < 2:   # the first comes from the prefill: no step to record
        raise InputError(f"--max-new-tokens {max_new_tokens}: a round needs at least 2 (the first token comes from "
                         "the prefill; the lattice and the timings are of the steps after it)")
    cfg = RoundConfig(deployment=deployment, out_dir=resume_dir or out_dir,
                      budget_min=20.0 if budget is None else budget, prompts=prompts,
                      n_prompts=n_prompts, max_new_tokens=max_new_tokens, candidates=_names(candidates),
                      control=control, scorer=scorer, memory_dir=memory_dir, records_dir=records_dir, fresh=fresh,
                      remember=not no_remember, seed=seed)
    if n_prompts and prompts and not resume_dir:
        _warn_short_prompts(prompts, n_prompts)
    inputs = _round_inputs(cfg, resume_dir)
    if out:   # a round's own files, its record and memory are inputs: refused before the round runs
        from specpilot.auditors.round.remember import default_records_dir
        from specpilot.fileio import check_output_path, refuse_inside

        if not dry_run:   # files the round is yet to write there (its stage files, a first record) do not exist yet
            refuse_inside(out, cfg.out_dir, "the round's folder", "which the round writes")
            if cfg.remember:
                refuse_inside(out, cfg.records_dir or default_records_dir(), "the deployment records folder",
                              "which the round writes")
        check_output_path(out, "--out", protect=inputs)
    if dry_run:
        if resume_dir:
            raise InputError("--dry-run plans a new round; leave out --resume")
        plan = plan_round(cfg)
        total = sum(s["seconds"] for s in plan["stages"])
        lines = [f"deployment: {plan['deployment']}", f"starts from: {plan['start']}"
                 + (f" (record {plan['record']})" if plan.get("record") else ""),
                 f"decode speed: {fmt_num(plan['tokens_per_s'])} tokens/s ({plan['tokens_per_s_source']})"
                 if plan["tokens_per_s"] is not None else f"decode speed: {plan['tokens_per_s_source']}",
                 f"estimated time: the {plan['budget_s'] / 60:.1f} min budget (the approve stage takes what the "
                 "others leave)" if plan.get("approve_takes_the_rest")
                 else f"estimated time: {total / 60:.1f} min of the {plan['budget_s'] / 60:.1f} min budget"]
        need = max(total, plan.get("every_candidate_s") or 0.0)
        if need > plan["budget_s"]:
            lines.append(f"warning: the smallest plan takes {need / 60:.1f} min, more than the "
                         f"{plan['budget_s'] / 60:.1f} min budget: the stages that run out stop and record what they "
                         f"skip (--budget {math.ceil(need / 60)} runs it all)")
        lines += [f"note: {x}" for x in plan.get("notes") or []]
        lines += [f"skipped for the budget: {x['id']}: {x['reason']}" for x in plan.get("over_budget") or []]
        lines += [f"not runnable here: {x['id']}: {x['reason']}" for x in plan["not_runnable"]]
        lines += [f"not planned: {x}: the current system's family; the round proposes it only when its retuning "
                  "changes the current system's size" for x in plan.get("current_family") or []]
        emit(Report(data=plan, title="specpilot round --dry-run: the plan",
                    sections=[Section(None, ["stage", "estimated s", "work"],
                                      [[s["stage"], s["seconds"], s["work"]] for s in plan["stages"]])],
                    lines=lines), fmt, out, protect=inputs)
        return 0
    if resume_dir and deployment:
        raise InputError("--resume continues the round in DIR with its own deployment; leave out DEPLOYMENT")
    if resume_dir:   # the round goes on as it was set up: a new setting would be silently ignored
        given = typed("prompts", "n_prompts", "max_new_tokens", "candidates", "scorer", "memory_dir", "records_dir",
                      "control", "fresh", "no_remember", "seed", "out_dir")
        if given:
            raise InputError(f"--resume continues the round in {resume_dir} as it was set up; leave out "
                             f"{', '.join(given)} (or start a new round)")

    def notify(stage, message):
        click.echo(f"[{stage}] {message}", err=True)

    res = run_round(cfg, resume=bool(resume_dir), budget_min=budget if resume_dir else None,
                    progress=progress, notify=notify)
    if res.complete:   # nothing is rewritten; the summary is printed as a run prints it (tools read --format json)
        click.echo(f"specpilot: the round in {res.dir} is complete: nothing to resume (its report: specpilot report "
                   f"{res.dir}; a new round: specpilot round)", err=True)
        md, html = (p if p.is_file() else None for p in (res.dir / "report.md", res.dir / "report.html"))
    else:
        from specpilot.reports.round_report import write_report

        try:
            md, html = write_report(res.dir)
        except ImportError as e:  # the round's files are complete; the report can be rendered elsewhere
            md = html = None
            click.echo(f"specpilot: warning: report not rendered ({e}); run 'specpilot report {res.dir}' where "
                       "matplotlib is installed", err=True)
        except KeyboardInterrupt as e:   # the stages' files are all written: only the report is not
            e.add_note(f"the round's files are in {res.dir}; its report is not written: specpilot report {res.dir} "
                       "writes it")
            raise
    st = res.state
    rows = [[d.id, d.memory or "-", d.verdict.upper(), fmt_num((d.timing or {}).get("gain")),
             ((d.audit or {}).get("verdict") or "-").upper(), d.reason] for d in res.decisions]
    stages = [[s, v["status"], round(v.get("seconds", 0.0), 1), "; ".join(v.get("skipped") or []) or "-"]
              for s, v in st["stages"].items()]
    data = {"schema": "specpilot.round-summary/1", "dir": str(res.dir), "deployment": st["deployment"],
            "start": st["start"], "final": st.get("final"), "stages": st["stages"],
            # each decision's samples stay in approve/decisions.json; the gain and audit verdict the table shows
            "decisions": [d.to_json() | {"timing": None, "audit": None, "gain": (d.timing or {}).get("gain"),
                                         "audit_verdict": (d.audit or {}).get("verdict")} for d in res.decisions],
            "record": res.record, "report": {"markdown": md and str(md), "html": html and str(html)},
            "stopped": st.get("stopped")}
    lines = [f"final system: {st.get('final') or st.get('current')}"] + ([f"report: {md} and {html}"] if md else []) \
        + ([f"deployment record: {res.record}"] if res.record else [])
    if st.get("stopped"):
        lines.append(f"stopped: {st['stopped']} (specpilot round --resume {res.dir} --budget MINUTES continues)")
    from specpilot.auditors.round.plan import cut_for_time, unjudged_for_time

    cut = cut_for_time(st)
    if cut:   # the round finished without them: more time in a resume does not bring them back
        lines.append(f"cut for time: the measure stage skipped {'; '.join(cut)} (a new round with a larger --budget "
                     "measures them)")
    if not st.get("stopped") and unjudged_for_time(data["decisions"]):
        lines.append(f"out of budget: not judged {', '.join(unjudged_for_time(data['decisions']))} (specpilot round "
                     f"--resume {res.dir} --budget MINUTES judges them)")
    emit(Report(data=data, title=f"Round in {res.dir}: {st['deployment']}",
                sections=[Section("stages", ["stage", "status", "seconds", "skipped"], stages),
                          Section("candidates", ["candidate", "memory", "verdict", "gain", "audit", "why"], rows)],
                lines=lines), fmt, out, protect=inputs + ([res.record] if res.record else []))
    return 0


def _round_inputs(cfg, resume_dir: str | None) -> list[str]:
    """What a round reads and keeps, which its --out must not replace: the round's folder, the
    deployment records and memory folders (a resumed round's own, as its round.json names them),
    the prompts, a deployment file and the models it names by path."""
    from specpilot.auditors.round.remember import default_records_dir
    from specpilot.bundles.memory import MEMORY_DIR
    from specpilot.models import model_inputs

    config = {}
    if resume_dir:
        try:   # a damaged round.json is the round's own error to report, with its message
            config = json.loads((Path(resume_dir) / "round.json").read_text()).get("config") or {}
        except (OSError, ValueError, AttributeError):
            config = {}
    config = config if isinstance(config, dict) else {}
    out = [cfg.out_dir, cfg.records_dir or default_records_dir(), cfg.memory_dir or MEMORY_DIR]
    out += [v for v in (config.get("records_dir"), config.get("memory_dir"), config.get("prompts"), cfg.prompts)
            if isinstance(v, str) and v]
    dep = cfg.deployment or config.get("deployment")
    if isinstance(dep, str) and dep:
        if Path(dep).is_file():
            from specpilot.auditors.round.deployment_file import named_files

            out += [dep] + named_files(Path(dep))
        else:
            from specpilot.engine.spec import EngineSpec

            out += EngineSpec.inputs_of(dep)
    for scorer in (cfg.scorer, config.get("scorer")):
        out += model_inputs(scorer) if isinstance(scorer, str) else []
    return [str(p) for p in out]
