"""Readers of other verbs' result files, for the verbs that take them as inputs.

Each checks the file's schema and the fields it needs and returns the dataclass the library
takes, so library code never opens another verb's file by path.
"""

from __future__ import annotations

import math

from specpilot.errors import InputError
from specpilot.fileio import is_int, is_num, read_json
from specpilot.limits import MAX_MS, MAX_ROWS, MAX_TAU
from specpilot.probes.ceiling_inputs import ProfileFigures, ReplayFigures, RowsProbeFigures, RunFigures



def _name(doc: dict, key: str, path: str, what: str) -> str | None:
    """A name field (model, GPU, device...): None where absent, null or empty; a value of another
    type is a damaged file, never taken for absent (which would skip the checks that compare it)."""
    v = doc.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise InputError(f"{path}: {what} {key!r} must be a name (a string) or null, got {v!r}")
    return v

def _finite(v, lo: float, hi: float, lo_open: bool = True) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v > lo if lo_open else v >= lo) and v <= hi)


def read_profile(path: str) -> ProfileFigures:
    """A ``specpilot profile`` JSON: kernel busy ms, step wall ms, floor and shape rows."""
    doc = read_json(path, kind="profile")
    for key in ("kernel_busy_ms", "step_wall_ms"):
        if not _finite(doc.get(key), 0, MAX_MS):
            raise InputError(f"{path}: profile's {key!r} must be a number in (0, {MAX_MS:g}] ms")
    floor = doc.get("total_floor_ms")
    # floors are computed, not measured: a large shape's floor may pass the step times' hour
    if floor is not None and not _finite(floor, 0, math.inf, lo_open=False):
        raise InputError(f"{path}: profile's 'total_floor_ms' must be a finite number >= 0 ms")
    shape = doc.get("shape") or {}
    rows = shape.get("rows") if isinstance(shape, dict) else None
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS):
        raise InputError(f"{path}: profile's shape 'rows' must be a whole number in [1, {MAX_ROWS}]")
    dist = doc.get("distributed")   # absent in profiles written before it was recorded
    if dist is not None:
        counts = ("rank", "world_size", "group_size", "gpus")
        if (not isinstance(dist, dict)
                or not all(isinstance(dist[k], int) and not isinstance(dist[k], bool) and 0 <= dist[k] <= 2 ** 31
                           for k in counts if k in dist)
                or ("collectives_ms" in dist and not _finite(dist["collectives_ms"], 0, MAX_MS, lo_open=False))):
            raise InputError(f"{path}: profile's 'distributed' must be null or an object of whole numbers "
                             f"({', '.join(counts)}) and 'collectives_ms' in [0, {MAX_MS:g}]")
    floor = float(floor) if isinstance(floor, (int, float)) and floor > 0 else None
    model, raw_gpu, gpu = _name(doc, "model", path, "profile's"), doc.get("gpu"), {}
    if raw_gpu is not None and not isinstance(raw_gpu, dict):
        raise InputError(f"{path}: profile's 'gpu' must be an object (name, key, bandwidth...) or null")
    if isinstance(raw_gpu, dict):   # the GPU it ran on (name), its floors' (key, floors_gpu where --gpu named one)
        gpu = {k: raw_gpu[k] for k in ("name", "key", "floors_gpu") if isinstance(raw_gpu.get(k), str) and raw_gpu[k]}
        gpu.update({k: float(raw_gpu[k]) for k in ("bandwidth_tbs", "bf16_tflops") if _finite(raw_gpu.get(k), 0, 1e7)})
        if "fp8_tflops" in raw_gpu:   # the fp8 peak its fp8 floors took (null: the bf16 one)
            fp8 = raw_gpu["fp8_tflops"]
            if fp8 is not None and not _finite(fp8, 0, 1e7):
                raise InputError(f"{path}: profile's gpu 'fp8_tflops' must be a positive number or null")
            gpu["fp8_tflops"] = float(fp8) if fp8 is not None else None
    return ProfileFigures(source=str(path), kernel_busy_ms=float(doc["kernel_busy_ms"]),
                          step_wall_ms=float(doc["step_wall_ms"]), total_floor_ms=floor,
                          floor_peak_ms=_floor_peak_ms(path, doc) if floor is not None else None,
                          rows=rows if isinstance(rows, int) else None, distributed=dist or None,
                          model=model, gpu=gpu or None,
                          shape=_profile_shape(path, shape), unfloored_drafter=_unfloored_drafter(doc, floor))


