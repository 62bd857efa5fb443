"""Paired-timing statistics and the approval rule (paper 3.3).

Each paired sample is one measurement of the base and one of the candidate under the same
conditions (same requests, adjacent in time or at the same time on two GPUs). Its *speed ratio*
is candidate speed / base speed (base time / candidate time for wall times, candidate throughput /
base throughput for throughputs), so a ratio above 1 means the candidate is faster.

- gain: geometric mean of the paired ratios.
- 95% interval: paired bootstrap, resampling whole blocks (an ABBA block or a GPU-swap block keeps
  its two pairs together so drift cancellation survives resampling); a t-interval on the log ratios
  is computed beside it as a check, and approval needs both lower bounds to clear the threshold.
- noise: stock's own noise from an A/A split in the same run (the base measured twice per block;
  with a GPU swap, base runs on the same GPU in consecutive blocks:
  |geometric mean of base_first / base_second - 1|), or given.
- approve when the lower bound > 1% + 2 x noise; a change that alters outputs must clear 3% (or
  1% + 2 x noise when that is larger), the paper's rule for patches that may carry a loss.
  Approval also needs at least two blocks: resampling a single block gives back the point estimate,
  and one A/A pair is too little to trust (an A/A run of one ABBA block was approved about once in
  15 tries on a loopback server).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from specpilot.errors import InputError

from .resample import bootstrap_mean_ci

TIMING_SCHEMA = "specpilot.timing/1"
BASE_MARGIN = 0.01
CHANGES_OUTPUT_MARGIN = 0.03
MIN_BLOCKS = 2     # a block bootstrap over one block is a point, not an interval


@dataclass
class Sample:
    """One paired measurement. ``base``/``candidate`` are in the metric's own unit."""

    pair: int
    block: int
    base: float
    candidate: float
    order: str = "AB"          # which ran first ("AB", "BA") or "||" when concurrent
    gpu_base: str | None = None
    gpu_candidate: str | None = None


@dataclass
class Verdict:
    gain: float
    ci_low: float
    ci_high: float
    t_ci: tuple[float, float]
    noise: float
    noise_source: str
    threshold: float
    approved: bool
    pairs: int
    blocks: int
    sd_log_ratio: float
    reason: str
    seed: int = 0      # of the bootstrap: stored so that re-judging the samples gives the same interval

    @property
    def verdict(self) -> str:
        return "approved" if self.approved else "not approved"


# the smallest measurement: a positive float below the normal range (1e-320) is no time or rate,
# and the ratios of a pair with it overflow
LEAST_MEASURED = sys.float_info.min


def measured(x) -> bool:
    """A measurement: a finite number (not true/false) no smaller than the least normal float."""
    from specpilot.fileio import is_num

    return is_num(x) and x >= LEAST_MEASURED


def speed_ratios(samples: Sequence[Sample], higher_is_better: bool) -> np.ndarray:
    if not all(measured(s.base) and measured(s.candidate) for s in samples):
        raise InputError("every measurement must be a positive finite number")
    b = np.array([s.base for s in samples], dtype=np.float64)
    c = np.array([s.candidate for s in samples], dtype=np.float64)
    with np.errstate(over="ignore", under="ignore"):
        r = c / b if higher_is_better else b / c
    if not (np.isfinite(r) & (r > 0)).all():   # overflowed, or underflowed to 0 (its log is -inf)
        raise InputError("a pair's measurements are too far apart for their ratio to be a number "
                         f"({min(b.min(), c.min()):.3g} beside {max(b.max(), c.max()):.3g})")
    return r


