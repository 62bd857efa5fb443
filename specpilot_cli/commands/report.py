"""``specpilot report``: render a round again (Markdown and one self-contained HTML page)."""

from __future__ import annotations

import click

from specpilot.options import NonEmptyPath
from specpilot.output import Report, Section, emit, output_options


@click.command("report")
@click.argument("round_dir", type=NonEmptyPath(file_okay=False))
@output_options
def command(round_dir, fmt, out):
    """Render the round in ROUND_DIR as report.md (plots in report/) and report.html (plots embedded).

    Reads only the round's files, so a round copied from another machine renders the same.

    \b
    Example:
      specpilot report smollm2-round
    """
    from pathlib import Path

    from specpilot.errors import InputError
    from specpilot.reports.round_report import write_report

    if not (Path(round_dir) / "round.json").is_file():
        raise InputError(f"{round_dir}: no round.json here; give the --out-dir of a 'specpilot round'")
    if out:   # the round's files are its inputs, the report's two files what it writes
        from specpilot.fileio import check_output_path

        own = next((n for n in ("report.md", "report.html") if Path(out).resolve() == (Path(round_dir) / n).resolve()),
                   None)
        if own:   # --out takes the list of what report wrote: over the report it would replace it
            raise InputError(f"--out {out}: refusing to overwrite the round's own {own} (it is rewritten by "
                             f"`specpilot report {round_dir}`); choose another --out")
        check_output_path(out, "--out", protect=[p for p in Path(round_dir).rglob("*") if p.is_file()])
    try:
        md, html = write_report(round_dir)
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        # the round's own files passed their checks: a value of the wrong type deeper in a stage
        # file (a gain that is text, a timing that is not a map) is the file's fault
        raise InputError(f"{round_dir}: a round file holds a value of the wrong type ({type(e).__name__}: "
                         f"{str(e)[:120]}); the round's files are damaged") from None
    emit(Report(data={"schema": "specpilot.report/1", "round": str(round_dir), "markdown": str(md), "html": str(html)},
                sections=[Section(None, ["file", "what"], [[str(md), "Markdown (plots in report/)"],
                                                          [str(html), "one self-contained HTML page"]])]), fmt, out,
         protect=[md, html])
    return 0