def _unfloored_drafter(doc: dict, floor: float | None) -> tuple[float, float | None] | None:
    """(ms a step, share) of the drafter kernels a profile timed with no floor beside a floor of
    the rest (profiled without --drafter); None otherwise or where the file does not say."""
    classes = doc.get("classes")
    row = classes.get("drafter") if isinstance(classes, dict) else None
    if floor is None or not isinstance(row, dict) or row.get("floor_ms") is not None:
        return None
    ms, share = row.get("ms"), row.get("share")
    if not _finite(ms, 0, MAX_MS):
        return None
    return float(ms), (float(share) if _finite(share, 0, 1, lo_open=False) else None)


def _profile_shape(path: str, shape: dict) -> dict:
    """The shape a profile's floors were set for (``profile --model``'s options), checked: what
    ``ceiling`` compares with its own and takes for the options not given."""
    if not isinstance(shape, dict):
        return {}
    out = {}
    for k in ("batch", "context", "draft_rows", "draft_passes"):
        v = shape.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2 ** 24:
            raise InputError(f"{path}: profile's shape {k!r} must be a whole number")
        out[k] = v
    for k in ("weight_dtype", "lm_head_dtype", "kv_dtype", "drafter"):
        v = shape.get(k)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise InputError(f"{path}: profile's shape {k!r} must be a name")
            out[k] = v
    for k in ("flops_fraction", "bw_fraction"):
        v = shape.get(k)
        if v is not None:
            if not _finite(v, 0, 1):
                raise InputError(f"{path}: profile's shape {k!r} must be a number in (0, 1]")
            out[k] = float(v)
    return out


def _floor_peak_ms(path: str, doc: dict) -> float | None:
    """A profile's floor at the GPU's full peak: its ``floor_peak_ms``, the value ``profile`` judged
    a model/config mismatch by (probes.profile.floor_at_peak); a profile file written without that
    field gets :func:`_floor_at_peak_guessed`."""
    if "floor_peak_ms" not in doc:
        return _floor_at_peak_guessed(doc)
    v = doc["floor_peak_ms"]
    if v is not None and not _finite(v, 0, math.inf):
        raise InputError(f"{path}: profile's 'floor_peak_ms' must be null or a finite number > 0 ms")
    return float(v) if v is not None else None


def _floor_at_peak_guessed(doc: dict) -> float | None:
    """The fallback for a profile file without ``floor_peak_ms`` (written before profile recorded
    it), guessed from what the file holds, as probes.profile.floor_at_peak cannot be re-run without
    the floors' bound classes: each class's floor times the fraction of the peak
    it assumed (the bandwidth's where the floor is the class's bytes over that share of the GPU's
    bandwidth, else the smaller fraction: the lowest floor the class could have), None where the
    profile records no fractions or classes."""
    shape, gpu, classes = doc.get("shape"), doc.get("gpu"), doc.get("classes")
    if not (isinstance(shape, dict) and isinstance(classes, dict)):
        return None
    bwf, ff = shape.get("bw_fraction"), shape.get("flops_fraction")
    if not (_finite(bwf, 0, 1) and _finite(ff, 0, 1)):
        return None
    bw = gpu.get("bandwidth_tbs") if isinstance(gpu, dict) else None
    total = 0.0
    for c in classes.values():
        f = c.get("floor_ms") if isinstance(c, dict) else None
        if not _finite(f, 0, MAX_MS):
            continue
        b = c.get("bytes")
        by_bytes = _finite(bw, 0, 1e6) and _finite(b, 0, 1e30) and abs(b / (bwf * bw * 1e12) * 1e3 - f) <= 1e-6 * f
        total += f * (bwf if by_bytes else min(bwf, ff))
    return total or None