def median(values) -> float:
    """The median; of an even count the middle two's midpoint, taken without their sum (which
    overflows for measurements near the largest float)."""
    v = sorted(values)
    n = len(v)
    lo, hi = v[(n - 1) // 2], v[n // 2]
    return lo + (hi - lo) / 2


def threshold_for(noise: float, changes_output: bool) -> float:
    """The gain the lower bound must beat, as a fraction (0.012 = 1.2%)."""
    base = BASE_MARGIN + 2.0 * noise
    return max(CHANGES_OUTPUT_MARGIN, base) if changes_output else base


def aa_noise(aa_pairs: Sequence[tuple[float, float]], higher_is_better: bool, swap: bool = False) -> float:
    """|geometric mean of first/second - 1| over the A/A split.

    ABBA: the two base runs of each block (first vs second). GPU swap (``swap``): a block's two base
    runs ran on *different* GPUs, so their ratio is mostly the GPUs' own speed difference, which the
    swap cancels out of the gain; the split then pairs base runs on the *same* GPU in consecutive
    blocks (block i vs block i+1, each GPU), which sees drift over the run the way ABBA's does."""
    if swap:
        aa_pairs = [(p[g], q[g]) for p, q in zip(aa_pairs, aa_pairs[1:]) for g in (0, 1)]
    if not aa_pairs:
        return 0.0
    a = np.array(aa_pairs, dtype=np.float64)
    r = a[:, 0] / a[:, 1] if higher_is_better else a[:, 1] / a[:, 0]
    return float(abs(math.exp(np.log(r).mean()) - 1.0))


def bootstrap_gain_ci(log_r: np.ndarray, blocks: np.ndarray, n_boot: int = 4000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of exp(mean log ratio), resampling blocks with replacement."""
    lo, hi = bootstrap_mean_ci(log_r, blocks, n_boot, seed, level)
    return (math.exp(lo), math.exp(hi))


def t_interval(log_r: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    from scipy import stats

    n = len(log_r)
    mu = float(log_r.mean())
    if n < 2:
        return (math.exp(mu), math.exp(mu))
    se = float(log_r.std(ddof=1)) / math.sqrt(n)
    t = float(stats.t.ppf(0.5 + level / 2, n - 1))
    return (math.exp(mu - t * se), math.exp(mu + t * se))


def judge(samples: Sequence[Sample], *, higher_is_better: bool, aa_pairs: Sequence[tuple[float, float]] = (),
          noise: float | None = None, changes_output: bool = False, n_boot: int = 4000,
          seed: int = 0) -> Verdict:
    """Gain, intervals, noise and the approval verdict for paired samples."""
    if len(samples) < 2:
        raise InputError(f"need at least 2 paired samples, got {len(samples)}")
    r = speed_ratios(samples, higher_is_better)
    log_r = np.log(r)
    blocks = np.array([s.block for s in samples])
    gain = math.exp(float(log_r.mean()))
    lo, hi = bootstrap_gain_ci(log_r, blocks, n_boot, seed)
    t_lo, t_hi = t_interval(log_r)
    if noise is None:
        swap = any(s.order == "||" for s in samples)
        noise_v = aa_noise(aa_pairs, higher_is_better, swap=swap)
        src = ("A/A split (base on the same GPU, consecutive blocks)" if swap
               else "A/A split (base first vs second run per block)")
        if not aa_pairs or (swap and len(aa_pairs) < 2):
            src = "none measured (no A/A split)"
    else:
        if not 0 <= noise < 1:
            raise InputError(f"--noise must be a fraction in [0, 1), got {noise}")
        noise_v, src = float(noise), "given"
    thr = threshold_for(noise_v, changes_output)
    need = 1.0 + thr
    ok_boot, ok_t = lo > need, t_lo > need
    n_blocks = len(np.unique(blocks))
    too_few_blocks = n_blocks < MIN_BLOCKS
    approved = ok_boot and ok_t and not too_few_blocks
    if ok_boot and ok_t and too_few_blocks:
        reason = (f"one block only: the block bootstrap cannot bound the gain from a single block "
                  f"(its interval is the point estimate); approval needs at least {MIN_BLOCKS} blocks "
                  f"({2 * MIN_BLOCKS} paired samples)")
    elif approved:
        reason = f"lower bound {_pct(min(lo, t_lo))} > threshold {_pct(need)}"
    elif ok_boot != ok_t:
        reason = (f"bootstrap ({_pct(lo)}) and t ({_pct(t_lo)}) lower bounds disagree about the threshold "
                  f"{_pct(need)}: more runs needed")
    else:   # both miss: quote the lower (the one further from approval)
        reason = f"lower bound {_pct(min(lo, t_lo))} <= threshold {_pct(need)}"
    sd = float(log_r.std(ddof=1)) if len(log_r) > 1 else 0.0
    return Verdict(gain, lo, hi, (t_lo, t_hi), noise_v, src, thr, approved, len(samples),
                   n_blocks, sd, reason, seed)


def _pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.2f}%"


@dataclass
class TimingResult:
    base: str
    candidate: str
    metric: str
    unit: str
    higher_is_better: bool
    schedule: str
    changes_output: bool
    samples: list[Sample]
    aa: list[tuple[float, float]]
    verdict: Verdict
    warmup: int = 0
    plan: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        v = self.verdict
        ratios = speed_ratios(self.samples, self.higher_is_better)
        samples = []
        for s, r in zip(self.samples, ratios):
            d = asdict(s)
            d["ratio"] = float(r)
            samples.append(d)
        return {
            "schema": TIMING_SCHEMA, "base": self.base, "candidate": self.candidate,
            "metric": self.metric, "unit": self.unit, "higher_is_better": self.higher_is_better,
            "schedule": self.schedule, "warmup": self.warmup, "runs": len(self.samples),
            "samples": samples,
            "aa": [{"block": i, "first": a, "second": b} for i, (a, b) in enumerate(self.aa)],
            "gain": v.gain, "ci_low": v.ci_low, "ci_high": v.ci_high, "seed": v.seed, "t_ci": list(v.t_ci),
            "sd_log_ratio": v.sd_log_ratio, "noise": v.noise, "noise_source": v.noise_source,
            "changes_output": self.changes_output, "threshold": v.threshold,
            "approved": v.approved, "verdict": v.verdict, "reason": v.reason,
            **({"plan": self.plan} if self.plan else {}), **self.extra,
        }


def read_timing(path) -> dict:
    """Read a ``specpilot.timing/1`` file (for other verbs and for re-judging)."""
    from specpilot.fileio import read_json

    d = read_json(path, "timing")
    for k in ("samples", "gain", "ci_low", "approved", "metric", "higher_is_better"):
        if k not in d:
            raise InputError(f"{path}: timing file lacks {k!r}")
    if not isinstance(d["metric"], str) or not isinstance(d["higher_is_better"], bool):
        raise InputError(f"{path}: 'metric' must be a string and 'higher_is_better' true or false")
    # compare times a command's wall clock (lower is better) or reads a throughput-like metric
    # (higher is better): the other way round, a slower candidate would be approved
    if d["higher_is_better"] == (d["metric"] == "wall"):
        raise InputError(f"{path}: metric {d['metric']!r} is "
                         f"{'lower' if d['metric'] == 'wall' else 'higher'} is better, but the file says "
                         f"'higher_is_better': {str(d['higher_is_better']).lower()}; the file is damaged")
    if not isinstance(d.get("changes_output", False), bool):
        raise InputError(f"{path}: 'changes_output' must be true or false")
    return d


def parse_samples(d: dict, path) -> tuple[list[Sample], list[tuple[float, float]]]:
    """The paired samples and A/A pairs of a timing (or partial timing) document, checked."""
    if not isinstance(d.get("samples"), list) or not isinstance(d.get("aa", []), list):
        raise InputError(f"{path}: 'samples' (and 'aa') must be lists")
    from specpilot.fileio import is_int, is_num

    samples, aa = [], []
    for i, x in enumerate(d["samples"]):
        if not (isinstance(x, dict) and is_int(x.get("pair")) and is_int(x.get("block"))
                and x["pair"] >= 0 and x["block"] >= 0 and is_num(x.get("base")) and is_num(x.get("candidate"))):
            raise InputError(f"{path}: sample {i} needs whole numbers 'pair' and 'block' (>= 0) and numbers 'base' "
                             "and 'candidate'")
        if not (measured(x["base"]) and measured(x["candidate"])):
            raise InputError(f"{path}: every measurement must be a positive finite number (sample {i})")
        samples.append(Sample(x["pair"], x["block"], float(x["base"]), float(x["candidate"]),
                              str(x.get("order", "AB")), x.get("gpu_base"), x.get("gpu_candidate")))
    for i, x in enumerate(d.get("aa", [])):
        if not (isinstance(x, dict) and is_num(x.get("first")) and is_num(x.get("second"))):
            raise InputError(f"{path}: A/A pair {i} needs numbers 'first' and 'second'")
        if not (measured(x["first"]) and measured(x["second"])):
            raise InputError(f"{path}: every measurement must be a positive finite number (A/A pair {i})")
        aa.append((float(x["first"]), float(x["second"])))
    return samples, aa


def rejudge(path, *, noise: float | None = None, changes_output: bool | None = None, n_boot: int = 4000,
            seed: int | None = None) -> TimingResult:
    """Judge the paired samples of a stored ``specpilot.timing/1`` file again (e.g. in CI, with
    a given noise or the changes-output rule). Every sample is checked; the rule is the same.
    ``seed``: the bootstrap's (None: the file's own ``seed``, 0 where it has none)."""
    from specpilot.fileio import reading

    with reading(path):
        return _rejudge(read_timing(path), path, noise, changes_output, n_boot, seed)


def _rejudge(d: dict, path, noise, changes_output, n_boot, seed) -> TimingResult:
    hib = d["higher_is_better"]
    samples, aa = parse_samples(d, path)
    if len(samples) < 2:
        raise InputError(f"{path}: {len(samples)} paired samples; a verdict needs at least 2")
    check_blocks(samples, aa, path)
    swap = str(d.get("schedule", "")).startswith("GPU swap")
    if d.get("schedule") is not None and any((s.order == "||") != swap for s in samples):
        raise InputError(f"{path}: its samples' orders are not those of its schedule {d.get('schedule')!r} ('AB' "
                         "and 'BA' in turn, '||' on a GPU swap); the file is damaged")
    warmup = d.get("warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= 10**6:
        raise InputError(f"{path}: 'warmup' must be a whole number in [0, 1000000]")
    stored = d.get("changes_output", False)
    co = stored if changes_output is None else (changes_output or stored)
    was = d.get("noise")
    if isinstance(was, bool) or not isinstance(was, (int, float)) or not math.isfinite(was) or was < 0:
        raise InputError(f"{path}: 'noise' must be the finite noise >= 0 the run was judged by, got {was!r}")
    if noise is not None and noise < was:
        raise InputError(f"--noise {noise:g} is below the noise the stored run judged by ({was:.4g}); --from can only "
                         "make the rule stricter: give at least that or leave --noise out")
    if noise is None and d.get("noise_source") == "given":
        noise = was   # the run was judged by a given noise: its A/A split's own estimate could only loosen it
    if seed is None:
        seed = d.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
            raise InputError(f"{path}: 'seed' must be the whole number in [0, 4294967295] the run's bootstrap used, "
                             f"got {seed!r}; the file is damaged")
    v = judge(samples, higher_is_better=hib, aa_pairs=aa, noise=noise, changes_output=co, n_boot=n_boot, seed=seed)
    keep = {k: d[k] for k in ("outputs_identical", "outputs_stable", "prompts", "max_new_tokens", "concurrency",
                              "changes_output_reason") if k in d}
    keep["rejudged_from"] = str(path)
    return TimingResult(str(d.get("base", "?")), str(d.get("candidate", "?")), str(d.get("metric", "?")),
                        str(d.get("unit", "")), hib, str(d.get("schedule", "?")), co, samples, aa, v,
                        warmup=warmup, plan=_plan(d.get("plan")), extra=keep)


def _plan(plan):
    """A stored power plan, kept when it has the figures the report shows."""
    num = (int, float)
    if (isinstance(plan, dict) and isinstance(plan.get("pairs"), int) and isinstance(plan.get("power"), num)
            and isinstance(plan.get("target_gain"), num) and all(math.isfinite(plan[k]) for k in ("power", "target_gain"))):
        return plan
    return None


PARTIAL_SCHEMA = "specpilot.timing-partial/1"


def partial_doc(base: str, candidate: str, metric: str, unit: str, higher_is_better: bool, schedule: str,
                samples: Sequence[Sample], aa: Sequence[tuple[float, float]], workload: dict | None = None,
                outputs: dict | None = None) -> dict:
    """The paired samples of an unfinished run: ``compare --resume`` continues from them.
    ``workload``: what each run of engines or servers sends (:func:`workload_of`); ``outputs``:
    each one's outputs so far (a digest of the first run's, and whether every run gave them)."""
    return {"schema": PARTIAL_SCHEMA, "base": base, "candidate": candidate, "metric": metric, "unit": unit,
            "higher_is_better": higher_is_better, "schedule": schedule, "runs": len(samples),
            "samples": [asdict(s) for s in samples],
            "aa": [{"block": i, "first": x, "second": y} for i, (x, y) in enumerate(aa)], "workload": workload,
            "outputs": outputs}


def workload_of(prompt_rows, max_new_tokens: int, concurrency: int) -> dict | None:
    """The request set of a run of engines or servers, as a partial file records it (a digest of
    the prompts' ids and tokens); None for shell commands (their workload is their own)."""
    if prompt_rows is None:
        return None
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps([[p.id, list(p.prompt_ids)] for p in prompt_rows]).encode()).hexdigest()
    return {"prompts": len(prompt_rows), "prompts_sha256": digest[:16], "max_new_tokens": max_new_tokens,
            "concurrency": concurrency}


