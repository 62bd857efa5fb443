"""``specpilot ceiling``: byte floors per row count, and the cost model from measurements.

The inputs are one :class:`CeilingRequest`: the deployment's shape, numbers given directly
(:class:`Measurements`) and figures from other verbs' results, already read
(:class:`ProfileFigures` from ``specpilot profile``: kernel busy ms, step wall ms, floor;
:class:`ReplayFigures` from ``specpilot replay``: tau per policy, tau(N) curves;
:class:`RowsProbeFigures` from ``specpilot probe rows``: T_step(N) and T_AR;
:class:`RunFigures` from ``specpilot run``: tau and the decode loop's step timing, wall and GPU).
Numbers given directly win over figures from results. Results of different deployments (model,
GPU, rows, batch, floor shape) are refused (:func:`check_one_deployment`); where two results give
the same measurement, one is used and a note says which and why (:func:`passed_over_notes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specpilot.errors import InputError
from specpilot.gpus import GPUSpec
from specpilot.models import ModelSpec

from .costmodel import CostModel, cost_model, step_time
from .floors import StepFloor, step_floor


@dataclass
class Measurements:
    tau: float | None = None
    tau_best: float | None = None
    step_ms: float | None = None
    ar_ms: float | None = None
    profile_ms: float | None = None
    floor_ms: float | None = None
    floor_peak_ms: float | None = None  # the floor at the GPU's full peak (both fractions 1), where known
    sources: dict[str, str] = field(default_factory=dict)
    origins: dict[str, object] = field(default_factory=dict)  # the file (its figures) each value came from
    passed_over: list[tuple[str, float, object]] = field(default_factory=list)  # another file's value, not used

    def set(self, name: str, value, source: str, origin: object = None) -> None:
        """Set a value unless the command line or a file before already gave it; ``origin``: the
        file's figures (a value of another file than the one used is kept in ``passed_over``)."""
        if value is None:
            return
        if getattr(self, name) is not None:
            if origin is not None and self.origins.get(name) not in (None, origin):
                self.passed_over.append((name, float(value), origin))
            return
        setattr(self, name, float(value))
        self.sources[name] = source
        if origin is not None:
            self.origins[name] = origin

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.tau, self.tau_best, self.step_ms, self.ar_ms, self.profile_ms))


@dataclass
class CeilingResult:
    model: ModelSpec | None
    gpu: GPUSpec | None
    floors: list[StepFloor]
    ar_floor: StepFloor | None
    cost: CostModel | None
    measurements: Measurements
    rows_for_cost: int | None
    fractions: dict[str, float]
    tau_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    by_nodes: list[dict] = field(default_factory=list)  # predicted speedup tau(N) / c(N) per node budget
    by_nodes_left_out: list[dict] = field(default_factory=list)  # budgets whose N + 1 rows the rows probe lacks
    warnings: list[str] = field(default_factory=list)
    cycle: dict | None = None  # TLV: the cycle's terms (tlv_cycle)

    def c_floor(self, f: StepFloor) -> float | None:
        return f.total_floor_ms / self.ar_floor.total_floor_ms if self.ar_floor else None

    def as_dict(self) -> dict:
        by_rows = {}
        for f in self.floors:
            d = f.as_dict()
            d["c_floor"] = self.c_floor(f)
            by_rows[str(f.rows)] = d
        first = self.floors[0] if self.floors else None
        return {
            "schema": "specpilot.ceiling/1",
            "model": self.model.name if self.model else None,
            "gpu": self.gpu.summary() if self.gpu else None,
            "shape": ({"rows": [f.rows for f in self.floors], "batch": first.batch, "context": first.context,
                       "weight_dtype": first.weight_dtype} if first else None),
            "fractions": self.fractions,
            "ar_floor_ms": self.ar_floor.total_floor_ms if self.ar_floor else None,
            "classes": ({k: v.as_dict() for k, v in first.classes.items()} if first else {}),
            "total_floor_ms": first.total_floor_ms if first else self.measurements.floor_ms,
            "by_rows": by_rows,
            "cost_model": ({**self.cost.as_dict(), "rows": self.rows_for_cost,
                            "sources": self.measurements.sources} if self.cost else None),
            "by_nodes": self.by_nodes,
            "by_nodes_left_out": self.by_nodes_left_out,
            "tlv_cycle": self.cycle,
            "warnings": self.warnings,
        }


@dataclass
class ProfileFigures:
    """What the ceiling takes from a profile: ``source`` names it (the file) in sources and errors."""

    source: str
    kernel_busy_ms: float
    step_wall_ms: float
    total_floor_ms: float | None = None  # None when the profile had no (positive) floor
    floor_peak_ms: float | None = None   # that floor at the GPU's full peak (its classes without the fractions)
    rows: int | None = None  # the profiled shape's rows per request
    distributed: dict | None = None  # the profile's ``distributed``: what shows the trace is one rank of several
    model: str | None = None  # the model its floors are of (profile --model), None without floors
    gpu: dict | None = None   # the GPU it ran on: name, key, and the figures of its floors (bandwidth_tbs, bf16_tflops)
    shape: dict = field(default_factory=dict)  # its floors' shape: batch, context, dtypes, fractions, drafter
    # drafter kernels it timed with no floor (profiled without --drafter): (ms a step, share of kernel time)
    unfloored_drafter: tuple[float, float | None] | None = None


