"""The tau/c cost model and its ceiling (paper 3.2).

speedup over AR = tau(N) / c(N), with c(N) = T_step(N) / T_AR. The ceiling multiplies the current
speedup by three factors, each the gain from removing one kind of waste:

- tree factor    = best reachable tau / tau            (build the tree better)
- kernel factor  = profiled GPU time / byte floor      (make kernels reach their floors)
- outside factor = step wall time / profiled GPU time  (remove time outside the profile)

ceiling = speedup x tree x kernel x outside = tau_best / (floor / T_AR). The speedup if one factor's
waste alone were removed: tau_best / c for the tree, the step without its outside time for the
outside factor, and the step with its kernels at their floor and its outside time kept for the
kernel factor (not speedup x kernel, which would shrink the outside time too). A factor whose inputs are
missing is reported as unknown and left out (taken as 1), and the result says so. A factor below 1
is no slowdown that removing a waste would bring: it says the inputs contradict each other (a
profile faster than the floor allows, a profile longer than the step, a best tau below the
current one). It is kept as measured in ``factors``, taken as 1 in the ceiling (``factors_used``),
and a warning names it and its cause, so the ceiling is never below the current speedup.
:func:`largest_factor_line` words the factor to attack, with its ``ADVICE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specpilot.errors import InputError

FACTORS = ("tree", "kernel", "outside")
# a verify step of several rows costs at least the AR step of one; below this c (noise of a few
# percent spared) the step and AR times cannot be of one deployment
C_NOISE = 0.95
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
    factors: dict[str, float | None]       # as measured (a value below 1 included)
    ceiling: float
    largest: str | None
    if_removed: dict[str, float | None]  # speedup if only this factor's waste were removed
    inputs: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    factors_used: dict[str, float | None] = field(default_factory=dict)  # in the ceiling: below 1 taken as 1
    warnings: list[str] = field(default_factory=list)  # one per factor below 1: the inputs' contradiction

    def as_dict(self) -> dict:
        return {"tau": self.tau, "c": self.c, "step_ms": self.step_ms, "ar_ms": self.ar_ms,
                "speedup": self.speedup, "factors": self.factors, "factors_used": self.factors_used,
                "ceiling": self.ceiling, "largest_factor": self.largest, "speedup_if_removed": self.if_removed,
                "inputs": self.inputs, "notes": self.notes, "warnings": self.warnings,
                "unknown_factors": [k for k, v in self.factors.items() if v is None]}


def _positive(name: str, v: float | None) -> None:
    if v is not None and not v > 0:
        raise InputError(f"{name} must be positive, got {v}")


def _taken_as_one(name: str, v: float) -> str:
    return f"the {name} factor {v:.3g} is taken as 1 in the ceiling"


def kernel_below_floor(factor: float, profile_ms: float, floor_ms: float, floor_peak_ms: float | None,
                       one_rank: bool = False) -> str:
    """The warning for a kernel factor below 1: profiled GPU time under the byte floor. Under the
    floor at the GPU's full peak (no fraction of it) no kernel can run: the model and shape options
    do not describe the profiled step (a model/config mismatch, as ``profile`` calls it); between
    that and the floor the kernels reach more of the peak than the floor's fractions assume."""
    head = _taken_as_one("kernel", factor)
    if one_rank:
        peak = f"; {floor_peak_ms:.4g} ms at the GPU's full peak" if floor_peak_ms is not None else ""
        return (f"{head}: the profiled GPU time ({profile_ms:.4g} ms) is below the byte floor ({floor_ms:.4g} ms"
                f"{peak}), and the profile is one rank's trace of a multi-GPU job, whose floor is the whole model's (see the "
                "warning on it)")
    if floor_peak_ms is not None and profile_ms < floor_peak_ms:
        return (f"model/config mismatch: {head}: the profiled GPU time ({profile_ms:.4g} ms) is below the byte floor "
                f"at the GPU's full peak ({floor_peak_ms:.4g} ms), so the model and shape options (--model, "
                "--rows/--batch/--context, the dtypes, --drafter) do not describe the profiled step")
    if floor_peak_ms is not None:
        return (f"{head}: the profiled GPU time ({profile_ms:.4g} ms) is below the byte floor ({floor_ms:.4g} ms) but "
                f"not below it at the GPU's full peak ({floor_peak_ms:.4g} ms): the kernels reach more of the peak "
                "than the floor's fractions assume (--bw-fraction, --flops-fraction)")
    return (f"{head}: the profiled GPU time ({profile_ms:.4g} ms) is below the byte floor ({floor_ms:.4g} ms): the "
            "model and shape options do not describe the profiled step (a model/config mismatch), or the kernels "
            "reach more of the peak than the floor's fractions assume")


