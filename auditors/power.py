"""How many paired runs a comparison needs (the default of ``specpilot compare --runs auto``).

A pilot of a few ABBA blocks measures the spread of the per-pair log speed ratio (sd) and of the
A/A split; the plan is the smallest even number of pairs for which a true gain of ``target_gain``
(3%, or half the gain seen so far when that is larger) would be approved with probability
``power`` (80%) under the approval rule of ``timing.judge``. The sd is replaced by its one-sided
80% upper confidence bound, so a lucky quiet pilot does not plan too few runs, and the plan is
redone from all samples as they come in (variance-only re-estimation; each stage at most
doubles the runs, so an early overestimate is corrected before it is spent), so a
pilot that missed the outliers is corrected. ``benchmarks/compare_validation.py`` checks the
whole procedure (pilot, plan, rule) by simulation and by real A/A runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .timing import threshold_for

PILOT_PAIRS = 8
MIN_PAIRS = 8
MAX_PAIRS = 400


@dataclass
class Plan:
    pairs: int
    sd_log_ratio: float          # as measured in the pilot
    sd_planned: float            # the upper confidence bound used for planning
    sd_aa: float
    target_gain: float
    power: float                 # predicted power at ``pairs``
    capped: bool                 # the runs needed exceed max_pairs

    def to_json(self) -> dict:
        return asdict(self)


def predicted_power(n_pairs: int, sd: float, sd_aa: float, target_gain: float = 1.03,
                    changes_output: bool = False, noise: float | None = None, aa_bias: float = 0.0) -> float:
    """P(approve) for a true gain ``target_gain`` with ``n_pairs`` pairs (normal approximation).

    The measured noise is modelled as a systematic A/A offset ``aa_bias`` (e.g. drift between the
    two base runs of a block, which no number of runs removes) plus the random part of the mean of
    n/2 A/A log ratios."""
    from scipy import stats

    n = max(n_pairs, 2)
    blocks = max(n // 2, 1)
    if noise is None:
        noise = math.sqrt(aa_bias ** 2 + sd_aa ** 2 * (2 / math.pi) / blocks)
    thr = math.log1p(threshold_for(noise, changes_output))
    if sd <= 0:
        return 1.0 if math.log(target_gain) > thr else 0.0
    se = sd / math.sqrt(n)
    t = float(stats.t.ppf(0.975, n - 1))
    return float(stats.norm.cdf((math.log(target_gain) - thr - t * se) / se))


def plan_runs(sd: float, sd_aa: float, pilot_n: int, *, target_gain: float = 1.03, power: float = 0.8,
              changes_output: bool = False, noise: float | None = None, aa_mean: float = 0.0,
              min_pairs: int = MIN_PAIRS, max_pairs: int = MAX_PAIRS) -> Plan:
    """Pairs needed, from the spread measured so far (``pilot_n`` pairs, ``pilot_n/2`` A/A blocks).

    ``aa_mean`` is the mean A/A log ratio so far: the part of it beyond what chance explains is
    treated as a systematic offset that more runs will not shrink."""
    from scipy import stats

    df = max(pilot_n - 1, 1)
    inflate = math.sqrt(df / float(stats.chi2.ppf(0.2, df)))
    sd_p, sd_aa_p = sd * inflate, sd_aa * inflate
    aa_blocks = max(pilot_n // 2, 1)
    bias = math.sqrt(max(aa_mean ** 2 - sd_aa ** 2 / aa_blocks, 0.0))   # unbiased for bias^2
    pw = lambda k: predicted_power(k, sd_p, sd_aa_p, target_gain, changes_output, noise, bias)  # noqa: E731
    n = max(min_pairs, 2)
    n += n % 2
    while n <= max_pairs:
        if pw(n) >= power:
            return Plan(n, sd, sd_p, sd_aa, target_gain, pw(n), False)
        n += 2
    n = max_pairs - max_pairs % 2
    return Plan(n, sd, sd_p, sd_aa, target_gain, pw(n), True)
