"""``specpilot revert``: remove the activation from an SGLang environment."""

from __future__ import annotations

import click

from specpilot.output import Report, emit, output_options


@click.command("revert")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Interpreter of the SGLang environment (default: this one).")
@output_options
def command(python, fmt, out):
    """Deactivate every SpecPilot bundle in the environment of --python.

    Removes the activation file 'specpilot apply' wrote (and any temporary file an interrupted
    apply left), so the environment's files are exactly as before the apply; a malformed
    activation is removed too. Running it when nothing is active is not an error. A symbolic
    link, folder or other non-file at the activation path is refused (exit 2: remove it by
    hand); a site-packages it cannot write is exit 3.

    \b
    Example:
      specpilot revert --python /opt/sglang/bin/python
    """
    from specpilot.bundles.activation import revert

    res = revert(python, out=out)
    data = {"schema": "specpilot.revert/1", "activation_path": res.path, "removed": res.removed, "swept": res.swept}
    if res.removed is None:
        lines = [f"nothing was active ({res.path} absent)"]
    else:
        lines = [f"removed {res.path}: {', '.join(res.removed)} no longer active; SGLang runs stock"]
    if res.swept:
        lines.append(f"also removed {len(res.swept)} leftover temporary file(s) of an interrupted apply")
    emit(Report(data=data, lines=lines), fmt, out, protect=[res.path])
    return 0
