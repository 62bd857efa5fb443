"""CUDA graphs for batched verify steps: one graph per (requests, rows per request) bucket.

A bucket (B, N) is a step of B requests x N rows laid out request after request (request b in
cache slot b, rows ``b*N .. b*N + N - 1``), attending over the whole static cache. The scheduler
pads a decode step to the smallest bucket that holds it (:func:`bucket`). A mixed bucket (B, N, P)
adds P rows for one prompt chunk after them (its slot and first row vary, so the step's segment
table is a graph input, :meth:`BatchGraphRunner.run_mixed`); other steps with prompt rows run
eagerly.

A hybrid's buckets need its GDN layers on the row kernels. Its one-row buckets advance every
request's state in place (one conv and delta-rule launch per layer); in its verify buckets every
row walks its root path from its request's committed state (:class:`~specpilot.engine.step_input.Walk`:
one conv and one verification launch per layer, the path kernel or TreeWY over every request),
the path table a static input like the mask: a request's tree rows walk their tree, chain rows
and padding rows the chain of their segment (reads only: padding outputs are dropped). A request
with one row in such a step is walked too, so its GDN state is committed afterwards like the
others' (:func:`walks`). What the commit reads (each GDN layer's projection and conv rows) a
verify bucket writes into buffers every bucket shares, sized for the most rows (only the last
replay is ever committed), not into memory of its own: the stashes, views of those buffers, are
handed back to the cache after every replay.
"""

from __future__ import annotations

import torch

from specpilot.engine.graphs import capture
from specpilot.engine.step_input import BatchStepInput, Segment, Walk
from specpilot.kernels.attention.decode import segment_table

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)   # a mixed bucket's prompt rows


def replays(model) -> bool:
    """Whether ``model``'s batched steps replay bucket graphs where graphs run (CUDA): a dense
    model's always, a hybrid's where its GDN layers run the row kernels."""
    return all(layer.runs_kernels(model.device) for layer in model.gdn_layers())


def mixes(model) -> bool:
    """Whether ``model``'s verify steps with a prompt chunk in them may replay mixed buckets
    (:meth:`BatchGraphRunner.prepare_mixed`): a dense model on the fused rows path, whose kernels
    read the step's segments from the device table a replay refreshes (a hybrid's GDN layers and
    the layer modules build theirs on the host)."""
    from specpilot.engine import fused_verify

    return fused_verify.takes_batch(model) and not model.gdn_layers()


def walks(model, rows: int) -> bool:
    """Whether bucket (B, ``rows``) of ``model`` walks every row's GDN path (a hybrid's verify
    bucket): its GDN states advance only by the commit, a one-row request's included."""
    return model.spec.is_hybrid and rows > 1


def bucket_paths(segments: list[Segment], N: int) -> torch.Tensor:
    """The path table [B * N, N] (host, int64) of a walking bucket's rows: a tree segment's rows
    walk its tree (its paths, local to the segment), every other row the chain of its segment."""
    from specpilot.kernels.gdn.rows import chain_paths

    out = torch.full((len(segments) * N, N), -1, dtype=torch.long)
    chain = chain_paths(N, "cpu")
    for b, sg in enumerate(segments):
        if sg.rows != N or sg.start != b * N:
            raise ValueError(f"segment {b} is not laid out for bucket rows {N}: rows {sg.start}..+{sg.rows}")
        block = out[b * N:(b + 1) * N]
        block.copy_(torch.where(chain >= 0, chain + b * N, -1))
        if sg.gdn_rows == "tree":
            p = sg.paths.cpu()
            k, d = p.shape
            if k > N or d > N:
                raise ValueError(f"segment {b}'s tree ({k} rows, depth {d}) does not fit bucket rows {N}")
            block[:k] = -1
            block[:k, :d] = torch.where(p >= 0, p + b * N, -1)
    return out


def bucket(n: int, limit: int) -> int:
    """The smallest bucket size >= n (``limit`` itself when above every bucket below it)."""
    return next((b for b in BUCKETS if n <= b <= limit), limit)


def sizes(limit: int, least: int = 1) -> list[int]:
    """Every size :func:`bucket` can give for counts from ``least`` up to ``limit``."""
    return sorted({bucket(n, limit) for n in range(least, limit + 1)})


