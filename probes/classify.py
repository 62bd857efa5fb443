"""Kernel classes: a YAML rule table (``kernel_classes.yaml``) users can extend with ``--rules``.

Each rule names a class and conditions (regex on the kernel's base name or its template/parameter
arguments, the launching CPU op, the enclosing range, kind, stream, input dims, position in the
step, runs per step); the first rule whose conditions all hold wins. Names are matched on their
base name (:mod:`.kernel_names`), so a template argument never decides the class.
:func:`explain` says which rule classified each kernel name, so a user can see and fix a
misclassification.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from statistics import median
from typing import Any

import yaml

from specpilot.errors import InputError
from specpilot.fileio import load_yaml

from .kernel_names import split_name
from .traces.model import KINDS, Aggregate, KernelGroup

SCHEMA = "specpilot.kernel_classes/1"
FLOOR_CLASSES = ("linear", "lm_head", "attention", "gdn", "moe", "norm", "drafter", "communication")
CONDITIONS = ("match", "args", "op", "range", "kind", "stream", "dims", "position", "per_step")
POSITIONS = ("last",)


@dataclass
class Rule:
    index: int
    cls: str
    source: str  # "default" or the user's file
    match: re.Pattern | None = None
    args: re.Pattern | None = None
    op: re.Pattern | None = None
    range: re.Pattern | None = None
    kind: tuple[str, ...] | None = None
    stream: tuple[int, ...] | None = None
    dims: int | str | None = None
    per_step: float | None = None
    position: str | None = None
    note: str = ""

    def describe(self) -> str:
        parts = []
        if self.kind:
            parts.append(f"kind={'|'.join(self.kind)}")
        if self.range:
            parts.append(f"range~/{self.range.pattern}/")
        for key, rx in (("name", self.match), ("args", self.args), ("op", self.op)):
            if rx is not None:
                pat = rx.pattern
                parts.append(f"{key}~/{pat if len(pat) <= 40 else pat[:37] + '...'}/")
        if self.stream:
            parts.append(f"stream={','.join(map(str, self.stream))}")
        if self.dims is not None:
            parts.append(f"dims has {self.dims}")
        if self.position:
            parts.append(f"{self.position} in step")
        if self.per_step is not None:
            parts.append(f"{self.per_step:g} per step")
        return f"{self.source}#{self.index}: " + " ".join(parts)


@dataclass
class RuleTable:
    classes: list[str]
    rules: list[Rule]
    sources: list[str] = field(default_factory=list)

    @property
    def range_regex(self) -> str | None:
        """One regex for every range a rule tests: the readers track only those ranges."""
        pats = [r.range.pattern for r in self.rules if r.range is not None]
        return "|".join(f"(?:{p})" for p in pats) if pats else None


def _parse(doc: Any, source: str, start_index: int = 0,
           shown: str | None = None) -> tuple[list[str], list[Rule], bool]:
    """The classes, rules and ``replace`` flag of one rules document; ``source`` labels its rules,
    errors name ``shown`` (the file as the user gave it), else ``source``."""
    name = shown or source
    if not isinstance(doc, dict):
        raise InputError(f"{name}: expected a YAML mapping with schema: {SCHEMA} and rules: [...]")
    if doc.get("schema") != SCHEMA:
        raise InputError(f"{name}: unknown schema {doc.get('schema')!r}; expected {SCHEMA}")
    raw = doc.get("rules")
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{name}: 'rules' must be a non-empty list")
    classes = doc.get("classes") or []
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise InputError(f"{name}: 'classes' must be a list of names")
    rules = []
    for i, r in enumerate(raw, start_index):
        where = f"{name}: rule {i}"
        if not isinstance(r, dict) or not isinstance(r.get("class"), str) or not r["class"]:
            raise InputError(f"{where}: each rule needs a 'class' name")
        unknown = set(r) - set(CONDITIONS) - {"class", "note"}
        if unknown:
            raise InputError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                             f"conditions are {', '.join(CONDITIONS)}")
        if not any(k in r for k in CONDITIONS):
            raise InputError(f"{where}: no condition (use match: '.' to catch everything)")
        rule = Rule(index=i, cls=r["class"], source=source, note=str(r.get("note", "")))
        for key in ("match", "args", "op", "range"):
            if key in r:
                if not isinstance(r[key], str):
                    raise InputError(f"{where}: {key} must be a regex string")
                try:
                    setattr(rule, key, re.compile(r[key], re.IGNORECASE))
                except re.error as e:
                    raise InputError(f"{where}: {key} {r[key]!r} is not a valid regex ({e})") from None
        if "kind" in r:
            kinds = tuple([r["kind"]] if isinstance(r["kind"], str) else r["kind"] or ())
            bad = [k for k in kinds if k not in KINDS]
            if bad or not kinds:
                raise InputError(f"{where}: kind must be among {', '.join(KINDS)}")
            rule.kind = kinds
        if "stream" in r:
            s = r["stream"] if isinstance(r["stream"], list) else [r["stream"]]
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in s):
                raise InputError(f"{where}: stream must be an integer or a list of integers")
            rule.stream = tuple(s)
        if "dims" in r:
            d = r["dims"]
            if not (d == "vocab" or (isinstance(d, int) and not isinstance(d, bool) and d > 0)):
                raise InputError(f"{where}: dims must be 'vocab' or a positive integer")
            rule.dims = d
        if "per_step" in r:
            p = r["per_step"]
            if isinstance(p, bool) or not isinstance(p, (int, float)) or p <= 0:
                raise InputError(f"{where}: per_step must be a positive number")
            rule.per_step = float(p)
        if "position" in r:
            if r["position"] not in POSITIONS:
                raise InputError(f"{where}: position must be one of {', '.join(POSITIONS)}")
            if rule.match is None:
                raise InputError(f"{where}: a position rule needs match (the kernels it ranks)")
            rule.position = r["position"]
        rules.append(rule)
    return classes, rules, bool(doc.get("replace", False))


def default_table_text() -> str:
    return (resources.files("specpilot.probes") / "kernel_classes.yaml").read_text(encoding="utf-8")


def load_rules(user_files: list[str] | tuple[str, ...] = ()) -> RuleTable:
    """The default table, with each user file's rules placed before it (``replace: true`` drops it)."""
    classes, rules, _ = _parse(yaml.safe_load(default_table_text()), "default")
    sources = ["default"]
    for f in reversed(list(user_files)):
        p = Path(f)
        if not p.is_file():
            what = "not a rules file (a folder or device)" if p.exists() else "no such rules file"
            raise InputError(f"{f}: {what}")
        try:
            doc = load_yaml(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"{f}: not valid YAML ({str(e).splitlines()[0]})") from None
        except yaml.YAMLError as e:   # the problem, not its context: the line named is the problem's
            mark = getattr(e, "problem_mark", None)
            where = f"{f}:{mark.line + 1}" if mark is not None else f
            detail = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise InputError(f"{where}: not valid YAML ({detail})") from None
        ucls, urules, replace = _parse(doc, p.name, shown=f)
        rules = urules + ([] if replace else rules)
        classes = list(dict.fromkeys([*classes, *ucls, *(r.cls for r in urules)]))
        sources.insert(0, p.name)
    for r in rules:
        if r.cls not in classes:
            classes.append(r.cls)
    return RuleTable(classes=classes, rules=rules, sources=sources)


