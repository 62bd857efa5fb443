"""TLV's cycle (paper 4.3), for ``specpilot ceiling`` and ``ceiling --check``: tau counts tokens per
exact pass, so the time it divides is the whole cycle, its terms ``TLV_TERMS`` (draft 1, Q pass,
draft 2, exact pass, append). :func:`tlv_cycle` takes them from a TLV run's time split, else from
a ``tlv:N`` replay policy and a rows probe; :func:`probe_qpass` is the rows probe's own Q pass at
a row count (``probe rows --qview``).
"""

from __future__ import annotations

from specpilot.errors import InputError

from .ceiling_inputs import CeilingRequest, RowsProbeFigures
from .costmodel import line_points, step_time


TLV_TERMS = ("draft1", "qpass", "draft2", "exact", "append")


def probe_qpass(probe: RowsProbeFigures, rows: int) -> tuple[float | None, str | None]:
    """The rows probe's Q pass at ``rows`` rows (``probe rows --qview``): timed there or linear
    between the two timed counts around it, and (None, why not) elsewhere: no Q pass timed, or
    ``rows`` outside the counts it was timed at (a Q pass is not extrapolated)."""
    q = probe.qpass_ms
    if not q:
        return None, f"rows probe {probe.source} timed no Q pass (probe rows --qview times it)"
    if rows in q:
        return q[rows], None
    if not min(q) < rows < max(q):
        got = f"{min(q)}-{max(q)}" if len(q) > 1 else f"{min(q)}"
        return None, f"rows probe {probe.source} timed its Q pass at {got} rows, not around {rows}"
    return step_time(rows, q), None


def tlv_cycle(req: CeilingRequest) -> dict | None:
    """TLV's cycle (paper 4.3): tau counts tokens per exact pass, so the time it divides is the
    whole cycle, draft 1 + Q pass + draft 2 + exact pass + append. The terms come from a TLV
    run's time split; without one, from a ``tlv:N`` replay policy and a rows probe: the Q pass
    (the probe's own Q pass times where it took them, ``probe rows --qview``, else its exact
    step) and the exact pass each at N + 1 rows (the draft tree, and C + subtree under the pending
    token), drafting and append unknown (left out of the cycle, and said so). With both, the
    probe's passes stand beside the run's (``probe_ms``)."""
    run, probe = req.run, req.rows_probe
    nodes = None
    if req.policy.startswith("tlv:"):
        try:
            nodes = int(req.policy.split(":", 1)[1])
        except ValueError:
            nodes = 0
        if nodes < 1:
            raise InputError(f"--policy {req.policy}: tlv:N takes a node budget N of 1 or more")
    if run is not None and run.tlv_ms:
        nodes = run.nodes or nodes
    elif nodes is None:
        return None
    probe_ms = None
    if probe is not None and nodes is not None:
        t = step_time(nodes + 1, probe.step_ms)
        q, why = probe_qpass(probe, nodes + 1)
        line = line_points(nodes + 1, probe.step_ms)   # the counts its passes are drawn from, untimed
        if t is not None:   # without a timed Q pass, the exact step stands for it
            probe_ms = {"qpass": q if q is not None else t, "exact": t, "rows": nodes + 1,
                        "qpass_timed": q is not None, "qview": probe.qview, "qpass_note": why,
                        "interpolated": list(line) if line else None}
    if run is not None and run.tlv_ms:
        terms, source, unknown = dict(run.tlv_ms), f"run {run.source}", []
        if probe_ms and probe_ms["qpass_timed"] and None not in (run.qview, probe.qview) and run.qview != probe.qview:
            probe_ms["qpass_note"] = (f"the probe's Q pass read the {probe.qview} view, the run's the {run.qview} "
                                      "view: the two Q pass columns are not the same pass")
    elif probe_ms is not None:
        terms = {"draft1": None, "qpass": probe_ms["qpass"], "draft2": None, "exact": probe_ms["exact"],
                 "append": None}
        between = probe_ms["interpolated"]
        source = f"rows probe {probe.source} at {nodes + 1} rows" + (
            f" (linear from its {between[0]}- and {between[1]}-row steps: it timed no {nodes + 1}-row step)"
            if between else "")
        unknown = ["draft1", "draft2", "append"]
    else:
        return None
    known = [v for v in terms.values() if v is not None]
    return {"nodes": nodes, "terms_ms": terms, "cycle_ms": sum(known) if known else None, "source": source,
            "unknown": unknown, "probe_ms": probe_ms}
