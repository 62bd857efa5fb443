"""Per-request caches for continuous batching: one static slot per running request.

Each attention layer holds K/V as ``[slots, kv_heads, max_seq, head_dim]`` and each GDN layer its
fp32 recurrent state ``[slots, heads, dk, dv]`` and conv state ``[slots, kernel - 1, channels]``.
Slot ``b`` belongs to the ``b``-th running request: the scheduler keeps running requests in
slots ``0 .. n-1`` (a leaving request's slot takes the last one's contents), so a step of ``n``
requests always addresses the first ``n`` slots, the fixed shape a CUDA graph per (requests, rows)
bucket replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerSlots:
    """One layer's per-slot tensors (``k``/``v`` for attention, ``state``/``conv`` for GDN), the
    GDN stashes of the last chain/tree step by slot, and ``walked``: the rows that step walked in
    one launch (``mixed``, ``conv``, ``ab`` and, by slot, the segment's first row there and the
    stash made from it), which lets their commits run as one launch too. ``keep`` (a GDN layer,
    while a bucket graph's step runs): the (projection rows, conv rows) buffers a walk writes
    what its commit reads into, shared by every bucket (only the last replay's is committed)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    state: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    stash: dict = field(default_factory=dict)
    walked: tuple | None = None
    keep: tuple | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.state, self.conv) if t is not None]


class BatchCache:
    """Static per-slot caches for ``model`` (a :class:`~specpilot.engine.model.Transformer`)."""

    def __init__(self, model, slots: int, max_seq: int | None = None):
        from specpilot.engine.model import Attention, check_cache_fits

        self.slots = int(slots)
        self.max_seq = int(max_seq or model.max_seq)
        # a hybrid's caches have one slot more, ``dump``: padding rows of a CUDA-graph bucket write
        # their K/V and advance their GDN states there, never in a slot whose request is prefilling
        self.dump = self.slots if model.spec.is_hybrid else None
        n = self.slots + (self.dump is not None)
        check_cache_fits(model.spec, self.max_seq, model.dtype, str(model.device), slots=n)
        self.layers: list[LayerSlots] = []
        for blk in model.layers:
            m = blk.mixer
            if isinstance(m, Attention):
                shape = (n, m.nkv, self.max_seq, m.hd)
                self.layers.append(LayerSlots(k=torch.zeros(shape, dtype=model.dtype, device=model.device),
                                              v=torch.zeros(shape, dtype=model.dtype, device=model.device)))
            else:
                self.layers.append(LayerSlots(
                    state=torch.zeros((n,) + tuple(m.state.shape), dtype=m.state.dtype, device=model.device),
                    conv=torch.zeros((n,) + tuple(m.conv_state.shape), dtype=m.conv_state.dtype,
                                     device=model.device)))

    def reset(self, slot: int) -> None:
        """A new request takes ``slot``: recurrent states start at zero (K/V are written before read)."""
        for lc in self.layers:
            lc.stash.pop(slot, None)
            if lc.state is not None:
                lc.state[slot].zero_()
                lc.conv[slot].zero_()

    def move(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes over the request of slot ``src`` (caches, states, stashes)."""
        if src == dst:
            return
        for lc in self.layers:
            for t in lc.tensors():
                t[dst].copy_(t[src])
            if src in lc.stash:
                lc.stash[dst] = lc.stash.pop(src)
            else:
                lc.stash.pop(dst, None)

    def clear(self) -> None:
        """Zero every slot (``/flush_cache``)."""
        for lc in self.layers:
            lc.stash.clear()
            lc.walked = None
            for t in lc.tensors():
                t.zero_()

    def save_states(self, slots: list[int], upto: int | None = None) -> list:
        """Copies of the GDN states of ``slots`` in the first ``upto`` layers (drafting restores them)."""
        idx = torch.tensor(slots, dtype=torch.long)
        return [(lc, lc.state[idx.to(lc.state.device)].clone(), lc.conv[idx.to(lc.conv.device)].clone())
                for lc in self.layers[:upto] if lc.state is not None]

    @staticmethod
    def restore_states(saved: list, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long)
        for lc, st, cv in saved:
            lc.state[idx.to(lc.state.device)] = st
            lc.conv[idx.to(lc.conv.device)] = cv