def cost_model(tau: float, step_ms: float, ar_ms: float, tau_best: float | None = None,
               profile_ms: float | None = None, floor_ms: float | None = None,
               floor_peak_ms: float | None = None, one_rank: bool = False) -> CostModel:
    """The cost model. ``floor_peak_ms``: the byte floor at the GPU's full peak (the floor with
    both fractions 1), which tells a model/config mismatch from kernels that beat the fractions;
    ``one_rank``: the profiled GPU time is one rank's of a multi-GPU job (the floor the whole
    model's), which a kernel factor below 1 then names."""
    for name, v in (("--tau", tau), ("--step-ms", step_ms), ("--ar-ms", ar_ms), ("--tau-best", tau_best),
                    ("--profile-ms", profile_ms), ("floor", floor_ms), ("floor at full peak", floor_peak_ms)):
        _positive(name, v)
    if tau < 1:
        raise InputError(f"--tau is tokens per verification pass and cannot be below 1 (got {tau})")
    notes: list[str] = []
    warnings: list[str] = []
    c = step_ms / ar_ms
    speedup = tau / c
    if c < C_NOISE:
        warnings.append(f"c = {step_ms:.4g} / {ar_ms:.4g} ms = {c:.3g}: a verify step faster than an AR step of one "
                        "row contradicts the inputs (T_step and T_AR from different models, GPUs or shapes, or one "
                        "of them mistyped), so the speedup and the ceiling read high")
    factors: dict[str, float | None] = {"tree": None, "kernel": None, "outside": None}
    if tau_best is not None:
        factors["tree"] = tau_best / tau
        if tau_best < tau:
            warnings.append(f"{_taken_as_one('tree', factors['tree'])}: the best reachable tau ({tau_best:.4g}) is "
                            f"below the current tau ({tau:.4g}); the best reachable tau is at least the current one, "
                            "so the two come from different replays or runs")
    if profile_ms is not None and floor_ms is not None:
        factors["kernel"] = profile_ms / floor_ms
        if profile_ms < floor_ms:
            warnings.append(kernel_below_floor(factors["kernel"], profile_ms, floor_ms, floor_peak_ms, one_rank))
    if profile_ms is not None:
        factors["outside"] = step_ms / profile_ms
        if profile_ms > step_ms:
            warnings.append(f"{_taken_as_one('outside', factors['outside'])}: the profiled GPU time "
                            f"({profile_ms:.4g} ms) exceeds the step wall time ({step_ms:.4g} ms), so the profile "
                            "covers more than one step (or the step time is another engine's)"
                            + ("; the kernel factor, from the same GPU time, reads high with it"
                               if factors["kernel"] is not None else ""))
    used = {k: (max(v, 1.0) if v is not None else None) for k, v in factors.items()}
    known = {k: v for k, v in used.items() if v is not None}
    ceiling = speedup
    for v in known.values():
        ceiling *= v
    # a factor taken as 1 (measured at or below it) offers no gain: it is never the largest
    gains = {k: v for k, v in factors.items() if v is not None and v > 1}
    largest = max(gains, key=gains.get) if gains else None
    over = [f"{k} factor" if k in factors else k
            for k, v in (*factors.items(), ("c", c), ("speedup", speedup), ("ceiling", ceiling))
            if v is not None and not math.isfinite(v)]
    if over:   # a time near 0 (1e-320 ms) divides to infinity: no figure can be read from it
        given = ", ".join(f"{k} {v:.4g}" for k, v in (("tau", tau), ("step ms", step_ms), ("AR ms", ar_ms),
                                                      ("profiled ms", profile_ms), ("floor ms", floor_ms)) if v)
        raise InputError(f"the cost model's {over[0]} overflows ({given}): a time or count near 0 is not a "
                         "measurement")
    if_removed = {k: (speedup * v if v is not None else None) for k, v in used.items()}
    if used["kernel"] is not None and profile_ms <= step_ms:
        # kernels at their floors leave the time outside them as it is: the step loses only the
        # kernels' excess (a host-bound step gains little), not 1/kernel of its wall
        if_removed["kernel"] = tau * ar_ms / (step_ms - profile_ms + profile_ms / used["kernel"])
    missing = [k for k, v in factors.items() if v is None]
    if missing:
        need = {"tree": "--tau-best or --replay", "kernel": "--profile-ms/--profile and a floor (--model)",
                "outside": "--profile-ms or --profile"}
        notes.append("unknown factors taken as 1: " + ", ".join(f"{k} (needs {need[k]})" for k in missing))
    return CostModel(tau=tau, step_ms=step_ms, ar_ms=ar_ms, c=c, speedup=speedup, factors=factors, ceiling=ceiling,
                     largest=largest, if_removed=if_removed, notes=notes, factors_used=used, warnings=warnings,
                     inputs={"tau_best": tau_best, "profile_ms": profile_ms, "floor_ms": floor_ms,
                             "floor_peak_ms": floor_peak_ms})


