"""Stage 3, propose: the memory's mechanisms that fit this deployment, retuned here, ordered so the
largest factor is attacked first; those that cannot run here are listed with the reason.

For the embedded engine a mechanism is an engine spec change (``engine_candidates.yaml``: the
memory entry it comes from, the factor it attacks, the options it sets, what it needs). Retuning
uses stage 2's predictions: a chain's draft length m and a tree's node budget N are the ones with
the highest predicted tau(N) / c(N) on this machine; the tree's depth and candidates per position
are the recorded lattice's; TLV takes the budget its cycles were recorded at. A candidate equal to
the current system is not proposed.

For an SGLang deployment a candidate is a memory entry (``apply`` with its variants) checked
against the entry's ``fits`` (drafter family, target kind, weight dtype, serving shape) and the
SGLang versions it was checked against (:mod:`.sglang`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib import resources

from specpilot.errors import InputError
from specpilot.fileio import is_num, need, need_fields

SCHEMA = "specpilot.round-candidates/1"
CONTROL = "no-op"


@dataclass
class Candidate:
    id: str
    memory: str | None
    what: str
    attacks: str | None
    system: str | None = None                # engine spec text (engine) or None
    change: dict = field(default_factory=dict)   # options it sets (engine) / variants (SGLang)
    retuned: str | None = None               # how and why, in words
    predicted_speedup: float | None = None   # over AR, from the model (None: not predicted)
    predicted_gain: float | None = None      # over the current system
    changes_output: bool = False
    control: bool = False


@dataclass
class Proposal:
    candidates: list[Candidate]
    not_proposed: list[dict]                 # {id, memory, reason}
    order: str                               # how the list is ordered, in words
    largest: str | None

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "candidates": [asdict(c) for c in self.candidates],
                "not_proposed": self.not_proposed, "order": self.order, "largest": self.largest}

    @classmethod
    def from_json(cls, d: dict) -> "Proposal":
        need_fields(d, cls)
        need(isinstance(d["candidates"], list), "candidates", "a list", d["candidates"])
        for i, c in enumerate(d["candidates"]):   # what the report prints and the approve stage runs
            named = isinstance(c, dict) and isinstance(c.get("id"), str)
            name = f"candidates[{i}]" + (f" ({c['id']})" if named else "")
            need(isinstance(c, dict), name, "an object (a candidate)", c)
            need_fields(c, Candidate, name)
            for key, (ok, want) in _FIELDS.items():
                if key in c:
                    need(ok(c[key]), f"{name}.{key}", want, c[key])
        cands = [Candidate(**c) for c in d["candidates"]]
        need(isinstance(d["not_proposed"], list), "not_proposed", "a list", d["not_proposed"])
        for i, x in enumerate(d["not_proposed"]):
            need(isinstance(x, dict) and isinstance(x.get("id"), str) and isinstance(x.get("reason"), str)
                 and _text_or_none(x.get("memory")), f"not_proposed[{i}]", "an object {id, memory, reason}", x)
        need(isinstance(d["order"], str), "order", "text", d["order"])
        need(_text_or_none(d.get("largest")), "largest", "a factor name or null", d.get("largest"))
        return cls(cands, d["not_proposed"], d["order"], d.get("largest"))


def _text_or_none(v) -> bool:
    return v is None or isinstance(v, str)


# a candidate's fields in candidates.json, the check each value gets and what it must be
_FIELDS = {"id": (lambda v: isinstance(v, str) and bool(v), "a candidate name"),
           "memory": (_text_or_none, "a memory entry name or null"),
           "what": (lambda v: isinstance(v, str), "text"),
           "attacks": (_text_or_none, "a factor name or null"),
           "system": (_text_or_none, "a system (text) or null"),
           "change": (lambda v: isinstance(v, dict), "an object"),
           "retuned": (_text_or_none, "text or null"),
           "predicted_speedup": (lambda v: v is None or (is_num(v) and v > 0), "a number > 0 or null"),
           "predicted_gain": (lambda v: v is None or (is_num(v) and v > 0), "a number > 0 or null"),
           "changes_output": (lambda v: isinstance(v, bool), "true or false"),
           "control": (lambda v: isinstance(v, bool), "true or false")}


def engine_catalog() -> list[dict]:
    import yaml

    text = (resources.files("specpilot.auditors.round") / "engine_candidates.yaml").read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    return doc["candidates"]


def check_names(names: list[str] | None, kind: str, memory_dir=None) -> None:
    """Refuse unknown ``--candidates`` before anything runs."""
    if not names:
        return
    if kind == "engine":
        known = {c["id"] for c in engine_catalog()} | {CONTROL}
    else:
        from specpilot.bundles.memory import load_memory

        known = set(load_memory(memory_dir))
    for name in names:
        if name not in known:
            raise InputError(f"--candidates: unknown candidate {name!r}; known: {', '.join(sorted(known))}")


def check_runnable(names: list[str] | None, device: str, control: bool, memory_dir=None) -> None:
    """Refuse a typed engine candidate the round could only list as not runnable here (a round of
    zero candidates that exits 0 would look like a verdict), with the reason the plan gives."""
    if not names:
        return
    from specpilot.bundles.memory import load_memory

    memory_ids = set(load_memory(memory_dir))
    by_id = {c["id"]: c for c in engine_catalog()}
    for name in names:
        if name == CONTROL:
            if not control:
                raise InputError(f"--candidates {CONTROL}: the control runs with --control")
            continue
        why = cannot_run_here(by_id[name], memory_ids, device)
        if why:
            raise InputError(f"--candidates {name}: cannot run here: {why}")


def cannot_run_here(candidate: dict, memory_ids: set[str] | None, device: str) -> str | None:
    """Why the round cannot run an engine catalog ``candidate`` on ``device`` (what ``--dry-run``
    lists as not runnable), or None."""
    needs = candidate.get("needs") or {}
    return memory_gap(candidate, memory_ids) or candidate.get("unavailable") or (
        f"needs a CUDA GPU: {candidate.get('why_device') or ''}".rstrip(": ")
        if needs.get("device") and needs["device"] != device else None)


def memory_gap(candidate: dict, memory_ids: set[str] | None) -> str | None:
    """Why ``candidate`` (an engine catalog entry) is not proposed with the memory ``memory_ids``
    (None: any memory), or None."""
    mem_id = candidate.get("memory")
    if mem_id and memory_ids is not None and mem_id not in memory_ids:
        return f"memory entry {mem_id!r} is not in the memory used"
    return None


def _best(model, family: str, limit: int | None = None) -> dict | None:
    rows = [r for r in model.by_nodes if r["family"] == family and (limit is None or r["nodes"] <= limit)]
    return max(rows, key=lambda r: r["speedup"]) if rows else None


def propose_engine(current, facts, model, meas, *, only: list[str] | None = None, control: bool = False,
                   memory_ids: set[str] | None = None) -> Proposal:
    """Candidates for an engine deployment whose current system is the spec ``current``."""
    catalog = engine_catalog()
    known = {c["id"] for c in catalog} | {CONTROL}
    for name in only or []:
        if name not in known:
            raise InputError(f"--candidates: unknown candidate {name!r}; known: {', '.join(sorted(known))}")
    lat = meas.lattice or {}
    cur_pred = model.current.get("speedup")
    proposed: list[Candidate] = []
    skipped: list[dict] = []
    for c in catalog:
        cid, mem_id = c["id"], c.get("memory")
        if only is not None and cid not in only:
            continue
        gap = memory_gap(c, memory_ids)
        if gap:
            skipped.append({"id": cid, "memory": mem_id, "reason": gap})
            continue
        if c.get("unavailable"):
            skipped.append({"id": cid, "memory": mem_id, "reason": c["unavailable"]})
            continue
        needs = c.get("needs") or {}
        if needs.get("device") and needs["device"] != facts.device:
            why = c.get("why_device") or f"needs device {needs['device']}"
            skipped.append({"id": cid, "memory": mem_id, "reason": f"needs a CUDA GPU: {why}"
                            if needs["device"] == "cuda" else why})
            continue
        change = dict(c.get("change") or {})
        retuned = None
        pred = None
        if c.get("retune") == "chain_depth":
            b = _best(model, "chain", limit=lat.get("m"))
            if b is None:
                skipped.append({"id": cid, "memory": mem_id, "reason": "no tau(N) / c(N) measured for chains "
                                "(no lattice or rows probe)"})
                continue
            change["depth"] = b["nodes"]
            pred = b["speedup"]
            retuned = (f"m = {b['nodes']} draft positions: the highest predicted tau(N)/c(N) of the chain here "
                       f"(tau {b['tau']:.3f}, c {b['c']:.3f})")
        elif c.get("retune") == "tree_nodes":
            b = _best(model, "best-first")
            if b is None:
                skipped.append({"id": cid, "memory": mem_id, "reason": "no tau(N) / c(N) measured for trees"})
                continue
            change.update(nodes=b["nodes"], depth=lat.get("m") or current.depth, topk=lat.get("k") or current.topk)
            pred = b["speedup"]
            retuned = (f"N = {b['nodes']} nodes: the highest predicted tau(N)/c(N) of the best-first tree here "
                       f"(tau {b['tau']:.3f}, c {b['c']:.3f}); depth {change['depth']}, "
                       f"{change['topk']} candidates per position as recorded")
        elif c.get("retune") == "tlv_nodes":
            b = next((r for r in model.by_nodes if r["family"] == "tlv"), None)
            if b is None or not meas.tlv:
                skipped.append({"id": cid, "memory": mem_id, "reason": "no TLV cycles recorded (the measure stage's "
                                "notes say why)"})
                continue
            from specpilot.engine.spec import EngineSpec

            rec = EngineSpec.parse(meas.tlv["spec"])
            change.update(nodes=rec.nodes, depth=rec.depth, topk=rec.topk)
            pred = b["speedup"]
            retuned = (f"N = {rec.nodes} nodes as recorded: tau {b['tau']:.3f} per exact pass, Q pass + exact pass "
                       f"{b['c']:.3f} T_AR per cycle; depth {rec.depth}, {rec.topk} candidates per position")
        try:
            spec = current.with_(**change)
        except InputError as e:
            skipped.append({"id": cid, "memory": mem_id, "reason": f"not a valid change here: {e}"})
            continue
        if str(spec) == str(current):
            skipped.append({"id": cid, "memory": mem_id, "reason": "already the current system"})
            continue
        gain = (pred / cur_pred) if (pred and cur_pred) else None
        proposed.append(Candidate(id=cid, memory=mem_id, what=c["what"], attacks=c.get("attacks"), system=str(spec),
                                  change={k: change[k] for k in change}, retuned=retuned, predicted_speedup=pred,
                                  predicted_gain=gain))
    factors = model.factors or {}

    def key(c: Candidate):
        f = factors.get(c.attacks or "")
        return (-(f if f is not None else 1.0), -(c.predicted_gain or 1.0))

    proposed.sort(key=key)
    if control:
        proposed.append(Candidate(id=CONTROL, memory=None, what="the current system itself, loaded again "
                                  "(a control: it must not be approved)", attacks=None, system=str(current),
                                  control=True))
    order = ("largest factor first (" + ", ".join(f"{k} {v:.3g}x" if v is not None else f"{k} unknown"
                                                  for k, v in factors.items()) + "), then predicted gain")
    return Proposal(proposed, skipped, order, model.largest)