_DIM_RX = re.compile(r"\d+")


@dataclass
class Decision:
    cls: str
    rule: Rule | None


class Classifier:
    def __init__(self, table: RuleTable, vocab: int | None = None):
        self.table = table
        self.vocab = vocab
        self._cache: dict[tuple, Decision] = {}
        self.per_step: dict[str, float] = {}

    def fit(self, agg: Aggregate) -> "Classifier":
        """Per-step run counts per kernel name (for ``per_step`` rules)."""
        steps = [s.index for s in agg.steps]
        counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for g in agg.groups:
            counts[g.name][g.step] += g.count
        self.per_step = {n: float(median([c.get(s, 0) for s in steps])) if steps else 0.0 for n, c in counts.items()}
        return self

    def classify(self, g: KernelGroup) -> Decision:
        key = (g.name, g.kind, g.stream, g.tag, g.dims, g.position)
        d = self._cache.get(key)
        if d is None:
            d = self._decide(g)
            self._cache[key] = d
        return d

    def holds(self, r: Rule, g: KernelGroup, ignore_position: bool = False) -> bool:
        """Whether every condition of ``r`` holds for ``g`` (its position aside, if asked)."""
        if r.kind is not None and g.kind not in r.kind:
            return False
        if r.stream is not None and g.stream not in r.stream:
            return False
        if r.range is not None and not (g.tag and r.range.search(g.tag)):
            return False
        if r.match is not None or r.args is not None:
            base, args = split_name(g.name)
            if r.match is not None and not r.match.search(base):
                return False
            if r.args is not None and not r.args.search(args):
                return False
        if r.op is not None and not r.op.search(g.op):
            return False
        if r.dims is not None:
            want = self.vocab if r.dims == "vocab" else r.dims
            if want is None or not g.dims or str(want) not in _DIM_RX.findall(g.dims.split("[", 1)[-1]):
                return False
        if r.position is not None and not ignore_position and g.position != r.position:
            return False
        if r.per_step is not None and self.per_step.get(g.name) != r.per_step:
            return False
        return True

    def _decide(self, g: KernelGroup) -> Decision:
        for r in self.table.rules:
            if self.holds(r, g):
                return Decision(r.cls, r)
        return Decision("other", None)

    def position_candidate(self, rule: Rule, g: KernelGroup) -> bool:
        """Whether ``g``'s kernels compete for ``rule``'s position: the rule's conditions hold
        (position aside), no earlier rule claims them, and they lie outside every tracked range."""
        if g.tag or not self.holds(rule, g, ignore_position=True):
            return False
        for r in self.table.rules:
            if r is rule:
                return True
            if r.position is None and self.holds(r, g):
                return False
        return False


@dataclass
class ExplainRow:
    name: str
    kind: str
    tag: str | None
    cls: str
    rule: str
    per_step: float
    ms_per_step: float


def explain(agg: Aggregate, clf: Classifier) -> list[ExplainRow]:
    """One row per distinct (name, kind, range) with its class, rule and time per step."""
    n_steps = max(len(agg.steps), 1)
    acc: dict[tuple, list] = {}
    for g in agg.groups:
        d = clf.classify(g)
        key = (g.name, g.kind, g.tag, d.cls, d.rule.describe() if d.rule else "no rule matched")
        a = acc.setdefault(key, [0, 0])
        a[0] += g.count
        a[1] += g.total_ns if g.excl_ns is None else g.excl_ns   # as the profile's class times
    rows = [ExplainRow(name=k[0], kind=k[1], tag=k[2], cls=k[3], rule=k[4], per_step=v[0] / n_steps,
                       ms_per_step=v[1] / n_steps / 1e6) for k, v in acc.items()]
    rows.sort(key=lambda r: -r.ms_per_step)
    return rows
