"""Stage 5, remember: approved mechanisms recorded for this deployment with their evidence, so the
next round starts from the result (paper 3.5: reused entries are retuned and remeasured per
deployment).

A **deployment record** (``specpilot.deployment-record/1``, YAML) is one file per deployment in
the records folder (``--records``, default ``~/.cache/specpilot/deployments``), named by the
deployment's identity (target, hardware, dtype, drafter, serving shape). It holds the stock
system, every round's start and final system, what was approved (figures, files, versions, what
remains unverified) and what was refused, and ``current``: the system the next round starts from.
The memory entries themselves are not edited: their evidence is generated from benchmark results.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path

from specpilot.errors import InputError
from specpilot.fileio import is_int, is_num, load_yaml, need

SCHEMA = "specpilot.deployment-record/1"


def default_records_dir() -> Path:
    # a blank value counts as unset (it would make a folder named " " in the current folder)
    return Path((os.environ.get("SPECPILOT_RECORDS") or "").strip() or Path.home() / ".cache" / "specpilot" / "deployments")


def record_path(records_dir: str | Path | None, identity: str) -> Path:
    return Path(records_dir or default_records_dir()) / f"{identity}.yaml"


def read_record(path: Path) -> dict | None:
    import yaml

    if not path.is_file():
        return None
    try:
        doc = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise InputError(f"{path}: unknown schema {doc.get('schema') if isinstance(doc, dict) else doc!r}; "
                         f"expected {SCHEMA}")
    return doc


def check_record(doc: dict) -> None:
    """What a resume's remember stage and the report read from a deployment record (the round's
    copy, ``remember/record.yaml``, is the one the report quotes): its rounds and current system,
    the last round's approved mechanisms. A ValueError naming the field."""
    rounds = doc.get("rounds") or []
    need(isinstance(rounds, list) and all(isinstance(r, dict) for r in rounds), "rounds", "a list of rounds", rounds)
    need(doc.get("current") is None or isinstance(doc["current"], str), "current", "a system (text) or null",
         doc.get("current"))
    approved = (rounds or [{}])[-1].get("approved") or []
    need(isinstance(approved, list), f"rounds[{len(rounds) - 1}].approved", "a list", approved)
    for i, a in enumerate(approved):
        name = f"rounds[{len(rounds) - 1}].approved[{i}]"
        need(isinstance(a, dict), name, "an object", a)
        need(isinstance(a.get("id"), str), f"{name}.id", "a candidate name", a.get("id"))
        need(a.get("memory") is None or isinstance(a["memory"], str), f"{name}.memory", "a memory entry or null",
             a.get("memory"))
        need(a.get("gain") is None or (is_num(a["gain"]) and a["gain"] > 0), f"{name}.gain", "a number > 0 or null",
             a.get("gain"))
        un = a.get("unverified") or []
        need(isinstance(un, list) and all(isinstance(x, str) for x in un), f"{name}.unverified", "a list of text",
             un)


def check_changes(d: dict) -> dict:
    """``remember/changes.json`` (``specpilot.round-memory/1``) as the report reads it: a
    ValueError naming the field."""
    need(isinstance(d.get("record"), str), "record", "a file name", d.get("record"))
    for side in ("before", "after"):
        v = d.get(side)
        need(isinstance(v, dict), side, "an object {current, rounds}", v)
        need(isinstance(v.get("current"), str) or (side == "before" and "current" in v and v["current"] is None),
             f"{side}.current", "a system (text)" + (" or null" if side == "before" else ""), v.get("current"))
        need(is_int(v.get("rounds")) and v["rounds"] >= 0, f"{side}.rounds", "a whole number >= 0", v.get("rounds"))
    for key in ("approved", "refused"):
        v = d.get(key, [])
        need(isinstance(v, list) and all(isinstance(x, dict) for x in v), key, "a list of objects", v)
    return d


