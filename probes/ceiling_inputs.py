"""The inputs of ``specpilot ceiling``: one :class:`CeilingRequest`, the deployment's shape (model,
GPU, rows per request, batch, context, storage dtypes, drafter, floor fractions, the current
policy), numbers given directly (:class:`Measurements`, which keeps where each value came from)
and figures from other verbs' results, already read (:class:`ProfileFigures` from ``specpilot
profile``: kernel busy ms, step wall ms, floor; :class:`ReplayFigures` from ``specpilot replay``:
tau per policy, tau(N) curves; :class:`RowsProbeFigures` from ``specpilot probe rows``: T_step(N)
and T_AR; :class:`RunFigures` from ``specpilot run``: tau and the decode loop's step timing, wall
and GPU, and :func:`run_step_ms`, the time a run's tau is over). ``ceiling --check``
(``costcheck``) takes the run, replay and rows probe figures too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.gpus import GPUSpec
from specpilot.models import ModelSpec

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
    steps: int | None = None      # the lattice's verification steps (over all its requests)
    curve_rows: dict[str, dict[int, dict[int, int]]] = field(default_factory=dict)  # per curve point: rows -> steps

    def name_of(self, policy: str) -> str | None:
        """The replay's name for ``policy``: itself, else the one policy of its family (``best-first``
        for ``best-first:32``), else None. A bare ``chain`` is a policy of its own, every draft
        position: it stands for a ``chain:N`` only where that one verifies all of them."""
        if policy in self.taus:
            return policy
        matches = [k for k in self.taus if k.split(":")[0] == policy]
        if policy == "chain":
            matches = [k for k in matches if self.positions is not None and self.nodes.get(k) == self.positions]
        return matches[0] if len(matches) == 1 else None


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


def run_step_ms(r: RunFigures) -> float:
    """The time a run's tau is over: its TLV cycle (a TLV run), else its decode loop's step."""
    return sum(r.tlv_ms.values()) if r.tlv_ms else r.step_wall_ms


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
