"""Token-forcing loss audit: phase 0 (delta), per-system mismatch statistics, the verdict.

Inputs are each system's outputs (same prompts, same prompt token ids) and the scorer's
teacher-forced argmax/margin for every output token (``specpilot.auditors.scorer``).

- Mismatch: the system's token is not the scorer's argmax (margin > 0).
- Phase 0: delta = the largest margin at stock's first divergence from AR (over prompts; at the
  divergence the larger of stock's and AR's token margins, both scored on the same prefix),
  rounded up to a multiple of 1/8; 1/8 when stock never diverges from AR.
- Event: a mismatch with margin >= 2 delta. An event is *explained* when a reference (stock or
  AR, other than the system itself) produced the same token after the same prefix, i.e. the
  reference made the same choice; otherwise it is unexplained.
- Verdict (paper 3.4): reject a system when its mismatch rate exceeds stock's by more than
  0.5 percentage points, or when it has more events than stock would have on as many tokens
  (events > ceil(stock_events x tokens / stock_tokens)). A system that produced no tokens while
  stock did is rejected too (there is nothing to audit); one with < 90% of stock's tokens is
  flagged in the warnings.
- Mismatches cluster within prompts, so intervals resample prompts, not tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction

import numpy as np

from specpilot.errors import InputError

from .outputs import Outputs, align, key
from .scorer import TokenScores

DELTA_STEP = 1.0 / 8.0
MAX_MISMATCH_INCREASE = 0.005  # 0.5 percentage points
# stock's own events (mismatches with margin >= 2 delta): its greedy tokens differ from the
# scorer's argmax at near ties (numerics: bf16 on random weights, 15% of tokens), seldom by a clear
# margin; at most tokens, the scorer is another model. A rate needs STOCK_EVENTS_MIN events: a few
# on a few tokens say nothing.
STOCK_EVENTS_WARNED = 0.05
STOCK_EVENTS_REFUSED = 0.5
STOCK_EVENTS_MIN = 8


@dataclass
class Scored:
    """One system's outputs with the scorer's verdict on every token, in reference prompt order."""

    outputs: Outputs
    role: str  # "system" | "stock" | "ar"
    scores: list[TokenScores]  # aligned with outputs.rows


@dataclass
class Divergence:
    id: str | int
    position: int
    stock_token: int
    ar_token: int
    margin: float


@dataclass
class Phase0:
    delta: float
    source: str  # "phase0" | "given" | "default"
    prompts: int = 0
    diverged: int = 0
    max_margin: float | None = None
    divergences: list[Divergence] = field(default_factory=list)


@dataclass
class MarginStats:
    near_ties: int  # mismatches with margin < delta
    delta_to_2delta: int
    events_2_to_4_delta: int
    events_4_delta_plus: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass
class SystemAudit:
    name: str
    role: str
    source: str
    prompts: int
    tokens: int
    mismatches: int
    mismatch_rate: float
    mismatch_ci: tuple[float, float]
    events: int
    event_rate: float
    unexplained_events: int
    margins: MarginStats
    diff_vs_stock: float | None = None  # mismatch rate minus stock's
    diff_ci: tuple[float, float] | None = None  # prompt-paired bootstrap
    events_allowed: int | None = None
    verdict: str | None = None  # "pass" | "reject" for systems; None for references
    reasons: list[str] = field(default_factory=list)


@dataclass
class AuditResult:
    verdict: str  # "pass" | "reject"
    delta: float
    phase0: Phase0
    systems: list[SystemAudit]
    rules: dict
    bootstrap: int
    seed: int
    warnings: list[str] = field(default_factory=list)

    def to_json(self, scorer_info: dict | None = None) -> dict:
        """The audit as ``specpilot audit --format json`` writes it (``specpilot.audit/1``)."""
        ph = self.phase0
        systems = []
        for s in self.systems:
            d = asdict(s)
            d["mismatch_ci"] = list(s.mismatch_ci)
            d["diff_ci"] = None if s.diff_ci is None else list(s.diff_ci)
            systems.append(d)
        return {"schema": "specpilot.audit/1", "verdict": self.verdict, "delta": self.delta,
                "phase0": {"source": ph.source, "delta": ph.delta, "prompts": ph.prompts, "diverged": ph.diverged,
                           "max_margin": ph.max_margin, "divergences": [asdict(x) for x in ph.divergences[:20]]},
                "rules": self.rules, "scorer": scorer_info,
                "bootstrap": {"resamples": self.bootstrap, "unit": "prompt", "seed": self.seed},
                "systems": systems, "warnings": self.warnings}


# ---------------------------------------------------------------------------------------------
def round_delta(margin: float | None) -> float:
    """Round up to a multiple of 1/8, at least 1/8 (1/8 when there was no divergence)."""
    if margin is None or margin <= 0:
        return DELTA_STEP
    return max(DELTA_STEP, math.ceil(margin / DELTA_STEP - 1e-9) * DELTA_STEP)


def _first_diff(a, b) -> int:
    """Index of the first differing token of two sequences (len of the shorter when one is a prefix)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    idx = np.flatnonzero(x)
    return int(idx[0]) if idx.size else n


