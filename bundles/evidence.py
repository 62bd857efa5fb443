"""Memory evidence generated from the benchmark results files, never pasted.

An evidence item of a memory entry that quotes measured figures names where they come from::

    - kind: gpu
      source: lm_head                       # benchmarks/results/lm_head.json
      values:                               # one number per name (specpilot.result_values specs)
        big: {row: {vocab: 151936, m: 1}, field: speedup}
      text: "certified INT8 LM head vs bf16 F.linear + argmax: {big:.2f}x at one row"
      what: ...                             # generated from text and values
      hardware: ...                         # generated from the results file's environment

``what`` and ``hardware`` are written by ``specpilot memory verify --record`` and checked by
``specpilot memory verify``: an item whose stored text no longer matches its results file is
stale, and a ``gpu`` item without a ``source`` quotes figures nobody can regenerate. Items of kind
``cpu-test`` (what a test checks) and ``paper`` (the paper's figures, "not measured here") are
kept as written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specpilot.errors import InputError
from specpilot.result_values import ResultsFiles, read_value

MEASURED_KINDS = ("gpu", "cpu-bench")


def default_results_dir() -> Path | None:
    """``benchmarks/results`` of the checkout this package runs from, when there is one."""
    d = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    return d if d.is_dir() else None


@dataclass
class Rendered:
    what: str
    hardware: str


def _hardware(doc: dict) -> str:
    parts = [str(doc.get("gpu") or "unknown machine")]
    for key, name in (("torch", "torch"), ("triton", "Triton")):
        if doc.get(key):
            parts.append(f"{name} {doc[key]}")
    date = str(doc.get("date") or "")[:10]
    return ", ".join(parts) + (f"; as of {date}" if date else "")


def render(item: dict, results_dir: str | Path, where: str = "evidence") -> Rendered:
    """The generated ``what`` and ``hardware`` of a measured evidence item."""
    results = ResultsFiles(results_dir)
    source = item.get("source")
    if not source or not isinstance(item.get("text"), str):
        raise InputError(f"{where}: a measured item needs source (a results subject) and text")
    values: dict = {}
    for name, spec in (item.get("values") or {}).items():
        values[name] = read_value(spec, source, results, values, f"{where}: value {name!r}")[0]
    try:
        what = item["text"].format(**values)
    except (KeyError, ValueError, IndexError) as e:
        raise InputError(f"{where}: text does not format with its values ({type(e).__name__}: {e})") from None
    return Rendered(what=what, hardware=_hardware(results(source)))


def problems(entry, results_dir: str | Path | None) -> list[str]:
    """Why ``entry``'s evidence is not what its results files say (empty when it is)."""
    return check(entry, results_dir).problems


@dataclass
class EvidenceCheck:
    """One entry's measured evidence against its results files. ``status``: ``current``, ``none measured``
    (no measured item), ``not checked`` (no results folder), else what is wrong, worst first, of
    ``missing`` (a results file it names is not in the folder), ``unsourced`` (figures without a
    results file) and ``stale`` (the text or hardware no longer what the file gives, or a value the
    file does not hold)."""

    status: str
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _subjects(item: dict) -> list[str]:
    """The results subjects a measured item reads: its ``source`` and any value's own."""
    out = [item["source"]]
    for spec in (item.get("values") or {}).values():
        if isinstance(spec, dict) and isinstance(spec.get("source"), str) and spec["source"] not in out:
            out.append(spec["source"])
    return out


