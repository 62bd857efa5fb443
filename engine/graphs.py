"""CUDA graphs for fixed-shape steps (gpt-fast style): one captured graph per row count T.

Static input buffers (tokens, positions, slots, mask over the whole ``max_seq`` cache) are
filled before each replay; the graph reads the full static cache, so a step's shape never
changes. Used for AR decode, for chain/tree verify steps (padded to a row bucket by
``Decoder._graph_verify``) and for ``probe rows`` (T = N rows).

Hybrid (GDN) models are captured when their GDN layers run the row kernels (on CUDA): a graph of
T > 1 rows lays them out as a tree whose root paths come from a static ``paths`` buffer (a chain is
a tree too), so one graph serves chain and tree steps; the layers' commit data (the step's conv
outputs and projections, graph memory) is recorded at capture and handed back after each replay.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specpilot.engine.model import Attention, Transformer
from specpilot.engine.step_input import StepInput


def time_replays(g: "torch.cuda.CUDAGraph", reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of ``reps`` replays of a captured graph, each timed with CUDA events."""
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return samples


def capture(fn, warmup: int, pool=None) -> tuple["torch.cuda.CUDAGraph", object]:
    """Run ``fn`` ``warmup`` times on a side stream (lazy initialisation, autotuning), then capture
    one call into a CUDA graph; returns the graph and the call's output (the graph's static output).
    ``pool`` (``torch.cuda.graph_pool_handle()``) shares graph memory with other captures into it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


def capture_in_place(model: Transformer, fn, warmup: int, slots: int) -> tuple["torch.cuda.CUDAGraph", object]:
    """:func:`capture` of a step of ``model`` at cache slots 0..``slots``-1: warm-up and capture
    really run it, writing K/V there and advancing GDN states, so both are put back afterwards."""
    caches = [c for blk in model.layers for c in (getattr(blk.mixer, "k_cache", None),
                                                  getattr(blk.mixer, "v_cache", None)) if c is not None]
    live = [t for g in model.gdn_layers() for t in (g.state, g.conv_state)]
    saved, states = [c[:, :, :slots].clone() for c in caches], [t.clone() for t in live]
    g, out = capture(fn, warmup)
    for c, sv in zip(caches, saved):
        c[:, :, :slots].copy_(sv)
    for t, sv in zip(live, states):
        t.copy_(sv)
    return g, out


def time_calls(fn, reps: int, warmup: int, cuda: bool) -> list[float]:
    """Milliseconds of ``reps`` eager calls of ``fn`` (after ``warmup`` untimed ones): CUDA events
    on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def graph_ready(model: Transformer) -> bool:
    """Whether the model's steps can be captured: CUDA, and GDN layers (if any) on the row kernels."""
    return model.device.type == "cuda" and all(g.runs_kernels(model.device) for g in model.gdn_layers())


