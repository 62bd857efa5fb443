"""Running two systems as paired timing runs: what a system is, and the ABBA / GPU-swap schedules.

Systems:

- :class:`ShellSystem` - a shell command; its measurement is the wall time of one run (lower is
  better) or a throughput it prints as a JSON object on its last stdout line (``--metric KEY``,
  higher is better). ``{gpu}`` in the command and ``CUDA_VISIBLE_DEVICES`` name the GPU it runs on
  when the schedule pins GPUs.
- :class:`GenerateSystem` - an embedded-engine spec or an SGLang-compatible server (through
  ``specpilot.auditors.systems``): one run generates greedily for the same prompts in the same order
  and measures output tokens per second.

Schedules (:func:`run_pairs`):

- ABBA (one GPU or CPU): blocks of A B B A. Pair 1 is (A, B), pair 2 is (A, B) measured in the
  reverse order, so a linear drift cancels within a block; the two A runs of a block are the A/A
  split that measures stock's own noise.
- GPU swap (``gpus=(g0, g1)``, shell commands): A on g0 and B on g1 at the same time, then A on g1
  and B on g0; the A/A split is A on g0 vs A on g1.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from specpilot import signals
from specpilot.errors import EnvironmentMissing, InputError

from .timing import LEAST_MEASURED, Sample, measured


class System:
    label: str
    metric: str = "wall"
    unit: str = "s"
    higher_is_better: bool = False

    def measure(self, gpu: str | None = None) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def start(self, gpu: str | None = None):  # concurrent runs; default: not supported
        raise InputError(f"{self.label}: running two systems at once on two GPUs needs shell commands "
                         "(--base-cmd/--candidate-cmd)")

    def close(self) -> None:
        pass


def _tail(text: str, n: int = 160) -> str:
    t = " ".join((text or "").split())
    return ("..." + t[-n:]) if len(t) > n else t


FIRST_RUN_TIMEOUT_S = 3600.0  # before any base run has finished
AUTO_TIMEOUT_FACTOR = 10.0
AUTO_TIMEOUT_MIN_S = 60.0


class RunTimeout:
    """How long one shell run may take: ``--timeout`` when given, else 10 x the slowest base run
    so far (warm-up runs included, they are A runs too), at least 60 s; 1 hour until the first
    base run has finished. Shared by both systems of a comparison."""

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.slowest_base: float | None = None

    def seconds(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if self.slowest_base is None:
            return FIRST_RUN_TIMEOUT_S
        return max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * self.slowest_base)

    def observe(self, role: str, wall: float) -> None:
        if role == "base":
            self.slowest_base = wall if self.slowest_base is None else max(self.slowest_base, wall)

    def describe(self, limit: float) -> str:
        if self.fixed is not None:
            return f"--timeout {self.fixed:g} s"
        if self.slowest_base is None:
            return f"the first-run limit of {limit:g} s (set --timeout)"
        return (f"the default limit of {limit:.3g} s ({AUTO_TIMEOUT_FACTOR:g} x the slowest base run, "
                f"{self.slowest_base:.3g} s, at least {AUTO_TIMEOUT_MIN_S:g} s; set --timeout)")


class ShellSystem(System):
    """A shell command, started in its own process group (``specpilot.signals.spawn``): a
    timeout or a signal ends the command and everything it started."""

    def __init__(self, cmd: str, role: str, metric: str = "wall", timeout: float | RunTimeout | None = None,
                 cwd: str | None = None):
        if not cmd or not cmd.strip():
            raise InputError(f"--{role}-cmd is empty")
        if not isinstance(timeout, RunTimeout):
            timeout = RunTimeout(timeout)
        self.cmd, self.role, self.timeout, self.cwd = cmd, role, timeout, cwd
        self.label = cmd
        self.metric = metric
        if metric == "wall":
            self.unit, self.higher_is_better = "s", False
        else:
            self.unit, self.higher_is_better = metric, True
        self.runs = 0

    def _argv(self, gpu):
        cmd = self.cmd.replace("{gpu}", shlex.quote(gpu)) if gpu is not None else self.cmd
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return cmd, env

    def measure(self, gpu=None) -> float:
        return self.finish(self.start(gpu))

    def start(self, gpu=None):
        cmd, env = self._argv(gpu)
        limit = self.timeout.seconds()
        t0 = time.perf_counter()
        try:
            p = signals.spawn(cmd, shell=True, env=env, cwd=self.cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        except OSError as e:
            raise InputError(f"{self.role} command could not start: {e}") from None
        return (p, t0, limit)

    def finish(self, handle) -> float:
        p, t0, limit = handle
        try:
            out, err = p.communicate(timeout=max(0.0, limit - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            _kill(p)
            raise InputError(f"{self.role} command ran past {self.timeout.describe(limit)} on run {self.runs + 1}: "
                             f"{self.cmd}") from None
        except BaseException:
            _kill(p)
            raise
        wall = time.perf_counter() - t0
        signals.forget(p)
        self.timeout.observe(self.role, wall)
        self.runs += 1
        if p.returncode != 0:
            raise InputError(f"{self.role} command failed (exit {p.returncode}) on run {self.runs}: {self.cmd}"
                             + (f"; stderr: {_tail(err)}" if err and err.strip() else ""))
        if self.metric == "wall":
            return wall
        return _metric_from_stdout(out, self.metric, f"{self.role} command run {self.runs}")


def _kill(p: subprocess.Popen) -> None:
    """End the command's whole process group."""
    signals.end(p)