@dataclass
class ReplayFigures:
    """What the ceiling takes from a replay: tau per policy name and tau(N) curves per policy."""

    source: str
    taus: dict[str, float]
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    nodes: dict[str, int | None] = field(default_factory=dict)  # the nodes each policy verifies (chain: its depth)
    positions: int | None = None  # the lattice's draft positions m


@dataclass
class RowsProbeFigures:
    """What the ceiling takes from a rows probe: T_step(N) in ms per row count N, T_AR, which AR
    step T_AR is (``ar_path``: ``fused`` or ``layers``; None in files that do not say) and the
    probe's warnings (e.g. a faster AR step exists)."""

    source: str
    step_ms: dict[int, float]
    ar_ms: float
    device: str | None = None  # where it was measured: "cpu", "cuda:0", ...
    gpu: str | None = None     # the GPU's name when measured on one
    cpu: str | None = None     # the CPU's name when measured on the CPU
    ar_path: str | None = None
    warnings: list[str] = field(default_factory=list)
    qpass_ms: dict[int, float] = field(default_factory=dict)   # the TLV Q pass per row count (probe rows --qview)
    qview: str | None = None                                    # the weights that Q pass read
    model: str | None = None                                    # the model it was measured on
    batch: int = 1                                              # requests per step it timed

    @property
    def on_cpu(self) -> bool:
        return self.gpu is None and (self.device or "").startswith("cpu")

    @property
    def hardware(self) -> str:
        if self.gpu:
            return self.gpu
        if self.on_cpu:
            return f"the CPU ({self.cpu})" if self.cpu else "the CPU"
        return self.device or "an unnamed device"


def check_rows_probe_hardware(probe: RowsProbeFigures | None, gpu: GPUSpec | None) -> str | None:
    """A rows probe measured on the CPU cannot stand beside a GPU's floors: InputError naming both.
    A probe from another GPU than the floors' gives a warning (returned)."""
    if probe is None or gpu is None:
        return None
    if probe.on_cpu:
        raise InputError(f"--rows-probe {probe.source} was measured on {probe.hardware}, but the floors are for "
                         f"{gpu.name} (--gpu): a CPU's T_step(N) says nothing about a GPU; run 'specpilot probe rows' "
                         f"on the {gpu.name}, or leave out --model for the measured figures alone")
    if probe.gpu and gpu.key not in ("custom",):
        from specpilot.gpus import match_gpu_name

        m = match_gpu_name(probe.gpu)
        same = (m is not None and m.key == gpu.key) or probe.gpu.lower() == gpu.name.lower()
        if not same:
            return (f"--rows-probe {probe.source} was measured on {probe.gpu}, the floors are for {gpu.name}: "
                    "c(N) and the floors come from different GPUs")
    return None


@dataclass
class RunFigures:
    """What the ceiling takes from a run: tau, the decode loop's mean wall ms per step (drafting,
    tree build, host round trip and KV compaction included) and, on CUDA, mean GPU ms per step
    (CUDA events around each step's kernels in the loop): the outside factor is their ratio.
    The rest is for TLV's cycle and ``ceiling --check``: the step's split (drafting, verify
    forward, Q pass, rest), verify ms and steps by rows, the decode time outside prefill, and a
    TLV run's mean cycle split."""

    source: str
    tau: float
    step_wall_ms: float
    step_gpu_ms: float | None = None
    mode: str | None = None
    nodes: int | None = None
    steps: int = 0
    delivered: int = 0               # tokens from verification passes (each request's first token excluded)
    decode_ms: float | None = None   # the requests' wall time without their prefills
    draft_ms: float | None = None
    verify_ms: float | None = None
    qpass_ms: float = 0.0
    rest_ms: float | None = None
    verify_by_rows: dict[int, tuple[int, float]] = field(default_factory=dict)  # rows -> (steps, mean verify ms)
    tlv_ms: dict[str, float] | None = None  # draft1, qpass, draft2, exact, append: mean ms per cycle
    qview: str | None = None                # a TLV run's Q pass weights (w12, fp8), None where it says nothing
    clocks: dict | None = None  # CUDA: min_mhz, max_mhz, slowed (share of samples), reasons (engine/clocks.py)
    model: str | None = None                # the model it decoded
    device: str | None = None               # where: "cpu", "cuda", "cuda:0", ...

    @property
    def policy(self) -> str | None:
        """The replay policy that is this run's system."""
        return {"ar": None, "chain": "chain", "tree": f"best-first:{self.nodes}",
                "tlv": f"tlv:{self.nodes}"}.get(self.mode or "")

    @property
    def has_split(self) -> bool:
        return self.verify_ms is not None and self.draft_ms is not None and self.rest_ms is not None

    @property
    def pass_ms(self) -> float | None:
        """Measured decode ms per verification (exact) pass, end to end: loop steps and the time between them."""
        return self.decode_ms / self.steps if self.decode_ms and self.steps else None

    @property
    def token_ms(self) -> float | None:
        """Measured decode ms per delivered token."""
        return self.decode_ms / self.delivered if self.decode_ms and self.delivered else None


