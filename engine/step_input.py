"""The rows of one forward pass. :class:`StepInput` is a one-request step (tokens, RoPE
positions, KV-cache slots, the attention mask, and how the GDN layers read the rows: ``gdn_rows``
``seq``, ``chain`` or ``tree``); :class:`BatchStepInput` carries the rows of several requests,
each request's consecutive rows a :class:`Segment` on its own cache slot (continuous batching);
:func:`walk_table` lays out a batched step's chain/tree segments as one :class:`Walk` for the GDN
layers' single path-walk launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepInput:
    """One forward's rows. ``tokens``, ``pos`` (rope positions), ``slots`` (KV-cache slots) are
    [T] long tensors; ``mask`` is bool [T, kv_len] (True = may attend); ``paths`` [T, D] only
    for ``gdn_rows == "tree"``; ``node_paths``: the GDN layers' memo of the tree nodes' paths
    without the root (TreeWY applying the root first), computed by the first layer that needs it."""

    tokens: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    gdn_rows: str = "seq"
    paths: torch.Tensor | None = None
    node_paths: torch.Tensor | None = None


@dataclass
class Segment:
    """Consecutive rows ``start .. start + rows - 1`` of a batched step that belong to cache slot
    ``slot``, laid out for the GDN layers as ``gdn_rows`` (``paths`` [rows, D] with row indices
    local to the segment, for ``"tree"``)."""

    slot: int
    start: int
    rows: int
    gdn_rows: str = "seq"
    paths: torch.Tensor | None = None


@dataclass
class Walk:
    """The GDN verify rows of a batched step that walk their root paths in one conv and one
    path-walk launch per layer: ``segments`` (indices into the step's segments, in row order),
    ``rows`` [W] their step rows (None: every row of the step, in order), ``paths`` [W, D] each
    walked row's root path as indices into the walked rows (-1 after its end), ``slots`` [W]
    the state slot each row walks from, ``segs`` int32 [n, 3] the walked segments as (first
    walked row, rows, slot) for TreeWY, and ``most`` the most rows of a segment."""

    segments: tuple[int, ...]
    rows: torch.Tensor | None
    paths: torch.Tensor
    slots: torch.Tensor
    segs: torch.Tensor
    most: int


def walk_table(segments: list[Segment], device) -> Walk | None:
    """The :class:`Walk` of the chain/tree segments of a step, when there are two or more (one
    segment runs the one-request path, which may pick TreeWY)."""
    from specpilot.kernels.gdn import rows as gdn_rows

    idx = tuple(i for i, sg in enumerate(segments) if sg.gdn_rows in ("tree", "chain"))
    if len(idx) < 2:
        return None
    local = [segments[i].paths.to(device) if segments[i].gdn_rows == "tree"
             else gdn_rows.chain_paths(segments[i].rows, device) for i in idx]
    depth = max(p.shape[1] for p in local)
    paths, segs, at = [], [], 0
    for i, p in zip(idx, local):
        paths.append(F.pad(torch.where(p >= 0, p + at, p), (0, depth - p.shape[1]), value=-1))
        segs.append([at, segments[i].rows, segments[i].slot])
        at += segments[i].rows
    rows = torch.cat([torch.arange(segments[i].start, segments[i].start + segments[i].rows) for i in idx])
    slots = torch.cat([torch.full((segments[i].rows,), segments[i].slot, dtype=torch.long) for i in idx])
    return Walk(idx, rows.to(device), torch.cat(paths), slots.to(device),
                torch.tensor(segs, dtype=torch.int32).to(device), max(n for _, n, _ in segs))


@dataclass
class BatchStepInput:
    """The rows of several requests in one forward. ``tokens``, ``pos`` (rope positions),
    ``slots`` (positions in the row's own request cache) and ``req`` (the row's cache slot) are
    [T] long tensors; ``mask`` bool [T, kv_len] over the row's own request cache; ``segments``
    cover rows 0..T-1 in order; ``seg_table``: their device table for the fused kernels, made on
    first use (``engine/fused_verify.py``); ``walk``: the GDN layers' :class:`Walk`, made by the
    first layer that needs it (a hybrid's CUDA-graph bucket brings its own, every row walked)."""

    tokens: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    req: torch.Tensor
    mask: torch.Tensor
    segments: list[Segment]
    seg_table: tuple | None = None
    walk: Walk | None = None