def check_metric(key: str, shell: bool = True) -> None:
    """InputError for a --metric the systems cannot be timed by, checked before any runs: beside
    engines and servers anything but ``wall`` (they are timed in tokens/s); beside shell commands
    one no output can carry: empty, or a dotted path with an empty part (``a..b``)."""
    if not shell:
        if key != "wall":
            raise InputError("--metric applies to shell commands; engines and servers are timed in tokens/s")
        return
    if not key or not key.strip():
        raise InputError(f"--metric {key!r}: empty; give 'wall' to time each run, or the key of the throughput "
                         "the commands print as JSON on their last stdout line (e.g. tokens_per_s)")
    if any(not part.strip() for part in key.split(".")):
        raise InputError(f"--metric {key!r}: an empty key in the dotted path (a.b reaches into nested objects)")


def _metric_shape(key: str, value: str) -> str:
    """The JSON object --metric KEY reads: a dotted key reaches into nested objects."""
    for part in reversed(key.split(".")):
        value = f"{{{json.dumps(part)}: {value}}}"
    return value


def _metric_from_stdout(out: str, key: str, where: str) -> float:
    lines = [ln for ln in (out or "").splitlines() if ln.strip()]
    if not lines:
        raise InputError(f"{where}: printed nothing; --metric {key} expects a JSON object like "
                         f"{_metric_shape(key, '123.4')} on its last line")
    try:
        obj = json.loads(lines[-1])
    except (json.JSONDecodeError, RecursionError):
        raise InputError(f"{where}: last stdout line is not JSON ({_tail(lines[-1], 60)!r}); --metric {key} "
                         f"expects {_metric_shape(key, 'number')}") from None
    v = obj
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            raise InputError(f"{where}: the JSON on its last line has no {key!r}")
        v = v[part]
    if not measured(v):
        tiny = isinstance(v, float) and 0 < v < LEAST_MEASURED
        raise InputError(f"{where}: {key!r} must be a positive number, got {v!r}"
                         + (" (below the normal floats: no measurement)" if tiny else ""))
    return float(v)