class GraphRunner:
    """The step graphs of one model (:meth:`get`, :meth:`run`) and the graphs of their commits
    (:meth:`commit`)."""

    def __init__(self, model: Transformer, warmup: int = 2):
        self.model = model
        self.graphs: dict[int, tuple] = {}
        self.stashes: dict[int, list] = {}
        self.commits: dict[tuple, tuple] = {}
        self.replayed: int | None = None   # the bucket :meth:`run` replayed last, until its commit
        self.warmup = warmup

    def _capture(self, T: int):
        from specpilot.kernels.gdn.rows import chain_paths

        m = self.model
        dev = m.device
        S = m.max_seq
        tokens = torch.zeros(T, dtype=torch.long, device=dev)
        pos = torch.zeros(T, dtype=torch.long, device=dev)
        slots = torch.arange(T, dtype=torch.long, device=dev)
        mask = torch.zeros(T, S, dtype=torch.bool, device=dev)
        mask[:, 0] = True
        gdn = m.gdn_layers()
        if gdn and T > 1:
            inp = StepInput(tokens, pos, slots, mask, "tree", chain_paths(T, dev).clone())
        else:
            inp = StepInput(tokens, pos, slots, mask, "seq")

        def fn():
            return m.greedy(inp, kv_len=S)

        g, out = capture_in_place(m, fn, self.warmup, T)
        self.stashes[T] = [layer._stash for layer in gdn]
        self.graphs[T] = (g, inp, out)
        return self.graphs[T]

    def get(self, T: int):
        return self.graphs.get(T) or self._capture(T)

    def run(self, tokens, pos, slots, mask, paths=None):
        """Replay the graph for T = len(tokens) rows; returns the argmax per row (device tensor).
        ``paths`` [T, <= T] (hybrids): the rows' root paths, -1 padded (default: a chain)."""
        T = len(tokens)
        g, inp, out = self.get(T)
        # host inputs in pinned memory copy without waiting for the host (Decoder.padded_rows)
        inp.tokens.copy_(tokens, non_blocking=True)
        inp.pos.copy_(pos, non_blocking=True)
        inp.slots.copy_(slots, non_blocking=True)
        inp.mask.copy_(mask, non_blocking=True)
        if inp.paths is not None:
            if paths is None:
                from specpilot.kernels.gdn.rows import chain_paths

                inp.paths.copy_(chain_paths(T, inp.paths.device))
            else:
                inp.paths.fill_(-1)
                inp.paths[:, :paths.shape[1]].copy_(paths, non_blocking=True)
        g.replay()
        for layer, st in zip(self.model.gdn_layers(), self.stashes.get(T, ())):
            layer._stash = st   # the step's commit data lives in the graph's memory
        self.replayed = T
        return out

    # ---- commits ----------------------------------------------------------------------
    # A verify step's commit is a few launches per layer (a GDN layer's path replay and conv
    # advance, an attention layer's K/V move), each costing more host time than its kernel takes:
    # 2-5 ms of host time a step on Qwen3.5-9B shapes (H200). A commit graph per (bucket, accepted
    # rows, moved) replays them in one launch, the accepted rows a static input.

    def commit(self, start: int, rows: list[int], gdn_rows: str) -> bool:
        """:meth:`Transformer.commit` of the step :meth:`run` replayed last, through its commit
        graph (captured on first use; :meth:`capture_commits` captures them at load); False where
        no graph serves (no replay of this runner before it, a layer's commit data from elsewhere,
        GDN layers off the row kernels) and the caller commits eagerly."""
        T, self.replayed = self.replayed, None
        m = self.model
        gdn, moved = m.commit_work(rows, gdn_rows)
        if not (moved or gdn):
            return True
        if gdn and (T is None or not self._commits_rows(T)
                    or any(layer._stash is not st for layer, st in zip(gdn, self.stashes[T]))):
            return False   # (the step's commit data is not this runner's bucket's: commit eagerly)
        L = len(rows)
        key = (T if gdn else 0, L, moved)
        g, idx = self.commits.get(key) or self._capture_commit(*key)
        host = torch.empty(3, L, dtype=torch.long, pin_memory=m.device.type == "cuda")
        a = host.numpy()
        a[0] = rows
        a[1] = start + a[0]
        a[2] = start + np.arange(L)
        idx.copy_(host, non_blocking=True)
        g.replay()
        for layer in gdn:
            layer._stash = None
        return True

    def capture_commits(self, buckets, most_rows: int, moves: bool) -> int:
        """Capture the commit graphs a decode loop over verify ``buckets`` can hit: up to
        ``most_rows`` accepted rows (the pending token's included) and, with ``moves`` (trees),
        the K/V moves of accepted rows that are not the first ones. Returns how many."""
        gdn = bool(self.model.gdn_layers())
        keys = set()
        for T in buckets:
            if T < 2:
                continue
            if gdn:
                self.get(T)
                if not self._commits_rows(T):
                    continue
            for L in range(1, min(T, most_rows) + 1):
                for moved in ((False, True) if moves and L > 1 else (False,)):
                    if gdn or moved:
                        keys.add((T if gdn else 0, L, moved))
        for key in sorted(keys - self.commits.keys()):
            self._capture_commit(*key)
        return len(keys)

    def _commits_rows(self, T: int) -> bool:
        """Whether bucket ``T``'s GDN layers leave row-kernel commit data (what a graph replays)."""
        return T in self.stashes and all(st is not None and st[0] == "rows" for st in self.stashes[T])

    def _capture_commit(self, T: int, L: int, moved: bool):
        """The commit graph of ``L`` accepted rows after a replay of bucket ``T`` (0: no GDN
        layers), with the attention layers' K/V moves where ``moved``; its static input ``idx``
        [3, L] holds the accepted rows, their slots and the slots they move to. Warm-up and
        capture commit rows 0..L-1 at slot 0 for real; :func:`capture_in_place` puts back what
        they change."""
        m = self.model
        idx = torch.arange(L, device=m.device).repeat(3, 1)
        attn = [blk.mixer for blk in m.layers if isinstance(blk.mixer, Attention)] if moved else []
        gdn = list(zip(m.gdn_layers(), self.stashes[T])) if T else []

        def fn():
            for a in attn:
                a.move(idx[1], idx[2])
            for layer, st in gdn:
                layer._stash = st
                layer.commit(None, idx[:1])

        kept = [layer._stash for layer in m.gdn_layers()]   # a pending commit's, when captured on first use
        g, _ = capture_in_place(m, fn, self.warmup, L)
        for layer, st in zip(m.gdn_layers(), kept):
            layer._stash = st
        self.commits[(T, L, moved)] = (g, idx)
        return g, idx

    def ar_graph(self, n_cache: int, token: int | None = None):
        """The one-row graph with its inputs set for the token at slot/position ``n_cache`` (the
        cache holds ``n_cache`` tokens); returns (graph, argmax output)."""
        g, inp, out = self.get(1)
        if token is not None:
            inp.tokens.fill_(token)
        inp.pos.fill_(n_cache)
        inp.slots.fill_(n_cache)
        inp.mask.copy_(torch.arange(self.model.max_seq, device=inp.mask.device)[None] <= n_cache)
        return g, out

    def ar_step(self, token: int, n_cache: int) -> int:
        g, out = self.ar_graph(n_cache, token)
        g.replay()
        return int(out[0])
