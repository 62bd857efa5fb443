"""Stage 4, approve: each candidate against the current system, with the ``compare`` library
(paired ABBA runs on the same prompts, A/A noise of the current system in the same run) and the
``audit`` library against stock (token forcing, phase 0 against AR). The paper's rule decides
(:func:`specpilot.auditors.timing.judge`): the 95% lower bound of the gain must exceed
1% + 2 x noise, 3% when the candidate's outputs differ from the current system's; and the audit
must pass. An approved candidate becomes the current system for the next one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from specpilot.fileio import is_int, is_num, need

SCHEMA = "specpilot.round-decisions/1"


@dataclass
class Decision:
    id: str
    memory: str | None
    system: str | None                 # the candidate (engine spec, or the SGLang bundles applied)
    base: str | None                   # the current system it was compared with
    verdict: str                       # approved | refused | skipped
    reason: str
    control: bool = False
    pairs: int = 0
    timing: dict | None = None         # specpilot.timing/1
    audit: dict | None = None          # specpilot.audit/1 data
    files: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


# each field's check, and what it must be: an entry of the wrong shape is named, not a TypeError
_FIELDS = {"id": (lambda v: isinstance(v, str) and bool(v), "a candidate name"),
           "memory": (lambda v: v is None or isinstance(v, str), "a memory entry name or null"),
           "system": (lambda v: v is None or isinstance(v, str), "a system (text) or null"),
           "base": (lambda v: v is None or isinstance(v, str), "a system (text) or null"),
           "verdict": (lambda v: v in ("approved", "refused", "skipped"), "approved, refused or skipped"),
           "reason": (lambda v: isinstance(v, str), "text"),
           "control": (lambda v: isinstance(v, bool), "true or false"),
           "pairs": (lambda v: is_int(v) and v >= 0, "a whole number >= 0"),
           "timing": (lambda v: v is None or isinstance(v, dict), "an object or null"),
           "audit": (lambda v: v is None or isinstance(v, dict), "an object or null"),
           "files": (lambda v: isinstance(v, dict), "an object"),
           "seconds": (lambda v: is_num(v) and v >= 0, "a number of seconds")}
_REQUIRED = ("id", "memory", "system", "base", "verdict", "reason")


def decisions_from_json(d: dict) -> list[Decision]:
    """The decisions of a ``specpilot.round-decisions/1`` document (a malformed entry is a
    ValueError naming it and what is wrong)."""
    rows = d["decisions"]
    if not isinstance(rows, list):
        raise ValueError(f"'decisions' is a {type(rows).__name__}, not a list of entries")
    out = []
    for i, x in enumerate(rows):
        if not isinstance(x, dict):
            raise ValueError(f"decisions[{i}] is a {type(x).__name__}, not an object (a candidate's decision)")
        name = f"decisions[{i}]" + (f" ({x['id']})" if isinstance(x.get("id"), str) else "")
        for key in x:
            if key not in _FIELDS:
                raise ValueError(f"{name}: unknown field {key!r} (known: {', '.join(_FIELDS)})")
        for key in _REQUIRED:
            if key not in x:
                raise ValueError(f"{name}: no field {key!r}")
        for key, v in x.items():
            check, want = _FIELDS[key]
            if not check(v):
                raise ValueError(f"{name}: {key} must be {want}, not {v!r:.40}")
        _check_timing(x.get("timing"), f"{name}: timing")
        _check_audit(x.get("audit"), f"{name}: audit")
        out.append(Decision(**x))
    return out


def _check_timing(t, name: str) -> None:
    """The numbers the report and the approve stage read from a decision's timing."""
    if t is None:
        return
    for key in ("gain", "ci_low", "ci_high"):   # ratios of tokens/s
        need(is_num(t.get(key)) and t[key] > 0, f"{name}.{key}", "a number > 0", t.get(key))
    need(t["ci_low"] <= t["ci_high"], f"{name}.ci_low", f"at most ci_high ({t['ci_high']})", t["ci_low"])
    need(is_num(t.get("threshold")) and t["threshold"] >= 0, f"{name}.threshold", "a number >= 0",
          t.get("threshold"))
    if t.get("noise") is not None:
        need(is_num(t["noise"]) and t["noise"] >= 0, f"{name}.noise", "a number >= 0 or null", t["noise"])
    for key in ("outputs_identical", "changes_output"):   # the report prints one, the record keeps the other
        if t.get(key) is not None:
            need(isinstance(t[key], bool), f"{name}.{key}", "true, false or null", t[key])
    la = t.get("load_average")   # the remember stage quotes it
    if la is not None:
        need(isinstance(la, list) and len(la) == 2 and all(v is None or is_num(v) for v in la),
              f"{name}.load_average", "two numbers (or nulls), or null", la)
    if t.get("runs") is not None:
        need(is_int(t["runs"]) and t["runs"] >= 0, f"{name}.runs", "a whole number >= 0", t["runs"])
    if t.get("t_ci") is not None:
        need(isinstance(t["t_ci"], list) and len(t["t_ci"]) == 2 and all(is_num(v) for v in t["t_ci"]),
              f"{name}.t_ci", "two numbers or null", t["t_ci"])
    samples = t.get("samples", [])
    need(isinstance(samples, list), f"{name}.samples", "a list", samples)
    for i, s in enumerate(samples):
        need(isinstance(s, dict) and is_num(s.get("ratio")) and s["ratio"] > 0, f"{name}.samples[{i}].ratio",
              "a number > 0", s.get("ratio") if isinstance(s, dict) else s)