@dataclass
class CeilingRequest:
    """One ``ceiling`` question: the deployment (model, GPU, rows per request, batch, context,
    storage dtypes, drafter), the floor fractions, and the measured inputs."""

    model: ModelSpec | None
    gpu: GPUSpec | None
    rows: list[int]
    batch: int = 1
    context: int = 2048
    weight_dtype: str = "bf16"
    lm_head_dtype: str | None = None
    kv_dtype: str = "bf16"
    drafter: ModelSpec | None = None
    draft_rows: int | None = None
    draft_passes: int = 1
    flops_fraction: float = 0.60
    bw_fraction: float = 0.90
    policy: str = "chain"  # the replay policy that is the current system
    measurements: Measurements = field(default_factory=Measurements)
    profile: ProfileFigures | None = None
    replay: ReplayFigures | None = None
    rows_probe: RowsProbeFigures | None = None
    run: RunFigures | None = None

    def step_floor(self, rows: int, drafter: bool = True, at_peak: bool = False) -> StepFloor:
        """The floor of one step at ``rows`` rows (``drafter=False``: the AR step, no drafter;
        ``at_peak``: at the GPU's full peak, both fractions 1)."""
        return step_floor(self.model, self.gpu, rows, batch=self.batch, context=self.context,
                          weight_dtype=self.weight_dtype, lm_head_dtype=self.lm_head_dtype, kv_dtype=self.kv_dtype,
                          drafter=self.drafter if drafter else None, draft_rows=self.draft_rows if drafter else None,
                          flops_fraction=1.0 if at_peak else self.flops_fraction,
                          bw_fraction=1.0 if at_peak else self.bw_fraction,
                          draft_passes=self.draft_passes if drafter else 1)


def _use_profile(p: ProfileFigures, m: Measurements) -> None:
    """The profile's step wall time and floor (its kernel busy time: ``_use_profile_gpu_time``)."""
    m.set("step_ms", p.step_wall_ms, f"profile {p.source}", p)
    if p.total_floor_ms is not None and m.floor_ms is None:
        m.set("floor_ms", p.total_floor_ms, f"profile {p.source}", p)
        m.floor_peak_ms = p.floor_peak_ms


def _use_profile_gpu_time(p: ProfileFigures, m: Measurements) -> None:
    """The profile's kernel busy time, before a run's GPU time: the floor it is set against is of
    the same trace's steps."""
    m.set("profile_ms", p.kernel_busy_ms, f"profile {p.source}", p)


def replay_policy(r: ReplayFigures, policy: str) -> str | None:
    """The replay's name for ``policy``: itself, else the one policy of its family (``best-first``
    for ``best-first:32``), else None."""
    if policy in r.taus:
        return policy
    matches = [k for k in r.taus if k.split(":")[0] == policy]
    return matches[0] if len(matches) == 1 else None


def policy_nodes(r: ReplayFigures | None, policy: str) -> int | None:
    """The nodes ``policy`` verifies a step besides the pending token (so N + 1 rows): the replay's
    own ``nodes`` for it (a chain's depth, cut to m), else its budget after ':' (a chain's cut to
    the lattice's m, a bare ``chain`` its m); None for ``oracle:K``, which builds no tree."""
    name = replay_policy(r, policy) if r is not None else None
    if r is not None and name is not None and r.nodes.get(name) is not None:
        return r.nodes[name]
    name = name or policy
    family, _, arg = name.partition(":")
    if family == "oracle":
        return None
    budget = arg.split(",")[-1]
    if family == "chain":
        m = r.positions if r is not None else None
        if budget.isdigit():
            return min(int(budget), m) if m is not None else int(budget)
        return m
    return int(budget) if budget.isdigit() else None


def _use_replay(r: ReplayFigures, m: Measurements, current_policy: str) -> None:
    taus = r.taus
    name = replay_policy(r, current_policy)
    cur = taus[name] if name is not None else None
    if cur is None:
        raise InputError(f"{r.source}: no policy {current_policy!r} in the replay (has {', '.join(taus)}); "
                         "choose one with --policy")
    m.set("tau", cur, f"replay {r.source} ({current_policy})", r)
    best_name = max(taus, key=taus.get)
    m.set("tau_best", taus[best_name], f"replay {r.source} ({best_name})", r)


def _use_run(r: RunFigures, m: Measurements) -> None:
    if r.tlv_ms:
        m.set("tau", r.tau, f"run {r.source} (tau per exact pass)", r)
        m.set("step_ms", run_step_ms(r), f"run {r.source} (TLV cycle ms: draft 1 + Q pass + draft 2 + "
              "exact pass + append)", r)
    m.set("tau", r.tau, f"run {r.source}", r)
    m.set("step_ms", r.step_wall_ms, f"run {r.source} (decode loop wall ms per step)", r)
    m.set("profile_ms", r.step_gpu_ms, f"run {r.source} (GPU ms per step in the loop, CUDA events)", r)


def run_step_ms(r: RunFigures) -> float:
    """The time a run's tau is over: its TLV cycle (a TLV run), else its decode loop's step."""
    return sum(r.tlv_ms.values()) if r.tlv_ms else r.step_wall_ms


def same_model(a: str | None, b: str | None) -> bool:
    """Two files' model names as one model (unknown: no objection; a catalog name and its
    -instruct folder name are one, as are a Hugging Face id and its last part)."""
    if not a or not b:
        return True
    a, b = model_key(a), model_key(b)
    return a.startswith(b) or b.startswith(a)


