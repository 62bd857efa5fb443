"""``specpilot ceiling``: byte floors per row count, and the cost model from measurements.

Inputs are numbers or files other verbs write: a profile JSON (``specpilot profile``: kernel busy
ms, step wall ms, floor), a replay JSON (``specpilot replay``: tau per policy, tau(N) curves) and a
rows-probe JSON (``specpilot probe rows``: T_step(N) and T_AR). Numbers given on the command line
win over numbers read from files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.errors import InputError
from specpilot.fileio import read_json
from specpilot.gpus import GPUSpec
from specpilot.models import ModelSpec

from .costmodel import CostModel, cost_model
from .floors import StepFloor, step_floor


@dataclass
class Measurements:
    tau: float | None = None
    tau_best: float | None = None
    step_ms: float | None = None
    ar_ms: float | None = None
    profile_ms: float | None = None
    floor_ms: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value, source: str) -> None:
        """Set a value unless the command line already gave it."""
        if value is None or getattr(self, name) is not None:
            return
        setattr(self, name, float(value))
        self.sources[name] = source

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.tau, self.tau_best, self.step_ms, self.ar_ms, self.profile_ms))


@dataclass
class CeilingResult:
    model: ModelSpec | None
    gpu: GPUSpec | None
    floors: list[StepFloor]
    ar_floor: StepFloor | None
    cost: CostModel | None
    measurements: Measurements
    rows_for_cost: int | None
    fractions: dict[str, float]
    tau_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    by_nodes: list[dict] = field(default_factory=list)  # predicted speedup tau(N) / c(N) per node budget

    def c_floor(self, f: StepFloor) -> float | None:
        return f.total_floor_ms / self.ar_floor.total_floor_ms if self.ar_floor else None

    def as_dict(self) -> dict:
        by_rows = {}
        for f in self.floors:
            d = f.as_dict()
            d["c_floor"] = self.c_floor(f)
            by_rows[str(f.rows)] = d
        first = self.floors[0] if self.floors else None
        return {
            "schema": "specpilot.ceiling/1",
            "model": self.model.name if self.model else None,
            "gpu": self.gpu.summary() if self.gpu else None,
            "shape": ({"rows": [f.rows for f in self.floors], "batch": first.batch, "context": first.context,
                       "weight_dtype": first.weight_dtype} if first else None),
            "fractions": self.fractions,
            "ar_floor_ms": self.ar_floor.total_floor_ms if self.ar_floor else None,
            "classes": ({k: v.as_dict() for k, v in first.classes.items()} if first else {}),
            "total_floor_ms": first.total_floor_ms if first else self.measurements.floor_ms,
            "by_rows": by_rows,
            "cost_model": ({**self.cost.as_dict(), "rows": self.rows_for_cost,
                            "sources": self.measurements.sources} if self.cost else None),
            "by_nodes": self.by_nodes,
        }


def read_profile(path: str, m: Measurements) -> dict:
    doc = read_json(path, kind="profile")
    for key in ("kernel_busy_ms", "step_wall_ms"):
        if not isinstance(doc.get(key), (int, float)):
            raise InputError(f"{path}: profile has no numeric {key!r}")
    m.set("profile_ms", doc["kernel_busy_ms"], f"profile {path}")
    m.set("step_ms", doc["step_wall_ms"], f"profile {path}")
    if isinstance(doc.get("total_floor_ms"), (int, float)) and doc["total_floor_ms"] > 0:
        m.set("floor_ms", doc["total_floor_ms"], f"profile {path}")
    return doc


def read_replay(path: str, m: Measurements, current_policy: str, rows: int | None) -> dict[str, dict[int, float]]:
    doc = read_json(path, kind="replay")
    pols = doc.get("policies")
    if not isinstance(pols, list) or not pols:
        raise InputError(f"{path}: replay has no 'policies' list")
    taus = {}
    for p in pols:
        if not isinstance(p, dict) or not isinstance(p.get("tau"), (int, float)) or "policy" not in p:
            raise InputError(f"{path}: every policy needs 'policy' and a numeric 'tau'")
        taus[str(p["policy"])] = float(p["tau"])
    cur = taus.get(current_policy)
    if cur is None:
        matches = [k for k in taus if k.split(":")[0] == current_policy]
        if len(matches) == 1:
            cur = taus[matches[0]]
    if cur is None:
        raise InputError(f"{path}: no policy {current_policy!r} in the replay (has {', '.join(taus)}); "
                         "choose one with --policy")
    m.set("tau", cur, f"replay {path} ({current_policy})")
    best_name = max(taus, key=taus.get)
    m.set("tau_best", taus[best_name], f"replay {path} ({best_name})")
    curves = {}
    for name, pts in (doc.get("curves") or {}).items():
        try:
            curves[name] = {int(k): float(v) for k, v in pts.items()}
        except (AttributeError, TypeError, ValueError):
            raise InputError(f"{path}: curve {name!r} must map node counts to tau") from None
    return curves


def read_rows_probe(path: str, m: Measurements, rows: int | None) -> dict[int, float]:
    doc = read_json(path, kind="rows")
    pts = doc.get("points")
    if not isinstance(pts, list) or not pts:
        raise InputError(f"{path}: rows probe has no 'points'")
    curve = {}
    for p in pts:
        try:
            curve[int(p["rows"])] = float(p["step_ms"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: every point needs integer 'rows' and numeric 'step_ms'") from None
    ar = doc.get("ar_ms", curve.get(1))
    if ar is None:
        raise InputError(f"{path}: rows probe has neither 'ar_ms' nor a point at 1 row")
    m.set("ar_ms", ar, f"rows probe {path}")
    if rows is not None and rows in curve:
        m.set("step_ms", curve[rows], f"rows probe {path} (rows={rows})")
    return curve


def compute_ceiling(model: ModelSpec | None, gpu: GPUSpec | None, rows: list[int], batch: int, context: int,
                    weight_dtype: str = "bf16", lm_head_dtype: str | None = None, kv_dtype: str = "bf16",
                    drafter: ModelSpec | None = None, draft_rows: int | None = None,
                    flops_fraction: float = 0.60, bw_fraction: float = 0.90,
                    measurements: Measurements | None = None, profile: str | None = None,
                    replay: str | None = None, rows_probe: str | None = None,
                    policy: str = "chain", draft_passes: int = 1) -> CeilingResult:
    m = measurements or Measurements()
    if batch <= 0:
        raise InputError(f"--batch must be positive, got {batch}")
    if context < 0:
        raise InputError(f"--context must be >= 0, got {context}")
    # measured analysis happens at one row count
    cost_rows = rows[0] if len(rows) == 1 else None
    prof = read_profile(profile, m) if profile else None
    if prof and cost_rows is None:
        shape_rows = (prof.get("shape") or {}).get("rows")
        if isinstance(shape_rows, int) and shape_rows in rows:
            cost_rows = shape_rows
    curves = read_replay(replay, m, policy, cost_rows) if replay else {}
    step_curve = read_rows_probe(rows_probe, m, cost_rows) if rows_probe else {}

    floors: list[StepFloor] = []
    ar_floor = None
    if model is not None and gpu is not None:
        for n in rows:
            floors.append(step_floor(model, gpu, n, batch, context, weight_dtype, lm_head_dtype, kv_dtype,
                                     drafter, draft_rows, flops_fraction, bw_fraction, draft_passes))
        ar_floor = step_floor(model, gpu, 1, batch, context, weight_dtype, lm_head_dtype, kv_dtype,
                              None, None, flops_fraction, bw_fraction)
        if cost_rows is not None:
            f = next(f for f in floors if f.rows == cost_rows)
            if m.floor_ms is None:
                m.set("floor_ms", f.total_floor_ms, f"byte floor of {model.name} at {cost_rows} rows")

    cost = None
    measured = {k: v for k, v in m.sources.items() if k != "floor_ms"}
    replay_only = bool(measured) and all(src.startswith("replay") for src in measured.values())
    if m.any and not (replay_only and model is not None):
        if len(rows) > 1 and cost_rows is None:
            raise InputError("measurements apply to one row count: give a single --rows N with --tau/--step-ms/...")
        missing = [n for n, v in (("--tau (or --replay)", m.tau), ("--step-ms (or --profile)", m.step_ms),
                                  ("--ar-ms (or --rows-probe)", m.ar_ms)) if v is None]
        if missing:
            raise InputError("the cost model needs " + ", ".join(missing))
        cost = cost_model(m.tau, m.step_ms, m.ar_ms, m.tau_best, m.profile_ms, m.floor_ms)
    elif model is None:
        raise InputError("give --model for byte floors, or measurements (--tau, --step-ms, --ar-ms, --profile ...)")
    res = CeilingResult(model=model, gpu=gpu, floors=floors, ar_floor=ar_floor, cost=cost, measurements=m,
                        rows_for_cost=cost_rows, fractions={"flops": flops_fraction, "bandwidth": bw_fraction},
                        tau_curve=curves)
    res.by_nodes = predict_by_nodes(curves, step_curve, m.ar_ms, res, model, gpu, batch, context, weight_dtype,
                                    lm_head_dtype, kv_dtype, drafter, draft_rows, flops_fraction, bw_fraction,
                                    draft_passes)
    return res


def predict_by_nodes(curves, step_curve, ar_ms, res, model, gpu, batch, context, weight_dtype, lm_head_dtype,
                     kv_dtype, drafter, draft_rows, flops_fraction, bw_fraction, draft_passes=1) -> list[dict]:
    """Speedup tau(N) / c(N) for every node budget N of the replay's tau(N) curves.

    c(N) is measured (rows probe: T_step(N) / T_AR) when a rows probe is given (node budgets it did
    not measure are left out, never mixed with floors), else the floor c(N) of the model (the
    regime where every kernel sits at its byte floor).
    """
    out = []
    for policy, pts in curves.items():
        for n, tau in sorted(pts.items()):
            if step_curve:
                if n not in step_curve or not ar_ms:
                    continue
                c, source = step_curve[n] / ar_ms, "measured"
            elif model is not None and gpu is not None and res.ar_floor is not None:
                f = step_floor(model, gpu, n, batch, context, weight_dtype, lm_head_dtype, kv_dtype, drafter,
                               draft_rows, flops_fraction, bw_fraction, draft_passes)
                c, source = f.total_floor_ms / res.ar_floor.total_floor_ms, "floor"
            else:
                continue
            out.append({"policy": policy, "nodes": n, "tau": tau, "c": c, "c_source": source, "speedup": tau / c})
    return out