class GenerateSystem(System):
    """An engine spec or HTTP server: tokens/s over the prompt set, one run = every prompt once."""

    def __init__(self, spec: str, prompts, max_new_tokens: int, timeout: float = 120.0, concurrency: int = 1):
        from .systems import make_generator

        self.system = self.check(spec, prompts, max_new_tokens, concurrency)
        self.concurrency = concurrency
        self.label = spec
        self.metric, self.unit, self.higher_is_better = "throughput", "tok/s", True
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.gen = make_generator(self.system, timeout=timeout)
        self.reset_outputs()

    def reset_outputs(self) -> None:
        """No run yet: the outputs bookkeeping ``measure`` keeps."""
        self.outputs: list[list[int]] | None = None   # the first run's (every prompt's tokens)
        self.outputs_digest: str | None = None   # of the first run's outputs, or a resumed file's
        self.outputs_stable = True   # every run since gave the same outputs
        self.outputs_unrecorded = False   # resumed from samples whose outputs were not kept

    @staticmethod
    def check(spec: str, prompts, max_new_tokens: int, concurrency: int = 1):
        """The parsed system, or InputError for what cannot be timed; nothing is loaded or started."""
        from .systems import parse_system

        if not prompts:
            raise InputError(f"{spec}: timing an engine or a server needs --prompts FILE")
        if max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
        system = parse_system(spec, files=False)
        if concurrency < 1:
            raise InputError(f"--concurrency {concurrency}: must be at least 1")
        if concurrency > 1 and system.kind != "http":
            raise InputError("--concurrency applies to servers; the embedded engine serves one request at a time")
        return system

    def measure(self, gpu=None) -> float:
        t0 = time.perf_counter()
        one = lambda p: list(self.gen.generate(list(p.prompt_ids), self.max_new_tokens))  # noqa: E731
        if self.concurrency > 1:  # the same requests, C in flight at once, answers kept in request order
            from .fanout import in_threads

            got = dict(in_threads(one, self.prompts, self.concurrency))
            outs = [got[i] for i in range(len(self.prompts))]
        else:
            outs = [one(p) for p in self.prompts]
        tokens = sum(len(o) for o in outs)
        wall = time.perf_counter() - t0
        digest = outputs_digest(outs)
        if self.outputs is None:
            self.outputs = outs
        if self.outputs_digest is None:
            self.outputs_digest = digest
        elif digest != self.outputs_digest:
            self.outputs_stable = False
        if tokens == 0:
            raise InputError(f"{self.label}: generated no tokens")
        return tokens / wall

    def outputs_record(self) -> dict:
        """What a partial file keeps of the outputs: a resumed comparison judges them with the rest."""
        return {"sha256": self.outputs_digest, "stable": self.outputs_stable}

    def resume_outputs(self, record: dict | None) -> None:
        """The outputs of an interrupted comparison's runs (``outputs_record``); later runs are
        compared with them."""
        if record is None:
            self.outputs_unrecorded = True
        else:
            self.outputs_digest = record.get("sha256")
            self.outputs_stable = bool(record.get("stable"))

    def close(self):
        self.gen.close()


def outputs_digest(outs: list[list[int]]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:32]


def recorded_as(spec: str | None, cmd: str | None, metric: str) -> tuple[str, str]:
    """The label and metric that the system :func:`make_system` makes of these options records in
    a timing file (what a resumed partial file is checked against), without starting it."""
    return (cmd, metric) if cmd is not None else (spec, "throughput")


def check_system(spec: str | None, role: str, *, metric: str, prompts=None, max_new_tokens: int = 128,
                 concurrency: int = 1) -> None:
    """Refuse (InputError) an engine/server system :func:`make_system` could not time, before
    either of a pair's systems loads a model or starts."""
    if spec is None:
        raise InputError(f"give --{role} SPEC or --{role}-cmd CMD")
    check_metric(metric, shell=False)
    GenerateSystem.check(spec, prompts, max_new_tokens, concurrency)


def make_system(spec: str | None, cmd: str | None, role: str, *, metric: str, timeout: float | RunTimeout | None,
                prompts=None, max_new_tokens: int = 128, concurrency: int = 1) -> System:
    """A shell system (``timeout``: seconds or a :class:`RunTimeout` shared with the other
    system) or an engine/server system (``timeout``: seconds per request, default 120)."""
    if cmd is not None:
        return ShellSystem(cmd, role, metric=metric, timeout=timeout)
    if isinstance(timeout, RunTimeout):
        timeout = timeout.fixed
    check_system(spec, role, metric=metric, prompts=prompts, max_new_tokens=max_new_tokens, concurrency=concurrency)
    return GenerateSystem(spec, prompts, max_new_tokens, timeout=timeout or 120.0, concurrency=concurrency)


@dataclass
class PairRun:
    samples: list[Sample]
    aa: list[tuple[float, float]]
    # engines and servers: each system's outputs_record at the time (None: not recorded)
    outputs: dict | None = None


def run_block(a: System, b: System, block: int, pair0: int, gpus: Sequence[str] | None) -> tuple[list[Sample], tuple]:
    if gpus:
        g0, g1 = gpus
        out = []
        firsts = []
        for ga, gb in ((g0, g1), (g1, g0)):
            ha = a.start(ga)
            try:
                hb = b.start(gb)
            except BaseException:
                _kill(ha[0])
                raise
            try:
                va = a.finish(ha)
            except BaseException:
                _kill(hb[0])  # never leave the other system running on its GPU
                raise
            vb = b.finish(hb)
            firsts.append(va)
            out.append(Sample(pair0 + len(out), block, va, vb, "||", ga, gb))
        return out, (firsts[0], firsts[1])
    a1 = a.measure()
    b1 = b.measure()
    b2 = b.measure()
    a2 = a.measure()
    return [Sample(pair0, block, a1, b1, "AB"), Sample(pair0 + 1, block, a2, b2, "BA")], (a1, a2)