def files_from_other_models(run: RunFigures | None, probe: RowsProbeFigures | None,
                            ar_run: RunFigures | None = None) -> None:
    """A run's speedup over AR cannot be modelled from another model's step times: InputError."""
    for other, what in ((probe, "--rows-probe"), (ar_run, "--ar-run")):
        if run is not None and other is not None and not same_model(run.model, other.model):
            raise InputError(f"{what} {other.source} was measured on {other.model}, the run {run.source} decoded "
                             f"{run.model}: give files of the same deployment")


def probe_model_mismatch(probe: RowsProbeFigures | None, model) -> str | None:
    """A warning when a rows probe's model is not the one whose floors stand beside it."""
    if probe is None or model is None or not probe.model:
        return None
    from specpilot.models import load_model_spec

    try:
        theirs = load_model_spec(probe.model).name
    except Exception:   # a folder or name this machine does not have: compared as written
        theirs = probe.model
    if same_model(theirs, model.name):
        return None
    return (f"--rows-probe {probe.source} was measured on {theirs}, the floors are for {model.name}: c(N) and the "
            "floors come from different models")


def _use_rows_probe(p: RowsProbeFigures, m: Measurements, rows: int | None, run: RunFigures | None = None) -> None:
    """T_AR from the probe, and its T_step at ``rows`` where nothing better gave one. Beside a run
    whose verify steps were not all of ``rows`` rows, the probe's point is not the same step
    (``--rows`` defaults to 1), so it is not offered, nor named in a note as the step passed over."""
    m.set("ar_ms", p.ar_ms, f"rows probe {p.source}" + (f" ({p.ar_path} AR step)" if p.ar_path else ""), p)
    other_rows = run is not None and bool(run.verify_by_rows) and set(run.verify_by_rows) != {rows}
    if rows is not None and rows in p.step_ms and not other_rows:
        m.set("step_ms", p.step_ms[rows], f"rows probe {p.source} (rows={rows})", p)


# two files that both time the step (a run's decode loop and a profile's traced steps) further
# apart than this are not one deployment's: run-to-run noise is a few percent, and a profiler adds
# launch overhead to the wall time of the steps it traces (up to some 15% on an eager step)
SAME_STEP_TOLERANCE = 0.25


def model_key(name: str) -> str:
    """A model name as files write it, compared case-blind by its last path part (a folder or a
    Hugging Face id names the same model as its catalog name)."""
    return name.strip().rstrip("/").rsplit("/", 1)[-1].lower()


def _gpu_key(name: str | None) -> str | None:
    from specpilot.gpus import match_gpu_name

    spec = match_gpu_name(name) if name else None
    return spec.key if spec is not None else None


def _same_gpu(a_key: str | None, a_name: str | None, b_key: str | None, b_name: str | None) -> bool:
    """Two GPUs as one (unknown: no objection): by catalog key, else by the names' catalog match."""
    a_key = a_key if a_key not in (None, "custom") else _gpu_key(a_name)
    b_key = b_key if b_key not in (None, "custom") else _gpu_key(b_name)
    if a_key and b_key:
        return a_key == b_key
    if a_name and b_name and not (a_key or b_key):
        return a_name.strip().lower() == b_name.strip().lower()
    return True


def _refuse(a: str, b: str, what: str, va, vb, advice: str) -> None:
    raise InputError(f"{a} and {b} disagree on the {what} ({va} against {vb}): they are not one deployment's; "
                     + advice)


def _profile_gpu_name(p: ProfileFigures) -> str:
    """The GPU the profile's trace ran on (what a run or a rows probe of its deployment ran on)."""
    g = p.gpu or {}
    return g.get("name") or g.get("key") or "an unnamed GPU"


def _profile_floors_gpu_name(p: ProfileFigures) -> str:
    """The GPU of the profile's floors: ``profile --gpu``'s (``floors_gpu``), else the trace's."""
    g = p.gpu or {}
    return g.get("floors_gpu") or g.get("name") or g.get("key") or "an unnamed GPU"