def read_replay(path: str) -> ReplayFigures:
    """A ``specpilot replay`` JSON: tau per policy and the tau(N) curves."""
    doc = read_json(path, kind="replay")
    pols = doc.get("policies")
    if not isinstance(pols, list) or not pols:
        raise InputError(f"{path}: replay has no 'policies' list")
    taus, nodes = {}, {}
    for p in pols:
        if not isinstance(p, dict) or not _finite(p.get("tau"), 1, MAX_TAU, lo_open=False) or "policy" not in p:
            raise InputError(f"{path}: every policy needs 'policy' and a 'tau' in [1, {MAX_TAU}]")
        if str(p["policy"]) in taus:   # replay writes each once: which tau is meant is unknown
            raise InputError(f"{path}: policy {p['policy']!r} is listed twice")
        taus[str(p["policy"])] = float(p["tau"])
        # the nodes a step verifies besides the pending token: 0 for a chain over a lattice of no
        # draft positions (an AR run's), which verifies the pending token alone
        n = p.get("nodes")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_ROWS):
            raise InputError(f"{path}: policy {p['policy']!r}: 'nodes' must be null or a whole number in "
                             f"[0, {MAX_ROWS}]")
        nodes[str(p["policy"])] = n
    m = doc.get("positions")   # 0 on a lattice of an AR run
    if m is not None and not (is_int(m) and 0 <= m <= MAX_ROWS):
        raise InputError(f"{path}: 'positions' must be null or a whole number in [0, {MAX_ROWS}], got {m!r}")
    curves = {}
    raw_curves = doc.get("curves") or {}
    if not isinstance(raw_curves, dict):
        raise InputError(f"{path}: 'curves' must map policies to {{nodes: tau}}")
    for name, pts in raw_curves.items():
        try:
            if not all(is_num(v) for v in pts.values()):   # a tau of true or "2.5" is no measurement
                raise TypeError
            curves[name] = {int(k): float(v) for k, v in pts.items()}
        except (AttributeError, TypeError, ValueError, OverflowError):
            raise InputError(f"{path}: curve {name!r} must map node counts to tau (numbers)") from None
        if not all(1 <= n <= MAX_ROWS and _finite(t, 1, MAX_TAU, lo_open=False) for n, t in curves[name].items()):
            raise InputError(f"{path}: curve {name!r}: node counts must be in [1, {MAX_ROWS}] and tau in "
                             f"[1, {MAX_TAU}]")
    steps = doc.get("steps")
    steps = steps if is_int(steps) and steps >= 0 else None
    return ReplayFigures(source=str(path), taus=taus, curves=curves, nodes=nodes, positions=m, steps=steps,
                         curve_rows=_curve_rows(path, doc.get("curve_rows"), curves))


def _curve_rows(path, raw, curves: dict[str, dict[int, float]]) -> dict[str, dict[int, dict[int, int]]]:
    """A replay's ``curve_rows`` (per curve point, steps by the rows they verified; absent in older files)."""
    if raw is None:
        return {}
    out: dict[str, dict[int, dict[int, int]]] = {}
    try:
        for name, pts in raw.items():
            cap = 1
            if name.split(":")[0] in ("shared", "adaptive"):   # a request's share: up to SHARED_CAP x its nodes
                from specpilot.engine.batch.rules import SHARED_CAP

                cap = SHARED_CAP
            out[name] = {}
            for n, hist in pts.items():
                got = {int(r): k for r, k in hist.items()}
                if not got or not all(is_int(k) and k > 0 for k in got.values()) or \
                        not all(1 <= r <= cap * int(n) + 1 for r in got):
                    raise ValueError
                out[name][int(n)] = got
    except (AttributeError, TypeError, ValueError, OverflowError):
        raise InputError(f"{path}: 'curve_rows' must map each curve's node counts to {{rows verified: steps}}, "
                         "rows from 1 to the nodes + 1 (a shared budget's request: twice its nodes + 1)") from None
    for name, pts in out.items():
        if set(pts) != set(curves.get(name, {})):
            raise InputError(f"{path}: 'curve_rows' of {name!r} are not of the curve's node counts")
    return out


