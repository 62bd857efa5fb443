"""Fitting a round into its budget: the run shape (prompts x new tokens), the paired runs per
candidate, and the clock that stops a stage cleanly when the time is spent.

Costs are estimated from what the round has measured so far (the current system's tokens/s, the
load time of an engine, the model's predicted gain of each candidate), so the plan is redone
before every candidate with the time actually left.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

PAIRS_MIN = 4      # two ABBA blocks: the fewest the approval rule accepts
PAIRS_MAX = 16
MEASURE_SHARE = 0.35  # at most this share of the budget goes to stage 1
BUDGET_SKIP = "budget: "   # what a stage skipped for want of time starts with


def unjudged_for_time(decisions: list[dict]) -> list[str]:
    """The candidates the approve stage skipped for want of time (a resume with --budget judges them)."""
    return [str(d.get("id")) for d in decisions
            if d.get("verdict") == "skipped" and str(d.get("reason", "")).startswith(BUDGET_SKIP)]


def cut_for_time(state: dict) -> list[str]:
    """What the round's measure stage skipped for want of time (its notes, the prefix left out)."""
    st = ((state.get("stages") or {}).get("measure") or {})
    return [n[len(BUDGET_SKIP):] for n in st.get("skipped") or [] if str(n).startswith(BUDGET_SKIP)]
DEFAULT_LOAD_S = {"cpu": 12.0, "cuda": 45.0}


class OutOfBudget(Exception):
    """Raised inside a stage when its time is spent; the stage records what it skipped."""


class Clock:
    def __init__(self, budget_s: float, spent_before: float = 0.0):
        self.budget_s = float(budget_s)
        self.t0 = time.monotonic() - spent_before

    def spent(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.spent()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise OutOfBudget(f"the budget ({self.budget_s / 60:.1f} min) ran out during {what}")


@dataclass
class Shape:
    prompts: int
    max_new_tokens: int

    def run_s(self, tokens_per_s: float, prefill_s: float) -> float:
        """Seconds one run (every prompt once) takes at ``tokens_per_s`` decode speed."""
        return self.prompts * (prefill_s + self.max_new_tokens / max(tokens_per_s, 1e-6))


SHAPES = {"cpu": [Shape(4, 48), Shape(3, 48), Shape(3, 32), Shape(2, 32), Shape(2, 24), Shape(2, 16)],
          "cuda": [Shape(8, 128), Shape(8, 96), Shape(6, 96), Shape(6, 64), Shape(4, 64), Shape(4, 48),
                   Shape(3, 32), Shape(2, 16)]}


def score_s(shape: Shape, tokens_per_s: float, prefill_s: float) -> float:
    """The audit's teacher forcing of three systems' outputs: a few prefill-like forwards."""
    return 0.5 + 0.5 * shape.run_s(tokens_per_s * 20.0, prefill_s)


def candidate_cost(shape: Shape, pairs: int, base_rate: float, cand_rate: float, prefill_s: float,
                   load_s: float, score_s: float) -> float:
    """One candidate: load it, a warm-up run of each system, ``pairs`` paired runs, the audit."""
    per_pair = shape.run_s(base_rate, prefill_s) + shape.run_s(cand_rate, prefill_s)
    return load_s + (1 + pairs) * per_pair + score_s


def choose_shape(device: str, left_s: float, rates: list[float], base_rate: float, prefill_s: float,
                 load_s: float, score_s: float, max_prompts: int | None = None,
                 fixed: Shape | None = None) -> tuple[Shape, int]:
    """The largest run shape with which every candidate gets 8 paired runs (else ``PAIRS_MIN``)
    inside ``left_s`` after the reference outputs are collected; returns (shape, pairs planned).
    Longer runs are preferred to more of them: they average a machine's jitter and give the audit
    more tokens; time left over goes to more pairs (:func:`pairs_for`). ``fixed`` (the user's) is
    kept as it is."""
    shapes = [fixed] if fixed else [s for s in SHAPES["cuda" if device == "cuda" else "cpu"]
                                   if max_prompts is None or s.prompts <= max_prompts] or [Shape(max_prompts or 2, 16)]
    for want in (8, PAIRS_MIN):
        for s in shapes:
            refs = s.run_s(base_rate, prefill_s)
            total = refs + sum(candidate_cost(s, want, base_rate, r, prefill_s, load_s, score_s) for r in rates)
            if total <= left_s:
                return s, want
    return shapes[-1], PAIRS_MIN


def pairs_for(shape: Shape, left_s: float, remaining: int, base_rate: float, cand_rate: float, prefill_s: float,
              load_s: float, score_s: float) -> int | None:
    """Pairs for the next candidate given the time left and the candidates still to run (each gets
    an equal share; time one does not use rolls over). None: not even ``PAIRS_MIN`` fit."""
    if candidate_cost(shape, PAIRS_MIN, base_rate, cand_rate, prefill_s, load_s, score_s) > left_s:
        return None
    share = left_s / max(remaining, 1)
    per_pair = shape.run_s(base_rate, prefill_s) + shape.run_s(cand_rate, prefill_s)
    fixed = load_s + per_pair + score_s
    n = int((share - fixed) // per_pair) if per_pair > 0 else PAIRS_MAX
    n = max(PAIRS_MIN, min(PAIRS_MAX, n))
    return n - n % 2


def as_dict(obj) -> dict:
    return asdict(obj)