def check_one_deployment(req: CeilingRequest, cost_rows: int | None) -> None:
    """Refuse (InputError, one line naming both inputs and the field) a profile of another model,
    GPU, row count, batch or floor shape than the other inputs, and a run whose step a profile
    times further apart than ``SAME_STEP_TOLERANCE``. A rows probe's own checks against a run
    (``files_from_other_models``) and against the floors (``check_rows_probe_hardware``,
    ``probe_model_mismatch``) stay as they are; a probe measured on the CPU beside a run or a
    profile on a GPU is refused here."""
    p, run, probe, model, gpu = req.profile, req.run, req.rows_probe, req.model, req.gpu
    run_cpu = run is not None and (run.device or "").startswith("cpu")
    probe_known = probe is not None and (probe.on_cpu or bool(probe.gpu) or (probe.device or "").startswith("cuda"))
    if probe_known and run is not None and run.device and probe.on_cpu != run_cpu:
        _refuse(f"--rows-probe {probe.source}", f"--run {run.source}", "device", probe.hardware,
                "the CPU" if run_cpu else run.device, "give a rows probe of the run's device")
    if p is None:
        return
    me = f"--profile {p.source}"
    # the model
    for other, label, theirs in ((model, f"--model {model.name}" if model else "", model.name if model else None),
                                 (run, f"--run {run.source}" if run else "", run.model if run else None),
                                 (probe, f"--rows-probe {probe.source}" if probe else "",
                                  probe.model if probe else None)):
        if other is not None and p.model and theirs and not same_model(p.model, theirs):
            advice = ("leave out --model to take the profile's floors, or profile that model" if other is model
                      else "give files of the same deployment")
            _refuse(me, label, "model", p.model, theirs, advice)
    # the GPU: --gpu, --bandwidth and --flops set floors, compared with the profile's floors' GPU
    # (``profile --gpu``'s where it named one); a run or a rows probe ran on the traced GPU
    pg = p.gpu or {}
    if gpu is not None:
        floors_name = pg.get("floors_gpu") or pg.get("name")
        if not _same_gpu(pg.get("key"), floors_name, gpu.key, gpu.name):
            _refuse(me, "--gpu", "floors' GPU", _profile_floors_gpu_name(p), gpu.name,
                    "leave out --gpu to take the profile's, or profile with that --gpu")
        if p.total_floor_ms is not None:   # the profile's floors are of its GPU's figures
            for k, what, unit in (("bandwidth_tbs", "peak bandwidth", "TB/s"), ("bf16_tflops", "dense bf16 peak",
                                                                                 "TFLOP/s")):
                mine, theirs = pg.get(k), getattr(gpu, k)
                if mine and abs(mine - theirs) > 1e-3 * mine:
                    _refuse(me, f"{'--bandwidth' if k == 'bandwidth_tbs' else '--flops'} {theirs:g}", f"GPU's {what}",
                            f"{mine:g} {unit}", f"{theirs:g} {unit}",
                            "the profile's floor is of its figures; leave the option out to take them")
    if run_cpu:
        _refuse(me, f"--run {run.source}", "device", _profile_gpu_name(p), "the CPU",
                "give a run on the profile's GPU")
    if probe is not None:
        if probe.on_cpu:
            _refuse(me, f"--rows-probe {probe.source}", "device", _profile_gpu_name(p), probe.hardware,
                    "give a rows probe of the profile's GPU")
        if probe.gpu and pg.get("name") and not _same_gpu(None, pg["name"], None, probe.gpu):
            _refuse(me, f"--rows-probe {probe.source}", "GPU", _profile_gpu_name(p), probe.gpu,
                    "give a rows probe of the GPU the profile traced")
    # the rows and the batch
    if p.rows is not None:
        if cost_rows != p.rows:
            _refuse(me, f"--rows {','.join(str(r) for r in req.rows)}", "rows per request", p.rows,
                    ",".join(str(r) for r in req.rows),
                    f"the profiled step verified {p.rows} row{'s' if p.rows != 1 else ''} per request; leave out "
                    "--rows to take the profile's, or profile a step of those rows")
        if run is not None and run.verify_by_rows and not min(run.verify_by_rows) <= p.rows <= max(run.verify_by_rows):
            lo, hi = min(run.verify_by_rows), max(run.verify_by_rows)
            _refuse(me, f"--run {run.source}", "rows per request", p.rows, f"{lo}-{hi}" if hi > lo else lo,
                    "give a profile of the run's verify steps")
    pb = p.shape.get("batch")
    if pb is not None:
        for label, theirs in ((f"--batch {req.batch}", req.batch), (f"--run {run.source}" if run else None, 1),
                              (f"--rows-probe {probe.source}" if probe else None, probe.batch if probe else None)):
            if label and theirs != pb:
                _refuse(me, label, "requests per step", pb, theirs,
                        "leave out --batch to take the profile's" if label.startswith("--batch")
                        else "give files of the same deployment")
    # the floors' shape, where --model sets floors beside the profile's step (and its own floors)
    if model is not None and p.shape.get("weight_dtype"):
        drafter = req.drafter.name if req.drafter is not None else None
        for key, opt, mine, theirs in (
                ("context", "--context", p.shape.get("context"), req.context),
                ("weight_dtype", "--weight-dtype", p.shape.get("weight_dtype"), req.weight_dtype),
                ("kv_dtype", "--kv-dtype", p.shape.get("kv_dtype"), req.kv_dtype),
                ("flops_fraction", "--flops-fraction", p.shape.get("flops_fraction"), req.flops_fraction),
                ("bw_fraction", "--bw-fraction", p.shape.get("bw_fraction"), req.bw_fraction),
                ("drafter", "--drafter", p.shape.get("drafter"), drafter),
                ("draft_passes", "--draft-passes", p.shape.get("draft_passes"), req.draft_passes if drafter else None),
                ("draft_rows", "--draft-rows", p.shape.get("draft_rows"),
                 (req.draft_rows or cost_rows) if drafter else None)):
            if key == "drafter":
                differ = bool(mine) != bool(theirs) or not same_model(mine, theirs)
            else:
                differ = mine is not None and theirs is not None and mine != theirs
            if differ:
                _refuse(me, f"{opt} {theirs}" if theirs is not None else f"no {opt}", key.replace("_", " "),
                        mine if mine is not None else "none", theirs if theirs is not None else "none",
                        f"the profile's floor is of its own shape; leave out {opt} to take the profile's")
    # a run and a profile that both time the step
    if run is not None:
        for what, theirs, mine, opt in (("step wall time", run_step_ms(run), p.step_wall_ms, "--step-ms"),
                                        ("GPU time per step", run.step_gpu_ms, p.kernel_busy_ms, "--profile-ms")):
            given = req.measurements.step_ms if opt == "--step-ms" else req.measurements.profile_ms
            if theirs and mine and given is None and abs(theirs - mine) > SAME_STEP_TOLERANCE * min(theirs, mine):
                raise InputError(f"--run {run.source} and {me} differ on the {what} by more than "
                                 f"{SAME_STEP_TOLERANCE:.0%} (run {theirs:.4g} ms, profile {mine:.4g} ms): they are "
                                 f"not one deployment's step; give files of one deployment, or choose with {opt}")


