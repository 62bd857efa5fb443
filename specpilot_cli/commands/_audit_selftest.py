"""``specpilot audit selftest``: the paper's validation of the audit on the real SmolLM2 (a planted
logit bias must be rejected, lossless systems pass)."""

from __future__ import annotations

import click

from specpilot.auditors.prompts_builtin import PROMPTS as BUILTIN_PROMPTS
from specpilot.errors import InputError
from specpilot.options import FiniteRange, device_option, seed_option, NonEmptyPath
from specpilot.output import Report, Section, emit, fmt_num, output_options, progress

from specpilot.fileio import refuse_inside

from .audit import _check_kept_outputs, _pct, audit_report


class _PromptCount(click.IntRange):
    """A count of built-in prompts; a file name (what --prompts is in every other verb) is told so."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
            self.fail(f"{value!r}: the self-test runs on its built-in prompts; give how many of them to use "
                      f"({self.min}-{self.max}), not a prompts file", param, ctx)
        return super().convert(value, param, ctx)


@click.command("selftest")
@click.option("--n-prompts", "--prompts", "n_prompts", type=_PromptCount(1, len(BUILTIN_PROMPTS)), default=24,
              show_default=True, help="Built-in prompts to use (a count: --prompts FILE of the other verbs is a file).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True,
              help="New tokens per prompt of every system the self-test runs.")
@click.option("--repeats", type=click.IntRange(1), default=6, show_default="6, at most --n-prompts",
              help="Disjoint prompt subsets audited separately for the false-reject and detection rates.")
@click.option("--biases", default="2,1,0.5,0.25,0.125", show_default=True,
              help="Logit biases of the defective system, largest first.")
@click.option("--bias-fraction", type=FiniteRange(0, 1, min_open=True), default=0.1, show_default=True,
              help="Fraction of the vocabulary whose logits get the bias.")
@click.option("--engine-prompts", type=int, default=4, show_default="4, at most --n-prompts",
              help="Prompts on which the embedded engine's chain and tree systems are run and audited (0: none).")
@device_option("cpu, cuda or cuda:N (default: cuda when present).")
@seed_option("the random prompts and biases")
@click.option("--save-outputs", "save_dir", type=NonEmptyPath(file_okay=False), default=None,
              help="Also write every system's outputs JSONL to this folder (to re-audit them with 'specpilot audit').")
@output_options
def selftest_cmd(n_prompts, max_new_tokens, repeats, biases, bias_fraction, engine_prompts, device, seed, save_dir,
                 fmt, out):
    """The paper's validation on the real SmolLM2: a planted logit bias must be rejected, lossless systems pass.

    Reports the full audit, the false-reject rate over repeated lossless audits (disjoint prompt
    subsets) and the detection rate as the bias shrinks. Exit 1 when the largest bias is not
    rejected or a lossless system is rejected on the full prompt set.
    """
    from specpilot.auditors.selftest import check_options, run_selftest
    from specpilot.options import typed

    given = typed("repeats", "engine_prompts")
    # the defaults follow a smaller --n-prompts; values typed that do not fit it are named by
    # run_selftest, every one at once, before the scorer loads
    if "--repeats" not in given:
        repeats = max(1, min(repeats, n_prompts))
    if "--engine-prompts" not in given:
        engine_prompts = max(0, min(engine_prompts, n_prompts))
    bias_list = _float_list(biases, "--biases")
    check_options(n_prompts, max_new_tokens, repeats, bias_list, bias_fraction, engine_prompts)   # before any load
    refuse_inside(out, save_dir, "--save-outputs", "where the outputs are saved")   # every system's, selftest's
    if save_dir is not None:   # the folder made, or refused, before any system runs (as audit check does)
        from specpilot.auditors.systems import default_save_path

        default_save_path(save_dir, "system")
    res = run_selftest(n_prompts=n_prompts, max_new_tokens=max_new_tokens, repeats=repeats, biases=bias_list,
                       bias_fraction=bias_fraction, engine_prompts=engine_prompts, device=device, seed=seed,
                       progress=progress, save_dir=save_dir,
                       check_save=lambda path, prompts, option: _check_kept_outputs(path, prompts, save_dir, None,
                                                                                    max_new_tokens, option))
    emit(selftest_report(res), fmt, out)
    return 0 if res.ok else 1


def _float_list(text: str, name: str) -> list[float]:
    vals = []
    parts = [p.strip() for p in str(text).split(",")]
    if any(not p for p in parts) and any(parts):   # as every other list option: "2,,1" is a slip, not 2,1
        raise InputError(f"{name} {text}: an empty value between commas")
    for part in parts:
        if not part:
            continue
        try:
            vals.append(float(part))
        except ValueError:
            raise InputError(f"{name}: {part!r} is not a number (e.g. {name} 4,2,1,0.5)") from None
    if not vals:
        raise InputError(f"{name}: give at least one value")
    return vals


def _environment() -> dict:
    """Facts a measured figure needs beside it: those every benchmark result names
    (:func:`specpilot.machine.run_facts`), with the Transformers version and torch's CPU threads."""
    from specpilot.machine import run_facts

    env = {"benchmark": "audit_selftest", **run_facts()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception:
        env["transformers"] = None
    try:
        import torch

        env["cpu_threads"] = torch.get_num_threads()
    except Exception:
        pass
    return env


def selftest_report(res) -> Report:
    from dataclasses import asdict

    full = audit_report(res.full, None)
    eng = audit_report(res.engine_audit, None) if res.engine_audit is not None else None
    rows = [asdict(r) for r in res.repeated]
    data = {
        "schema": "specpilot.audit-selftest/1",
        **_environment(),
        "cpu": res.cpu,
        "device": res.device,
        "ok": res.ok,
        "problems": res.problems,
        "model": res.model,
        "prompts": res.prompts,
        "max_new_tokens": res.max_new_tokens,
        "bias_fraction": res.bias_fraction,
        "false_reject_rate": res.false_reject_rate,
        "false_reject_audits": res.false_reject_audits,
        "detection_rate": res.detection,
        "repeats": res.repeats,
        "prompts_per_repeat": res.prompts_per_repeat,
        "rows": rows,
        "full_audit": full.data,
        "engine_prompts": res.engine_prompts,
        "engine_systems": res.engine_systems,
        "engine_note": res.engine_note,
        "engine_audit": eng.data if eng else None,
        "generation_s": res.generation_s,
    }
    rep_rows = [[r.system, r.kind, r.audits, r.rejected, f"{100 * r.rate:.0f}%", _pct(r.mean_mismatch_rate),
                 fmt_num(r.mean_events)] for r in res.repeated]
    sections = [Section("Full audit, all prompts: " + s.title, s.headers, s.rows) for s in full.sections]
    lines = [ln for ln in full.lines if not ln.startswith("verdict:")]
    if eng is not None:
        sections += [Section(f"Embedded engine, first {res.engine_prompts} prompts: " + s.title, s.headers, s.rows)
                     for s in eng.sections[:1]]
        lines += [f"engine audit: delta = {res.engine_audit.delta:g}, verdict "
                  f"{res.engine_audit.verdict.upper()} (the bias row is the positive control)"]
    sections.append(Section(f"Repeated audits ({res.repeats} disjoint subsets of {res.prompts_per_repeat} prompts)",
                            ["system", "kind", "audits", "rejected", "reject rate", "mean mismatch rate",
                             "mean events"], rep_rows))
    lines.append("")
    fr = sum(r.rejected for r in res.repeated if r.kind == "lossless")
    lines.append(f"false-reject rate of lossless systems: {fr}/{res.false_reject_audits} audits "
                 f"({100 * res.false_reject_rate:.1f}%) on {res.repeats} disjoint subsets of "
                 f"{res.prompts_per_repeat} prompts")
    lines.append("detection rate by bias: " + ", ".join(f"bias {b}: {100 * v:.0f}%" for b, v in res.detection.items()))
    if res.engine_note:
        lines.append(f"engine systems: {res.engine_note}")
    lines.append(f"model {res.model} on {res.device} ({res.cpu}); {res.prompts} chat prompts x up to "
                 f"{res.max_new_tokens} new tokens; bias on {100 * res.bias_fraction:g}% of the vocabulary")
    for p in res.problems:
        lines.append(f"PROBLEM: {p}")
    lines.append(f"selftest: {'OK' if res.ok else 'FAILED'}")
    return Report(data=data, title="Audit self-test on SmolLM2-135M-Instruct (paper 3.4)", sections=sections,
                  lines=lines)
