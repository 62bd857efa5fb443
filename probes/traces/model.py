"""The common event model every trace reader produces.

Readers do not hand back millions of kernel records: they aggregate while reading (in SQL for
Nsight exports, in one streaming pass for Kineto) into :class:`KernelGroup` rows, one per
(step, kernel name, kind, stream, tag, shape), plus one :class:`StepInfo` per detected step.
Everything downstream (classification, profile, plots) works on this small summary.

Times are integer nanoseconds on the trace's own clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

KINDS = ("kernel", "memcpy", "memset", "graph")  # "graph": a whole CUDA graph traced as one record


@dataclass(frozen=True)
class GPUInfo:
    """What the trace says about its GPU (``TARGET_INFO_GPU`` or Kineto ``deviceProperties``)."""

    name: str
    sm_count: int | None = None
    bandwidth_tbs: float | None = None  # peak memory bandwidth the profiler reports, TB/s
    memory_gb: float | None = None
    l2_mb: float | None = None
    source: str = ""


@dataclass(frozen=True)
class Range:
    """An NVTX range or a PyTorch profiler annotation."""

    name: str
    start: int
    end: int
    thread: int | str | None = None
    gpu: bool = False  # a gpu_user_annotation (already on the GPU clock)


@dataclass
class StepInfo:
    """One decode/verify step.

    ``start``/``end`` is the step's wall window: the NVTX/annotation range (stretched to the
    end of the GPU work it launched, and started no earlier than the previous step's end), or,
    for steps found from CUDA graph launches or idle gaps, the GPU period from this step's first
    kernel to the next step's first kernel.
    ``busy_ns`` is the union of GPU activity intervals (kernels, memcpy, memset) of the step.
    """

    index: int
    label: str
    start: int
    end: int
    gpu_start: int | None = None
    gpu_end: int | None = None
    busy_ns: int = 0
    events: int = 0

    @property
    def wall_ns(self) -> int:
        return self.end - self.start


@dataclass
class KernelGroup:
    """All events of one name/kind/stream/tag/shape within one step."""

    step: int
    name: str
    kind: str = "kernel"
    stream: int | None = None
    tag: str | None = None  # innermost enclosing range that a rule's ``range:`` may test
    dims: str | None = None  # the launching op's name and input shapes ("aten::mm[[32,4096],[4096,151936]]", Kineto)
    count: int = 0
    total_ns: int = 0
    position: str | None = None  # "last": the step's last launch among a position rule's kernels
    comm_bytes: int = 0  # message bytes of the collectives in the group (Kineto: record_param_comms)
    # the group's time that no earlier-starting event of its stream covers (steps.exclusive_ns): its
    # share of the step when kernels overlap under programmatic dependent launch; None: not computed
    excl_ns: int | None = None

    @property
    def op(self) -> str:
        """Name of the CPU op that launched the kernels ("" when the trace does not say)."""
        return self.dims.split("[", 1)[0] if self.dims else ""


@dataclass
class Aggregate:
    """A trace summarised per step: what ``specpilot profile`` builds on."""

    path: str
    format: str  # "nsys-sqlite" | "kineto"
    format_version: str
    gpu: GPUInfo | None
    step_mode: str  # "range" | "graph" | "gap" | "whole"
    step_detail: str
    steps: list[StepInfo]
    groups: list[KernelGroup]
    total_events: int = 0  # GPU events read (kernels + memcpy + memset), in steps or not
    notes: list[str] = field(default_factory=list)  # what the trace lacks, what was assumed
    warnings: list[str] = field(default_factory=list)  # what makes the steps found doubtful (damaged annotations)
    # (name -> bool) -> {step: (name, kind, stream, dims, duration ns[, exclusive ns])}: the last kernel
    # launched in each step, outside any tracked range, among names the predicate accepts (None: cannot tell)
    locate_last: Callable[[Callable[[str], bool]], dict[int, tuple]] | None = None
    orphans: tuple[int, int] = (0, 0)  # kernels left out because their launch lies outside the trace: count, ns
    annotations: dict[str, int] = field(default_factory=dict)  # range families (digits as N) -> count
    # what the trace says of the multi-GPU job it may be one process of, where it says it: rank and
    # world_size (Kineto distributedInfo), group_size (the largest group its collectives ran over),
    # gpus (GPUs with kernels in the trace, when more than one)
    distributed: dict[str, int] = field(default_factory=dict)
    # the temporary copy (decompressed, or exported from a .nsys-rep) that locate_last reads again:
    # deleted once every aggregate holding it is gone
    temp_folder: object | None = None


@dataclass
class StepRequest:
    """How the caller wants steps found."""

    range_regex: str | None = None  # --step-range
    mode: str = "auto"  # auto | range | graph | gap | whole
    gap_us: float | None = None  # --gap-us: idle gap that separates steps (gap mode)
    tag_regex: str | None = None  # ranges whose names rules test with ``range:``
    device: int | None = None  # GPU index when the trace holds several
    include_orphans: bool = False  # keep kernels whose launch lies outside the trace
