#!/usr/bin/env python3
"""Render the measured-figures tables of README.md and docs/ from the benchmark results files.

    python scripts/figures.py            # rewrite every table that changed
    python scripts/figures.py --check    # exit 1 when a table is not what the results files give

``benchmarks/figures.yaml`` lists the tables. Each names its file and block (the README's table sits
between ``<!-- figures:begin -->`` and ``<!-- figures:end -->``, a docs table between
``<!-- figures:begin NAME -->`` and ``<!-- figures:end NAME -->``), its columns and its rows. A row
names its subject file (``benchmarks/results/<source>.json``), the values to read from it and one
format string per cell; ``{sources}`` in a cell links the files the row read. Above each table goes
an "as of" line (dates, GPU or CPU, driver, torch and Triton versions) taken from the files read.
So every number in a table comes from a results file: re-run a benchmark, then this script.

A value is read by a spec (the language of ``specpilot.result_values``) such as::

    m1: {field: summary.geomean_speedup_m1}                      # a dotted path into the file
    big: {row: {vocab: 151936, m: 1}, field: speedup}           # the one row of "rows" matching
    best: {in: rows, row: {true_gain: 1.03}, field: approved_rate, agg: max}   # min max first last count
    c8: {source: probe_rows_llama8b_bf16, in: points, row: {rows: 8}, field: c}
    x: {field: ..., scale: 1000, divide_by: other}              # arithmetic on the value read

A row with ``for: {shape: [a, b], label: [x, y]}`` stands for one row per value, ``$shape`` and
``$label`` replaced in its value specs and cells.

Exit codes: 0 done (or up to date), 1 stale (``--check``), 2 bad spec, missing file, field or block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from specpilot.errors import InputError
from specpilot.result_values import ResultsFiles as Results, read_value

REPO = Path(__file__).resolve().parents[1]


class SpecError(Exception):
    """A spec, results file or README that cannot give the table."""


def environment_line(docs: list[dict]) -> str:
    """'As of' line: the dates, and each machine's GPU/CPU, driver, torch and Triton versions."""
    keys = ("gpu", "driver", "torch", "triton")
    groups: list[dict] = []
    dates: list[str] = []
    for doc in docs:
        env = {k: doc.get(k) for k in keys if doc.get(k)}
        if env.get("gpu") == "cpu":
            env["gpu"] = "CPU"
            if doc.get("cpu"):
                env["cpu"] = doc["cpu"]
        if doc.get("date"):
            dates.append(str(doc["date"])[:10])
        # a file that leaves a field out (a `probe rows` output has no driver) joins the machine
        # it agrees with on the fields it has
        same = next((g for g in groups if all(g[k] == v for k, v in env.items() if k in g)), None)
        if same is None:
            groups.append(env)
        else:
            for k, v in env.items():
                same.setdefault(k, v)
    parts = []
    for g in groups:
        text = g.get("gpu", "unknown device") + (f" ({g['cpu']})" if g.get("cpu") else "")
        if g.get("driver"):
            text += f" (driver {g['driver']})"
        versions = [f"torch {g['torch']}" if g.get("torch") else "", f"Triton {g['triton']}" if g.get("triton") else ""]
        text += "".join(f", {v}" for v in versions if v)
        parts.append(text)
    span = f"{min(dates)} to {max(dates)}" if dates and min(dates) != max(dates) else (dates[0] if dates else "undated")
    return f"As of {span}: " + "; ".join(parts) + "."


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def substitute(obj, loop: dict):
    """``$name`` of a ``for`` loop in a spec; a string that is just ``$name`` keeps the value's type."""
    if isinstance(obj, str):
        for name, value in loop.items():
            if obj == f"${name}":
                return value
            obj = obj.replace(f"${name}", str(value))
        return obj
    if isinstance(obj, list):
        return [substitute(x, loop) for x in obj]
    if isinstance(obj, dict):
        return {k: substitute(v, loop) for k, v in obj.items()}
    return obj


def expand(row, where: str) -> list[tuple[dict, str]]:
    """A row with ``for: {name: [values], ...}`` once per value (several names are zipped)."""
    if not isinstance(row, dict) or "for" not in row:
        return [(row, where)]
    loop = row["for"]
    if not isinstance(loop, dict) or not loop or not all(isinstance(v, list) and v for v in loop.values()):
        raise SpecError(f"{where}: 'for' maps names to non-empty lists")
    if len({len(v) for v in loop.values()}) != 1:
        raise SpecError(f"{where}: the lists of 'for' differ in length")
    body = {k: v for k, v in row.items() if k != "for"}
    return [(substitute(body, dict(zip(loop, vals))), f"{where} [{', '.join(map(str, vals))}]")
            for vals in zip(*loop.values())]


BOUNDS = ("min", "max", "within")