def phase0(stock: Scored, ar: Scored) -> Phase0:
    """delta from stock's first divergence from AR on each prompt."""
    pairs = align(stock.outputs, ar.outputs)
    ar_pos = {key(r.id): j for j, r in enumerate(ar.outputs.rows)}
    divs: list[Divergence] = []
    for i, (s_row, a_row) in enumerate(pairs):
        t = _first_diff(s_row.output_ids, a_row.output_ids)
        if t >= min(len(s_row.output_ids), len(a_row.output_ids)):
            continue  # identical, or one stopped earlier: no divergent token
        j = ar_pos[key(a_row.id)]
        m = max(float(stock.scores[i].margin[t]), float(ar.scores[j].margin[t]))
        divs.append(Divergence(s_row.id, t, int(s_row.output_ids[t]), int(a_row.output_ids[t]), m))
    mx = max((d.margin for d in divs), default=None)
    return Phase0(delta=round_delta(mx), source="phase0", prompts=len(pairs), diverged=len(divs),
                  max_margin=mx, divergences=sorted(divs, key=lambda d: -d.margin))


# ---------------------------------------------------------------------------------------------
def _per_prompt(scored: Scored, order: list[str], delta: float, references: list[Scored]):
    """Per prompt (in ``order``): tokens, mismatches, events, unexplained events; and all mismatch margins."""
    pos = {key(r.id): i for i, r in enumerate(scored.outputs.rows)}
    refs = [(ref, {key(r.id): i for i, r in enumerate(ref.outputs.rows)}) for ref in references]
    n_tok = np.zeros(len(order), np.int64)
    n_mis = np.zeros(len(order), np.int64)
    n_evt = np.zeros(len(order), np.int64)
    n_unx = np.zeros(len(order), np.int64)
    margins = []
    for k, pid in enumerate(order):
        i = pos[pid]
        row, sc = scored.outputs.rows[i], scored.scores[i]
        n_tok[k] = len(row.output_ids)
        mis = sc.margin > 0
        n_mis[k] = int(mis.sum())
        margins.append(sc.margin[mis])
        ev = np.flatnonzero(sc.margin >= 2 * delta)
        n_evt[k] = ev.size
        if ev.size:
            # explained iff some reference shares the prefix through the event token
            agree = 0
            for ref, rpos in refs:
                agree = max(agree, _first_diff(row.output_ids, ref.outputs.rows[rpos[pid]].output_ids))
            n_unx[k] = int((ev >= agree).sum())
    allm = np.concatenate(margins) if margins else np.zeros(0, np.float32)
    return n_tok, n_mis, n_evt, n_unx, allm


def _ratio_ci(num: np.ndarray, den: np.ndarray, idx: np.ndarray) -> tuple[float, float]:
    d = den[idx].sum(1)
    r = np.where(d > 0, num[idx].sum(1) / np.maximum(d, 1), 0.0)
    lo, hi = np.percentile(r, [2.5, 97.5])
    return float(lo), float(hi)


def _margin_stats(m: np.ndarray, delta: float) -> MarginStats:
    q = (lambda p: float(np.percentile(m, p))) if m.size else (lambda p: None)
    return MarginStats(
        near_ties=int((m < delta).sum()),
        delta_to_2delta=int(((m >= delta) & (m < 2 * delta)).sum()),
        events_2_to_4_delta=int(((m >= 2 * delta) & (m < 4 * delta)).sum()),
        events_4_delta_plus=int((m >= 4 * delta).sum()),
        p50=q(50), p90=q(90), p99=q(99), max=float(m.max()) if m.size else None)


