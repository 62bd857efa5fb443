"""``specpilot apply``: activate mechanism bundles in an SGLang environment."""

from __future__ import annotations

import click

from specpilot import signals
from specpilot.output import Report, Section, emit, output_options
from specpilot.options import not_blank


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 4] + " ...)"


@click.command("apply")
@click.argument("bundles")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Interpreter of the SGLang environment (default: this one).")
@click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
              help="Set a bundle variant (see 'specpilot memory show ID'); repeatable, each name once. VALUE "
                   "is a decimal integer or number (24, 2.5), true/false, a list [16, 12, 8] or text. A setting "
                   "that has no effect on the drafter (node_budget on DFlash2) gets a warning on stderr.")
@click.option("--drafter", type=click.Choice(["eagle", "eagle3", "dflash", "dflash2", "dspark"]), default=None,
              help="The server's drafter: bundles that do not work with it are refused, and the launch "
                   "command gets the flags right for it (e.g. the tree's node budget only for EAGLE). "
                   "Default: the only drafter every bundle named accepts (batching: dspark; "
                   "tree,lattice-trace: dflash2), a note says so; none when several fit (tree alone: "
                   "eagle, eagle3 or dflash2), and drafter-specific flags are left out.")
@click.option("--model", "model", default="MODEL", metavar="PATH", callback=not_blank,
              help="Model path to put in the printed launch command.")
@click.option("--force", is_flag=True, help="Apply to an SGLang version the bundles were not checked against.")
@click.option("--experimental", is_flag=True, help="Allow bundles whose memory status is experimental.")
@click.option("--dry-run", is_flag=True, help="Check everything and print the launch command; write nothing.")
@output_options
def command(bundles, python, settings, drafter, model, force, experimental, dry_run, fmt, out):
    """Activate BUNDLES (comma-separated, e.g. batching,w12) in an SGLang installation.

    Finds SGLang in the environment of --python without importing it, refuses an unsupported
    version (exit 3; --force overrides), checks statically (AST of the installed files) that
    every hook target exists with a compatible signature, checks that SpecPilot is installed
    there, then writes the activation atomically into that environment's site-packages and
    prints the launch command. Bundles that cannot run together are refused with the reason
    (each names the drafters it works with, e.g. tree a DFlash2 or EAGLE drafter, tlv a plain
    DFlash one, batching DSpark). Bundles that apply together but leave one of them idle (tree
    with lattice-trace: the trace records stock's chain, so the tree verify stays off) get a
    warning on stderr, as does a --set that does nothing on the drafter; the exit status stays 0.
    SGLang's files are never edited; 'specpilot revert' undoes it.

    \b
    Example:
      specpilot apply tree --drafter eagle --python /opt/sglang/bin/python --set node_budget=32
    """
    from specpilot.bundles.activation import apply

    res = apply(bundles, python=python, force=force, experimental=experimental, settings=settings,
                dry_run=dry_run, model=model, drafter=drafter, out=out, fmt=fmt)
    if res.interrupted:   # the signal came once the activation was in place: applied all the same
        click.echo(f"specpilot: {res.interrupted} came after {res.path} was written; the activation is in place",
                   err=True)
    try:
        _report(res, bundles, dry_run, fmt, out)
    except signals.Interrupted as e:   # the activation is in place: a signal now does not undo the apply
        if dry_run:
            raise
        click.echo(f"specpilot: interrupted by {e.name}; {res.path} is written (the activation is in place), "
                   "its report was not", err=True)
    return 0


def _report(res, bundles, dry_run, fmt, out) -> None:
    act = res.activation
    rows = [[c.target, c.kind, "ok" if c.ok else "FAIL", _short(c.signature or c.found or "-")] for c in res.checks]
    data = {"schema": "specpilot.apply/1", "dry_run": dry_run, "activation_path": res.path,
            "previous": res.previous, "activation": act, "swept": res.swept,
            "checks": [c.__dict__ for c in res.checks], "notes": res.notes, "warnings": res.warnings}
    verb = "would write" if dry_run else "wrote"
    lines = [f"SGLang {res.env.sglang_version} at {res.env.sglang_package}"
             + (" (forced: not a checked version)" if act["sglang"]["forced"] else ""),
             f"{verb} {res.path}: {', '.join(act['closure'])}"
             + (f" (replaces {', '.join(res.previous)})" if res.previous else ""),
             "", "launch with (add your usual drafter and parallelism flags)"
             + (f", flags for {act['drafter']}:" if act.get("drafter") else ":"), f"  {res.launch}"]
    if res.notes:
        lines += [""] + [f"note: {n}" for n in res.notes]
    settings_rows = [[k, v] for k, v in act["settings"].items()]
    sections = [Section("hook targets and symbols (static check)", ["target", "kind", "check", "installed"], rows)]
    if settings_rows:
        sections.append(Section("variants", ["name", "value"], settings_rows))
    for w in res.warnings:
        click.echo(f"specpilot: warning: {w}", err=True)
    emit(Report(data=data, sections=sections, lines=lines, title=f"specpilot apply {bundles}"), fmt, out,
         protect=[res.path])