def passed_over_notes(m: Measurements) -> list[str]:
    """A note for each measurement two files gave, where the value not used differs: which file's
    is used and why."""
    names = {"step_ms": "T_step", "profile_ms": "the GPU time per step", "tau": "tau", "floor_ms": "the floor",
             "ar_ms": "T_AR", "tau_best": "the best reachable tau"}
    why = {("step_ms", RunFigures): "the run delivered its tau in its own steps, which no profiler slowed",
           ("step_ms", ProfileFigures): "the profile's is the engine's whole step, whose kernel busy and outside "
                                        "times give the kernel and outside factors (a rows probe times a bare "
                                        "forward)",
           ("profile_ms", ProfileFigures): "the profile's floor is of the same trace's steps",
           ("tau", RunFigures): "the run's own tau, over the steps it timed"}
    out = []
    for name, value, origin in m.passed_over:
        used, used_origin = getattr(m, name), m.origins.get(name)
        if used is None or used_origin is None or abs(value - used) <= 5e-3 * abs(used):
            continue
        unit = "" if name in ("tau", "tau_best") else " ms"
        reason = why.get((name, type(used_origin)))
        out.append(f"{names[name]} is {_file_label(used_origin)}'s {used:.4g}{unit}, not {_file_label(origin)}'s "
                   f"{value:.4g}{unit}" + (f": {reason}" if reason else ""))
    return out


def _file_label(f) -> str:
    kind = {ProfileFigures: "profile", RunFigures: "run", RowsProbeFigures: "rows probe",
            ReplayFigures: "replay"}.get(type(f), "file")
    return f"{kind} {getattr(f, 'source', '?')}"


def compute_ceiling(req: CeilingRequest) -> CeilingResult:
    m, model, gpu, rows = req.measurements, req.model, req.gpu, req.rows
    if req.batch <= 0:
        raise InputError(f"--batch must be positive, got {req.batch}")
    if req.context < 0:
        raise InputError(f"--context must be >= 0, got {req.context}")
    # measured analysis happens at one row count
    cost_rows = rows[0] if len(rows) == 1 else None
    if req.profile and cost_rows is None and req.profile.rows in rows:
        cost_rows = req.profile.rows
    if req.run:
        files_from_other_models(req.run, req.rows_probe)
    check_one_deployment(req, cost_rows)
    # the step a run's tau was delivered in before a profile's (a profiler slows the step it
    # traces), and the profile's GPU time before the run's (the profile's floor is of its steps)
    if req.profile:
        _use_profile_gpu_time(req.profile, m)
    if req.run:
        _use_run(req.run, m)
    if req.profile:
        _use_profile(req.profile, m)
    curves = {}
    if req.replay:
        _use_replay(req.replay, m, req.policy)
        curves = req.replay.curves
    cycle = tlv_cycle(req)
    if cycle is not None and cycle["cycle_ms"]:
        m.set("step_ms", cycle["cycle_ms"], f"TLV cycle ({cycle['source']})",
              req.run if cycle["source"].startswith("run ") else req.rows_probe)
    step_curve = {}
    warning = check_rows_probe_hardware(req.rows_probe, gpu if model is not None else None)
    if req.rows_probe:
        _use_rows_probe(req.rows_probe, m, cost_rows, req.run)
        step_curve = req.rows_probe.step_ms

    floors: list[StepFloor] = []
    ar_floor = None
    if model is not None and gpu is not None:
        floors = [req.step_floor(n) for n in rows]
        ar_floor = req.step_floor(1, drafter=False)
        if not all(math.isfinite(f.total_floor_ms) for f in (*floors, ar_floor)):
            raise InputError("the byte floors overflow: the GPU's bandwidth or FLOP/s, or a fraction of them, is too "
                             "small a number (--bandwidth, --flops, --bw-fraction, --flops-fraction)")
        if cost_rows is not None:
            f = next(f for f in floors if f.rows == cost_rows)
            if m.floor_ms is None:
                m.set("floor_ms", f.total_floor_ms, f"byte floor of {model.name} at {cost_rows} rows")
                m.floor_peak_ms = req.step_floor(cost_rows, at_peak=True).total_floor_ms

    cost = rank = None
    measured = {k: v for k, v in m.sources.items() if k != "floor_ms"}
    replay_only = bool(measured) and all(src.startswith("replay") for src in measured.values())
    if m.any and not (replay_only and model is not None):
        if len(rows) > 1 and cost_rows is None:
            raise InputError("measurements apply to one row count: give a single --rows N with --tau/--step-ms/...")
        missing = [n for n, v in (("--tau (or --replay)", m.tau), ("--step-ms (or --profile)", m.step_ms),
                                  ("--ar-ms (or --rows-probe)", m.ar_ms)) if v is None]
        if m.step_ms is None and req.rows_probe is not None and cost_rows is not None:
            timed = ",".join(str(n) for n in sorted(req.rows_probe.step_ms))
            raise InputError(f"--rows-probe {req.rows_probe.source} has no point at {cost_rows} rows (timed at "
                             f"{timed}): give one of those --rows, or --step-ms")
        if missing:
            raise InputError("the cost model needs " + ", ".join(missing))
        rank = one_rank_profile(req.profile, m) if m.profile_ms is not None and m.floor_ms is not None else None
        drafter = unfloored_drafter(req.profile, m)
        cost = cost_model(m.tau, m.step_ms, m.ar_ms, m.tau_best, m.profile_ms, m.floor_ms,
                          floor_peak_ms=m.floor_peak_ms, one_rank=rank is not None)
        cost.notes[:0] = passed_over_notes(m)
    elif model is None:
        raise InputError("give --model for byte floors, or measurements (--tau, --step-ms, --ar-ms, --profile ...)")
    res = CeilingResult(model=model, gpu=gpu, floors=floors, ar_floor=ar_floor, cost=cost, measurements=m,
                        rows_for_cost=cost_rows, fractions={"flops": req.flops_fraction, "bandwidth": req.bw_fraction},
                        tau_curve=curves)
    res.cycle = cycle
    if cycle is not None and cost is not None:
        cycle["tau"], cycle["speedup"] = cost.tau, cost.speedup
    res.by_nodes = predict_by_nodes(req, curves, step_curve, res)
    if req.rows_probe:
        res.warnings = rows_probe_warnings(req.rows_probe)
    if warning:
        res.warnings.append(warning)
    other = probe_model_mismatch(req.rows_probe, model)
    if other:
        res.warnings.append(other)
    mismatch = (rows_mismatch(req.policy, cost_rows, m, req.rows_probe, res.by_nodes,
                              policy_nodes(req.replay, req.policy))
                if cost is not None and req.replay else None)
    if mismatch:
        res.warnings.append(mismatch)
    if cost is not None:   # before the files' warnings: a factor taken as 1 changes the ceiling
        res.warnings[:0] = cost.warnings
        if drafter:
            res.warnings.insert(0, drafter)
        if rank:
            res.warnings.insert(0, rank)   # first, as profile puts it: it may explain the kernel factor
    return res


