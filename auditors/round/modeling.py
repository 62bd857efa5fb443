"""Stage 2, model: the cost model of the current system, its ceiling's three factors, the largest
one, and the predicted speedup tau(N) / c(N) per node budget (paper 3.2).

* tau: 1 for AR; else the replayed tau of the current system's policy (``chain:m``,
  ``best-first:N``) on the recorded lattice. Best reachable tau: the highest tau of any replayed
  policy (the top-K oracle included).
* c(N) = E[T_step(rows)] / T_AR: the rows probe's step time at the rows each recorded step's tree
  of budget N verifies (1 + its size: N + 1 when the drafter filled it, fewer when it proposed
  fewer candidates, 1 when it proposed none), averaged over the steps; step times between probed
  row counts are interpolated linearly.
* TLV (an engine deployment's recorded TLV cycles, ``measure.record_tlv``): tau per exact pass
  of ``tlv:N`` over c = (Q pass + exact pass ms per cycle) / T_AR, at the recorded N.
* kernel factor = profiled GPU busy ms / byte floor ms; outside factor = step wall ms / GPU busy
  ms (the profile of the engine's real decode steps). Unknown without a profile (CPU).

The numbers go through :func:`specpilot.probes.ceiling.compute_ceiling`, the ``ceiling`` verb's
library, so the round's model is the one ``specpilot ceiling`` prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specpilot.fileio import is_int, is_num, need, need_fields
from specpilot.probes.costmodel import mean_over_rows, step_time  # noqa: F401  (step_time: ceiling --check too)

SCHEMA = "specpilot.round-model/1"


@dataclass
class ModelResult:
    current: dict                      # policy, rows, tau, c, speedup
    cost_model: dict | None            # compute_ceiling's cost_model (factors, ceiling, largest)
    largest: str | None
    factors: dict[str, float | None]
    by_nodes: list[dict] = field(default_factory=list)   # family, nodes, rows, tau, c, speedup
    best: dict | None = None
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "ModelResult":
        need_fields(d, cls)
        _check_model(d)
        return cls(**{k: v for k, v in d.items() if k != "schema"})


def _positive_or_none(v) -> bool:
    return v is None or (is_num(v) and v > 0)


def _check_model(d: dict) -> None:
    """The fields the report and a resume read have the types the stage writes: a ValueError naming
    the field (the reader says the file is malformed)."""
    def row(r, name: str, fields=("tau", "c", "speedup"), nulls: bool = False) -> None:
        need(isinstance(r, dict), name, "an object", r)
        for k in fields:   # tokens per pass, step ratios and speedups: all positive
            v = r.get(k)
            ok = (v is None and nulls) or (is_num(v) and v > 0)
            need(ok, f"{name}.{k}", "a number > 0 or null" if nulls else "a number > 0", v)

    if "current" in d:   # a field missing is need_fields' to name
        # null where the round had no replayed tau or no rows probe (skipped for time)
        row(d["current"], "current", nulls=True)
    for key in ("factors", "sources"):
        if key in d:
            need(isinstance(d[key], dict), key, "an object", d[key])
    for k, v in (d.get("factors") or {}).items():
        need(_positive_or_none(v), f"factors.{k}", "a number > 0 or null", v)
    if d.get("largest") is not None:
        need(isinstance(d["largest"], str), "largest", "a factor name or null", d["largest"])
    if d.get("cost_model") is not None:
        cm = d["cost_model"]
        need(isinstance(cm, dict), "cost_model", "an object or null", cm)
        need(_positive_or_none(cm.get("ceiling")), "cost_model.ceiling", "a number > 0 or null", cm.get("ceiling"))
        sir = cm.get("speedup_if_removed") or {}
        need(isinstance(sir, dict), "cost_model.speedup_if_removed", "an object", sir)
        for k, v in sir.items():
            need(_positive_or_none(v), f"cost_model.speedup_if_removed.{k}", "a number > 0 or null", v)
    rows = d.get("by_nodes", [])
    need(isinstance(rows, list), "by_nodes", "a list", rows)
    for i, r in enumerate(rows):
        row(r, f"by_nodes[{i}]", ("rows", "tau", "c", "speedup"))
        need(isinstance(r.get("family"), str), f"by_nodes[{i}].family", "a family name", r.get("family"))
        need(is_int(r.get("nodes")), f"by_nodes[{i}].nodes", "a whole number", r.get("nodes"))
    if d.get("best") is not None:
        row(d["best"], "best")
    need(isinstance(d.get("notes", []), list), "notes", "a list", d.get("notes"))

    def predicted(self, family: str, nodes: int | None) -> dict | None:
        if family == "ar":
            return {"family": "ar", "nodes": 0, "rows": 1, "tau": 1.0, "c": 1.0, "speedup": 1.0}
        return next((r for r in self.by_nodes if r["family"] == family and r["nodes"] == nodes), None)


def expected_c(family: str, n: int, step_ms: dict[int, float], ar_ms: float, verify_rows: dict) -> tuple[float, float] | None:
    """(c, mean rows) of a tree of budget ``n``: over the recorded steps when their row counts are
    known, else at N + 1 rows."""
    hist = (verify_rows.get(family) or {}).get(str(n))
    got = mean_over_rows({int(r): k for r, k in hist.items()} if hist else {n + 1: 1},
                         lambda r: step_time(r, step_ms))
    return None if got is None else (got[0] / ar_ms, got[1])


def predict(curves: dict[str, dict[int, float]], step_ms: dict[int, float], ar_ms: float,
            verify_rows: dict | None = None) -> list[dict]:
    out = []
    for family in ("chain", "best-first"):
        for n, tau in sorted((curves.get(family) or {}).items()):
            if not ar_ms:
                continue
            got = expected_c(family, n, step_ms, ar_ms, verify_rows or {})
            if got is None:
                continue
            c, rows = got
            out.append({"family": family, "nodes": n, "rows": rows, "tau": tau, "c": c, "speedup": tau / c})
    return out


def tlv_passes_ms(tlv: dict) -> float:
    """A TLV cycle's target passes, Q pass + exact pass, in ms (the recording run's clock). The
    drafts are left out, as the chain and tree rows leave drafting out of T_step."""
    return tlv["time_ms"]["qpass"] + tlv["time_ms"]["exact"]


def tlv_row(tlv: dict, ar_ms: float) -> dict:
    """The TLV prediction at the recorded budget: tau per exact pass over the cycle's two passes."""
    c = tlv_passes_ms(tlv) / ar_ms
    return {"family": "tlv", "nodes": tlv["nodes"], "rows": float(tlv["nodes"] + 1), "tau": tlv["tau"], "c": c,
            "speedup": tlv["tau"] / c}