def _check_partial_workload(path, theirs, workload: dict | None) -> None:
    """Refuse to resume samples measured on another request set (``theirs``, the file's record)."""
    if theirs is not None and not isinstance(theirs, dict):
        raise InputError(f"--resume {path}: its 'workload' must be null or an object (the prompts' digest, "
                         "max_new_tokens, concurrency); the file is damaged")
    if workload is None or theirs == workload:
        return
    if theirs is None:   # engines and servers always record it: samples of no known request set
        raise InputError(f"--resume {path}: it does not say which request set its samples were measured on (no "
                         "'workload'); start the comparison again")
    diff = ", ".join(f"{k} {theirs.get(k)} there, {workload.get(k)} here" for k in workload
                     if theirs.get(k) != workload.get(k))
    raise InputError(f"--resume {path}: its samples were measured on another request set ({diff}); resume with the "
                     "same --prompts, --max-new-tokens and --concurrency")


def partial_samples(path) -> int:
    """How many paired samples a ``specpilot.timing-partial/1`` file holds (read before any system
    is started, to refuse a resume that asks for fewer)."""
    from specpilot.fileio import read_json

    return len(parse_samples(read_json(path, "timing-partial"), path)[0])


def read_partial(path, *, base: str, candidate: str, metric: str, schedule: str, workload: dict | None):
    """Samples and A/A pairs of a ``specpilot.timing-partial/1`` file taken with these systems on
    this request set (``workload``, :func:`workload_of`), read before any system starts."""
    from specpilot.fileio import read_json

    d = read_json(path, "timing-partial")
    theirs = (d.get("base"), d.get("candidate"), d.get("metric"), d.get("schedule"))
    if theirs != (base, candidate, metric, schedule):
        raise InputError(f"--resume {path}: its samples are of base {theirs[0]!r} vs candidate {theirs[1]!r} "
                         f"({theirs[2]}, {theirs[3]}), not of these systems; resume with the same systems and "
                         "options")
    _check_partial_workload(path, d.get("workload"), workload)
    samples, aa = parse_samples(d, path)
    check_blocks(samples, aa, f"--resume {path}")
    return samples, aa, _partial_outputs(path, d.get("outputs"))


