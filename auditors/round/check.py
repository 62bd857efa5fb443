"""The CI gate: re-measure the current system and compare it with a round's baseline.

A baseline (``specpilot.baseline/1``, ``baseline.json`` of a round) holds the final system of the
round, its prompts (as token ids, inside the outputs), the new tokens per prompt, the tokens/s of
its paired runs and their A/A noise, and the outputs of the system, stock and AR. :func:`run_check`
runs the system again on the same prompts and fails when

* it is slower beyond the measured noise: the 95% upper bound of fresh / baseline throughput
  (bootstrap of the geometric means, each set resampled on its own) lies below
  1 - (1% + 2 x noise), noise being the larger of the baseline's A/A noise and the fresh runs' own
  (consecutive runs paired), plus ``tolerance`` (0 by default; a shared CPU drifts between
  sessions far more than within one), or
* its outputs fail the token-forcing audit against the baseline's stock outputs.

The runs are not paired with the baseline's (they ran on another day, maybe on another build), so
the gate is meant for a machine as steady as the one the baseline came from; it warns when the
machine differs.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from specpilot.errors import EnvironmentMissing, InputError

SCHEMA = "specpilot.check/1"


@dataclass
class CheckResult:
    system: str
    baseline: str
    runs: int
    fresh: list[float]
    reference: list[float] | None
    gain: float | None = None
    ci: tuple[float, float] | None = None
    noise: float | None = None
    threshold: float | None = None
    timing: str = "not judged"            # ok | regression | not judged
    audit: dict | None = None
    audit_verdict: str = "not run"        # pass | reject | not run
    outputs_identical: bool | None = None
    passed: bool = True
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    machine: str | None = None
    baseline_machine: str | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["ci"] = list(self.ci) if self.ci else None
        return {"schema": SCHEMA, **d}


def _boot_ratio(fresh: np.ndarray, ref: np.ndarray, n: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    lf, lr = np.log(fresh), np.log(ref)
    a = lf[rng.integers(0, len(lf), (n, len(lf)))].mean(1)
    b = lr[rng.integers(0, len(lr), (n, len(lr)))].mean(1)
    lo, hi = np.percentile(a - b, [2.5, 97.5])
    return math.exp(lo), math.exp(hi)


def judge_regression(fresh: list[float], reference: list[float], reference_noise: float | None,
                     seed: int = 0, tolerance: float = 0.0) -> tuple[float, tuple[float, float], float, float, bool]:
    """(gain, 95% interval, noise, threshold, regression) for throughputs (higher is better);
    ``tolerance`` is added to the threshold (a runner whose speed drifts between sessions more
    than within one: a shared CPU)."""
    from specpilot.auditors.timing import BASE_MARGIN, aa_noise

    f, r = np.asarray(fresh, float), np.asarray(reference, float)
    if len(f) < 2 or len(r) < 2 or (f <= 0).any() or (r <= 0).any():
        raise InputError("the regression check needs at least 2 positive samples on each side")
    gain = math.exp(np.log(f).mean() - np.log(r).mean())
    ci = _boot_ratio(f, r, seed=seed)
    own = aa_noise([(fresh[i], fresh[i + 1]) for i in range(0, len(fresh) - 1, 2)], higher_is_better=True)
    noise = max(own, reference_noise or 0.0)
    threshold = BASE_MARGIN + 2 * noise + tolerance
    return gain, ci, noise, threshold, ci[1] < 1.0 - threshold


def run_check(baseline: dict, *, system: str | None = None, runs: int | None = None, scorer: str | None = None,
              audit: bool = True, timing: bool = True, seed: int = 0, tolerance: float = 0.0, progress=None,
              notify=None) -> CheckResult:
    from specpilot.auditors.outputs import OutputRow, Outputs, Prompt

    from .deployment import engine_facts
    from .engines import EnginePool, EngineScorer, PooledSystem, outputs_from
    from .approve import audit_data, run_audit

    notify = notify or (lambda stage, msg: None)
    if baseline.get("kind", "engine") != "engine":
        raise InputError(f"{baseline['_path']}: the CI gate re-measures embedded-engine baselines; for an SGLang "
                         "deployment run 'specpilot round' on its deployment file")
    from specpilot.engine.spec import EngineSpec

    # --system is typed (strict); the baseline's is stored (read leniently, see EngineSpec.parse)
    if system:
        try:
            spec = EngineSpec.parse(system, strict=True)
        except InputError as e:
            raise InputError(f"--system {system}: {e}") from None
    else:
        spec = EngineSpec.parse(baseline["system"])
    sys_text = str(spec)
    outs = baseline.get("outputs") or {}
    rows = outs.get("system") or outs.get("stock")
    if not rows:
        raise InputError(f"{baseline['_path']}: the baseline holds no outputs (its prompts); run the round again")
    prompts = [Prompt(r["id"], list(r["prompt_ids"])) for r in rows]
    max_new = int(baseline.get("max_new_tokens") or max(len(r["output_ids"]) for r in rows) or 1)
    ref = baseline.get("samples")
    n = runs or max(4, len(ref or []) or 6)
    if n < 2:
        raise InputError(f"--runs {n}: need at least 2 runs")
    if audit and not outs.get("stock"):   # a gate must check what it says it checks
        raise InputError(f"{baseline['_path']}: the baseline holds no stock outputs to audit against; give "
                         "--no-audit to check the timing only")
    timed = bool(ref and len(ref) >= 2)
    if not audit and not timing:
        raise InputError("--no-audit and --no-timing leave nothing to check")
    if timing and not timed:   # a gate that passes on half its check must be asked for
        held = ("holds 1 timing sample, and a timing check needs at least 2" if ref and len(ref) == 1
                else "holds no timing samples (its round timed no candidate)")
        raise InputError(f"{baseline['_path']}: the baseline {held}; give --no-timing to audit only, or run the "
                         "round with a larger --budget")
    if audit and not scorer and not baseline.get("stock"):
        raise InputError(f"{baseline['_path']}: baseline lacks 'stock' (the engine whose target scores the "
                         "audit); give --scorer MODEL")
    if audit and not any(r["output_ids"] for r in outs["stock"]):   # every verdict would pass on no evidence
        raise InputError(f"{baseline['_path']}: outputs.stock holds no tokens: the audit has nothing to compare "
                         "against; run the round again, or give --no-audit")
    import torch

    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        where = f"--system {sys_text}" if system else f"{baseline['_path']}: the baseline's system {sys_text}"
        raise EnvironmentMissing(f"{where} runs on CUDA and no CUDA GPU is visible: run the check on a machine "
                                 "with a GPU (the baseline's throughput is of its GPU)")
    if (audit and not scorer and EngineSpec.parse(baseline["stock"]).device.startswith("cuda")
            and not torch.cuda.is_available()):   # before the timed runs, not after them
        raise EnvironmentMissing(f"{baseline['_path']}: the audit's scorer is the baseline's stock engine "
                                 f"{baseline['stock']}, on CUDA, and no CUDA GPU is visible: give --scorer MODEL "
                                 "(the target model), or --no-audit")
    from specpilot.auditors.systems import check_engine_prompts

    check_engine_prompts([(f"{baseline['_path']}: {sys_text}", sys_text)], prompts, max_new)
    if audit and not scorer:   # the stock engine scores the stock rows, outputs included
        from specpilot.engine.api import model_vocab

        stock_prompts = [Prompt(r["id"], list(r["prompt_ids"])) for r in outs["stock"]]
        check_engine_prompts([(f"{baseline['_path']}: stock {baseline['stock']}", baseline["stock"])], stock_prompts,
                             max_new)
        vocab = model_vocab(baseline["stock"])
        for role in ("stock", "ar", "system"):
            for r in outs.get(role) or []:
                bad = next((t for t in r["output_ids"] if t >= vocab), None)
                if bad is not None:
                    raise InputError(f"{baseline['_path']}: outputs.{role} row {r['id']!r}: token id {bad} is outside "
                                     f"the stock model's vocabulary (0..{vocab - 1})")
    if audit:   # the scorer forces the system's outputs: token ids of another vocabulary are not its tokens
        from specpilot.engine.api import model_vocab

        sys_vocab = model_vocab(sys_text)
        if scorer:
            from specpilot.auditors.scorer import scorer_vocab_size

            sc_vocab, sc_name = scorer_vocab_size(scorer), f"--scorer {scorer}"   # None: told as it scores
        else:
            sc_vocab = model_vocab(baseline["stock"])
            sc_name = f"the baseline's scorer (stock {baseline['stock']}, {baseline['_path']})"
        if sc_vocab is not None and sc_vocab != sys_vocab:
            if system:
                raise InputError(f"--system {sys_text}: its vocabulary ({sys_vocab} tokens) is not that of {sc_name}, "
                                 f"{sc_vocab} tokens: the audit cannot score its outputs; check it against a baseline "
                                 "of its own model, or give --no-audit")
            # the baseline's own system: the scorer given is the one at odds
            raise InputError(f"{sc_name}: its vocabulary ({sc_vocab} tokens) is not that of the baseline's system "
                             f"{sys_text} ({sys_vocab} tokens): the audit cannot score its outputs; give a scorer of "
                             "its model, or leave --scorer out")
        if scorer and sc_vocab is not None:   # the rows the scorer forces, before the timed runs
            for role in ("stock", "ar", "system"):
                for r in outs.get(role) or []:
                    bad = next((t for t in (*r["prompt_ids"], *r["output_ids"]) if t >= sc_vocab), None)
                    if bad is not None:
                        raise InputError(f"{baseline['_path']}: outputs.{role} row {r['id']!r}: token id {bad} is "
                                         f"outside the vocabulary of {sc_name} (0..{sc_vocab - 1}); is it the target "
                                         "model of these outputs?")
    res = CheckResult(system=sys_text, baseline=baseline["_path"], runs=n if timing else 0, fresh=[], reference=ref)
    facts = engine_facts(spec)
    res.machine = facts.gpu or facts.cpu
    bf = baseline.get("facts") or {}
    res.baseline_machine = bf.get("gpu") or bf.get("cpu")
    # where the baseline was measured matters only where throughput is compared (not --no-timing)
    if timing and res.baseline_machine is None:   # an older or hand-made baseline: not "measured on None"
        res.warnings.append(f"the baseline does not say what machine it was measured on (no facts.gpu or facts.cpu); "
                            f"this is {res.machine}: throughputs from different machines are not comparable")
    elif timing and res.machine != res.baseline_machine:
        res.warnings.append(f"the baseline was measured on {res.baseline_machine}, this is {res.machine}: "
                            "throughputs from different machines are not comparable")
    if system and sys_text != baseline["system"]:
        res.warnings.append(f"checking {sys_text} against the baseline of {baseline['system']}")
    pool = EnginePool()
    notify("check", f"loading {sys_text}")
    sysm = PooledSystem(sys_text, pool.get(sys_text), prompts, max_new)
    sysm.measure()  # warm-up (and, with --no-timing, the outputs the audit needs)
    if timing:
        it = range(n) if progress is None else progress(range(n), total=n, desc="runs", unit="run")
        t0 = time.perf_counter()
        for _ in it:
            res.fresh.append(sysm.measure())
        notify("check", f"{n} runs in {time.perf_counter() - t0:.0f} s: median {float(np.median(res.fresh)):.4g} "
                        "tokens/s")
        res.gain, res.ci, res.noise, res.threshold, regression = judge_regression(
            res.fresh, ref, baseline.get("noise"), seed=seed, tolerance=tolerance)
        res.timing = "regression" if regression else "ok"
        if res.threshold >= 1:   # 1 - threshold <= 0: no interval of positive throughputs lies below it
            res.warnings.append(f"the threshold 1 - {res.threshold:.2%} (1% + 2 x noise {res.noise:.2%}"
                                + (f" + tolerance {tolerance:.0%}" if tolerance else "") + ") is not above 0: "
                                "timing cannot fail; lower --tolerance, or measure a quieter baseline")
        if regression:
            res.reasons.append(f"slower: {res.gain:.4f}x of the baseline, 95% interval [{res.ci[0]:.4f}, "
                               f"{res.ci[1]:.4f}] entirely below 1 - {res.threshold:.2%} (1% + 2 x noise {res.noise:.2%}"
                               + (f" + tolerance {tolerance:.0%})" if tolerance else ")"))
    else:
        res.warnings.append("--no-timing: timing not judged")
    fresh_out = outputs_from(sysm, prompts, "system")
    base_sys = [list(r["output_ids"]) for r in outs.get("system") or []]
    if base_sys:
        res.outputs_identical = [list(r.output_ids) for r in fresh_out.rows] == base_sys
    if audit:
        stock = Outputs("stock", [OutputRow(r["id"], r["prompt_ids"], r["output_ids"]) for r in outs["stock"]], "stock")
        ar = Outputs("ar", [OutputRow(r["id"], r["prompt_ids"], r["output_ids"]) for r in outs["ar"]], "ar") \
            if outs.get("ar") else None
        if scorer:
            from specpilot.auditors.scorer import Scorer

            sc = Scorer.load(scorer)
        else:
            notify("check", f"loading the stock engine for the scorer ({baseline['stock']})")
            sc = EngineScorer(pool.get(str(EngineSpec.parse(baseline["stock"]))),
                              "stock engine's target, FP32 LM head")
        result = run_audit(fresh_out, stock, ar, sc, seed=seed)
        res.warnings += [f"audit: {w}" for w in result.warnings]
        res.audit = audit_data(result, getattr(sc, "info", None))
        res.audit_verdict = result.verdict
        if result.verdict != "pass":
            res.reasons += ["audit: " + r for s in result.systems if s.role == "system" for r in s.reasons]
    res.passed = not res.reasons
    return res
