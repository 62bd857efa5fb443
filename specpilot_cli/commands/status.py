"""``specpilot status``: what is active in an SGLang environment and whether it still matches."""

from __future__ import annotations

import click

from specpilot.output import Report, Section, emit, output_options


@click.command("status")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Interpreter of the SGLang environment (default: this one).")
@output_options
def command(python, fmt, out):
    """Show the active bundles in the environment of --python and check they still match.

    Re-runs the static check of every hook target against the installed SGLang and compares the
    installed version, the target files and the bundle modules with what was recorded at apply.
    Exit 0 when nothing is active or everything matches, 1 when the activation no longer matches
    (apply again or revert).

    \b
    Example:
      specpilot status --python /opt/sglang/bin/python
    """
    from specpilot.bundles.activation import status

    res = status(python)
    act = res.activation
    data = {"schema": "specpilot.status/1", "activation_path": res.path, "active": act is not None,
            "matches": res.matches, "problems": res.problems,
            "sglang": {"version": res.env.sglang_version, "package": res.env.sglang_package},
            "specpilot_installed": res.env.specpilot_version, "activation": act,
            "checks": [c.__dict__ for c in res.checks]}
    if act is None:
        if res.env.sglang_package is None:
            sglang = "SGLang is not installed there"
        else:
            sglang = f"SGLang {res.env.sglang_version or '(unknown version)'} runs stock"
        lines = [f"no bundles active ({res.path} absent); {sglang}"]
        emit(Report(data=data, lines=lines), fmt, out)
        return 0
    sections = [Section("active", ["bundles", "applied", "SGLang then", "SGLang now", "matches"],
                        [[", ".join(act.get("closure", [])), act.get("applied_at"), act.get("sglang", {}).get("version"),
                          res.env.sglang_version, "yes" if res.matches else "NO"]]),
                Section("hook targets", ["target", "kind", "check"],
                        [[c.target, c.kind, "ok" if c.ok else "FAIL"] for c in res.checks])]
    lines = [f"problem: {p}" for p in res.problems] or ["the activation matches the installed SGLang"]
    lines += ["", "launch with:", f"  {act.get('launch')}"]
    emit(Report(data=data, sections=sections, lines=lines, title="specpilot status"), fmt, out)
    return 0 if res.matches else 1
