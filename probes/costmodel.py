"""The tau/c cost model and its ceiling (paper 3.2).

speedup over AR = tau(N) / c(N), with c(N) = T_step(N) / T_AR. The ceiling multiplies the current
speedup by three factors, each the gain from removing one kind of waste:

- tree factor    = best reachable tau / tau            (build the tree better)
- kernel factor  = profiled GPU time / byte floor      (make kernels reach their floors)
- outside factor = step wall time / profiled GPU time  (remove time outside the profile)

ceiling = speedup x tree x kernel x outside = tau_best / (floor / T_AR). A factor whose inputs are
missing is reported as unknown and left out (taken as 1), and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.errors import InputError

FACTORS = ("tree", "kernel", "outside")
ADVICE = {
    "tree": "build a better draft tree (replay policies: specpilot replay)",
    "kernel": "make kernels reach their byte floors (e.g. W12 weights, fused kernels)",
    "outside": "remove time outside the GPU profile (CUDA graphs, scheduler and launch overhead)",
}


@dataclass
class CostModel:
    tau: float
    step_ms: float
    ar_ms: float
    c: float
    speedup: float
    factors: dict[str, float | None]
    ceiling: float
    largest: str | None
    if_removed: dict[str, float | None]  # speedup if only this factor's waste were removed
    inputs: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"tau": self.tau, "c": self.c, "step_ms": self.step_ms, "ar_ms": self.ar_ms,
                "speedup": self.speedup, "factors": self.factors, "ceiling": self.ceiling,
                "largest_factor": self.largest, "speedup_if_removed": self.if_removed,
                "inputs": self.inputs, "notes": self.notes,
                "unknown_factors": [k for k, v in self.factors.items() if v is None]}


def _positive(name: str, v: float | None) -> None:
    if v is not None and not v > 0:
        raise InputError(f"{name} must be positive, got {v}")


def cost_model(tau: float, step_ms: float, ar_ms: float, tau_best: float | None = None,
               profile_ms: float | None = None, floor_ms: float | None = None) -> CostModel:
    for name, v in (("--tau", tau), ("--step-ms", step_ms), ("--ar-ms", ar_ms), ("--tau-best", tau_best),
                    ("--profile-ms", profile_ms), ("floor", floor_ms)):
        _positive(name, v)
    if tau < 1:
        raise InputError(f"--tau is tokens per verification pass and cannot be below 1 (got {tau})")
    notes: list[str] = []
    c = step_ms / ar_ms
    speedup = tau / c
    factors: dict[str, float | None] = {"tree": None, "kernel": None, "outside": None}
    if tau_best is not None:
        factors["tree"] = tau_best / tau
        if tau_best < tau:
            notes.append(f"best reachable tau {tau_best:.3g} is below the current tau {tau:.3g}: check the replay inputs")
    if profile_ms is not None and floor_ms is not None:
        factors["kernel"] = profile_ms / floor_ms
        if profile_ms < floor_ms:
            notes.append("profiled GPU time is below the byte floor: the floor fractions are stricter than this GPU")
    if profile_ms is not None:
        factors["outside"] = step_ms / profile_ms
        if profile_ms > step_ms:
            notes.append("profiled GPU time exceeds the step wall time: does the profile cover more than one step?")
    known = {k: v for k, v in factors.items() if v is not None}
    ceiling = speedup
    for v in known.values():
        ceiling *= v
    largest = max(known, key=known.get) if known else None
    if_removed = {k: (speedup * v if v is not None else None) for k, v in factors.items()}
    missing = [k for k, v in factors.items() if v is None]
    if missing:
        need = {"tree": "--tau-best or --replay", "kernel": "--profile-ms/--profile and a floor (--model)",
                "outside": "--profile-ms or --profile"}
        notes.append("unknown factors taken as 1: " + ", ".join(f"{k} (needs {need[k]})" for k in missing))
    return CostModel(tau=tau, step_ms=step_ms, ar_ms=ar_ms, c=c, speedup=speedup, factors=factors, ceiling=ceiling,
                     largest=largest, if_removed=if_removed, notes=notes,
                     inputs={"tau_best": tau_best, "profile_ms": profile_ms, "floor_ms": floor_ms})


def step_time(rows: int, step_ms: dict[int, float]) -> float | None:
    """T_step at ``rows``: measured, or linear between (beyond: from) the nearest probed counts."""
    if rows in step_ms:
        return step_ms[rows]
    pts = sorted(step_ms)
    if len(pts) < 2:
        return None
    lo = max([p for p in pts if p < rows], default=None)
    hi = min([p for p in pts if p > rows], default=None)
    if lo is None:
        lo, hi = pts[0], pts[1]
    elif hi is None:
        lo, hi = pts[-2], pts[-1]
    return step_ms[lo] + (step_ms[hi] - step_ms[lo]) * (rows - lo) / (hi - lo)
