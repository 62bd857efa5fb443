"""``ceiling --check``: the cost model's predicted speedup over AR against a run's measured one.

predicted = tau_p x T_AR_p / T_pass_p, with T_pass_p (per verification pass; TLV: per cycle)
= verify_p + drafting + Q pass + rest, where

- tau_p: the replay's tau for the run's policy (``chain``, ``best-first:N``, ``tlv:N``), else the
  run's own;
- verify_p: the rows probe's T_step at the rows the run's passes verified (its steps by rows,
  interpolated between probed counts), else the run's own verify ms;
- drafting, Q pass and rest (acceptance, KV compaction, host work inside the step): the run's
  step split, the engine's own measured step times (the Q pass the rows probe's at the run's
  N + 1 rows where the probe timed one around them, ``probe rows --qview``);
- T_AR_p: the rows probe's T_AR, else the AR run's loop step (``--ar-run``).

measured = T_AR_m / (the run's decode ms per delivered token), the decode time end to end (every
request's wall time minus its prefill), with T_AR_m the AR run's decode ms per token (``--ar-run``)
or, without one, the rows probe's T_AR.

The terms are those the prediction takes from elsewhere than the run's end-to-end time: tau,
c(N) (verify ms), drafting (the run's, unless given), outside/host time (the prediction counts the
step's rest only; measured, the rest plus the time between the loop's steps), T_AR and TLV's Q
pass (the run's own on both sides unless the rows probe timed one). Each
term's effect is the predicted speedup with that one term replaced by its measured value; when
the prediction misses by more than the tolerance, the term whose effect is largest is named; when it
does not but terms that alone would move it past the tolerance cancel, a note names them. A run
(or AR run) whose GPU lowered its SM clock while it decoded (its ``gpu_clocks``) gets a note saying
so: a rows probe's short bursts run at full clock, a long decode loop may not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specpilot.errors import InputError

from .ceiling_inputs import ReplayFigures, RowsProbeFigures, RunFigures
from .costmodel import step_time
from .tlv_cycle import probe_qpass

TERMS = ("tau", "c(N)", "drafting", "Q pass", "outside/host", "T_AR")
UNITS = {"tau": "tokens/pass", "c(N)": "verify ms/pass", "drafting": "ms/pass", "Q pass": "ms/pass",
         "outside/host": "ms/pass", "T_AR": "ms/token"}


@dataclass
class Term:
    name: str
    predicted: float
    measured: float
    predicted_from: str
    measured_from: str
    speedup_if_measured: float = 0.0  # the prediction with this term's measured value

    def as_dict(self) -> dict:
        return {"term": self.name, "unit": UNITS[self.name], "predicted": self.predicted, "measured": self.measured,
                "predicted_from": self.predicted_from, "measured_from": self.measured_from,
                "speedup_if_measured": self.speedup_if_measured}


@dataclass
class CheckResult:
    run: str
    mode: str | None
    nodes: int | None
    policy: str | None
    predicted: float
    measured: float
    tolerance: float
    terms: list[Term]
    cycle: dict | None = None  # TLV: the run's cycle terms (ms per cycle)
    off: str | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # the rows probe's own (noise, its AR step)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def passed(self) -> bool:
        return abs(self.error) <= self.tolerance

    def as_dict(self) -> dict:
        return {"schema": "specpilot.ceiling-check/1", "run": self.run, "mode": self.mode, "nodes": self.nodes,
                "policy": self.policy, "predicted_speedup": self.predicted, "measured_speedup": self.measured,
                "error": self.error, "tolerance": self.tolerance, "passed": self.passed, "term_off": self.off,
                "terms": [t.as_dict() for t in self.terms], "tlv_cycle_ms": self.cycle, "notes": self.notes,
                "warnings": self.warnings}


def _speedup(tau: float, ar_ms: float, pass_ms: float) -> float:
    return tau * ar_ms / pass_ms


def check_run(run: RunFigures, replay: ReplayFigures | None = None, probe: RowsProbeFigures | None = None,
              ar_run: RunFigures | None = None, tolerance: float = 0.10, policy: str | None = None,
              draft_ms: float | None = None) -> CheckResult:
    """Predicted against measured speedup of ``run`` (see the module's docstring)."""
    if not (0 < tolerance <= 10):   # the range --tolerance takes, 10 included
        raise InputError(f"--tolerance must be in (0, 10], got {tolerance}")
    src = run.source
    if not run.has_split:
        raise InputError(f"{src}: the run's step_timing has no drafting/verify/rest split; run specpilot run "
                         "--format json again with this version")
    if run.pass_ms is None or not run.steps or not run.delivered:
        raise InputError(f"{src}: the run needs 'steps' and per-request 'seconds', 'prefill_seconds' and 'tokens' "
                         "to measure its decode time")
    from .ceiling_checks import files_from_other_models

    files_from_other_models(run, probe, ar_run)
    if ar_run is None and probe is None:
        raise InputError("--check needs the AR reference: --ar-run AR_RUN.json (specpilot run --mode ar on the same "
                         "prompts) or --rows-probe (its T_AR)")
    if ar_run is not None and (ar_run.mode not in (None, "ar") or ar_run.token_ms is None):
        raise InputError(f"--ar-run {ar_run.source}: give an AR run (mode ar) with per-request timing"
                         + (f"; it is mode {ar_run.mode}" if ar_run.mode not in (None, "ar") else ""))
    # tau, c(N) and the step split would all be the run's own: a gate that cannot fail
    if replay is None and probe is None:
        raise InputError(f"--check {src} with --ar-run alone predicts the run from itself (its own tau, c(N) and "
                         "step split): give --rows-probe (c(N) and T_AR from a probe), and --replay for tau (a "
                         "replay of the run's own lattice gives its own tau)")
    notes: list[str] = []
    policy = policy or run.policy

    # tau
    tau_m = run.delivered / run.steps
    tau_p, tau_from = tau_m, f"run {src} (its own)"
    if run.mode == "ar":
        tau_p, tau_from = 1.0, "AR: one token per pass"
    elif replay is not None:
        if policy is None:
            raise InputError(f"{src}: the run does not say its mode; choose the replay policy with --policy")
        taus = replay.taus
        name = replay.name_of(policy)
        if name is None:
            raise InputError(f"{replay.source}: no policy {policy!r} in the replay (has {', '.join(taus)}); replay "
                             f"the run's lattice with --policy {policy}, or choose one with --policy")
        tau_p, tau_from = taus[name], f"replay {replay.source} ({name})"
        if replay.steps and run.steps and replay.steps != run.steps:   # a lattice records one row per pass
            notes.append(f"the replay's lattice has {replay.steps} steps, the run {run.steps} passes: it is not this "
                         "run's lattice, so its tau is another run's, not this run's exactly")
    else:
        notes.append("no --replay: tau is the run's own")

    # c(N): the verify forward per pass
    verify_m = run.verify_ms
    verify_p, verify_from = verify_m, f"run {src} (its own)"
    if probe is not None:
        if not run.verify_by_rows:
            raise InputError(f"{src}: step_timing has no verify ms by rows to place the rows probe's T_step")
        total = sum(n for n, _ in run.verify_by_rows.values())
        times = [(step_time(r, probe.step_ms), n) for r, (n, _) in run.verify_by_rows.items()]
        if any(t is None for t, _ in times):
            raise InputError(f"--rows-probe {probe.source} needs at least two row counts to place "
                             f"{', '.join(map(str, sorted(run.verify_by_rows)))} rows")
        # between probed counts a step is interpolated; past them a line through two points says
        # nothing of how the step grows (a probe of 1 and 2 rows put a 17-row step at 0.3x)
        lo, hi = min(probe.step_ms), max(probe.step_ms)
        outside = sorted(r for r in run.verify_by_rows if not lo <= r <= hi)
        if outside:
            need = sorted({*probe.step_ms, *outside})
            raise InputError(f"--rows-probe {probe.source} timed {lo}..{hi} rows; the run verified "
                             f"{', '.join(map(str, outside))} rows too: probe them (probe rows --rows "
                             f"{','.join(map(str, need))})")
        verify_p = sum(t * n for t, n in times) / total
        rows = sorted(run.verify_by_rows)
        verify_from = f"rows probe {probe.source} at {rows[0]}..{rows[-1]} rows, weighted by the run's steps"
    else:
        notes.append("no --rows-probe: c(N) is the run's own verify forward and T_AR the AR run's own step; "
                     "only tau is predicted from another file")

    # drafting (TLV: draft 1 + draft 2), the run's own; TLV's Q pass the rows probe's at the run's
    # N + 1 rows where it timed one there (probe rows --qview), else the run's own
    qpass_p, qpass_from = run.qpass_ms, f"run {src} (its own)"
    if probe is not None and run.mode == "tlv" and run.nodes:
        q, _ = probe_qpass(probe, run.nodes + 1)
        if q is not None and None not in (run.qview, probe.qview) and run.qview != probe.qview:
            notes.append(f"the probe's Q pass read the {probe.qview} view, the run's the {run.qview} view: the "
                         "prediction takes the run's own Q pass (probe rows --qview "
                         f"{run.qview} times that one)")
        elif q is not None:
            qpass_p, qpass_from = q, f"rows probe {probe.source} at {run.nodes + 1} rows (its Q pass)"
    draft_m = run.draft_ms
    draft_p = draft_m if draft_ms is None else draft_ms
    draft_from = f"run {src} (loop step split)" if draft_ms is None else "--draft-ms"

    # outside/host: the step's rest (predicted) against everything per pass that is not a forward or drafting
    host_p = run.rest_ms
    host_m = run.pass_ms - run.verify_ms - run.draft_ms - run.qpass_ms

    # T_AR
    if ar_run is not None:
        ar_m, ar_m_from = ar_run.token_ms, f"AR run {ar_run.source} (decode ms per token)"
    else:
        ar_m, ar_m_from = probe.ar_ms, f"rows probe {probe.source}"
    if probe is not None:
        ar_p, ar_p_from = probe.ar_ms, f"rows probe {probe.source}"
    else:
        ar_p, ar_p_from = ar_run.step_wall_ms, f"AR run {ar_run.source} (loop step wall ms)"

    pass_p = verify_p + draft_p + qpass_p + host_p
    if pass_p <= 0:
        raise InputError(f"{src}: the predicted pass time is not positive ({pass_p:.4g} ms)")
    predicted = _speedup(tau_p, ar_p, pass_p)
    measured = ar_m / run.token_ms
    terms = [Term("tau", tau_p, tau_m, tau_from, f"run {src}"),
             Term("c(N)", verify_p, verify_m, verify_from, f"run {src} (verify ms per pass)"),
             Term("drafting", draft_p, draft_m, draft_from, f"run {src}"),
             *([Term("Q pass", qpass_p, run.qpass_ms, qpass_from, f"run {src}")]
               if run.mode == "tlv" or run.qpass_ms else []),
             Term("outside/host", host_p, host_m, f"run {src} (the step's rest)",
                  f"run {src} (decode ms per pass - verify - drafting"
                  + (" - Q pass)" if run.mode == "tlv" or run.qpass_ms else ")")),
             Term("T_AR", ar_p, ar_m, ar_p_from, ar_m_from)]
    for t in terms:
        tau, ar, pms = tau_p, ar_p, pass_p
        if t.name == "tau":
            tau = t.measured
        elif t.name == "T_AR":
            ar = t.measured
        else:
            pms = pass_p - t.predicted + t.measured
        t.speedup_if_measured = _speedup(tau, ar, pms) if pms > 0 else math.inf
    res = CheckResult(run=src, mode=run.mode, nodes=run.nodes, policy=policy, predicted=predicted, measured=measured,
                      tolerance=tolerance, terms=terms, notes=notes,
                      cycle=dict(run.tlv_ms, cycle=sum(run.tlv_ms.values())) if run.tlv_ms else None)
    if probe is not None:
        from .ceiling import rows_probe_warnings

        res.warnings = rows_probe_warnings(probe)
    for r in (run, ar_run):
        if r is not None and r.clocks and r.clocks["slowed"] > 0:
            c = r.clocks
            notes.append(f"the GPU lowered its clock during {r.source} ({', '.join(c['reasons']) or 'slowdown'} in "
                         f"{100 * c['slowed']:.0f}% of the samples, SM {c['min_mhz']:.0f}-{c['max_mhz']:.0f} MHz): "
                         "its steps are slower than a probe's at full clock")
    # a pass can hide terms off in opposite directions (a loaded CPU: c(N) and T_AR both 2x): name them
    def dev(t):
        return math.log(t.speedup_if_measured / predicted) if t.speedup_if_measured not in (0, math.inf) else 0.0

    def named(ts):
        return ", ".join(f"{t.name} ({t.predicted:.4g} predicted vs {t.measured:.4g} measured {UNITS[t.name]}: "
                         f"{t.speedup_if_measured:.3f}x)" for t in ts)

    moved = [t for t in terms if dev(t) and abs(t.speedup_if_measured / predicted - 1) > tolerance]
    if res.passed and moved:
        if {dev(t) > 0 for t in moved} == {True, False}:
            notes.append("the speedups agree, but these terms alone move the prediction past the tolerance and "
                         f"cancel: {named(moved)}")
        else:   # one direction past the tolerance: the terms within it that pull the other way offset it
            pull = sum(dev(t) for t in moved)
            offset = sorted((t for t in terms if t not in moved and dev(t) * pull < 0), key=lambda t: -abs(dev(t)))
            notes.append(f"the speedups agree, but {'this term alone moves' if len(moved) == 1 else 'these terms alone move'} "
                         f"the prediction past the tolerance: {named(moved)}; "
                         + (f"offset by {named(offset)}" if offset else "the terms together stay within it"))
    if not res.passed:
        res.off = max(terms, key=lambda t: abs(math.log(t.speedup_if_measured / predicted))
                      if t.speedup_if_measured not in (0, math.inf) else math.inf).name
    return res


def verdict_line(res: CheckResult) -> str:
    """One line: pass/fail, both speedups and, on a fail, the term that is off with both numbers."""
    head = (f"predicted {res.predicted:.3f}x vs measured {res.measured:.3f}x over AR "
            f"({100 * res.error:+.1f}%, tolerance {100 * res.tolerance:g}%)")
    if res.passed:
        return f"PASS: {head}"
    t = next(t for t in res.terms if t.name == res.off)
    return (f"FAIL: {head}; term off: {t.name} (predicted {t.predicted:.4g} from {t.predicted_from}, measured "
            f"{t.measured:.4g} {UNITS[t.name]}; with the measured value the prediction is "
            f"{t.speedup_if_measured:.3f}x)")