def run_pairs(a: System, b: System, n_pairs: int, *, gpus: Sequence[str] | None = None, start_block: int = 0,
              start_pair: int = 0, tick: Callable[[int], None] | None = None,
              on_block: Callable[[list[Sample], tuple], None] | None = None) -> PairRun:
    """``n_pairs`` (rounded up to whole blocks of 2) paired samples on the chosen schedule;
    ``on_block`` gets each finished block's samples and A/A pair."""
    samples: list[Sample] = []
    aa = []
    block = start_block
    while len(samples) < n_pairs:
        s, pair_aa = run_block(a, b, block, start_pair + len(samples), gpus)
        samples.extend(s)
        aa.append(pair_aa)
        block += 1
        if on_block:
            on_block(s, pair_aa)
        if tick:
            tick(len(s))
    return PairRun(samples, aa)


def warm_up(a: System, b: System, n: int, gpus: Sequence[str] | None = None) -> None:
    for _ in range(n):
        if gpus:
            run_block(a, b, -1, 0, gpus)
        else:
            a.measure()
            b.measure()


def parse_gpus(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if len(parts) != 2 or parts[0] == parts[1]:
        raise InputError(f"--gpus {text!r}: give two different GPU ids, e.g. --gpus 0,1")
    bad = [p for p in parts if not (p.isdigit() or p.startswith(("GPU-", "MIG-")))]
    if bad:   # what CUDA_VISIBLE_DEVICES takes: an index, a GPU-/MIG- UUID
        raise InputError(f"--gpus {text!r}: {bad[0]!r} is not a GPU id (an index such as 0, or a GPU-/MIG- UUID)")
    from specpilot.machine import gpu_count

    n = gpu_count()
    if n == 0:   # the swap would time two CPU runs and report them as two GPUs
        raise EnvironmentMissing(f"--gpus {text}: no GPU is visible on this machine (no driver answers)")
    for p in parts:
        if p.isdigit() and int(p) >= n:
            raise EnvironmentMissing(f"--gpus {text}: GPU {p} does not exist ({n} visible)")
    return parts[0], parts[1]


def outputs_records(a: System, b: System) -> dict | None:
    """Both systems' outputs records (engines and servers), for a partial file."""
    if isinstance(a, GenerateSystem) and isinstance(b, GenerateSystem):
        return {"base": a.outputs_record(), "candidate": b.outputs_record()}
    return None


def _outputs_known(a: GenerateSystem, b: GenerateSystem) -> bool:
    """Both systems' outputs were seen (or recorded) for every run judged."""
    return not any(x.outputs_unrecorded or x.outputs_digest is None for x in (a, b))


def _outputs_differ(a: System, b: System) -> str | None:
    """Why the candidate's outputs are not shown to be the base's (every run of each compared),
    or None where they are, or the systems are not engines or servers."""
    if not (isinstance(a, GenerateSystem) and isinstance(b, GenerateSystem)):
        return None
    if not _outputs_known(a, b):
        return "the outputs of the resumed runs were not recorded"
    unstable = [role for role, x in (("base", a), ("candidate", b)) if not x.outputs_stable]
    if unstable:
        return f"the {' and the '.join(unstable)}'s outputs changed from run to run"
    return "candidate outputs differ from base outputs" if a.outputs_digest != b.outputs_digest else None


def even_pairs(option: str, n: int) -> None:
    """Pairs are measured in blocks of two (ABBA, or a GPU swap): a half block has neither its
    drift cancellation nor its A/A pair, so an odd count is refused, not rounded."""
    if n % 2:
        raise InputError(f"{option} {n}: pairs come in blocks of 2 (ABBA, or a GPU swap); give an even number, "
                         f"e.g. {max(n - 1, 2)} or {n + 1}")


def paired_compare(a: System, b: System, *, runs: int | None = None, warmup: int = 1,
                   gpus: Sequence[str] | None = None, noise: float | None = None, changes_output: bool = False,
                   max_runs: int = 400, n_boot: int = 4000, seed: int = 0,
                   tick: Callable[[int], None] | None = None, set_total: Callable[[int], None] | None = None,
                   prior: PairRun | None = None, on_block: Callable[[PairRun], None] | None = None):
    """Warm up, run paired samples (a pilot and a power-planned total when ``runs`` is None), judge.

    ``prior``: samples of an interrupted run of the same systems to continue from; ``on_block``
    gets every sample so far after each block (to keep them in a resumable file).
    """
    import math

    import numpy as np

    from .power import PILOT_PAIRS, plan_runs
    from .timing import TimingResult, judge, speed_ratios

    if runs is not None and runs < 2:
        raise InputError(f"--runs {runs}: need at least 2 pairs")
    even_pairs("--runs", runs) if runs is not None else even_pairs("--max-runs", max_runs)
    if a.higher_is_better != b.higher_is_better or a.unit != b.unit:
        raise InputError("base and candidate must be measured in the same metric")
    hib = a.higher_is_better
    user_changes_output = changes_output
    samples: list[Sample] = list(prior.samples) if prior else []
    aa_pairs: list[tuple] = list(prior.aa) if prior else []
    if prior and isinstance(a, GenerateSystem) and isinstance(b, GenerateSystem):
        a.resume_outputs(prior.outputs.get("base") if prior.outputs else None)
        b.resume_outputs(prior.outputs.get("candidate") if prior.outputs else None)

    def keep(block_samples, block_aa):
        samples.extend(block_samples)
        aa_pairs.append(block_aa)
        if on_block:
            on_block(PairRun(samples, aa_pairs, outputs_records(a, b)))

    def more(n: int) -> None:
        run_pairs(a, b, n, gpus=gpus, start_block=len(aa_pairs), start_pair=len(samples), tick=tick, on_block=keep)

    warm_up(a, b, warmup, gpus)
    plan = None
    if runs is None:
        stages = []
        want = min(PILOT_PAIRS, max_runs)
        for stage in range(8):  # the pilot, then re-plans from all samples so far
            if set_total:
                set_total(max(want, len(samples)))
            if want > len(samples):
                more(want - len(samples))
            if _outputs_differ(a, b):
                changes_output = True  # plan for the rule that will judge it
            lr = np.log(speed_ratios(samples, hib))
            aa = np.array(aa_pairs, dtype=float)
            aa_lr = np.log(aa[:, 0] / aa[:, 1]) if hib else np.log(aa[:, 1] / aa[:, 0])
            # plan for a true 3% gain, or half the gain seen so far when larger: a clear win does
            # not need the runs a 3% gain needs (with no gain this is the 3% plan)
            target = max(1.03, 1.0 + (math.exp(float(lr.mean())) - 1.0) / 2.0)
            p = plan_runs(float(lr.std(ddof=1)), float(aa_lr.std(ddof=1)) if len(aa_lr) > 1 else 0.0,
                          len(lr), target_gain=target, changes_output=changes_output, noise=noise,
                          aa_mean=float(aa_lr.mean()), max_pairs=max_runs)
            stages.append(p.to_json() | {"after_pairs": len(samples)})
            if p.pairs <= len(samples) or len(samples) >= max_runs:
                break
            want = min(p.pairs, 2 * len(samples))   # at most double per stage, then re-plan
        plan = stages[-1] | {"stages": stages}
    else:
        if set_total:
            set_total(runs)
        if tick and samples:
            tick(len(samples))
        if runs > len(samples):
            more(runs - len(samples))
    extra = {}
    if isinstance(a, GenerateSystem) and isinstance(b, GenerateSystem):
        why = _outputs_differ(a, b)
        extra["outputs_identical"] = (a.outputs_digest == b.outputs_digest) if _outputs_known(a, b) else None
        extra["outputs_stable"] = a.outputs_stable and b.outputs_stable
        extra["prompts"] = len(a.prompts)
        extra["max_new_tokens"] = a.max_new_tokens
        extra["concurrency"] = a.concurrency
        if why and not user_changes_output:
            changes_output = True
            extra["changes_output_reason"] = f"{why}: the 3% rule applies"
    v = judge(samples, higher_is_better=hib, aa_pairs=aa_pairs, noise=noise, changes_output=changes_output,
              n_boot=n_boot, seed=seed)
    schedule = f"GPU swap on {gpus[0]},{gpus[1]}" if gpus else "ABBA"
    return TimingResult(a.label, b.label, a.metric, a.unit, hib, schedule, changes_output, samples, aa_pairs, v,
                        warmup=warmup, plan=plan, extra=extra)