def build_model(meas) -> ModelResult:
    """The model of the current system from stage 1's :class:`~.measure.Measurement`."""
    from specpilot.probes.ceiling import compute_ceiling
    from specpilot.probes.ceiling_inputs import CeilingRequest, Measurements, ProfileFigures
    from specpilot.probes.costmodel import best_tree_tau

    notes: list[str] = []
    taus = meas.taus
    if meas.current_policy == "ar":
        tau = 1.0
    else:
        tau = taus.get(meas.current_policy)
        if tau is None:
            notes.append(f"no replayed tau for {meas.current_policy}; the model cannot place the current system")
    # the best reachable tau of one pass: the tree lattice's policies and curves (TLV's tau counts exact passes)
    best = best_tree_tau(taus, meas.curves)
    best_policy, tau_best = best if best else (None, None)
    rows = meas.current_rows
    ar_ms = meas.ar_ms
    step = meas.step_ms.get(rows)
    fam, _, arg = meas.current_policy.partition(":")
    if fam in ("chain", "best-first") and ar_ms:
        got = expected_c(fam, int(arg) if arg else rows - 1, meas.step_ms, ar_ms, meas.verify_rows)
        if got is not None:
            step = got[0] * ar_ms  # the current system's mean step, at the rows its trees verify
    if fam == "tlv" and ar_ms and meas.tlv:
        step = tlv_passes_ms(meas.tlv)   # a cycle's two target passes
    by_nodes = predict(meas.curves, meas.step_ms, ar_ms, meas.verify_rows) if ar_ms else []
    if ar_ms and meas.tlv:
        by_nodes.append(tlv_row(meas.tlv, ar_ms))
    best = max(by_nodes, key=lambda r: r["speedup"]) if by_nodes else None
    cost = None
    factors: dict[str, float | None] = {"tree": None, "kernel": None, "outside": None}
    sources: dict[str, str] = {}
    if tau is not None and step and ar_ms:
        m = Measurements()
        c_probe = step / ar_ms
        profile = None
        if meas.profile:
            p = meas.profile
            if p.get("kernel_busy_ms") and p.get("step_wall_ms"):
                # T_step on the profile's clock (real decode steps, host work included) and T_AR on
                # the same clock through the rows probe's c(N)
                m.set("step_ms", p["step_wall_ms"], "profile of the engine's decode steps")
                m.set("ar_ms", p["step_wall_ms"] / c_probe, "profile step wall / rows probe c(N)")
                floor = p.get("total_floor_ms")
                profile = ProfileFigures(source="measure/profile.json", kernel_busy_ms=float(p["kernel_busy_ms"]),
                                         step_wall_ms=float(p["step_wall_ms"]),
                                         total_floor_ms=float(floor) if floor else None, rows=rows)
        lattice = "measure/tlv.lattice.jsonl" if fam == "tlv" else "measure/replay.json"
        m.set("tau", tau, "AR: one token per pass" if meas.current_policy == "ar"
              else f"replay {lattice} ({meas.current_policy})")
        if tau_best is not None:
            if tau > tau_best:   # the current system (a TLV cycle counts exact passes) already beats the trees
                m.set("tau_best", tau, f"replay {lattice} ({meas.current_policy}, the current system)")
            else:
                m.set("tau_best", tau_best, f"replay measure/replay.json ({best_policy})")
        m.set("step_ms", step, "TLV recording: Q pass + exact pass per cycle" if fam == "tlv"
              else "rows probe measure/rows.json (the current system's verify rows)")
        m.set("ar_ms", ar_ms, "rows probe measure/rows.json (1 row)")
        res = compute_ceiling(CeilingRequest(model=None, gpu=None, rows=[rows], measurements=m, profile=profile))
        cost = res.as_dict()["cost_model"]
        factors = dict(cost["factors"])
        sources = dict(cost.get("sources") or {})
        why = {"tree": "no lattice was replayed", "kernel": "no profile of the decode steps (on a CPU there are no "
               "GPU kernels), or no byte floor for this model and GPU", "outside": "no profile of the decode steps"}
        for n in (cost.get("warnings") or []) + (cost.get("notes") or []):   # the model's doubts first
            if n.startswith("unknown factors taken as 1"):  # the ceiling verb's wording names its flags
                unknown = [k for k, v in factors.items() if v is None]
                n = "unknown factors taken as 1: " + "; ".join(f"{k} ({why[k]})" for k in unknown)
            notes.append(n)
    current = {"policy": meas.current_policy, "rows": rows, "tau": tau,
               "c": (step / ar_ms) if (step and ar_ms) else None,
               "speedup": (tau / (step / ar_ms)) if (tau and step and ar_ms) else None}
    return ModelResult(current=current, cost_model=cost, largest=(cost or {}).get("largest_factor"),
                       factors=factors, by_nodes=by_nodes, best=best, notes=notes, sources=sources)
