"""Readers of other verbs' result files, for the verbs that take them as inputs.

Each checks the file's schema and the fields it needs and returns the dataclass the library
takes, so library code never opens another verb's file by path.
"""

from __future__ import annotations

from specpilot.errors import InputError
from specpilot.fileio import read_json
from specpilot.probes.ceiling import ProfileFigures, ReplayFigures, RowsProbeFigures


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


def read_rows_probe(path: str, batch: int | None = None) -> RowsProbeFigures:
    """A ``specpilot probe rows`` JSON: T_step(N) per row count and T_AR. With ``batch``, the probe
    must have timed that many requests per step (``probe rows --batch``; absent = 1)."""
    doc = read_json(path, kind="rows")
    measured = doc.get("batch", 1)
    if not isinstance(measured, int) or isinstance(measured, bool) or measured < 1:
        raise InputError(f"{path}: rows probe 'batch' must be a positive integer")
    if batch is not None and measured != batch:
        raise InputError(f"{path}: the rows probe timed {measured} request(s) per step but --batch is {batch}; "
                         f"give --batch {measured} or probe again with probe rows --batch {batch}")
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
    return RowsProbeFigures(source=str(path), step_ms=curve, ar_ms=ar)
