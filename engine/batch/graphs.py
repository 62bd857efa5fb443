"""CUDA graphs for batched verify steps: one graph per (requests, rows per request) bucket.

A bucket (B, N) is a step of B requests x N rows laid out request after request (request b in
cache slot b, rows ``b*N .. b*N + N - 1``), attending over the whole static cache. The scheduler
pads a decode step to the smallest bucket that holds it (:func:`bucket`); steps with prompt rows
run eagerly. Hybrids replay one-row buckets only (their AR steps: one conv and delta-rule launch
over every request's state slot); their verify steps walk host-built paths and run eagerly.
"""

from __future__ import annotations

import torch

from specpilot.engine.graphs import capture
from specpilot.engine.model import BatchStepInput, Segment

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def replays(model, rows: int | None = None) -> bool:
    """Whether batched steps of ``rows`` rows per request (any, when None) of ``model`` replay
    bucket graphs where graphs run (CUDA): a hybrid's only with the fused kernels and one row."""
    if not model.spec.is_hybrid:
        return True
    return model.fused_decode and rows in (None, 1)


def bucket(n: int, limit: int) -> int:
    """The smallest bucket size >= n (``limit`` itself when above every bucket below it)."""
    return next((b for b in BUCKETS if n <= b <= limit), limit)


class _Eager:
    """A bucket step without CUDA graphs (CPU): replay runs it on the static inputs into ``out``."""

    def __init__(self, fn, out: torch.Tensor):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class BatchGraphRunner:
    def __init__(self, model, cache, warmup: int = 2):
        self.model, self.cache, self.warmup = model, cache, warmup
        self.graphs: dict[tuple[int, int], tuple] = {}

    def _capture(self, B: int, N: int):
        m, dev, S = self.model, self.model.device, self.cache.max_seq
        T = B * N
        # tokens, pos, slots and req are rows of one tensor: a step's inputs arrive in two copies
        ids = torch.zeros(4, T, dtype=torch.long, device=dev)
        ids[2] = torch.arange(N, device=dev).repeat(B)
        ids[3] = torch.arange(B, device=dev).repeat_interleave(N)
        inp = BatchStepInput(ids[0], ids[1], ids[2], ids[3], torch.zeros(T, S, dtype=torch.bool, device=dev),
                             [Segment(b, b * N, N) for b in range(B)])
        inp.mask[:, 0] = True

        def fn():
            return m.greedy_batch(inp, self.cache, S)

        # warm-up and capture run the step for real: keep the positions and states they write intact
        kept = [(t[:B, :, :N], t[:B, :, :N].clone()) for lc in self.cache.layers for t in (lc.k, lc.v)
                if t is not None]
        kept += [(t[:B], t[:B].clone()) for lc in self.cache.layers for t in (lc.state, lc.conv) if t is not None]
        if dev.type == "cuda":
            g, out = capture(fn, self.warmup)
        else:
            out = fn()
            g = _Eager(fn, out)
        for t, saved in kept:
            t.copy_(saved)
        pin = dev.type == "cuda"
        staging = (torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pin),
                   torch.empty(inp.mask.shape, dtype=torch.bool, pin_memory=pin))
        self.graphs[(B, N)] = (g, inp, out, ids, staging)
        return self.graphs[(B, N)]

    def get(self, B: int, N: int):
        return self.graphs.get((B, N)) or self._capture(B, N)

    def run(self, inp: BatchStepInput, B: int, N: int) -> torch.Tensor:
        """Replay bucket (B, N) on ``inp`` (laid out for it; host tensors are fastest: they go through
        pinned staging in two asynchronous copies); the argmax of every row. The staging is reused
        by the next call, so read the result (a host sync) before calling again."""
        g, sinp, out, ids, (hids, hmask) = self.get(B, N)
        hids.copy_(torch.stack((inp.tokens, inp.pos, inp.slots, inp.req)))
        hmask.copy_(inp.mask)
        ids.copy_(hids, non_blocking=True)
        sinp.mask.copy_(hmask, non_blocking=True)
        g.replay()
        return out

    def replay(self, B: int, N: int) -> torch.Tensor:
        """Replay bucket (B, N) on the inputs its buffers hold now; its output (every row's argmax)."""
        g, _, out, _, _ = self.graphs[(B, N)]
        g.replay()
        return out

    def output(self, B: int, N: int) -> torch.Tensor:
        return self.graphs[(B, N)][2]

    def advance(self, B: int, live: torch.Tensor) -> None:
        """Feed one-row bucket (B, 1) its next AR step on the device: each ``live`` row's token becomes
        its last argmax, its position and cache position move on by one and the new position joins
        its mask; other rows (padding) stay as they are."""
        _, sinp, out, ids, _ = self.graphs[(B, 1)]
        ids[0].copy_(torch.where(live, out, ids[0]))
        ids[1:3] += live
        sinp.mask.scatter_(1, ids[2].unsqueeze(1), live.unsqueeze(1))