def _limits(s: Scored) -> str | None:
    """The --max-new-tokens its rows record ("8" or "8-16"), None where a row records none."""
    got = {r.max_new_tokens for r in s.outputs.rows}
    if not got or None in got:
        return None
    return str(min(got)) if len(got) == 1 else f"{min(got)}-{max(got)}"


def audit(systems: list[Scored], stock: Scored, ar: Scored | None = None, *, delta: float | None = None,
          max_increase: float = MAX_MISMATCH_INCREASE, bootstrap: int = 2000, seed: int = 0) -> AuditResult:
    """Audit each system against stock; phase 0 from AR unless ``delta`` is given."""
    if delta is not None:
        if not (delta > 0 and math.isfinite(delta)):
            raise InputError(f"--delta {delta}: must be a positive number")
        ph = Phase0(delta=float(delta), source="given")
    elif ar is not None:
        ph = phase0(stock, ar)
    else:
        ph = Phase0(delta=DELTA_STEP, source="default")
    d = ph.delta

    if stock.outputs.tokens == 0:   # every verdict would be a pass on no evidence
        raise InputError(f"{stock.outputs.source or stock.outputs.name}: stock produced no tokens; the audit has "
                         "nothing to compare against (collect stock's outputs again)")
    everyone = [stock] + ([ar] if ar is not None else []) + list(systems)
    for s in everyone[1:]:
        align(stock.outputs, s.outputs)  # raises on different prompt sets / prompt ids
    order = [key(r.id) for r in stock.outputs.rows]
    P = len(order)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, P, size=(bootstrap, P)) if P else np.zeros((bootstrap, 0), np.int64)

    refs_all = [stock] + ([ar] if ar is not None else [])
    per = {}
    for s in everyone:
        per[id(s)] = _per_prompt(s, order, d, [r for r in refs_all if r is not s])
    st_tok, st_mis, st_evt, _, _ = per[id(stock)]
    st_rate = st_mis.sum() / max(st_tok.sum(), 1)
    st_events, st_tokens = int(st_evt.sum()), int(st_tok.sum())
    st_evt_rate = st_events / st_tokens if st_events >= STOCK_EVENTS_MIN else 0.0
    if st_evt_rate > STOCK_EVENTS_REFUSED:   # a gate against such a stock passes almost anything
        raise InputError(f"{stock.outputs.source or stock.outputs.name}: the scorer's greedy token differs from "
                         f"stock's by a clear margin (>= 2 delta = {2 * d:g}) at {st_evt_rate:.1%} of its tokens "
                         f"({st_events} of {st_tokens}): the scorer is not the model that produced them greedily; "
                         "score with the target model (--scorer)")

    rows: list[SystemAudit] = []
    warnings: list[str] = []
    if st_evt_rate > STOCK_EVENTS_WARNED:
        warnings.append(f"the scorer's greedy token differs from stock's by a clear margin at {st_evt_rate:.1%} of "
                        "its tokens (events): greedy outputs of the scorer's model differ from it at near ties "
                        "(numerics); is the scorer the target model, and was stock greedy?")
    for s in everyone:
        n_tok, n_mis, n_evt, n_unx, allm = per[id(s)]
        tokens = int(n_tok.sum())
        rate = float(n_mis.sum() / tokens) if tokens else 0.0
        sa = SystemAudit(
            name=s.outputs.name, role=s.role, source=s.outputs.source, prompts=P, tokens=tokens,
            mismatches=int(n_mis.sum()), mismatch_rate=rate, mismatch_ci=_ratio_ci(n_mis, n_tok, idx),
            events=int(n_evt.sum()), event_rate=float(n_evt.sum() / tokens) if tokens else 0.0,
            unexplained_events=int(n_unx.sum()), margins=_margin_stats(allm, d))
        if s.role == "system":
            sa.diff_vs_stock = rate - float(st_rate)
            ds = n_tok[idx].sum(1)
            dst = st_tok[idx].sum(1)
            diffs = n_mis[idx].sum(1) / np.maximum(ds, 1) - st_mis[idx].sum(1) / np.maximum(dst, 1)
            lo, hi = np.percentile(diffs, [2.5, 97.5])
            sa.diff_ci = (float(lo), float(hi))
            # whole events, rounded up: stock's rate x tokens exactly rejected a lossless system that
            # stopped a token before stock with stock's own events (5 on 191 tokens against 5 on 192)
            allowed = math.ceil(int(st_evt.sum()) * tokens / st_tokens - 1e-9) if st_tokens else 0
            sa.events_allowed = int(allowed)
            # in exact fractions: 4/200 - 3/200 is 0.005000000000000001 in floats, "more than" 0.5 pp
            excess = (Fraction(int(n_mis.sum()), max(tokens, 1))
                      - Fraction(int(st_mis.sum()), max(int(st_tok.sum()), 1)) - Fraction(repr(float(max_increase))))
            if excess > 0:
                sa.reasons.append(f"mismatch rate {rate:.2%} exceeds stock's {st_rate:.2%} by "
                                  f"{100 * sa.diff_vs_stock:.2f} pp (limit {100 * max_increase:.2f} pp)")
            if sa.events > allowed:
                sa.reasons.append(f"{sa.events} events (margin >= 2 delta = {2 * d:g}) vs {allowed} allowed by "
                                  f"stock's {int(st_evt.sum())} on {st_tokens} tokens "
                                  f"({sa.unexplained_events} unexplained)")
            if tokens == 0 and st_tokens > 0:
                sa.reasons.append("produced no tokens (stock produced some): nothing to audit")
            elif st_tokens and tokens < 0.9 * st_tokens:
                mine, theirs = _limits(s), _limits(stock)
                why = (f" (collected with --max-new-tokens {mine}, stock with {theirs})"
                       if mine and theirs and mine != theirs else "")
                warnings.append(f"{sa.name}: {tokens} tokens vs stock's {st_tokens}{why}; a system that stops early "
                                "is audited only on what it produced")
            elif _limits(s) and _limits(stock) and _limits(s) != _limits(stock):
                # longer generations than stock's: its rates and events are over other stretches of text
                warnings.append(f"{sa.name}: collected with --max-new-tokens {_limits(s)}, stock with "
                                f"{_limits(stock)} ({tokens} tokens vs stock's {st_tokens}); collect both with one "
                                "limit for rates of the same stretches")
            sa.verdict = "reject" if sa.reasons else "pass"
            half = (hi - lo) / 2
            if sa.verdict == "pass" and half > max_increase:
                warnings.append(f"{sa.name}: the mismatch-rate difference is only known to +/-{100 * half:.2f} pp "
                                f"over {P} prompts; audit more prompts for the {100 * max_increase:.1f} pp rule to bite")
        rows.append(sa)
    if int(st_tok.sum()) < 1000:
        n = int(st_tok.sum())
        warnings.append(f"only {n} stock tokens: one mismatch moves a rate by {100 / n:.2f} pp; audit 1000+ tokens "
                        f"for the {100 * max_increase:.1f} pp rule to mean much")
    if ph.source == "default":
        warnings.append("no --ar outputs: delta = 1/8 by default (phase 0 needs AR outputs)")
    verdict = "reject" if any(r.verdict == "reject" for r in rows) else "pass"
    rules = {"max_mismatch_increase": max_increase, "event_margin": 2 * d,
             "events": "events > ceil(stock_events x tokens / stock_tokens)"}
    return AuditResult(verdict=verdict, delta=d, phase0=ph, systems=rows, rules=rules, bootstrap=bootstrap,
                       seed=seed, warnings=warnings)


def score_outputs(scorer, outputs: Outputs, role: str, **kw) -> Scored:
    """Teacher-force one system's outputs through the scorer."""
    try:
        scores = scorer.score([(r.prompt_ids, r.output_ids) for r in outputs.rows], **kw)
    except InputError as e:   # "sequence 3: ..." names a row: say whose, and which prompt
        import re

        m = re.match(r"sequence (\d+): (.*)", str(e))
        if m and int(m.group(1)) < len(outputs.rows):
            e = InputError(f"prompt {outputs.rows[int(m.group(1))].id!r}: {m.group(2)}")
        raise InputError(f"{outputs.source or outputs.name}: {e}") from None
    return Scored(outputs, role, scores)
