"""Numbers read out of the benchmark results files (``benchmarks/results/<subject>.json``).

One small language serves the figures tables (``scripts/figures.py``, ``benchmarks/figures.yaml``)
and the memory's evidence (``specpilot.bundles.evidence``)::

    m1: {field: summary.geomean_speedup_m1}                      # a dotted path into the file
    big: {row: {vocab: 151936, m: 1}, field: speedup}           # the one row of "rows" matching
    best: {in: rows, row: {true_gain: 1.03}, field: approved_rate, agg: max}   # min max first last count
    c8: {source: probe_rows_llama8b_bf16, in: points, row: {rows: 8}, field: c}
    x: {field: ..., scale: 1000, divide_by: other}              # arithmetic on the value read
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.errors import InputError

AGGREGATES = ("min", "max", "first", "last", "count")
KEYS = {"source", "in", "row", "field", "agg", "scale", "divide_by"}


class ResultsFiles:
    """The results files of one folder, each read once."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.docs: dict[str, dict] = {}

    def __call__(self, subject: str) -> dict:
        if subject not in self.docs:
            path = self.folder / f"{subject}.json"
            if not path.is_file():
                raise InputError(f"no results file {subject}.json in {self.folder}")
            try:
                self.docs[subject] = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise InputError(f"{path.name}: not JSON ({e})") from None
        return self.docs[subject]


def lookup(obj, path: str, where: str):
    """Follow a dotted path (list items by index) through JSON data."""
    for part in str(path).split("."):
        if isinstance(obj, list):
            try:
                obj = obj[int(part)]
            except (ValueError, IndexError):
                raise InputError(f"{where}: no item {part!r} in a list of {len(obj)}") from None
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            raise InputError(f"{where}: no field {part!r}")
    return obj


def matches(row, want: dict) -> bool:
    return isinstance(row, dict) and all(k in row and row[k] == v for k, v in want.items())


def read_value(spec: dict, default_source: str, results: ResultsFiles, done: dict | None = None,
               where: str = "value"):
    """(value, source subject) of one value spec; ``done``: the values read before it (``divide_by``)."""
    if not isinstance(spec, dict):
        raise InputError(f"{where}: a value spec is a mapping, got {spec!r}")
    unknown = set(spec) - KEYS
    if unknown:
        raise InputError(f"{where}: unknown keys {sorted(unknown)}")
    source = spec.get("source", default_source)
    doc = results(source)
    where = f"{where} ({source}.json)"
    agg = spec.get("agg")
    if agg is not None and agg not in AGGREGATES:
        raise InputError(f"{where}: agg must be one of {', '.join(AGGREGATES)}")
    if "row" in spec or agg:
        items = lookup(doc, spec.get("in", "rows"), where)
        if not isinstance(items, list):
            raise InputError(f"{where}: {spec.get('in', 'rows')!r} is not a list")
        chosen = [r for r in items if matches(r, spec.get("row") or {})]
        if agg == "count":
            value = len(chosen)
        else:
            if not chosen:
                raise InputError(f"{where}: no row matches {spec.get('row')}")
            if agg is None and len(chosen) > 1:
                raise InputError(f"{where}: {len(chosen)} rows match {spec.get('row')} (give agg)")
            if "field" not in spec:
                raise InputError(f"{where}: no field given")
            picked = [lookup(r, spec["field"], where) for r in chosen]
            value = {"min": min, "max": max, "first": lambda v: v[0], "last": lambda v: v[-1],
                     None: lambda v: v[0]}[agg](picked)
    else:
        if "field" not in spec:
            raise InputError(f"{where}: no field given")
        value = lookup(doc, spec["field"], where)
    if "scale" in spec or "divide_by" in spec:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InputError(f"{where}: cannot do arithmetic on {value!r}")
        value = value * spec.get("scale", 1)
        if "divide_by" in spec:
            if spec["divide_by"] not in (done or {}):
                raise InputError(f"{where}: divide_by {spec['divide_by']!r} is not a value read before it")
            value = value / done[spec["divide_by"]]
    return value, source
