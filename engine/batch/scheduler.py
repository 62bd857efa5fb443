"""Continuous batching: requests join and leave between steps; one step runs every running
request's rows (AR, chain or tree verification, and admitted prompt chunks) through one weight
stream. Greedy and lossless: each request's tokens are the target's argmax along its own
accepted path, exactly as the one-request decoder (``specpilot.engine.decode``) computes them.

One iteration (:meth:`BatchDecoder.step`):

1. cancelled requests leave; waiting requests take free slots (up to ``batch`` running);
2. with nothing decoding, prompts are prefilled in a pass of their own;
3. otherwise the decoding requests draft (one lattice each), each verifies at most its block of
   draft positions (``block=adaptive``), the node budget is filled (``budget``: shared or equal,
   the batched tree builder) and the step runs the verify rows plus the prompt rows the
   admission rule lets in (``admit``); then a prefill pass for the prompts left out. In mode
   tlv each request's tree is its TLV cycle's (:mod:`.tlv`: a Q pass over every draft-1 tree,
   the commit chains, draft 2) and the step is the cycles' exact pass;
4. each request accepts its longest matching path plus the bonus token, commits it in its own
   cache slot and delivers tokens until a stop condition (``Request.offer``);
5. finished requests free their slots (the last running request moves into the hole).

In AR mode with bucket graphs, while every running request decodes, steps overlap with the host
(:mod:`.overlap`): each iteration launches the next step, fed on the device, before it takes the
tokens of the step in flight.

The rules are in :mod:`.rules`, the lattices-to-trees side in :mod:`.planner`, the row layout in
:mod:`.step`, the slots in :mod:`.cache`, the totals in :mod:`.stats`.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import torch

from specpilot.engine.batch import rules, tlv
from specpilot.engine.batch.cache import BatchCache
from specpilot.engine.batch.commit import commit_step
from specpilot.engine.batch.drafting import BatchDrafting
from specpilot.engine.batch.graphs import PROMPT_BUCKETS, bucket, mixes, replays, sizes, walks
from specpilot.engine.batch.overlap import Streak
from specpilot.engine.batch.planner import DraftPlanner
from specpilot.engine.batch.requests import Request
from specpilot.engine.batch.stats import BatchStats
from specpilot.engine.batch.step import Rows, assemble, fits_mixed, prefill_rows, verify_rows
from specpilot.engine.decode import GenerationResult, check_request
from specpilot.engine.drafters import Lattice
from specpilot.engine.spec import cache_room, request_rows
from specpilot.machine import torch_threads
from specpilot.engine.tlv import TLVStats
from specpilot.errors import InputError
from specpilot.kernels import tree as treelib
from specpilot.kernels.gdn.path import row_paths


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already."""


