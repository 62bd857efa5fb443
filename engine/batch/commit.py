"""Committing a batched verify step: every request's accepted rows in a few launches per layer.

After a verify step each request keeps its accepted rows (row 0, the pending token, then its
accepted path), given as rows local to its segment:

* attention layers move the K/V of every request's accepted rows that are not already in place
  (cache position ``start + rows[i]`` to ``start + i``) in one gather and one scatter per cache;
* GDN layers whose verify rows were walked in one launch (``GatedDeltaNet._walk``) replay every
  request's accepted path into its own slot's state in one launch (the path kernel, the
  arithmetic of a one-request commit) and advance every conv state in one gather and one scatter
  (:meth:`GatedDeltaNet.commit_walked`);
* any other GDN stash (a step whose rows were not walked together) commits one request at a time.

The index tables are made on the host once per step and reach the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommitPlan:
    """The GDN part of a step's commit: ``slots`` (host) and, on the device, ``slots_t`` [B], the
    accepted paths ``paths`` [B, D] as rows of the walked step (-1 after the end), and the conv
    windows' sources (``use_old`` [B, K-1]: from the slot's old window row ``old_row``, else walked
    row ``mix_row``). ``starts``: each request's first row among the walked rows."""

    slots: list[int]
    starts: list[int]
    slots_t: torch.Tensor
    paths: torch.Tensor
    old_row: torch.Tensor
    mix_row: torch.Tensor
    use_old: torch.Tensor


def gdn_plan(items: list[tuple[int, list[int]]], walked: dict, window: int, device) -> CommitPlan | None:
    """The plan for ``items`` (slot, accepted rows) whose rows a layer walked (``walked``: slot ->
    (first row, stash)), with conv windows of ``window`` rows; None when a slot was not walked."""
    if not items or any(s not in walked for s, _ in items):
        return None
    B, D = len(items), max(len(r) for _, r in items)
    paths = np.full((B, D), -1, dtype=np.int64)
    src = np.zeros((3, B, window), dtype=np.int64)   # old_row, mix_row, use_old
    starts = []
    for b, (s, rows) in enumerate(items):
        at = walked[s][0]
        starts.append(at)
        paths[b, :len(rows)] = at + np.asarray(rows)
        for j in range(window):
            p = len(rows) + j
            if p < window:
                src[0, b, j], src[2, b, j] = p, 1
            else:
                src[1, b, j] = at + rows[p - window]
    slots = [s for s, _ in items]
    flat = torch.from_numpy(np.concatenate([np.asarray(slots, dtype=np.int64), paths.ravel(), src.ravel()]))
    flat = flat.to(device, non_blocking=True)
    tab = flat[B + B * D:].view(3, B, window)
    return CommitPlan(slots, starts, flat[:B], flat[B:B + B * D].view(B, D), tab[0], tab[1], tab[2] != 0)


def kv_moves(items: list[tuple[int, int, list[int]]], device):
    """(slots, src, dst) device tensors of the K/V entries that move for ``items`` (slot, first
    cache position, accepted rows); None when every accepted row is in place."""
    s, src, dst = [], [], []
    for slot, start, rows in items:
        for i, r in enumerate(rows):
            if r != i:
                s.append(slot)
                src.append(start + r)
                dst.append(start + i)
    if not s:
        return None
    t = torch.tensor([s, src, dst], dtype=torch.long).to(device, non_blocking=True)
    return t[0], t[1], t[2]


def commit_step(model, cache, items: list[tuple[int, int, list[int], str]]) -> None:
    """Commit a batched step for ``items`` (slot, first cache position, accepted rows, gdn_rows) of
    ``model``'s batch cache ``cache`` (module doc)."""
    from specpilot.engine.gated_deltanet import GatedDeltaNet
    from specpilot.engine.model import Attention

    items = [it for it in items if it[3] in ("chain", "tree") or it[2] != list(range(len(it[2])))]
    if not items:
        return
    dev = model.device
    moves = kv_moves([(s, start, rows) for s, start, rows, _ in items], dev)
    gdn = [(s, rows) for s, _, rows, kind in items if kind in ("chain", "tree")]
    plan, accepted = None, dict(gdn)
    for blk, lc in zip(model.layers, cache.layers):
        if isinstance(blk.mixer, Attention):
            if moves is not None:
                s, src, dst = moves
                lc.k[s, :, dst] = lc.k[s, :, src]
                lc.v[s, :, dst] = lc.v[s, :, src]
        elif isinstance(blk.mixer, GatedDeltaNet) and gdn:
            if plan is None and lc.walked is not None:
                plan = gdn_plan(gdn, lc.walked[3], lc.conv.shape[1], dev)
            rest = blk.mixer.commit_walked(lc, plan) if plan is not None else list(accepted)
            for s in rest:
                blk.mixer.commit_slot(lc, s, accepted[s])