def read_rows_probe(path: str, batch: int | None = None, one_request: str | None = None) -> RowsProbeFigures:
    """A ``specpilot probe rows`` JSON: T_step(N) per row count and T_AR. With ``batch``, the probe
    must have timed that many requests per step (``probe rows --batch``; absent = 1). With
    ``one_request`` (the option naming a run, which is of one request per step) it must be of one."""
    doc = read_json(path, kind="rows")
    measured = doc.get("batch", 1)
    if not isinstance(measured, int) or isinstance(measured, bool) or measured < 1:
        raise InputError(f"{path}: rows probe 'batch' must be a positive integer")
    if one_request and measured != 1:
        raise InputError(f"{path}: the rows probe timed {measured} requests per step, but {one_request} is a run of "
                         "one request per step; give a rows probe of one request (probe rows without --batch)")
    if batch is not None and measured != batch:
        raise InputError(f"{path}: the rows probe timed {measured} request(s) per step but --batch is {batch}; "
                         f"give --batch {measured} or probe again with probe rows --batch {batch}")
    pts = doc.get("points")
    if not isinstance(pts, list) or not pts:
        raise InputError(f"{path}: rows probe has no 'points'")
    curve, qpass = {}, {}
    for p in pts:
        r, ms = (p.get("rows"), p.get("step_ms")) if isinstance(p, dict) else (None, None)
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_ROWS or not _finite(ms, 0, MAX_MS):
            raise InputError(f"{path}: every point needs 'rows' in [1, {MAX_ROWS}] and 'step_ms' in (0, {MAX_MS:g}]")
        if r in curve:   # which of the two the cost model would take is not for the reader to pick
            raise InputError(f"{path}: two points at {r} rows; a rows probe times each row count once")
        curve[r] = float(ms)
        q = p.get("qpass_ms")
        if q is not None:
            if not _finite(q, 0, MAX_MS) or r < 2:
                raise InputError(f"{path}: a point's 'qpass_ms' must be a number in (0, {MAX_MS:g}], at 2 rows or more")
            qpass[r] = float(q)
    ar = doc.get("ar_ms", curve.get(1))
    if ar is None:
        raise InputError(f"{path}: rows probe has neither 'ar_ms' nor a point at 1 row")
    if not _finite(ar, 0, MAX_MS):
        raise InputError(f"{path}: rows probe 'ar_ms' must be a number in (0, {MAX_MS:g}]")
    path_name = doc.get("ar_path")
    warnings = doc.get("warnings") or []
    if path_name is not None and not isinstance(path_name, str) or not isinstance(warnings, list):
        raise InputError(f"{path}: rows probe 'ar_path' must be a string and 'warnings' a list")
    return RowsProbeFigures(source=str(path), step_ms=curve, ar_ms=float(ar),
                            device=_name(doc, "device", path, "rows probe"), gpu=_name(doc, "gpu", path, "rows probe"),
                            cpu=_name(doc, "cpu", path, "rows probe"),
                            ar_path=path_name, warnings=[str(w) for w in warnings], qpass_ms=qpass,
                            qview=doc.get("qview") if doc.get("qview") in ("w12", "fp8") else None,
                            model=_name(doc, "model", path, "rows probe"), batch=measured)


