"""Rendering of command results: table, json, yaml, markdown; atomic ``--out``.

A command builds a :class:`Report`: ``data`` is the machine-readable object (what json/yaml
print, the file contract other tools read) and ``sections`` are the human tables. The CLI never
formats numbers inside library code; it hands a Report to :func:`emit`.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import click

FORMATS = ("table", "json", "yaml", "markdown")


@dataclass
class Section:
    title: str | None
    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    note: str | None = None


@dataclass
class Report:
    data: dict
    sections: list[Section] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # free text after the tables
    title: str | None = None


def fmt_num(x: Any, digits: int = 4) -> Any:
    """Human formatting: significant digits, thousands kept readable, None as '-'."""
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, float):
        return x
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    mag = abs(x)
    if mag >= 1e7 or mag < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}" if mag < 10 ** digits else f"{x:.0f}"


def _render_text(report: Report, markdown: bool) -> str:
    from tabulate import tabulate

    out: list[str] = []
    if report.title:
        out.append(f"# {report.title}" if markdown else report.title)
        out.append("")
    for s in report.sections:
        if s.title:
            out.append(f"## {s.title}" if markdown else s.title)
            if markdown:
                out.append("")
        rows = [[fmt_num(v) for v in r] for r in s.rows]
        out.append(tabulate(rows, headers=list(s.headers), tablefmt="github" if markdown else "simple",
                            disable_numparse=True))
        if s.note:
            out.append("")
            out.append(s.note)
        out.append("")
    for line in report.lines:
        out.append(line)
    return "\n".join(out).rstrip() + "\n"


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        from .fileio import _json_default

        return json.dumps(report.data, indent=2, default=_json_default) + "\n"
    if fmt == "yaml":
        import yaml

        from .fileio import _json_default

        # round-trip through JSON so dataclasses/arrays become plain types
        plain = json.loads(json.dumps(report.data, default=_json_default))
        return yaml.safe_dump(plain, sort_keys=False)
    if fmt == "markdown":
        return _render_text(report, markdown=True)
    return _render_text(report, markdown=False)


def emit(report: Report, fmt: str, out: str | None, protect: Sequence[str] = ()) -> None:
    """Print or atomically write the report in the chosen format."""
    text = render(report, fmt)
    if out:
        from .fileio import write_text_atomic

        write_text_atomic(out, text, protect=protect)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text, nl=False)


def output_options(f: Callable) -> Callable:
    """``--format`` and ``--out``, shared by every verb."""
    f = click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
                     help="Write the result to FILE (atomically) instead of stdout.")(f)
    f = click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                     help="Output format.")(f)
    return f


def progress(iterable=None, total=None, desc: str | None = None, unit: str = "it"):
    """A progress bar on stderr, quiet when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)
