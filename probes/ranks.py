"""Tensor-parallel ranks: one profile per rank, side by side, and which rank each step waits for.

Each rank's trace (one file per rank, or one GPU of a multi-GPU Nsight export) is profiled with the
same options. Steps are matched by position: the i-th profiled step of every rank is one step of
the group. A tensor-parallel step ends when its slowest rank does, so per step the group's busy
time is the largest rank's, and ``imbalance`` = (slowest - fastest) / slowest. Communication
(NCCL/RCCL and custom all-reduce kernels) is its own class, with a byte floor from the message
sizes the trace records and the GPU's link bandwidth.
"""

from __future__ import annotations

from collections import Counter
from statistics import median
from typing import Any

from specpilot.errors import InputError

from .profile import Profile

SCHEMA = "specpilot.profile_ranks/1"
TIE = "tie"   # the ``slowest`` count of steps whose slowest busy time two or more ranks share


def rank_profiles(profiles: list[Profile], labels: list[str], found: list[int] | None = None) -> dict[str, Any]:
    """The ranks side by side. ``found``: the steps each rank's trace held, where the profiles were
    cut to the first ``min(found)`` (every figure is then over the steps every rank has)."""
    if len(profiles) < 2:
        raise InputError("tensor-parallel mode needs two or more ranks (trace files, or --ranks on a multi-GPU trace)")
    n = min(p.steps for p in profiles)
    if n == 0:
        raise InputError("a rank has no steps to compare")
    counts = found or [p.steps for p in profiles]
    if len(set(counts)) > 1:
        cut = len({p.steps for p in profiles}) == 1
        note = (f"ranks found different step counts ({', '.join(map(str, counts))}); "
                + (f"every figure is over the first {n} of each" if cut else f"the first {n} of each are compared"))
    else:
        note = None
    classes = list(dict.fromkeys(c for p in profiles for c in p.classes))
    ranks = []
    for label, p in zip(labels, profiles):
        comm = p.classes.get("communication")
        ranks.append({"rank": label, "trace": p.trace.get("path"), "gpu": (p.gpu or {}).get("name"), "steps": p.steps,
                      "kernel_busy_ms": p.kernel_busy.median, "step_wall_ms": p.step_wall.median,
                      "classes": {c: (p.classes[c].ms if c in p.classes else 0.0) for c in classes},
                      "communication_ms": comm.ms if comm else 0.0,
                      "communication_bytes": comm.bytes if comm else None,
                      "communication_floor_ms": comm.floor_ms if comm else None,
                      "communication_efficiency": comm.efficiency if comm else None})
    per_step, slowest = [], Counter()
    for i in range(n):
        busy = [p.per_step[i]["busy_ms"] for p in profiles]
        top = max(range(len(busy)), key=lambda r: busy[r])
        tie = busy.count(busy[top]) > 1   # no rank is the slowest: none is credited
        slowest[TIE if tie else labels[top]] += 1
        per_step.append({"step": i, "busy_ms": busy, "slowest": None if tie else labels[top], "max_busy_ms": busy[top],
                         "imbalance": (busy[top] - min(busy)) / busy[top] if busy[top] else 0.0})
    # each rank's warnings named by their rank (as a diff names base: and candidate:); a note every
    # rank has once, any other named by its rank
    shared = [x for x in dict.fromkeys(x for p in profiles for x in p.notes) if all(x in p.notes for p in profiles)]
    notes = ([note] if note else []) + shared + [f"{label}: {x}" for label, p in zip(labels, profiles)
                                                 for x in p.notes if x not in shared]
    warnings = [f"{label}: {w}" for label, p in zip(labels, profiles) for w in p.warnings]
    gpus = list(dict.fromkeys(r["gpu"] for r in ranks if r["gpu"]))
    if len(gpus) > 1:   # one tensor-parallel group runs on one kind of GPU: the imbalance is the GPUs'
        warnings.insert(0, f"the ranks' traces come from different GPUs ({', '.join(gpus)}): they are not one "
                           "tensor-parallel group's, and the imbalance is the GPUs' difference")
    return {"schema": SCHEMA, "ranks": ranks, "classes": classes, "steps": n,
            "group_busy_ms": median(s["max_busy_ms"] for s in per_step),
            "imbalance": median(s["imbalance"] for s in per_step),
            "slowest": dict(slowest.most_common()), "per_step": per_step, "warnings": warnings, "notes": notes}