def status(targets, values: dict, where: str) -> str:
    """``met`` when every target of a row holds for the values read, else ``not met`` with the
    values that miss (``targets``: ``[{value: name, min: x | max: x | within: x, label: text}]``;
    ``within``: ``|value| <= x``)."""
    if targets is None:
        return "met"
    missed = []
    for t in targets if isinstance(targets, list) else [None]:
        if not isinstance(t, dict) or t.get("value") not in values or sum(b in t for b in BOUNDS) != 1:
            raise SpecError(f"{where}: a target needs 'value' (a value of the row) and one of 'min', 'max', 'within'")
        v, label = values[t["value"]], t.get("label", t["value"])
        if "min" in t and not v >= t["min"]:
            missed.append(f"{label} {v:.3g} < {t['min']}")
        if "max" in t and not v <= t["max"]:
            missed.append(f"{label} {v:.3g} > {t['max']}")
        if "within" in t and not abs(v) <= t["within"]:
            missed.append(f"{label} {v:+.3g} outside +-{t['within']}")
    return "met" if not missed else f"not met ({', '.join(missed)})"


def render_table(table: dict, results: Results, where: str) -> str:
    columns, rows = table.get("columns"), table.get("rows")
    if not isinstance(columns, list) or not columns or not isinstance(rows, list) or not rows:
        raise SpecError(f"{where}: needs 'columns' and a non-empty 'rows' list")
    up = "../" * (len(Path(table["file"]).parts) - 1)

    def links(subjects):
        return ", ".join(f"[{s}]({up}benchmarks/results/{s}.json)" for s in subjects)

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + " --- |" * len(columns)]
    used: list[str] = []
    cites_per_row = False
    for i, raw in enumerate(rows, 1):
        for row, at in expand(raw, f"{where} row {i}"):
            if not isinstance(row, dict) or "source" not in row or not isinstance(row.get("cells"), list):
                raise SpecError(f"{at}: needs 'source' and a 'cells' list")
            if len(row["cells"]) != len(columns):
                raise SpecError(f"{at}: {len(row['cells'])} cells for {len(columns)} columns")
            values: dict = {}
            sources = [row["source"]]
            results(row["source"])
            for name, vspec in (row.get("values") or {}).items():
                values[name], src = read_value(vspec, row["source"], results, values, f"{at}, value {name!r}")
                if src not in sources:
                    sources.append(src)
            shown = {k: ("yes" if v else "no") if isinstance(v, bool) else "-" if v is None else v
                     for k, v in values.items()}
            shown["sources"] = links(sources)
            shown["status"] = status(row.get("targets"), values, at)
            cites_per_row |= any("{sources}" in str(c) for c in row["cells"])
            out = []
            for c in row["cells"]:
                try:
                    out.append(cell(str(c).format(**shown)))
                except (KeyError, ValueError, IndexError, TypeError, AttributeError) as e:
                    raise SpecError(f"{at}: cell {c!r}: {type(e).__name__}: {e}") from None
            lines.append("| " + " | ".join(out) + " |")
            used += [s for s in sources if s not in used]
    head = environment_line([results(s) for s in used])
    if not cites_per_row:
        head += f" Source: {links(used)}."
    notes = [str(n) for n in table.get("notes") or []]
    return "\n".join([head, "", *lines, *([""] + notes if notes else [])])


def markers(block: str) -> tuple[str, str]:
    name = f" {block}" if block else ""
    return f"<!-- figures:begin{name} -->", f"<!-- figures:end{name} -->"


def splice(text: str, block: str, table: str, where: str) -> str:
    begin, end = markers(block)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SpecError(f"{where}: needs exactly one {begin} ... {end} block")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def build(spec, results: Results, root: Path) -> dict[Path, tuple[str, str]]:
    """{file: (its text now, its text with every table rendered)} for the files the spec names."""
    if not isinstance(spec, dict) or not isinstance(spec.get("tables"), list) or not spec["tables"]:
        raise SpecError("figures.yaml: needs a non-empty 'tables' list")
    files: dict[Path, list[str]] = {}
    for i, table in enumerate(spec["tables"], 1):
        if not isinstance(table, dict) or not isinstance(table.get("file"), str):
            raise SpecError(f"figures.yaml table {i}: needs 'file'")
        where = f"figures.yaml table {i} ({table['file']})"
        path = root / table["file"]
        if path not in files:
            try:
                text = path.read_text()
            except OSError as e:
                raise SpecError(f"{where}: cannot read it: {e.strerror}") from None
            files[path] = [text, text]
        block = str(table.get("block") or "")
        files[path][1] = splice(files[path][1], block, render_table(table, results, where), where)
    return {p: (old, new) for p, (old, new) in files.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a table is stale; write nothing")
    ap.add_argument("--root", type=Path, default=REPO, help="folder the spec's file names are relative to")
    ap.add_argument("--spec", type=Path, default=REPO / "benchmarks" / "figures.yaml")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    try:
        try:
            spec = yaml.safe_load(args.spec.read_text())
        except OSError as e:
            raise SpecError(f"cannot read {e.filename}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise SpecError(f"{args.spec.name}: not YAML ({e})") from None
        files = build(spec, Results(args.results), args.root)
    except (SpecError, InputError) as e:
        print(f"figures: error: {e}", file=sys.stderr)
        return 2
    stale = [p for p, (old, new) in files.items() if old != new]
    if args.check:
        for p in stale:
            print(f"figures: {p.relative_to(args.root)} is stale: run python scripts/figures.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(files[p][1])
        tmp.replace(p)
        print(f"wrote the figures in {p.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