def best_tree_tau(taus: dict[str, float], curves: dict[str, dict[int, float]],
                  current: str | None = None) -> tuple[str, float] | None:
    """The best reachable tau of one verification pass in a replay: the highest of its policies and
    of its tau(N) curves' points (``best-first:32`` where ``--nodes`` replayed 32 nodes beside a
    ``best-first:8`` policy), as (name, tau); None for an empty replay. A TLV tau counts exact
    passes of a two-pass cycle, which no draft tree reaches (an oracle does not bound it): it
    counts only where it is the ``current`` policy."""
    cands = {k: v for k, v in taus.items() if not k.startswith("tlv") or k == current}
    for fam, pts in curves.items():
        if not fam.startswith("tlv"):
            for n, v in pts.items():
                cands.setdefault(f"{fam}:{n}", v)
    if not cands:
        return None
    name = max(cands, key=cands.get)
    return name, cands[name]


def line_points(rows: int, step_ms: dict[int, float]) -> tuple[int, int] | None:
    """The probed counts :func:`step_time` draws its line through for ``rows`` it was not probed at:
    the two around it, beyond the probe the two nearest; None where it was probed (or cannot be)."""
    pts = sorted(step_ms)
    if rows in step_ms or len(pts) < 2:
        return None
    lo = max([p for p in pts if p < rows], default=None)
    hi = min([p for p in pts if p > rows], default=None)
    if lo is None:
        return pts[0], pts[1]
    if hi is None:
        return pts[-2], pts[-1]
    return lo, hi


def step_time(rows: int, step_ms: dict[int, float]) -> float | None:
    """T_step at ``rows``: measured, or linear between (beyond: from) the nearest probed counts."""
    if rows in step_ms:
        return step_ms[rows]
    line = line_points(rows, step_ms)
    if line is None:
        return None
    lo, hi = line
    return step_ms[lo] + (step_ms[hi] - step_ms[lo]) * (rows - lo) / (hi - lo)


def mean_over_rows(rows: dict[int, int], cost) -> tuple[float, float] | None:
    """(mean cost, mean rows) over steps by the rows each verified (``rows``: rows -> steps), with
    ``cost(rows)`` a step's cost (T_step, or a floor); None where a row count has none. A budget of
    N nodes verifies fewer than N + 1 rows where the drafter proposed fewer candidates (an n-gram
    drafter often proposes none): c(N) is the mean over the steps it verifies, as the paper's
    T_step(N) is the step's cost at the rows it runs."""
    total = sum(rows.values())
    costs = [(cost(r), k) for r, k in rows.items()]
    if total <= 0 or any(c is None for c, _ in costs):
        return None
    return sum(c * k for c, k in costs) / total, mean_rows(rows)


def mean_rows(rows: dict[int, int]) -> float | int:
    """The mean of a {rows: steps} histogram (whole where every step verified the same rows)."""
    if len(rows) == 1:
        return next(iter(rows))
    return sum(r * k for r, k in rows.items()) / sum(rows.values())


def largest_factor_line(largest: str | None, factors: dict[str, float | None], name=str) -> str | None:
    """The sentence that names the factor to attack: the largest with its advice where it offers a
    gain (above 1), else that none does; None when no factor is known. ``name`` dresses the
    factor's name (the round report's Markdown bold). ``largest`` is None where no factor offers a
    gain: the sentence says so where any factor is known."""
    if not largest:
        return ("No known factor offers a gain (each is 1 or below)."
                if any(v is not None for v in factors.values()) else None)
    v = factors.get(largest)
    if v is not None and v > 1:
        return f"Largest factor: {name(largest)} ({v:.3g}x): {ADVICE[largest]}."
    return "No known factor offers a gain (each is 1 or below)."
