"""A batch decoder's totals since start (:class:`BatchStats`): what ``serve``'s ``/metrics``,
``run --batch`` and the benchmarks read."""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.engine.metrics import STEP_BUCKETS, Histogram
from specpilot.engine.tlv import TLVStats


@dataclass
class BatchStats:
    """Totals since start (read by ``serve``'s /metrics and ``run``)."""

    verify_steps: int = 0        # verify passes (each counts once, whatever its requests)
    prefill_passes: int = 0
    prefill_seconds: float = 0.0  # their wall time (the device's work too where a prompt ends: its token is copied)
    # row counts: rows = prompt_rows + verify_rows and verify_rows = request_steps + proposed, batched
    # or not. Not counted anywhere here: bucket padding rows, the row in flight of a request that
    # finished before an overlapped step was taken, TLV's Q-pass rows (a scratch pass of the 8-bit
    # view); lattice-target rows only in lattice_rows.
    request_steps: int = 0       # sum over verify passes of the requests they verified
    rows: int = 0                # rows run through the target for requests: prompt_rows + verify_rows
    verify_rows: int = 0         # per request verified in a step: its root row (pending token) + its own draft nodes
    prompt_rows: int = 0         # prompt rows prefilled, in passes of their own or riding verify steps
    admitted_prompt_rows: int = 0  # ... of them, those that rode a verify step (admission)
    overlapped_steps: int = 0    # AR steps fed on the device while the host took the previous one's tokens
    eager_steps: int = 0         # verify steps run eagerly although there are bucket graphs (prompt rows in them)
    eager_seconds: float = 0.0   # ... their wall time (launches, the device's work, the argmax copy)
    mixed_steps: int = 0         # verify steps with a prompt chunk replayed from a mixed bucket graph
    prefill_replays: int = 0     # prefill passes of one chunk replayed from a mixed bucket (verify rows all padding)
    drafted_positions: int = 0   # draft positions the drafter proposed
    kept_positions: int = 0      # ... inside the requests' blocks
    proposed: int = 0            # draft tokens the verify passes checked, each request's own (tree nodes, chain
    #                              drafts; tlv: the exact pass's tree); the sum of the requests' ``proposed``
    accepted: int = 0            # ... accepted
    tokens: int = 0              # tokens delivered
    step_seconds: float = 0.0
    step_hist: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))   # seconds per step
    finished: dict = field(default_factory=dict)    # finish type -> count
    tlv: TLVStats | None = None  # mode tlv: every request's cycles (the phase seconds are per batched step)
    tlv_steps: int = 0           # batched steps that ran TLV cycles
    # recording lattices: a finished request decodes on (plain AR rows) until its last draft's
    # targets are known; those rows, and the steps that run only them, are counted here, not above
    lattice_rows: int = 0
    lattice_steps: int = 0
    lattice_seconds: float = 0.0

    def tau(self) -> float | None:
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else None