def read_run(path: str) -> RunFigures:
    """A ``specpilot run`` JSON: tau and the decode loop's step timing (wall ms per step and its
    split on every device; GPU ms on CUDA), the decode time without prefill, and TLV's cycle split."""
    doc = read_json(path, kind="run")
    timing = doc.get("step_timing")
    if not isinstance(timing, dict):
        if isinstance(doc.get("batch"), dict):
            raise InputError(f"{path}: a batched run (--batch) has no per-step timing of one request; ceiling "
                             "--run/--check take a one-request run (specpilot run without --batch)")
        if doc.get("steps") == 0:   # its one token came from the prefill: no step to time
            raise InputError(f"{path}: the run made no verification passes (its only token came from the prefill); "
                             "run it with --max-new-tokens 2 or more")
        raise InputError(f"{path}: the run has no 'step_timing' (a run JSON from an older SpecPilot): run "
                         "specpilot run --format json again")
    tau, wall, gpu_ms = doc.get("tau"), timing.get("wall_ms"), timing.get("gpu_ms")
    if not _finite(tau, 1, MAX_TAU, lo_open=False):   # tokens per verification pass: the bonus token at least
        raise InputError(f"{path}: the run's 'tau' must be a finite number in [1, {MAX_TAU:g}], got {tau!r}")
    if not (_finite(wall, 0, MAX_MS) and (gpu_ms is None or _finite(gpu_ms, 0, MAX_MS))):
        raise InputError(f"{path}: a run needs step_timing 'wall_ms' (and 'gpu_ms', when present) in "
                         f"(0, {MAX_MS:g}]")
    split = {}
    for k in ("draft_ms", "verify_ms", "rest_ms", "qpass_ms"):
        v = timing.get(k)
        # the rest is the wall time less the GPU's parts, which may exceed it by a little: it alone may be < 0
        lo = -MAX_MS if k == "rest_ms" else 0.0
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                  and lo <= v <= MAX_MS):
            raise InputError(f"{path}: step_timing {k!r} must be a finite number of ms"
                             + ("" if k == "rest_ms" else " >= 0"))
        split[k] = float(v) if v is not None else None
    by_rows = {}
    for r in timing.get("by_rows") or []:
        rows, n, v = (r.get("rows"), r.get("steps"), r.get("verify_ms")) if isinstance(r, dict) else (None,) * 3
        if v is None:
            continue
        if (isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS
                or not isinstance(n, int) or n < 1 or not _finite(v, 0, MAX_MS, lo_open=False)):
            raise InputError(f"{path}: step_timing 'by_rows' entries need 'rows' in [1, {MAX_ROWS}], 'steps' >= 1 "
                             "and 'verify_ms'")
        by_rows[rows] = (n, float(v))
    results = doc.get("results") or []
    decode_ms, delivered = None, 0
    if isinstance(results, list) and results and all(isinstance(r, dict) for r in results):
        if not all(_finite(r.get("seconds"), 0, MAX_MS, lo_open=False) and is_int(r.get("tokens"))
                   and r["tokens"] >= 1 for r in results):
            raise InputError(f"{path}: every result needs 'seconds' (>= 0) and 'tokens' (a whole number >= 1)")
        try:
            decode_ms = sum(1e3 * (float(r["seconds"]) - float(r.get("prefill_seconds") or 0.0)) for r in results)
        except (TypeError, ValueError):
            raise InputError(f"{path}: a result's 'prefill_seconds' must be a number of seconds") from None
        delivered = sum(int(r["tokens"]) - 1 for r in results)
        if not (math.isfinite(decode_ms) and decode_ms > 0):
            decode_ms = None
    steps = doc.get("steps", timing.get("steps", 0))
    if not (is_int(steps) and steps >= 0):
        raise InputError(f"{path}: the run's 'steps' must be a whole number >= 0, got {steps!r}")
    tlv = doc.get("tlv")
    tlv_ms = None
    if isinstance(tlv, dict):
        t = tlv.get("time_ms")
        keys = ("draft1", "qpass", "draft2", "exact", "append")
        if not isinstance(t, dict) or not all(_finite(t.get(k), 0, MAX_MS, lo_open=False) for k in keys):
            raise InputError(f"{path}: a TLV run's 'tlv.time_ms' needs {', '.join(keys)} in ms")
        tlv_ms = {k: float(t[k]) for k in keys}
    nodes = doc.get("nodes")
    clocks = _run_clocks(path, doc.get("gpu_clocks"))
    return RunFigures(source=str(path), tau=float(tau), step_wall_ms=float(wall),
                      step_gpu_ms=float(gpu_ms) if gpu_ms is not None else None,
                      mode=_name(doc, "mode", path, "run's"),
                      nodes=nodes if isinstance(nodes, int) and not isinstance(nodes, bool) else None,
                      steps=steps,
                      delivered=delivered, decode_ms=decode_ms, draft_ms=split["draft_ms"],
                      verify_ms=split["verify_ms"], qpass_ms=split["qpass_ms"] or 0.0, rest_ms=split["rest_ms"],
                      verify_by_rows=by_rows, tlv_ms=tlv_ms, clocks=clocks,
                      qview=tlv.get("qview") if isinstance(tlv, dict) and tlv.get("qview") in ("w12", "fp8") else None,
                      model=_name(doc, "model", path, "run's"), device=_name(doc, "device", path, "run's"))


def _run_clocks(path: str, c) -> dict | None:
    """A run's ``gpu_clocks`` (engine/clocks.py; null off CUDA): SM MHz range, slowed share, reasons."""
    if c is None:
        return None
    mhz = c.get("sm_mhz") if isinstance(c, dict) else None
    reasons = c.get("reasons") if isinstance(c, dict) else None
    if not (isinstance(mhz, dict) and all(_finite(mhz.get(k), 0, 1e5) for k in ("min", "max"))
            and _finite(c.get("slowed"), 0, 1, lo_open=False)
            and isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)):
        raise InputError(f"{path}: 'gpu_clocks' needs 'sm_mhz' with 'min' and 'max' in MHz, 'slowed' in [0, 1] and "
                         "'reasons' (a list of names), or null")
    return {"min_mhz": float(mhz["min"]), "max_mhz": float(mhz["max"]), "slowed": float(c["slowed"]),
            "reasons": list(reasons)}