def check(entry, results_dir: str | Path | None) -> EvidenceCheck:
    """``entry``'s measured evidence against the results files of ``results_dir``."""
    out: list[str] = []
    kinds: set[str] = set()
    measured = False
    for i, item in enumerate(entry.evidence):
        where = f"evidence {i + 1} ({item.get('kind')})"
        if item.get("kind") not in MEASURED_KINDS:
            continue
        measured = True
        if not item.get("source"):
            out.append(f"{where}: quotes measurements without a results file (give source, values, text)")
            kinds.add("unsourced")
            continue
        if results_dir is None:
            continue
        absent = [s for s in _subjects(item) if not (Path(results_dir) / f"{s}.json").is_file()]
        if absent:
            out += [f"{where}: no results file {s}.json in {results_dir}" for s in absent]
            kinds.add("missing")
            continue
        try:
            r = render(item, results_dir, where)
        except InputError as e:
            out.append(str(e))
            kinds.add("stale")
            continue
        if " ".join(str(item.get("what", "")).split()) != " ".join(r.what.split()):
            says, gives = _where_they_differ(str(item.get("what", "")), r.what)
            out.append(f"{where}: stale: the text says {says!r}, {item['source']}.json now gives {gives!r}")
            kinds.add("stale")
        elif item.get("hardware") != r.hardware:
            out.append(f"{where}: stale hardware {item.get('hardware')!r}; {item['source']}.json says {r.hardware!r}")
            kinds.add("stale")
    if kinds:
        status = ", ".join(k for k in ("missing", "unsourced", "stale") if k in kinds)
    elif not measured:
        status = "none measured"
    else:
        status = "not checked" if results_dir is None else "current"
    return EvidenceCheck(status=status, problems=out)


def _where_they_differ(a: str, b: str, before: int = 4, width: int = 90) -> tuple[str, str]:
    """The two texts from a few words before their first difference (a long text's start is the
    same in both: cut there, the two quotes read alike)."""
    wa, wb = a.split(), b.split()
    i = next((k for k, (x, y) in enumerate(zip(wa, wb)) if x != y), min(len(wa), len(wb)))
    start = max(0, i - before)
    lead = "..." if start else ""
    return (_short(lead + " ".join(wa[start:]), width), _short(lead + " ".join(wb[start:]), width))


def _short(text, width: int = 90) -> str:
    t = " ".join(str(text or "").split())
    return t if len(t) <= width else t[: width - 3] + "..."


def record(entry, results_dir: str | Path, text: str | None = None) -> str:
    """The entry's YAML text (``text``, else its file's) with every measured item's ``what`` and
    ``hardware`` regenerated from the results files; the other items, the comments and blank lines
    between items and the rest of the file as written (a measured item is rewritten whole, at the
    list's indentation)."""
    import re

    import yaml

    text = entry.path.read_text(encoding="utf-8") if text is None else text
    if not any(i.get("kind") in MEASURED_KINDS and i.get("source") for i in entry.evidence):
        return text
    start = text.find("\nevidence:")
    if start < 0:
        raise InputError(f"{entry.path}: no top-level 'evidence' list")
    end = text.find("\nlimits:", start)
    if end < 0:
        raise InputError(f"{entry.path}: 'limits' must follow 'evidence'")
    head, *lines = text[start + 1:end].split("\n")
    firsts = [i for i, line in enumerate(lines) if re.match(r"( *)- ", line)]
    indent = len(lines[firsts[0]]) - len(lines[firsts[0]].lstrip(" ")) if firsts else 0
    starts = [i for i in firsts if len(lines[i]) - len(lines[i].lstrip(" ")) == indent]
    if len(starts) != len(entry.evidence):
        raise InputError(f"{entry.path}: the evidence list's items must each start with '- ' at one indentation")
    out = [head] + lines[:starts[0] if starts else len(lines)]
    for n, (a, b) in enumerate(zip(starts, starts[1:] + [len(lines)])):
        item = entry.evidence[n]
        if item.get("kind") in MEASURED_KINDS and item.get("source"):
            r = render(item, results_dir, f"{entry.path}: evidence {n + 1}")
            item = dict(item, what=r.what, hardware=r.hardware)
            dumped = yaml.safe_dump([item], sort_keys=False, width=110, allow_unicode=True).rstrip("\n")
            out += [" " * indent + line if line else line for line in dumped.split("\n")]
            tail = b
            while tail > a + 1 and (not lines[tail - 1].strip() or lines[tail - 1].lstrip().startswith("#")):
                tail -= 1
            out += lines[tail:b]   # the blank lines and comments after the item
        else:
            out += lines[a:b]
    return text[: start + 1] + "\n".join(out) + text[end:]
