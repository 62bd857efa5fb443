"""Rendering of command results: table, json, yaml, markdown; atomic ``--out``.

A command builds a :class:`Report`: ``data`` is the machine-readable object (what json/yaml
print, the file contract other tools read) and ``sections`` are the human tables. The CLI never
formats numbers inside library code; it hands a Report to :func:`emit`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import unicodedata
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
    # the plain table wraps a column's text at its width here (None: unwrapped); a long prose
    # column would otherwise widen every line of the table (markdown tables cannot wrap)
    wrap: Sequence[int | None] | None = None


@dataclass
class Report:
    data: dict
    sections: list[Section] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # free text after the tables
    title: str | None = None
    wrap: int | None = None   # the plain text wraps the title and free lines at this width


def _wrapped(line: str, width: int | None) -> str:
    """``line`` wrapped at ``width``, its continuation lines indented under its text (past a
    leading "  - " of a list item)."""
    if not width or len(line) <= width:
        return line
    import textwrap

    lead = len(line) - len(line.lstrip(" -"))
    return textwrap.fill(line, width, subsequent_indent=" " * lead, break_on_hyphens=False,
                         break_long_words=False)


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


def visible(text: str) -> str:
    """``text`` with its control characters other than newline and tab written as escapes
    (``\\x1b``, ``\\x08``, ``\\x85``): a model's output or a user's id printed to a terminal must
    not move the cursor, erase lines or send escape sequences."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def _cell(text: str, markdown: bool) -> str:
    """A table cell of one line: a newline in a value (an id, a model's text) would start a row of
    its own, and in Markdown a ``|`` a column of its own."""
    text = visible(text)
    if markdown:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")
    return text.replace("\n", "\\n")


def _paragraphs(text: str) -> str:
    """Markdown joins consecutive lines into one paragraph: each line of ``text`` its own."""
    return text.replace("\n", "\n\n")


def _render_text(report: Report, markdown: bool) -> str:
    from tabulate import tabulate

    out: list[str] = []
    width = None if markdown else report.wrap
    if report.title:
        out.append(f"# {report.title}" if markdown else _wrapped(report.title, width))
        out.append("")
    for s in report.sections:
        if s.title:
            out.append(f"## {s.title}" if markdown else s.title)
            if markdown:
                out.append("")
        rows = [[_cell(v, markdown) if isinstance(v, str) else fmt_num(v) for v in r] for r in s.rows]
        wrap = {} if markdown or not s.wrap else {"maxcolwidths": list(s.wrap)}
        out.append(tabulate(rows, headers=list(s.headers), tablefmt="github" if markdown else "simple",
                            disable_numparse=True, **wrap))
        if s.note:
            out.append("")
            out.append(_paragraphs(s.note) if markdown else s.note)
        out.append("")
    for line in report.lines:
        out.extend([_paragraphs(line), ""] if markdown else [_wrapped(line, width)])
    return visible("\n".join(out).rstrip()) + "\n"


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        from .fileio import json_text

        return json_text(report.data) + "\n"
    if fmt == "yaml":
        import yaml

        from .fileio import plain_data

        return yaml.safe_dump(plain_data(report.data), sort_keys=False)
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


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` with its noun in the singular or plural: "1 step", "3 passes"."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def _check_out(ctx, param, value):
    if value is not None and not value.strip():
        raise click.BadParameter("an empty file name; give a file, or leave --out out for stdout")
    if value:
        from .fileio import check_output_path

        check_output_path(value, "--out")  # before any long work
    return value


def output_options(f: Callable) -> Callable:
    """``--format`` and ``--out``, shared by every verb."""
    f = click.option("--out", "out", type=click.Path(dir_okay=False), default=None, callback=_check_out,
                     help="Write the result to FILE (atomically) instead of stdout.")(f)
    f = click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                     help="Output format.")(f)
    return f


STATUS_LOGGER = "specpilot.status"  # library code reports long steps here ("loading model ...")
PROGRESS_SECONDS = 15.0  # one progress line per this many seconds when stderr is not a terminal


class _StderrLines:
    """A file for tqdm that turns its carriage-return redraws into whole lines (CI logs)."""

    def write(self, s: str) -> None:
        text = s.replace("\r", "").replace("\x1b[A", "").strip()
        if text:
            sys.stderr.write(f"{text}\n")

    def flush(self) -> None:
        sys.stderr.flush()


def progress_seconds() -> float:
    """Seconds between progress lines without a terminal: ``SPECPILOT_PROGRESS_SECONDS`` (blank:
    unset), else :data:`PROGRESS_SECONDS`; 0 prints every update. Anything but a finite number
    >= 0 is an InputError naming the variable."""
    import os

    from .errors import InputError

    raw = (os.environ.get("SPECPILOT_PROGRESS_SECONDS") or "").strip()
    if not raw:
        return PROGRESS_SECONDS
    try:
        every = float(raw)
    except ValueError:
        every = math.nan
    if not (math.isfinite(every) and every >= 0):
        raise InputError(f"SPECPILOT_PROGRESS_SECONDS={raw!r}: give the seconds between progress lines, a finite "
                         f"number >= 0 (0: every update), or unset it for the default {PROGRESS_SECONDS:g}")
    return every


def progress(iterable=None, total=None, desc: str | None = None, unit: str = "it"):
    """Progress on stderr: a bar on a terminal; otherwise one plain line every
    :func:`progress_seconds` (default 15) seconds, so CI logs show long work moving."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
    every = progress_seconds()

    class LineBar(tqdm):
        def refresh(self, *args, **kwargs):  # an explicit refresh waits for the first interval too
            start = getattr(self, "start_t", None)  # unset while tqdm is still being built
            if start is not None and self._time() - start < self.delay:
                return None
            return super().refresh(*args, **kwargs)

        def close(self):   # a signal inside tqdm's __init__ leaves no ``pos``: its __del__ would print a traceback
            if hasattr(self, "pos"):
                super().close()

    return LineBar(iterable, total=total, desc=desc, unit=unit, file=_StderrLines(), leave=False, mininterval=every,
                maxinterval=max(every, 1.0), miniters=1, delay=every,
                bar_format="{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}]")


class _StatusHandler(logging.Handler):
    """``specpilot: <message>`` on whatever ``sys.stderr`` is at the time (tests swap it)."""

    def emit(self, record):
        try:
            sys.stderr.write(f"specpilot: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def status_lines():
    """Show the library's status lines (``logging.getLogger(STATUS_LOGGER).info``) on stderr."""
    logger = logging.getLogger(STATUS_LOGGER)
    handler = _StatusHandler()
    old_level, old_prop = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_prop


def status(message: str) -> None:
    """One ``specpilot: ...`` status line on stderr (e.g. before a long model load)."""
    logging.getLogger(STATUS_LOGGER).info(message)