class _Eager:
    """A bucket step without CUDA graphs (CPU): replay runs it on the static inputs into ``out``."""

    def __init__(self, fn, out: torch.Tensor):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def _feed(inp: BatchStepInput, sinp: BatchStepInput, ids: torch.Tensor, staging) -> None:
    """A bucket's inputs from ``inp`` (host tensors): tokens, positions, cache positions, slots and
    the mask through the pinned ``staging``, copied to the graph's buffers asynchronously."""
    hids, hmask = staging[0], staging[1]
    hids.copy_(torch.stack((inp.tokens, inp.pos, inp.slots, inp.req)))
    hmask.copy_(inp.mask)
    ids.copy_(hids, non_blocking=True)
    sinp.mask.copy_(hmask, non_blocking=True)


class BatchGraphRunner:
    def __init__(self, model, cache, warmup: int = 2):
        self.model, self.cache, self.warmup = model, cache, warmup
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.mixed: dict[tuple[int, int, int], tuple] = {}   # (B, N, P): prompt rows after the B x N
        # One memory pool for every bucket: a replay's outputs (argmax, the stashes the commit
        # reads) are consumed before the next replay on the same stream, so the graphs may share
        # their scratch; captured largest first (:meth:`prepare`), the smaller ones fit in its pool.
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.keeps: list[tuple] = []   # per GDN layer: the walking buckets' (projection, conv) rows

    def _keep(self, T: int) -> list[tuple]:
        """Each GDN layer's kept-rows buffers (:attr:`LayerSlots.keep`) of at least ``T`` rows. A
        larger bucket than any before gets new ones (the graphs captured earlier keep theirs)."""
        if not self.keeps or self.keeps[0][0].shape[0] < T:
            m = self.model
            self.keeps = [(torch.empty(T, g.in_proj.out_features, dtype=m.dtype, device=m.device),
                           torch.empty(T, g.conv_dim, dtype=m.dtype, device=m.device)) for g in m.gdn_layers()]
        return self.keeps

    def prepare(self, shapes) -> None:
        """Capture the buckets ``shapes`` ((B, N) pairs) not captured yet, the most rows first."""
        for B, N in sorted(set(shapes), key=lambda s: (-s[0] * s[1], -s[1])):
            self.get(B, N)

    def _capture(self, B: int, N: int, P: int = 0):
        m, dev, S = self.model, self.model.device, self.cache.max_seq
        T = B * N + P
        walking = walks(m, N)
        # tokens, pos, slots and req are rows of one tensor: a step's inputs arrive in two copies
        ids = torch.zeros(4, T, dtype=torch.long, device=dev)
        ids[2, :B * N] = torch.arange(N, device=dev).repeat(B)
        ids[3, :B * N] = torch.arange(B, device=dev).repeat_interleave(N)
        segs = [Segment(b, b * N, N, "chain" if walking else "seq") for b in range(B)]
        segtab = None
        if P:   # the prompt rows: slot 0 at capture, the step's own segment table at every replay
            ids[2, B * N:] = torch.arange(P, device=dev)
            segs.append(Segment(0, B * N, P))
            segtab = segment_table(segs, dev)[0]
        inp = BatchStepInput(ids[0], ids[1], ids[2], ids[3], torch.zeros(T, S, dtype=torch.bool, device=dev), segs)
        if segtab is not None:
            inp.seg_table = (segtab, max(N, P))
        inp.mask[:, 0] = True
        paths = None
        if walking:
            paths = bucket_paths(segs, N).to(dev)
            # TreeWY reads a padding request's state from its segment's own slot (reads only)
            segs_t = torch.tensor([[b * N, N, b] for b in range(B)], dtype=torch.int32, device=dev)
            inp.walk = Walk(tuple(range(B)), None, paths, ids[3], segs_t, N)

        gdn = [lc for lc in self.cache.layers if lc.state is not None]
        keeps = self._keep(T) if walking else []

        def fn():
            for lc, kp in zip(gdn, keeps):
                lc.keep = kp
            try:
                return m.greedy_batch(inp, self.cache, S)
            finally:
                for lc in gdn:
                    lc.keep = None

        # warm-up and capture run the step for real: keep the positions, states and stashes they
        # write intact
        kept = [(t[:B, :, :max(N, P)], t[:B, :, :max(N, P)].clone()) for lc in self.cache.layers
                for t in (lc.k, lc.v) if t is not None]
        kept += [(t[:B], t[:B].clone()) for lc in self.cache.layers for t in (lc.state, lc.conv) if t is not None]
        stashes = [(dict(lc.stash), lc.walked) for lc in self.cache.layers]
        if dev.type == "cuda":
            g, out = capture(fn, self.warmup, self.pool)
        else:
            out = fn()
            g = _Eager(fn, out)
        for t, saved in kept:
            t.copy_(saved)
        # the stashes the captured step leaves are views of the graph's buffers: every replay's
        views = [({b: lc.stash[b] for b in range(B) if b in lc.stash}, lc.walked) for lc in self.cache.layers] \
            if walking and dev.type == "cuda" else None
        for lc, (saved, walked) in zip(self.cache.layers, stashes):
            lc.stash.clear()
            lc.stash.update(saved)
            lc.walked = walked
        pin = dev.type == "cuda"
        staging = (torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pin),
                   torch.empty(inp.mask.shape, dtype=torch.bool, pin_memory=pin),
                   None if paths is None else torch.empty(paths.shape, dtype=paths.dtype, pin_memory=pin))
        if P:
            self.mixed[(B, N, P)] = (g, inp, out, ids, staging, segtab,
                                     torch.empty(segtab.shape, dtype=segtab.dtype, pin_memory=pin))
            return self.mixed[(B, N, P)]
        self.graphs[(B, N)] = (g, inp, out, ids, staging, paths, views)
        return self.graphs[(B, N)]

    def get(self, B: int, N: int):
        return self.graphs.get((B, N)) or self._capture(B, N)

    def prepare_mixed(self, shapes) -> None:
        """Capture the mixed buckets ``shapes`` ((B, N, P) triples: B x N verify rows, then P rows of
        one prompt chunk) not captured yet, the most rows first. Only where :func:`mixes`."""
        shapes = set(shapes)
        if shapes and not mixes(self.model):
            raise ValueError("mixed buckets need a dense model on the fused rows path")
        for B, N, P in sorted(shapes, key=lambda s: -(s[0] * s[1] + s[2])):
            if (B, N, P) not in self.mixed:
                self._capture(B, N, P)

    def run_mixed(self, inp: BatchStepInput, B: int, N: int, P: int) -> torch.Tensor:
        """Replay mixed bucket (B, N, P), captured by :meth:`prepare_mixed`, on ``inp`` (laid out by
        ``assemble(pad=(B, N), prompt=(chunk, P))``, host tensors); every row's argmax. As
        :meth:`run`: read the result before the next call."""
        g, sinp, out, ids, staging, segtab, hseg = self.mixed[(B, N, P)]
        _feed(inp, sinp, ids, staging)
        hseg.copy_(segment_table(inp.segments, "cpu")[0])
        segtab.copy_(hseg, non_blocking=True)
        g.replay()
        return out

    def run(self, inp: BatchStepInput, B: int, N: int) -> torch.Tensor:
        """Replay bucket (B, N) on ``inp`` (laid out for it; host tensors are fastest: they go through
        pinned staging in asynchronous copies); the argmax of every row. The staging is reused
        by the next call, so read the result (a host sync) before calling again."""
        g, sinp, out, ids, staging, paths, _ = self.get(B, N)
        _feed(inp, sinp, ids, staging)
        if paths is not None:
            staging[2].copy_(bucket_paths(inp.segments, N))
            paths.copy_(staging[2], non_blocking=True)
        self._replay(B, N)
        return out

    def _replay(self, B: int, N: int) -> None:
        g, *_, views = self.graphs[(B, N)]
        g.replay()
        if views is not None:   # the commit reads the stashes of this replay
            for lc, (stash, walked) in zip(self.cache.layers, views):
                lc.stash.update(stash)
                lc.walked = walked

    def replay(self, B: int, N: int) -> torch.Tensor:
        """Replay bucket (B, N) on the inputs its buffers hold now; its output (every row's argmax)."""
        self._replay(B, N)
        return self.graphs[(B, N)][2]

    def output(self, B: int, N: int) -> torch.Tensor:
        return self.graphs[(B, N)][2]

    def advance(self, B: int, live: torch.Tensor) -> None:
        """Feed one-row bucket (B, 1) its next AR step on the device: each ``live`` row's token becomes
        its last argmax, its position and cache position move on by one and the new position joins
        its mask; other rows (padding) stay as they are, mask included (a free slot's padding row
        writes at position 0, the one it attends)."""
        _, sinp, out, ids, *_ = self.graphs[(B, 1)]
        ids[0].copy_(torch.where(live, out, ids[0]))
        ids[1:3] += live
        at = ids[2].unsqueeze(1)
        sinp.mask.scatter_(1, at, sinp.mask.gather(1, at) | live.unsqueeze(1))