def _check_audit(a, name: str) -> None:
    """The fields the report reads from a decision's audit."""
    if a is None:
        return
    # an audit that ran always says its verdict and its systems (specpilot.audit/1)
    need(a.get("verdict") in ("pass", "reject"), f"{name}.verdict", "pass or reject", a.get("verdict"))
    if a.get("delta") is not None:   # the record keeps it
        need(is_num(a["delta"]) and a["delta"] >= 0, f"{name}.delta", "a number >= 0 or null", a["delta"])
    systems = a.get("systems")
    need(isinstance(systems, list) and bool(systems), f"{name}.systems", "a list of the audited systems", systems)
    for i, s in enumerate(systems):
        n = f"{name}.systems[{i}]"
        need(isinstance(s, dict), n, "an object", s)
        need(isinstance(s.get("role"), str), f"{n}.role", "text", s.get("role"))
        for key in ("tokens", "events", "mismatches"):
            if s.get(key) is not None or key == "events":   # the report plots the events, rate and interval
                need(is_int(s.get(key)) and s[key] >= 0, f"{n}.{key}", "a whole number >= 0", s.get(key))
        need(is_num(s.get("mismatch_rate")) and 0 <= s["mismatch_rate"] <= 1, f"{n}.mismatch_rate",
              "a number in [0, 1]", s.get("mismatch_rate"))
        ci = s.get("mismatch_ci")
        need(isinstance(ci, list) and len(ci) == 2 and all(is_num(v) and 0 <= v <= 1 for v in ci) and ci[0] <= ci[1],
              f"{n}.mismatch_ci", "two numbers in [0, 1], low first", ci)


def audit_data(result, scorer_info) -> dict:
    """The audit as ``specpilot audit --format json`` writes it (``specpilot.audit/1``)."""
    return result.to_json(asdict(scorer_info) if scorer_info is not None else None)


def run_audit(candidate_outputs, stock, ar, scorer, seed: int = 0):
    """Score the candidate's, stock's and AR's outputs and audit the candidate against stock."""
    from specpilot.auditors.forcing import audit, score_outputs

    scored = score_outputs(scorer, candidate_outputs, "system")
    st = score_outputs(scorer, stock, "stock")
    a = score_outputs(scorer, ar, "ar") if ar is not None else None
    return audit([scored], st, a, seed=seed)


def audit_reasons(data: dict) -> list[str]:
    return [r for s in data.get("systems", []) if s.get("role") == "system" for r in s.get("reasons", [])]


def decide(timing: dict, audit: dict | None) -> tuple[str, str]:
    """(verdict, reason) from a timing result and an audit."""
    t_ok = bool(timing.get("approved"))
    a_ok = audit is None or audit.get("verdict") == "pass"
    rule = "3% rule: outputs differ from the current system's" if timing.get("changes_output") else "1% + 2 x noise rule"
    timing_text = (f"gain {timing['gain']:.4f}x, 95% lower bound {min(timing['ci_low'], timing['t_ci'][0]):.4f} vs "
                   f"threshold {1 + timing['threshold']:.4f} ({rule})")
    if t_ok and a_ok:
        return "approved", f"faster: {timing_text}; audit PASS against stock"
    why = []
    if not t_ok:
        why.append(f"not shown faster: {timing_text}")
    if not a_ok:
        why.append("audit REJECT: " + "; ".join(audit_reasons(audit) or ["rejected"]))
    return "refused", "; ".join(why)


def compare_engines(base_sys, cand_sys, pairs: int, seed: int, tick=None):
    from specpilot.auditors.pairing import paired_compare

    return paired_compare(base_sys, cand_sys, runs=pairs, warmup=1, seed=seed, tick=tick)


def elapsed(t0: float) -> float:
    return time.perf_counter() - t0