def _partial_outputs(path, rec) -> dict | None:
    """A partial file's outputs records (None: not recorded, judged as outputs not shown equal)."""
    if rec is None:
        return None
    ok = isinstance(rec, dict) and all(
        isinstance(rec.get(k), dict) and (rec[k].get("sha256") is None or isinstance(rec[k].get("sha256"), str))
        and isinstance(rec[k].get("stable"), bool) for k in ("base", "candidate"))
    if not ok:
        raise InputError(f"--resume {path}: its 'outputs' must be null or the base's and candidate's records "
                         "(sha256, stable); the file is damaged")
    return rec


def check_blocks(samples: Sequence[Sample], aa, where) -> None:
    """Whole blocks only: two pairs and one A/A pair each (a half block has neither its drift
    cancellation nor its A/A pair, so it is not judged)."""
    blocks = {s.block for s in samples}
    if len(aa) != len(blocks) or len(samples) != 2 * len(aa):
        raise InputError(f"{where}: {len(samples)} samples in {len(blocks)} blocks do not match its {len(aa)} A/A "
                         "pairs (every block has two paired samples and one A/A pair)")
    if len({s.pair for s in samples}) != len(samples):
        raise InputError(f"{where}: two samples have one pair number; the file is damaged")
    by_block: dict[int, list[Sample]] = {}
    for s in samples:
        by_block.setdefault(s.block, []).append(s)
    odd = next(((b, len(v)) for b, v in sorted(by_block.items()) if len(v) != 2), None)
    if odd:
        raise InputError(f"{where}: block {odd[0]} holds {odd[1]} samples (every block has two); the file is damaged")
    # the order each pair ran in picks the noise estimator ('||': the GPU swap's): the schedule's
    # orders only, or one edited sample would loosen the rule
    for b, pair in sorted(by_block.items()):
        orders = tuple(s.order for s in sorted(pair, key=lambda s: s.pair))
        if orders not in (("AB", "BA"), ("||", "||")):
            raise InputError(f"{where}: block {b}'s samples ran in the orders {', '.join(map(repr, orders))}, not a "
                             "block's ('AB' then 'BA', or '||' twice on a GPU swap); the file is damaged")
    if len({s.order == "||" for s in samples}) > 1:
        raise InputError(f"{where}: some blocks ran in turn (AB, BA) and some at once on two GPUs ('||'); the file "
                         "is damaged")
    # a block's A/A pair is its base's two runs (the noise comes from them): another pair is a damaged file
    for (b, pair), (x, y) in zip(sorted(by_block.items()), aa):
        first, second = sorted(pair, key=lambda s: s.pair)
        if (first.base, second.base) != (x, y):
            raise InputError(f"{where}: the A/A pair of block {b} ({x:g}, {y:g}) is not its base's two runs "
                             f"({first.base:g}, {second.base:g}); the file is damaged")
