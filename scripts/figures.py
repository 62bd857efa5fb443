#!/usr/bin/env python3
"""Render the README's "What has been measured" table from the benchmark results files.

    python scripts/figures.py            # rewrite the table in README.md
    python scripts/figures.py --check    # exit 1 when README.md is not what the files give

The table sits between ``<!-- figures:begin -->`` and ``<!-- figures:end -->``. What goes in it is
``benchmarks/figures.yaml``: per row, the subject file (``benchmarks/results/<subject>.json``), the
values to read from it, a format string, the target and the verdict. Every number in the table comes
from a results file, so re-running a benchmark and then this script is how the README changes.

A value is read by a spec such as::

    m1: {field: summary.geomean_speedup_m1}                      # a dotted path into the file
    big: {row: {vocab: 151936, m: 1}, field: speedup}           # the one row of "rows" matching
    best: {in: rows, row: {true_gain: 1.03}, field: approved_rate, agg: max}
    c8: {source: probe_rows_llama8b_bf16, in: points, row: {rows: 8}, field: c}
    x: {field: ..., scale: 1000, divide_by: other}              # arithmetic on the value read

Exit codes: 0 done (or up to date), 1 stale (``--check``), 2 bad spec, missing file or field.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- figures:begin -->"
END = "<!-- figures:end -->"
AGGREGATES = ("min", "max", "first", "last", "count")


class SpecError(Exception):
    """A spec, results file or README that cannot give the table."""


def lookup(obj, path: str, where: str):
    """Follow a dotted path (list items by index) through JSON data."""
    for part in path.split("."):
        if isinstance(obj, list):
            try:
                obj = obj[int(part)]
            except (ValueError, IndexError):
                raise SpecError(f"{where}: no item {part!r} in a list of {len(obj)}") from None
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            raise SpecError(f"{where}: no field {part!r}")
    return obj


def matches(row, want: dict) -> bool:
    return isinstance(row, dict) and all(k in row and row[k] == v for k, v in want.items())


class Results:
    """The results files, each read once."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.docs: dict[str, dict] = {}

    def __call__(self, subject: str) -> dict:
        if subject not in self.docs:
            path = self.folder / f"{subject}.json"
            if not path.is_file():
                raise SpecError(f"no results file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
            try:
                self.docs[subject] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise SpecError(f"{path.name}: not JSON ({e})") from None
        return self.docs[subject]


def read_value(spec: dict, default_source: str, results: Results, done: dict, where: str):
    if not isinstance(spec, dict):
        raise SpecError(f"{where}: a value spec is a mapping, got {spec!r}")
    unknown = set(spec) - {"source", "in", "row", "field", "agg", "scale", "divide_by"}
    if unknown:
        raise SpecError(f"{where}: unknown keys {sorted(unknown)}")
    source = spec.get("source", default_source)
    doc = results(source)
    where = f"{where} ({source}.json)"
    agg = spec.get("agg")
    if agg is not None and agg not in AGGREGATES:
        raise SpecError(f"{where}: agg must be one of {', '.join(AGGREGATES)}")
    if "row" in spec or agg:
        items = lookup(doc, spec.get("in", "rows"), where)
        if not isinstance(items, list):
            raise SpecError(f"{where}: {spec.get('in', 'rows')!r} is not a list")
        chosen = [r for r in items if matches(r, spec.get("row") or {})]
        if agg == "count":
            value = len(chosen)
        else:
            if not chosen:
                raise SpecError(f"{where}: no row matches {spec.get('row')}")
            if agg is None and len(chosen) > 1:
                raise SpecError(f"{where}: {len(chosen)} rows match {spec.get('row')} (give agg)")
            if "field" not in spec:
                raise SpecError(f"{where}: no field given")
            picked = [lookup(r, spec["field"], where) for r in chosen]
            value = {"min": min, "max": max, "first": lambda v: v[0], "last": lambda v: v[-1],
                     None: lambda v: v[0]}[agg](picked)
    else:
        if "field" not in spec:
            raise SpecError(f"{where}: no field given")
        value = lookup(doc, spec["field"], where)
    if "scale" in spec or "divide_by" in spec:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SpecError(f"{where}: cannot do arithmetic on {value!r}")
        value = value * spec.get("scale", 1)
        if "divide_by" in spec:
            if spec["divide_by"] not in done:
                raise SpecError(f"{where}: divide_by {spec['divide_by']!r} is not a value read before it")
            value = value / done[spec["divide_by"]]
    return value, source


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


def render(spec: dict, results: Results) -> str:
    if not isinstance(spec, dict) or not isinstance(spec.get("rows"), list) or not spec["rows"]:
        raise SpecError("figures.yaml: needs a non-empty 'rows' list")
    header = ["mechanism / tool", "measured", "target", "verdict", "source"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    used: list[str] = []
    for i, row in enumerate(spec["rows"], 1):
        where = f"figures.yaml row {i}"
        if not isinstance(row, dict) or not {"what", "source", "measured"} <= set(row):
            raise SpecError(f"{where}: needs 'what', 'source' and 'measured'")
        where = f"figures.yaml row {i} ({row['what'][:40]})"
        values: dict = {}
        sources = [row["source"]]
        results(row["source"])
        for name, vspec in (row.get("values") or {}).items():
            values[name], src = read_value(vspec, row["source"], results, values, f"{where}, value {name!r}")
            if src not in sources:
                sources.append(src)
        shown = {k: ("yes" if v else "no") if isinstance(v, bool) else v for k, v in values.items()}
        try:
            measured = row["measured"].format(**shown)
        except (KeyError, ValueError, IndexError, TypeError) as e:
            raise SpecError(f"{where}: measured template: {type(e).__name__}: {e}") from None
        links = ", ".join(f"[{s}](benchmarks/results/{s}.json)" for s in sources)
        lines.append("| " + " | ".join(cell(c) for c in (row["what"], measured, row.get("target", ""),
                                                          row.get("verdict", ""), links)) + " |")
        used += [s for s in sources if s not in used]
    notes = spec.get("notes") or []
    return "\n".join([environment_line([results(s) for s in used]), "", *lines, *([""] + list(notes) if notes else [])])


def splice(readme: str, table: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SpecError(f"README needs exactly one {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the README's table is stale; write nothing")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--spec", type=Path, default=REPO / "benchmarks" / "figures.yaml")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    try:
        try:
            spec = yaml.safe_load(args.spec.read_text())
            readme = args.readme.read_text()
        except OSError as e:
            raise SpecError(f"cannot read {e.filename}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise SpecError(f"{args.spec.name}: not YAML ({e})") from None
        new = splice(readme, render(spec, Results(args.results)))
    except SpecError as e:
        print(f"figures: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != readme:
            print(f"figures: {args.readme.name} is stale: run python scripts/figures.py", file=sys.stderr)
            return 1
        return 0
    if new != readme:
        tmp = args.readme.with_name(args.readme.name + ".tmp")
        tmp.write_text(new)
        tmp.replace(args.readme)
        print(f"wrote the figures table in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
