"""Readers of other verbs' result files, for the verbs that take them as inputs.

Each checks the file's schema and the fields it needs and returns the dataclass the library
takes, so library code never opens another verb's file by path.
"""

from __future__ import annotations

from specpilot.errors import InputError
from specpilot.fileio import read_json
from specpilot.probes.ceiling import ProfileFigures, ReplayFigures, RowsProbeFigures, RunFigures


def read_profile(path: str) -> ProfileFigures:
    """A ``specpilot profile`` JSON: kernel busy ms, step wall ms, floor and shape rows."""
    doc = read_json(path, kind="profile")
    for key in ("kernel_busy_ms", "step_wall_ms"):
        if not isinstance(doc.get(key), (int, float)):
            raise InputError(f"{path}: profile has no numeric {key!r}")
    floor = doc.get("total_floor_ms")
    rows = (doc.get("shape") or {}).get("rows")
    return ProfileFigures(source=str(path), kernel_busy_ms=float(doc["kernel_busy_ms"]),
                          step_wall_ms=float(doc["step_wall_ms"]),
                          total_floor_ms=float(floor) if isinstance(floor, (int, float)) and floor > 0 else None,
                          rows=rows if isinstance(rows, int) else None)


def read_replay(path: str) -> ReplayFigures:
    """A ``specpilot replay`` JSON: tau per policy and the tau(N) curves."""
    doc = read_json(path, kind="replay")
    pols = doc.get("policies")
    if not isinstance(pols, list) or not pols:
        raise InputError(f"{path}: replay has no 'policies' list")
    taus = {}
    for p in pols:
        if not isinstance(p, dict) or not isinstance(p.get("tau"), (int, float)) or "policy" not in p:
            raise InputError(f"{path}: every policy needs 'policy' and a numeric 'tau'")
        taus[str(p["policy"])] = float(p["tau"])
    curves = {}
    for name, pts in (doc.get("curves") or {}).items():
        try:
            curves[name] = {int(k): float(v) for k, v in pts.items()}
        except (AttributeError, TypeError, ValueError):
            raise InputError(f"{path}: curve {name!r} must map node counts to tau") from None
    return ReplayFigures(source=str(path), taus=taus, curves=curves)


def read_rows_probe(path: str) -> RowsProbeFigures:
    """A ``specpilot probe rows`` JSON: T_step(N) per row count and T_AR."""
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
    try:
        ar = float(ar)
    except (TypeError, ValueError):
        raise InputError(f"{path}: rows probe 'ar_ms' must be a number") from None
    path_name = doc.get("ar_path")
    warnings = doc.get("warnings") or []
    if path_name is not None and not isinstance(path_name, str) or not isinstance(warnings, list):
        raise InputError(f"{path}: rows probe 'ar_path' must be a string and 'warnings' a list")
    return RowsProbeFigures(source=str(path), step_ms=curve, ar_ms=ar, ar_path=path_name,
                            warnings=[str(w) for w in warnings])


def read_run(path: str) -> RunFigures:
    """A ``specpilot run`` JSON: tau and the decode loop's step timing (a CUDA run's)."""
    doc = read_json(path, kind="run")
    timing = doc.get("step_timing")
    if not isinstance(timing, dict):
        raise InputError(f"{path}: the run has no 'step_timing' (only CUDA runs time their steps)")
    try:
        return RunFigures(source=str(path), tau=float(doc["tau"]), step_wall_ms=float(timing["wall_ms"]),
                          step_gpu_ms=float(timing["gpu_ms"]))
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path}: a run needs numeric 'tau' and step_timing 'wall_ms' and 'gpu_ms'") from None