def versions() -> dict:
    out = {"python": platform.python_version()}
    from specpilot import __version__

    out["specpilot"] = __version__
    for mod in ("torch", "triton", "transformers"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:
            out[mod] = None
    return out


def _approved_item(d, facts, machine_note: str, unverified_extra: list[str]) -> dict:
    t = d.timing or {}
    a = d.audit or {}
    sysrow = next((s for s in a.get("systems", []) if s.get("role") == "system"), {})
    stock = next((s for s in a.get("systems", []) if s.get("role") == "stock"), {})
    unverified = list(unverified_extra)
    tokens = sysrow.get("tokens") or 0
    if tokens and tokens < 1000:
        unverified.append(f"audited on {tokens} tokens: one mismatch moves the rate by {100 / tokens:.2f} pp "
                          "(1000+ tokens for the 0.5 pp rule to mean much)")
    return {
        "id": d.id, "memory": d.memory, "system": d.system, "compared_with": d.base,
        "gain": t.get("gain"), "ci_95": [t.get("ci_low"), t.get("ci_high")], "t_ci_95": t.get("t_ci"),
        "noise": t.get("noise"), "threshold": t.get("threshold"), "pairs": t.get("runs"),
        "changes_output": t.get("changes_output"),
        "audit": {"verdict": a.get("verdict"), "delta": a.get("delta"), "tokens": tokens,
                  "mismatch_rate": sysrow.get("mismatch_rate"), "stock_mismatch_rate": stock.get("mismatch_rate"),
                  "events": sysrow.get("events")},
        "files": d.files, "measured_on": machine_note, "unverified": unverified,
    }


def build_entry(round_dir: Path, facts, stock: str, start: str, final: str, decisions, extra_unverified: dict,
                budget_note: str, round_id: str | None = None) -> dict:
    machine = facts.gpu or facts.cpu or facts.device
    approved = [_approved_item(d, facts, machine, extra_unverified.get(d.id, [])) for d in decisions
                if d.verdict == "approved"]
    return {
        "round": str(Path(round_dir).resolve()), "round_id": round_id,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "start": start, "final": final, "stock": stock, "versions": versions(), "budget": budget_note,
        "approved": approved,
        "refused": [{"id": d.id, "memory": d.memory, "system": d.system, "reason": d.reason, "control": d.control}
                    for d in decisions if d.verdict == "refused"],
        "skipped": [{"id": d.id, "memory": d.memory, "reason": d.reason} for d in decisions if d.verdict == "skipped"],
    }


def remember(path: Path, facts, stock: str, entry: dict, legacy_key: str | None = None) -> tuple[dict, dict | None]:
    """Append ``entry`` (one round; its own earlier entry is replaced) to the deployment's record and
    write it atomically; returns (the new record, the record as it was before this round: without
    its own earlier entry, None when there was none)."""
    import yaml

    from specpilot.fileio import atomic_open

    before = read_record(path)
    doc = dict(before) if before else {"schema": SCHEMA, "identity": facts.identity(), "deployment": facts.to_json(),
                                       "stock": stock, "rounds": []}
    rounds = list(doc.get("rounds") or [])
    # a resumed round that judged more replaces its own entry, found by the id round.json got at the
    # round's start: another round in a folder of the same name is a round of its own. A round
    # started before rounds had ids has only its folder to go by.
    if entry.get("round_id"):
        at = next((i for i, r in enumerate(rounds) if isinstance(r, dict) and r.get("round_id") == entry["round_id"]),
                  None)
    else:
        at = next((i for i, r in enumerate(rounds) if isinstance(r, dict) and not r.get("round_id")
                   and r.get("round") in (entry["round"], legacy_key)), None)
    if at is None:
        rounds.append(entry)
    else:
        rounds[at] = entry
    doc["rounds"] = rounds
    if at is None or at == len(rounds) - 1:
        doc["current"] = entry["final"]
    if "bundles" in entry:  # SGLang: the bundles the next round starts with
        doc["bundles"], doc["settings"] = entry["bundles"], entry.get("settings") or {}
    doc = json.loads(json.dumps(doc, default=str))  # plain types for YAML
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w") as fh:
        fh.write(yaml.safe_dump(doc, sort_keys=False, width=110, allow_unicode=True))
    if before is not None and at is not None:   # a resumed round: what stood before its first entry
        old = list(before.get("rounds") or [])
        prev = old[at - 1] if at > 0 else None
        current = before.get("current") if at < len(old) - 1 else (prev.get("final") if isinstance(prev, dict)
                                                                    else None)
        before = {**before, "rounds": old[:at] + old[at + 1:], "current": current}
        if not before["rounds"]:
            before = None
    return doc, before
