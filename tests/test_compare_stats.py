"""The paired-timing statistics and the approval rule, on samples with known answers."""

import math

import numpy as np
import pytest

from specpilot.auditors.power import plan_runs, predicted_power
from specpilot.auditors.timing import Sample, aa_noise, judge, threshold_for
from specpilot.errors import InputError


def samples(ratios, base=1.0, per_block=2):
    """Wall-time samples whose speed ratio (base / candidate) is exactly ``ratios``."""
    return [Sample(i, i // per_block, base, base / r) for i, r in enumerate(ratios)]


def test_gain_is_geometric_mean_of_ratios():
    v = judge(samples([1.1, 1.0 / 1.1, 1.2, 1.2]), higher_is_better=False, noise=0.0)
    assert v.gain == pytest.approx(math.sqrt(1.2))


def test_throughput_direction():
    s = [Sample(i, i // 2, 100.0, 110.0) for i in range(10)]
    v = judge(s, higher_is_better=True, noise=0.0)
    assert v.gain == pytest.approx(1.1) and v.approved
    v = judge(s, higher_is_better=False, noise=0.0)
    assert v.gain == pytest.approx(1 / 1.1) and not v.approved


def test_constant_gain_has_degenerate_interval_and_rule():
    v = judge(samples([1.02] * 8), higher_is_better=False, noise=0.0)
    assert v.ci_low == pytest.approx(1.02) and v.t_ci[0] == pytest.approx(1.02)
    assert v.approved                                     # 2% > 1%
    assert not judge(samples([1.02] * 8), higher_is_better=False, noise=0.006).approved   # 1% + 1.2%
    assert not judge(samples([1.02] * 8), higher_is_better=False, noise=0.0, changes_output=True).approved
    assert judge(samples([1.031] * 8), higher_is_better=False, noise=0.0, changes_output=True).approved


def test_one_block_is_never_approved():
    """A single ABBA block's bootstrap interval is its point estimate: two near-equal pairs from one
    block (as an A/A run on a loopback server once gave) must not approve; two blocks may."""
    one = [Sample(0, 0, 199.6, 211.3), Sample(1, 0, 196.2, 207.4)]
    v = judge(one, higher_is_better=True, aa_pairs=[(199.6, 196.2)])
    assert v.ci_low > 1 + v.threshold and v.t_ci[0] > 1 + v.threshold      # both bounds would clear it
    assert not v.approved and v.blocks == 1 and "one block" in v.reason
    assert judge(samples([1.05] * 4), higher_is_better=False, noise=0.0).approved


def test_thresholds():
    assert threshold_for(0.0, False) == pytest.approx(0.01)
    assert threshold_for(0.001, False) == pytest.approx(0.012)
    assert threshold_for(0.001, True) == pytest.approx(0.03)
    assert threshold_for(0.02, True) == pytest.approx(0.05)


def test_aa_noise_from_split():
    # base first runs 1% slower than second runs: noise 1%
    assert aa_noise([(1.01, 1.0)] * 4, higher_is_better=False) == pytest.approx(1 - 1 / 1.01)
    assert aa_noise([(100.0, 101.0)] * 4, higher_is_better=True) == pytest.approx(1 - 100 / 101)
    assert aa_noise([(1.0, 1.0)] * 4, higher_is_better=False) == 0.0
    assert aa_noise([], higher_is_better=False) == 0.0


def test_noise_measured_raises_threshold():
    s = samples([1.05] * 6)
    aa = [(1.0, 1.03)] * 3        # stock itself moves 3% within a block
    v = judge(s, higher_is_better=False, aa_pairs=aa)
    assert v.noise == pytest.approx(0.03, rel=1e-6)
    assert v.threshold == pytest.approx(0.01 + 2 * v.noise)
    assert not v.approved and "threshold" in v.reason


def test_wide_interval_not_approved_and_intervals_cover():
    rng = np.random.default_rng(1)
    r = np.exp(rng.normal(math.log(1.03), 0.08, 10))
    v = judge(samples(r), higher_is_better=False, noise=0.0)
    assert v.ci_low < v.gain < v.ci_high and v.t_ci[0] < v.gain < v.t_ci[1]
    assert not v.approved


def test_bootstrap_resamples_blocks():
    # pairs within a block agree, blocks disagree: the block bootstrap sees 3 units, not 12
    r = [1.0] * 4 + [1.2] * 4 + [1.1] * 4
    v_blocks = judge(samples(r, per_block=4), higher_is_better=False, noise=0.0)
    v_pairs = judge(samples(r, per_block=1), higher_is_better=False, noise=0.0)
    assert (v_blocks.ci_high - v_blocks.ci_low) > (v_pairs.ci_high - v_pairs.ci_low)


@pytest.mark.parametrize("bad", [[Sample(0, 0, 1.0, 1.0)], [Sample(0, 0, 1.0, 0.0), Sample(1, 0, 1.0, 1.0)],
                                 [Sample(0, 0, float("nan"), 1.0), Sample(1, 0, 1.0, 1.0)]])
def test_bad_samples(bad):
    with pytest.raises(InputError):
        judge(bad, higher_is_better=False, noise=0.0)


def test_power_plan_grows_with_spread():
    small = plan_runs(0.002, 0.002, 8)
    big = plan_runs(0.03, 0.03, 8)
    assert small.pairs == 8 and not small.capped
    assert big.pairs > small.pairs and big.pairs % 2 == 0
    assert plan_runs(0.5, 0.5, 8, max_pairs=50).capped
    assert predicted_power(big.pairs, big.sd_planned, 0.03 * big.sd_planned / 0.03) >= 0.8
    assert predicted_power(1000, 0.01, 0.01, target_gain=1.0) < 0.01


def test_gpu_swap_noise_ignores_the_gpus_own_speed_difference():
    """With a GPU swap the two base runs of a block ran on different GPUs: a GPU 3% slower than the
    other is not stock noise (the swap cancels it from the gain), so a true 4% gain is approved."""
    import random

    rnd = random.Random(0)
    samples, aa = [], []
    for blk in range(8):
        runs = []
        for k, (ga, gb) in enumerate((("0", "1"), ("1", "0"))):
            speed = {"0": 1.0, "1": 0.97}      # GPU 1 is 3% slower, for both systems
            base = 100.0 * speed[ga] * (1 + rnd.gauss(0, 0.002))
            cand = 104.0 * speed[gb] * (1 + rnd.gauss(0, 0.002))
            samples.append(Sample(2 * blk + k, blk, base, cand, "||", ga, gb))
            runs.append(base)
        aa.append(tuple(runs))
    assert aa_noise(aa, higher_is_better=True) == pytest.approx(0.03, abs=0.005)   # the ABBA split would
    assert aa_noise(aa, higher_is_better=True, swap=True) < 0.005                  # same GPU, next block
    v = judge(samples, higher_is_better=True, aa_pairs=aa)
    assert v.approved and "same GPU" in v.noise_source and v.gain == pytest.approx(1.04, abs=0.005)


def test_a_refusal_quotes_the_lower_of_the_two_bounds():
    # two blocks of scattered gains: the t-interval reaches further down than the block bootstrap
    s = [Sample(0, 0, 100.0, 250.0), Sample(1, 0, 100.0, 150.0), Sample(2, 1, 100.0, 300.0),
         Sample(3, 1, 100.0, 101.0)]
    v = judge(s, higher_is_better=True, noise=0.9)
    assert not v.approved and v.ci_low > v.t_ci[0]
    assert v.reason.startswith(f"lower bound {(v.t_ci[0] - 1) * 100:+.2f}% <= threshold"), v.reason