def unfloored_drafter(p: ProfileFigures | None, m: Measurements) -> str | None:
    """The warning for a kernel factor whose GPU time, from a profile, counts drafter kernels that
    the floor beside it leaves out (the profile had no --drafter; a floor of ``--model`` must be of
    the profile's shape, so it has none either); None otherwise."""
    if p is None or p.unfloored_drafter is None or m.sources.get("profile_ms") != f"profile {p.source}":
        return None
    from .profile import unfloored_drafter_warning

    ms, share = p.unfloored_drafter
    kf = m.profile_ms / m.floor_ms if m.floor_ms else None
    return (f"--profile {p.source}: {unfloored_drafter_warning(ms, share, kf)}, and the ceiling with it; profile "
            "with --drafter MODEL")


def one_rank_profile(p: ProfileFigures | None, m: Measurements) -> str | None:
    """The warning for a kernel factor of one rank's profile against a floor of the whole model
    (the profile's own floors or ``--model``'s: neither is split by rank, and neither is scaled
    here), or None when the profile is not a rank's or gave neither side of the factor."""
    from .profile import is_one_rank, rank_evidence

    if p is None or not p.distributed or not is_one_rank(p.distributed):
        return None
    mine = f"profile {p.source}"
    if mine not in (m.sources.get("profile_ms"), m.sources.get("floor_ms")):
        return None

    said, by = rank_evidence(p.distributed)
    floor = "the profile's own" if m.sources.get("floor_ms") == mine else m.sources.get("floor_ms")
    return (f"--profile {p.source} is one rank's trace of a multi-GPU job ({said}), and the floor beside it "
            f"({floor}) is the whole model's on one GPU, not split by rank and not scaled here: the kernel factor "
            f"reads up to {by} low and the ceiling with it")


def largest_factor_line(largest: str | None, factors: dict[str, float | None], name=str) -> str | None:
    """The sentence that names the factor to attack: the largest with its advice where it offers a
    gain (above 1), else that none does; None when no factor is known. ``name`` dresses the
    factor's name (the round report's Markdown bold). ``largest`` is None where no factor offers a
    gain: the sentence says so where any factor is known."""
    if not largest:
        return ("No known factor offers a gain (each is 1 or below)."
                if any(v is not None for v in factors.values()) else None)
    v = factors.get(largest)
    if v is not None and v > 1:
        from .costmodel import ADVICE

        return f"Largest factor: {name(largest)} ({v:.3g}x): {ADVICE[largest]}."
    return "No known factor offers a gain (each is 1 or below)."