class BatchDecoder:
    """Continuous-batching greedy decoder on ``model`` (``mode``: ar, chain, tree, tlv with ``qview``
    the Q pass's weights; ``drafter``: the kind, ngram/self/model). ``graphs``: bucket steps from
    static buffers (CUDA graphs on a GPU); ``overlap``: with them, AR steps overlap the host's work.
    Thread-safe :meth:`submit` and :meth:`cancel`; :meth:`step` and :meth:`run_forever` on one
    engine thread."""

    def __init__(self, model, mode: str = "ar", drafter: str | None = None, *, nodes: int = 32, depth: int = 8,
                 topk: int = 8, eos_ids=(), batch: int = 8, budget: str = "shared", block: str = "adaptive",
                 admit: str = "waiting", admit_rows: int = 128, draft_layers: int | None = None, draft_model=None,
                 graphs: bool = False, max_queue: int | None = None, prefill_chunk: int = 512, qview=None,
                 overlap: bool = True):
        if mode != "ar" and drafter is None:
            raise InputError(f"mode {mode} needs a drafter")
        if mode == "tlv" and qview is None:
            raise InputError("mode=tlv needs the Q pass's weights (qview)")
        self.model, self.mode, self.qview = model, mode, qview
        self.nodes, self.depth, self.topk = nodes, depth, topk if mode in ("tree", "tlv") else 1
        self.eos_ids = frozenset(eos_ids or ())
        self.batch, self.budget, self.block, self.admit = int(batch), budget, block, admit
        self.admit_rows, self.prefill_chunk = int(admit_rows), int(prefill_chunk)
        self.max_queue = None if max_queue is None else int(max_queue)   # None: no bound
        self.cache = BatchCache(model, self.batch)
        self.drafting = None if mode == "ar" else BatchDrafting(drafter, model, self.cache, layers=draft_layers,
                                                               draft_model=draft_model)
        self.planner = DraftPlanner(mode, nodes, depth, self.topk, self.batch, budget, block, model.device)
        self.runner = None
        if graphs and mode != "tlv":   # TLV's two passes run eagerly
            from specpilot.engine.batch.graphs import BatchGraphRunner

            self.runner = BatchGraphRunner(model, self.cache)
        self.overlap = bool(overlap) and self.runner is not None and mode == "ar" and replays(model)
        self.streak: Streak | None = None   # overlapped AR steps in flight
        self.running: list[Request] = []          # running[i] holds slot i
        self.waiting: deque[Request] = deque()
        self.cond = threading.Condition()
        self.stats = BatchStats()
        self.threads = 0
        self.draining = False
        self.warmup_seconds = 0.0   # what warm_up took, when the engine ran it

    # ---- sizes ----------------------------------------------------------------------
    @property
    def rows_per_request(self) -> int:
        """Most rows one request puts into a verify step."""
        return request_rows(self.mode, self.nodes, self.depth, self._shared_cap)

    @property
    def _shared_cap(self) -> int:
        return rules.SHARED_CAP if self.budget == "shared" else 1

    def capacity_needed(self, prompt_len: int, max_new: int) -> int:
        return prompt_len + max_new + cache_room(self.mode, self.nodes, self.depth, self._shared_cap)

    def check(self, req: Request) -> None:
        """Refuse a request the engine cannot run (InputError)."""
        ids = req.prompt_ids
        check_request(ids, req.max_new_tokens, self.model.spec.vocab_size, self.capacity_needed, self.cache.max_seq,
                      mode=self.mode)

    # ---- thread-safe API --------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request (checked first: InputError); see :meth:`submit_all`."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: list[Request]) -> list[Request]:
        """Queue every request of ``reqs`` or none (each checked first: InputError). QueueFull when
        more than ``max_queue`` requests would wait beyond the free slots they are about to take
        (0: none may wait for a slot)."""
        for req in reqs:
            self.check(req)
        if self.max_queue is not None and len(reqs) > self.batch + self.max_queue:   # never, not later either
            raise InputError(f"{len(reqs)} requests in one list: more than this server holds at once ({self.batch} "
                             f"slots + a queue of {self.max_queue}); send at most {self.batch + self.max_queue}")
        with self.cond:
            if self.draining:
                raise QueueFull("the server is shutting down")
            free = max(0, self.batch - len(self.running))
            if self.max_queue is not None and len(self.waiting) + len(reqs) > self.max_queue + free:
                ahead = max(0, len(self.waiting) - free)
                if self.max_queue == 0:
                    # free slots that the requests already waiting will not take
                    open_ = max(0, free - len(self.waiting))
                    if len(reqs) == 1 or open_ == 0:
                        raise QueueFull(f"all {self.batch} slots are taken and no request may wait for one (a "
                                        "queue of 0)")
                    raise QueueFull(f"a list of {len(reqs)} requests needs {len(reqs)} free slots, "
                                    f"{open_} of {self.batch} {'is' if open_ == 1 else 'are'} free, and a queue of 0 "
                                    "lets none wait for one")
                raise QueueFull((f"{ahead} request{' is' if ahead == 1 else 's are'} waiting for a slot already")
                                if len(reqs) == 1 else
                                f"{len(reqs)} requests with {ahead} waiting already would pass the queue's "
                                f"{self.max_queue}")
            now = time.perf_counter()
            for req in reqs:
                req.t_arrival = now
                self.waiting.append(req)
            self.cond.notify_all()
        return reqs

    def cancel(self, req: Request) -> None:
        """Stop a request at the next step boundary (a client went away); frees its slot."""
        req.cancelled = True
        with self.cond:
            self.cond.notify_all()

    def load(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self.cond:
            return len(self.running), len(self.waiting)

    def idle(self) -> bool:
        with self.cond:
            return not self.running and not self.waiting

    def abort_all(self, message: str) -> None:
        """Finish every waiting and running request as aborted (engine thread, or no thread running)."""
        self.streak = None   # its step in flight only writes slots that are freed here
        with self.cond:
            reqs = list(self.waiting) + list(self.running)
            self.waiting.clear()
        for r in reqs:
            r.abort(message)
            self._release(r)
            self._notify(r, [])

    def flush(self) -> bool:
        """Zero the caches when nothing runs (``/flush_cache``); False when requests are in flight."""
        with self.cond:
            if self.running or self.waiting:
                return False
            self.cache.clear()
            if self.drafting is not None:
                self.drafting.clear()
            return True

    @torch.no_grad()
    def warm_up(self) -> float:
        """Compile and capture now what requests will hit (the engine calls this at load on CUDA):
        the graph of every (requests, rows) bucket a step can pad to, the tree builder at every
        request bucket, then a synthetic workload through this decoder - ``batch`` requests
        finishing a few steps apart, then prompts of every Triton specialisation class
        (:data:`~specpilot.engine.decode.WARMUP_PROMPTS`) arriving while others decode (prefill
        passes and, under the admission rule, prompt rows in verify steps). Totals and drafting
        state start afresh afterwards; the caches stay dirty (a request writes what it reads).
        Returns the seconds taken."""
        from specpilot.engine.decode import WARMUP_PROMPTS

        t0 = time.perf_counter()
        self.check(Request([0, 1], 1))   # a cache too small for any request: say so, capture nothing
        if self.runner is not None and replays(self.model):
            rows = [1] if self.mode == "ar" else sizes(self.rows_per_request)
            self.runner.prepare([(B, N) for B in sizes(self.batch) for N in rows])
            self.runner.prepare_mixed([(bucket(self.batch, self.batch), 1, P) for P in self.prompt_sizes()])
        if self.mode in ("chain", "tree"):   # a chain's lattices come without transitions
            k = self.topk
            for B in sizes(self.batch):
                for tr in (None,) if self.mode == "chain" else (None, [[[-1.0] * k] * k] * (self.depth - 1)):
                    lat = Lattice([[1] * k] * self.depth, [[-0.5] * k] * self.depth, tr)
                    self.planner.trees([lat] * B, list(range(B)))
        V = self.model.spec.vocab_size
        room = self.cache.max_seq - self.capacity_needed(2, 0)   # new tokens a 2-token prompt may take

        def short(i: int, n: int) -> Request:
            return Request([(3 * i + 1) % V, (5 * i + 2) % V], max(1, min(n, room)), id=("warm-up", i))

        self.generate_many([short(i, 3 * i + 2) for i in range(self.batch)])   # apart by more than a streak's end
        prompts = [Request([(7 * k) % 31 % V for k in range(n)], 4, id=("warm-up", n), arrival_step=1 + j)
                   for j, n in enumerate(WARMUP_PROMPTS) if self.capacity_needed(n, 4) <= self.cache.max_seq]
        self.generate_many([short(i, 2 * len(prompts) + 8) for i in range(max(1, self.batch // 2))] + prompts)
        self.stats = BatchStats()
        self.planner.reset()
        if self.drafting is not None:
            self.drafting.clear()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def prompt_sizes(self) -> list[int]:
        """The prompt rows of the mixed buckets (:meth:`_run`) this decoder captures: AR steps of a
        model that :func:`~.graphs.mixes`, the buckets up to the most rows one prompt chunk brings
        into a step under the admission rule (none with ``admit=off``) that leave a position of the
        cache after them for the bucket's own padding row of the chunk's slot."""
        if self.runner is None or self.mode != "ar" or not mixes(self.model):
            return []
        most = {"waiting": self.admit_rows - 1, "all": self.prefill_chunk}.get(self.admit, 0)
        return [p for p in PROMPT_BUCKETS if p // 2 < most and p < self.cache.max_seq]

    def run_forever(self, stop: threading.Event, on_error=None) -> None:
        """The engine thread: step while there is work, sleep on the condition otherwise."""
        if self.threads:
            torch.set_num_threads(self.threads)
        while not stop.is_set():
            with self.cond:
                if not self.running and not self.waiting:
                    self.cond.wait(0.05)
                    continue
            try:
                self.step()
            except Exception as e:  # an engine bug fails the requests in flight, not the server
                if on_error is not None:
                    on_error(e)
                self.abort_all(f"engine error: {type(e).__name__}: {e}")

    # ---- the scheduler -----------------------------------------------------------------
    def _notify(self, r: Request, new: list[int]) -> None:
        if r.on_update is not None:
            r.on_update(r, new, r.done)

    def _release(self, r: Request) -> None:
        """Free the request's slot: the last running request moves into it."""
        if r.t_done is None:
            r.t_done = time.perf_counter()
        with self.cond:
            if r.slot is None or r.slot >= len(self.running) or self.running[r.slot] is not r:
                r.slot = None
                return
            i, last = r.slot, len(self.running) - 1
            if i != last:
                mover = self.running[last]
                self.cache.move(last, i)
                if self.drafting is not None:
                    self.drafting.move(last, i)
                self.planner.move(last, i)
                self.running[i] = mover
                mover.slot = i
            self.running.pop()
            r.slot = None
            self.stats.finished[r.stop_reason] = self.stats.finished.get(r.stop_reason, 0) + 1

    def _admit(self) -> None:
        with self.cond:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
                r.abort("cancelled")
                r.t_done = time.perf_counter()
                self._notify(r, [])
            while self.waiting and len(self.running) < self.batch:
                r = self.waiting.popleft()
                r.slot = len(self.running)
                r.t_admitted = time.perf_counter()
                self.running.append(r)
                self.cache.reset(r.slot)
                if self.drafting is not None:
                    self.drafting.admit(r.slot)
                self.planner.admit(r.slot)
        for r in [r for r in self.running if r.cancelled]:
            r.abort("cancelled")
            self._release(r)
            self._notify(r, [])

    @torch.no_grad()
    def step(self) -> bool:
        """One scheduler iteration; False when there was nothing to do."""
        t0 = time.perf_counter()
        self._lattice_only = False
        if self.streak is not None:
            self._streak_step()
        else:
            self._admit()
            if not self.running:
                return False
            t0 = time.perf_counter()
            decoding = [r for r in self.running if r.prefilled == len(r.prompt_ids)]
            prefilling = [r for r in self.running if r.prefilled < len(r.prompt_ids)]
            if not decoding:
                self._prefill_pass(prefilling)
            # a recorded lattice takes a row per step, which the overlapped steps do not write
            elif self.overlap and not prefilling and not any(r.done or r.record_lattice for r in decoding):
                self._start_streak(decoding)
            else:
                left_out = self._verify_step(decoding, prefilling)
                if left_out:
                    self._prefill_pass(left_out)
        dt = time.perf_counter() - t0
        if self._lattice_only:
            self.stats.lattice_seconds += dt
        else:
            self.stats.step_seconds += dt
            self.stats.step_hist.observe(dt)
        for r in [r for r in self.running if r.done and r.tail <= 0]:
            self._finish_lattice(r)
            self._release(r)
        return True

    # overlapped AR steps ------------------------------------------------------------
    def _start_streak(self, decoding: list[Request]) -> None:
        """Launch the AR step of ``decoding`` (every running request, in slots 0..n-1) from the host,
        then go on as :meth:`_streak_step`."""
        blocks = [verify_rows(r.slot, r.full[-1], treelib.chain_tree([]), r.n_cache, "seq") for r in decoding]
        B = bucket(len(decoding), self.batch)
        inp, _, _ = assemble(blocks, self.cache.max_seq, torch.device("cpu"), pad=(B, 1), dump=self.cache.dump,
                             held=self._held())
        self.runner.run(inp, B, 1)
        self.streak = Streak(self.runner, decoding, B)
        self._streak_step()

    def _streak_step(self) -> None:
        """Launch the next AR step, take the tokens of the one in flight; end the streak (taking the
        step still in flight) when its requests change."""
        s = self.streak
        toks = s.next()
        self.stats.overlapped_steps += 1
        self._take_ar(s.reqs, toks)
        if any(r.done or r.cancelled for r in s.reqs) or (self.waiting and len(self.running) < self.batch):
            self.drain()

    def drain(self) -> None:
        """End overlapped AR steps: take the tokens of the step in flight (requests that finished
        before it get none)."""
        s, self.streak = self.streak, None
        if s is not None:
            toks = s.last()
            self._take_ar([r for r in s.reqs if not r.done], [t for r, t in zip(s.reqs, toks) if not r.done])

    def _take_ar(self, reqs: list[Request], toks: list[int]) -> None:
        """One AR step's tokens, one per request."""
        n = len(reqs)
        self.stats.verify_steps += 1
        self.stats.request_steps += n
        self.stats.verify_rows += n
        self.stats.rows += n
        now = time.perf_counter()
        for r, t in zip(reqs, toks):
            self._extend(r, [t], now)

    def _extend(self, r: Request, toks: list[int], now: float, step: bool = True) -> None:
        """A verify step's accepted tokens (the last one the bonus) join ``r``'s committed tokens and
        are delivered; ``step``: count the step for the request (False: a finished request's tail)."""
        if step:
            r.steps += 1
        r.n_cache += len(toks)
        r.full.extend(toks)
        self._deliver(r, toks, now, step)

    # prompt rows ---------------------------------------------------------------------
    def _prefill_blocks(self, reqs: list[Request], rows: list[int]) -> list[Rows]:
        out = []
        for r, n in zip(reqs, rows):
            if n > 0:
                a = r.prefilled
                b = min(len(r.prompt_ids), a + n)
                out.append(prefill_rows(r.slot, r.prompt_ids, a, b, b == len(r.prompt_ids)))
        return out

    def _prefill_pass(self, reqs: list[Request]) -> None:
        """Prompt chunks of ``reqs`` (first come first) in a pass of their own, up to
        ``prefill_chunk`` rows in all (at least one request's chunk)."""
        t0 = time.perf_counter()
        rows, budget = [], self.prefill_chunk
        for r in reqs:
            n = min(len(r.prompt_ids) - r.prefilled, budget)
            rows.append(max(0, n))
            budget -= max(0, n)
        blocks = self._prefill_blocks(reqs, rows)
        if not blocks:
            return
        dev = self.model.device
        replayed = self._replay_mixed([], blocks[0], 1) if len(blocks) == 1 else None
        if replayed is not None:   # one chunk: a mixed bucket whose verify rows are all padding
            out, need = replayed
            flat = [i for n in need for i in n]
            preds = [out[i] for i in flat]
            self.stats.prefill_replays += 1
        else:
            inp, kv, need = assemble(blocks, self.cache.max_seq, dev)
            flat = [i for n in need for i in n]
            if flat:
                preds = self.model.greedy_batch(inp, self.cache, kv, rows=torch.tensor(flat, device=dev)).tolist()
            else:   # no prompt ends in this pass: the chunks only fill the caches
                self.model.hidden_batch(inp, self.cache, kv)
                preds = []
        self.stats.prefill_passes += 1
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.rows += sum(len(b) for b in blocks)
        self.stats.prompt_rows += sum(len(b) for b in blocks)
        self._after_prefill(blocks, need, preds, flat)

    def _after_prefill(self, blocks: list[Rows], need, preds: list[int], flat: list[int]) -> None:
        at = {row: p for row, p in zip(flat, preds)}
        now = time.perf_counter()
        for blk, nd in zip(blocks, need):
            r = self.running[blk.slot]
            r.prefilled = blk.cslots[-1] + 1
            if nd:   # the prompt's last row: its argmax is the first token
                first = at[nd[0]]
                r.n_cache = len(r.prompt_ids)
                r.full = [first]
                self._deliver(r, [first], now)

    def _deliver(self, r: Request, toks: list[int], now: float, step: bool = False) -> None:
        """Offer ``toks`` to ``r``; ``step``: they are a verify pass's (its accepted drafts and the
        bonus), whose accepted drafts are counted as delivered: a pass the request's end cuts
        (max_new_tokens, a stop) counts its delivered tokens less one, so that tau and the drafts
        accepted describe the tokens the request got, as its completion tokens do."""
        if r.done:
            r.tail -= len(toks)
            return
        new = r.offer(toks, now)
        if step:   # before the update goes out: a finished request's answer reads these counts
            acc = len(toks) - 1 if len(new) == len(toks) else max(len(new) - 1, 0)
            r.accepts.append(acc)
            self.stats.accepted += acc
        self.stats.tokens += len(new)
        if r.done and r.record_lattice and r.lattice:
            need = max(x["_at"] + x["_m"] + 1 for x in r.lattice)
            r.tail = need - len(r.full)
        self._notify(r, new)

    # verify steps --------------------------------------------------------------------
    def _verify_step(self, decoding: list[Request], prefilling: list[Request]) -> list[Request]:
        m = self.model
        B = len(decoding)
        tail = [r.done for r in decoding]   # finished requests decoding lattice targets: plain AR rows
        lats = [None] * B
        trees = [treelib.chain_tree([]) for _ in range(B)]
        drafters = [b for b in range(B) if self.mode != "ar" and not tail[b]]
        cyc, t_draft = {}, time.perf_counter()
        if drafters:
            got = self.drafting.propose([(decoding[b].slot, decoding[b].prompt_ids + decoding[b].full,
                                          decoding[b].n_cache) for b in drafters], self.depth, self.topk)
            for b, lat in zip(drafters, got):
                lats[b] = lat
            if self.mode == "tlv":
                self._tlv_totals().seconds["draft1"] += time.perf_counter() - t_draft
                cyc = tlv.cycles(self, decoding, drafters, got, trees, self._tlv_totals().seconds)
            else:
                built, drafted, kept = self.planner.build(got, [decoding[b].slot for b in drafters])
                self.stats.drafted_positions += drafted
                self.stats.kept_positions += kept
                for b, tr in zip(drafters, built or ()):   # no node deeper than the request can take
                    trees[b] = treelib.within_depth(tr, decoding[b].room() - 1)
        gdn = "tree" if self.mode in ("tree", "tlv") else "chain"
        blocks = []
        for b, r in enumerate(decoding):
            tr = trees[b]
            kind = gdn if len(tr) else "seq"
            paths = row_paths([-1] + [p + 1 for p in tr.parents]) if kind == "tree" else None
            blocks.append(verify_rows(r.slot, r.full[-1], tr, r.n_cache, kind, paths))
        verify = sum(len(b) for b in blocks)
        rows, need_pass = rules.plan_admission(self.admit, [len(r.prompt_ids) - r.prefilled for r in prefilling],
                                               verify, self.admit_rows, self.prefill_chunk)
        pblocks = self._prefill_blocks(prefilling, rows)
        t_exact = time.perf_counter()
        preds, need = self._run(blocks, pblocks)
        t_append = time.perf_counter()
        extra = sum(len(blk) for blk, t in zip(blocks, tail) if t)   # lattice-target rows
        self._lattice_only = all(tail) and not pblocks
        if self._lattice_only:
            self.stats.lattice_steps += 1
        else:
            self.stats.verify_steps += 1
        self.stats.request_steps += sum(1 for t in tail if not t)
        self.stats.verify_rows += verify - extra
        self.stats.lattice_rows += extra
        self.stats.admitted_prompt_rows += sum(len(b) for b in pblocks)
        self.stats.prompt_rows += sum(len(b) for b in pblocks)
        self.stats.rows += verify - extra + sum(len(b) for b in pblocks)
        now = time.perf_counter()
        accepted, commits, results = [], [], []
        for b, r in enumerate(decoding):   # every request's accepted rows, committed in one pass
            path, toks = treelib.accept_predictions(trees[b], [preds[i] for i in need[b]])
            results.append((path, toks))
            commits.append((r.slot, r.n_cache, [0] + [1 + p for p in path], blocks[b].gdn_rows))
        commit_step(m, self.cache, commits)   # skips requests with nothing to move or replay
        for b, r in enumerate(decoding):
            path, toks = results[b]
            lat = Lattice.empty() if self.mode == "ar" and not tail[b] else lats[b]   # AR: a lattice of no draft
            if lat is not None and r.record_lattice:
                row = {"schema": "specpilot.lattice/1", "request": r.id, "step": r.steps,
                       # the decoder's step: who verified together
                       "batch_step": self.stats.verify_steps + self.stats.lattice_steps - 1,
                       "tokens": lat.tokens, "logprobs": lat.logprobs,
                       "transitions": lat.transitions, "target": None, "_at": len(r.full), "_m": lat.m}
                if b in cyc:   # what replaying the cycle needs, as the one-request TLV decoder records it
                    row.update(cyc[b].record(self.nodes, lat))
                r.lattice.append(row)
            if b in cyc:   # the request's counts and the decoder's totals
                if r.tlv is None:
                    r.tlv = TLVStats(self.nodes)
                for st in (r.tlv, self._tlv_totals()):
                    cyc[b].count(st, [preds[i] for i in need[b]], len(toks))
            if not tail[b]:   # its own draft nodes (its block's rows past the root), not another request's
                accepted.append((r.slot, len(path)))
                r.proposed += len(trees[b])
                self.stats.proposed += len(trees[b])
            self._extend(r, toks, now, step=not tail[b])
        self.planner.note_accepted(accepted)
        if cyc:
            self.stats.tlv_steps += 1
            sec = self._tlv_totals().seconds
            sec["exact"] += t_append - t_exact
            sec["append"] += time.perf_counter() - t_append
        if pblocks:
            flat = [i for n in need[B:] for i in n]
            self._after_prefill(pblocks, need[B:], [preds[i] for i in flat], flat)
        return [r for r, n in zip(prefilling, rows) if n == 0] if need_pass else []

    def _tlv_totals(self) -> TLVStats:
        if self.stats.tlv is None:
            self.stats.tlv = TLVStats(self.nodes)
        return self.stats.tlv

    def _replay_mixed(self, blocks: list[Rows], chunk: Rows, N: int) -> tuple[list[int], list[list[int]]] | None:
        """Replay the mixed bucket (B, N, P) that holds ``blocks`` and prompt ``chunk`` (B: every slot;
        P: the smallest prompt size the chunk fits), when warm-up captured it; every row's argmax and
        where each block's ``need`` rows are. None where no such bucket exists."""
        if self.runner is None or not self.runner.mixed:
            return None
        B = bucket(self.batch, self.batch)
        P = next((p for p in PROMPT_BUCKETS if len(chunk) <= p), 0)
        if (B, N, P) not in self.runner.mixed or not fits_mixed(chunk, P, N, self.cache.max_seq):
            return None
        inp, _, need = assemble(blocks, self.cache.max_seq, torch.device("cpu"), pad=(B, N), prompt=(chunk, P),
                                held=self._held())
        return self.runner.run_mixed(inp, B, N, P).tolist(), need

    def _held(self) -> dict[int, int]:
        """Per running slot the first cache position past what its request holds (its committed or
        prefilled length; free slots: 0), where a bucket's padding rows for it write."""
        return {r.slot: max(r.prefilled, r.n_cache) for r in self.running} | \
            {s: 0 for s in range(len(self.running), self.batch)}

    def _run(self, blocks: list[Rows], pblocks: list[Rows]) -> tuple[list[int], list[list[int]]]:
        """Run the step's rows; the argmax of the rows each block needs (host list) and where they are."""
        m, dev = self.model, self.model.device
        allb = blocks + pblocks
        N = bucket(max(len(b) for b in blocks), self.rows_per_request) if blocks else 0
        if self.runner is not None and not pblocks and replays(m):
            B = bucket(max(b.slot for b in blocks) + 1, self.batch)
            inp, _, need = assemble(allb, self.cache.max_seq, torch.device("cpu"), pad=(B, N), dump=self.cache.dump,
                                    held=self._held())
            out = self.runner.run(inp, B, N).tolist()
            if walks(m, N):   # a one-row request's GDN rows were walked too: it commits like the others
                for blk in blocks:
                    if blk.gdn_rows == "seq":
                        blk.gdn_rows = "chain"
            return out, need
        if len(pblocks) == 1 and blocks:   # one prompt chunk: the mixed bucket that holds it, if captured
            replayed = self._replay_mixed(blocks, pblocks[0], N)
            if replayed is not None:
                self.stats.mixed_steps += 1
                return replayed
        t0 = time.perf_counter()
        inp, kv, need = assemble(allb, self.cache.max_seq, dev)
        flat = [i for n in need for i in n]
        preds = m.greedy_batch(inp, self.cache, kv, rows=torch.tensor(flat, device=dev)).tolist()
        full = [0] * len(inp.tokens)
        for i, p in zip(flat, preds):
            full[i] = p
        if self.runner is not None:
            self.stats.eager_steps += 1
            self.stats.eager_seconds += time.perf_counter() - t0
        return full, need

    def _finish_lattice(self, r: Request) -> None:
        """Fill each recorded step's target from the request's committed tokens."""
        if not r.record_lattice:
            return
        for x in r.lattice:
            if "_at" in x:
                at, mm = x.pop("_at"), x.pop("_m")
                x["target"] = r.full[at:at + max(mm + 1, 1)]
                if len(r.output) > at:   # what the step could deliver: replay caps its tau there
                    x["remaining"] = len(r.output) - at

    # ---- batch runs (``run --batch``) -------------------------------------------------
    def generate_many(self, requests: list[Request], progress=None) -> list[GenerationResult]:
        """Run ``requests`` to the end on this thread; request i joins at scheduler iteration
        ``requests[i].arrival_step`` (0 = at once). Results in the same order."""
        for r in requests:
            self.check(r)
        with torch_threads(self.threads):
            pending = sorted(requests, key=lambda r: r.arrival_step)
            it, done = 0, 0
            while pending or not self.idle():
                while pending and pending[0].arrival_step <= it:
                    self.submit(pending.pop(0))
                if not self.step() and pending:
                    it = pending[0].arrival_step
                    continue
                it += 1
                if progress is not None:
                    now = sum(1 for r in requests if r.done and r.slot is None)
                    if now > done:
                        progress(now - done)
                        done = now
        return [result_of(r) for r in requests]


def result_of(r: Request) -> GenerationResult:
    """A finished request as the one-request decoder's :class:`GenerationResult` (``seconds``: from
    arrival; ``prefill_seconds``: time to the first token)."""
    end = r.t_done or time.perf_counter()
    first = (r.t_first - r.t_arrival) if r.t_first is not None else 0.0
    out = list(r.output)
    tau = (len(out) - 1) / r.steps if r.steps else 1.0
    res = GenerationResult(out, r.steps, tau, end - r.t_arrival, list(r.lattice), first, list(r.accepts),
                           r.stop_reason)
    if r.tlv is not None:   # counts only: the phases' time belongs to the batched steps
        res.tlv = r.tlv.to_json(timed=False)
    return res


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation) or None for no data."""
    return float(np.percentile(xs, q)) if xs else None
