"""Two profiles side by side: what a change did to each kernel class and to the top kernels, per step.

Both profiles come from the same options (rules, floors, step selection), so a class or a kernel
name means the same thing on both sides. Kernels are matched by name and class; the kernels listed
are each side's ``top_n`` by time, merged; a kernel present on one side only shows 0 ms on the other.
In every entry ``delta`` (``delta_ms``) is candidate less base and ``relative`` that over base.
"""

from __future__ import annotations

from typing import Any

from .profile import Profile

SCHEMA = "specpilot.profile_diff/2"


def _rel(base: float, cand: float) -> float | None:
    return (cand - base) / base if base else None


def diff_profiles(base: Profile, cand: Profile, top_n: int = 15) -> dict[str, Any]:
    classes = list(dict.fromkeys([*base.classes, *cand.classes]))
    rows = []
    for c in classes:
        b, k = base.classes.get(c), cand.classes.get(c)
        bms, kms = (b.ms if b else 0.0), (k.ms if k else 0.0)
        rows.append({"class": c, "base_ms": bms, "candidate_ms": kms, "delta_ms": kms - bms, "relative": _rel(bms, kms),
                     "base_share": b.share if b else 0.0, "candidate_share": k.share if k else 0.0,
                     "base_efficiency": b.efficiency if b else None,
                     "candidate_efficiency": k.efficiency if k else None,
                     # an efficiency a model/config mismatch makes meaningless stays flagged, as in one profile
                     "base_flag": b.flag if b else None, "candidate_flag": k.flag if k else None})
    kb = {(t["name"], t["class"]): t for t in base.top}
    kc = {(t["name"], t["class"]): t for t in cand.top}
    # each side's top_n (``top`` is sorted by ms, largest first), merged: a kernel the change removed
    # stays in the list as one it added does
    picked = {(t["name"], t["class"]) for t in base.top[:top_n]} | {(t["name"], t["class"]) for t in cand.top[:top_n]}
    keys = sorted(picked, key=lambda x: (-max(kb.get(x, {}).get("ms", 0.0), kc.get(x, {}).get("ms", 0.0)), x))
    kernels = []
    for key in keys:
        bms, kms = kb.get(key, {}).get("ms", 0.0), kc.get(key, {}).get("ms", 0.0)
        kernels.append({"name": key[0], "class": key[1], "base_ms": bms, "candidate_ms": kms, "delta_ms": kms - bms,
                        "relative": _rel(bms, kms), "base_share": kb.get(key, {}).get("share", 0.0),
                        "candidate_share": kc.get(key, {}).get("share", 0.0)})
    totals = []
    for label, attr in (("step wall ms", "step_wall"), ("kernel busy ms", "kernel_busy")):
        bv, kv = getattr(base, attr).median, getattr(cand, attr).median
        totals.append({"what": label, "base": bv, "candidate": kv, "delta": kv - bv, "relative": _rel(bv, kv)})
    for label, attr in (("outside ms", "outside_ms"), ("kernel factor", "kernel_factor"),
                        ("outside factor", "outside_factor")):
        bv, kv = getattr(base, attr), getattr(cand, attr)
        if bv is not None and kv is not None:
            totals.append({"what": label, "base": bv, "candidate": kv, "delta": kv - bv, "relative": _rel(bv, kv)})
    warnings = [f"base: {w}" for w in base.warnings] + [f"candidate: {w}" for w in cand.warnings]
    bg, cg = (base.gpu or {}).get("name"), (cand.gpu or {}).get("name")
    if bg and cg and bg != cg:
        warnings.append(f"the traces come from different GPUs ({bg} -> {cg}): the difference is not the change alone")
    return {"schema": SCHEMA, "base": _summary(base), "candidate": _summary(cand), "totals": totals,
            "classes": rows, "kernels": kernels, "warnings": warnings,
            "notes": [f"base: {n}" for n in base.notes] + [f"candidate: {n}" for n in cand.notes]}


def _summary(p: Profile) -> dict:
    return {"trace": p.trace.get("path"), "gpu": (p.gpu or {}).get("name"), "steps": p.steps,
            "step_detail": p.step_detail}