def rows_mismatch(policy: str, cost_rows: int | None, m: Measurements, probe: RowsProbeFigures | None = None,
                  by_nodes: list[dict] | None = None, nodes: int | None = None) -> str | None:
    """A warning when the cost model divides the tau of ``policy`` (a replay policy with a node
    budget) by a step of another row count taken from a rows probe (``--rows``, default 1). Its
    advice is what works here: ``--rows N + 1`` where the probe timed N + 1 rows; else the step
    linear between the probe's counts around it (as ``ceiling --check`` interpolates) for
    ``--step-ms``, and the ``probe rows`` command that times it; the by-node table's row only
    where that table is printed with it. ``nodes``: the nodes the policy verifies (``policy_nodes``:
    a chain's depth too); by default its budget after ':'."""
    if nodes is None:
        nodes = policy_nodes(None, policy)
    if nodes is None or cost_rows is None or nodes + 1 == cost_rows \
            or not m.sources.get("step_ms", "").startswith("rows probe"):
        return None
    budget, want = nodes, nodes + 1
    head = (f"the cost model pairs {policy}'s tau with the {cost_rows}-row step (--rows {cost_rows}); the policy "
            f"verifies {budget} nodes and the pending token a step, {want} rows: ")
    table = any(r["nodes"] == budget and r["policy"] in (policy, policy.partition(":")[0])
                for r in by_nodes or [])
    if probe is None or want in probe.step_ms:
        return head + f"give --rows {want}" + (", or read its row of the by-node table" if table else "")
    timed = sorted(probe.step_ms)
    rows_arg = ",".join(str(n) for n in sorted(set(timed) | {want}))
    model = f" --model {probe.model}" if probe.model else ""
    advice = [f"the probe timed {','.join(str(n) for n in timed)} rows, not {want}"]
    if timed[0] < want < timed[-1]:
        lo, hi = max(n for n in timed if n < want), min(n for n in timed if n > want)
        ms = step_time(want, probe.step_ms)
        advice.append(f"linear between its {lo}- and {hi}-row steps (as ceiling --check interpolates) T_step({want}) "
                      f"is {ms:.4g} ms: give --rows {want} --step-ms {ms:.4g}")
    advice.append(f"or time {want} rows with specpilot probe rows{model} --rows {rows_arg} (and the probe's other "
                  f"options), then give --rows {want}")
    if table:
        advice.append("or read its row of the by-node table")
    return head + "; ".join(advice)


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
        if t is not None:   # without a timed Q pass, the exact step stands for it
            probe_ms = {"qpass": q if q is not None else t, "exact": t, "rows": nodes + 1,
                        "qpass_timed": q is not None, "qview": probe.qview, "qpass_note": why}
    if run is not None and run.tlv_ms:
        terms, source, unknown = dict(run.tlv_ms), f"run {run.source}", []
        if probe_ms and probe_ms["qpass_timed"] and None not in (run.qview, probe.qview) and run.qview != probe.qview:
            probe_ms["qpass_note"] = (f"the probe's Q pass read the {probe.qview} view, the run's the {run.qview} "
                                      "view: the two Q pass columns are not the same pass")
    elif probe_ms is not None:
        terms = {"draft1": None, "qpass": probe_ms["qpass"], "draft2": None, "exact": probe_ms["exact"],
                 "append": None}
        source, unknown = f"rows probe {probe.source} at {nodes + 1} rows", ["draft1", "draft2", "append"]
    else:
        return None
    known = [v for v in terms.values() if v is not None]
    return {"nodes": nodes, "terms_ms": terms, "cycle_ms": sum(known) if known else None, "source": source,
            "unknown": unknown, "probe_ms": probe_ms}


def rows_probe_warnings(p: RowsProbeFigures) -> list[str]:
    """What a rows probe says against its own T_AR (c(N) = T_step(N) / T_AR is only as honest as
    the AR step it divides by)."""
    out = [f"rows probe {p.source}: {w}" for w in p.warnings]
    if p.ar_path is None:
        out.append(f"rows probe {p.source} does not say which AR step its T_AR is (no ar_path); c(N) may be "
                   "against a slower AR step than the engine runs: re-run specpilot probe rows")
    return out


def predict_by_nodes(req: CeilingRequest, curves: dict[str, dict[int, float]], step_curve: dict[int, float],
                     res: CeilingResult) -> list[dict]:
    """Speedup tau(N) / c for every node budget N of the replay's tau(N) curves, c at the N + 1
    rows a budget of N verifies (its nodes and the pending token they hang from).

    c is measured (rows probe: T_step(N + 1) / T_AR) when a rows probe is given (budgets whose
    N + 1 rows it did not time are left out, never mixed with floors), else the model's floor c
    (the regime where every kernel sits at its byte floor). The budgets a rows probe leaves out
    go to ``res.by_nodes_left_out`` (``policy``, ``nodes``, ``rows``), which the report names.
    """
    ar_ms = res.measurements.ar_ms
    out = []
    for policy, pts in curves.items():
        for n, tau in sorted(pts.items()):
            rows = n + 1
            if step_curve:
                if rows not in step_curve or not ar_ms:
                    res.by_nodes_left_out.append({"policy": policy, "nodes": n, "rows": rows})
                    continue
                c, source = step_curve[rows] / ar_ms, "measured"
            elif req.model is not None and req.gpu is not None and res.ar_floor is not None:
                c, source = req.step_floor(rows).total_floor_ms / res.ar_floor.total_floor_ms, "floor"
            else:
                continue
            out.append({"policy": policy, "nodes": n, "rows": rows, "tau": tau, "c": c, "c_source": source,
                        "speedup": tau / c})
    return out
