"""The decode loop: AR, chain (stock) and best-first tree verification, greedy and lossless
(the TLV cycle, ``engine/tlv.py``, builds on :meth:`Decoder.verify_tree`).

Bookkeeping per request: the KV cache holds the committed tokens except the last one, the
*pending* token (committed, not yet run through the target). A step feeds the pending token as
row 0 and the draft nodes as rows 1..n at slots ``n_cache + row`` and positions
``n_cache + 1 + depth``; row i attends to the committed cache plus its own root path. The
target's argmax at each row decides acceptance; the accepted rows' KV is moved to consecutive
slots and GDN layers commit by snapshot (chain) or replay (tree).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specpilot.engine.drafters import Lattice
from specpilot.engine.model import Transformer
from specpilot.engine.spec import MAX_CTX, cache_room, request_rows, room_words
from specpilot.engine.step_input import StepInput
from specpilot.errors import InputError
from specpilot.kernels import tree as treelib
from specpilot.kernels.gdn.path import row_paths
from specpilot.machine import torch_threads


def check_request(prompt_ids, max_new_tokens: int, vocab: int, need, slots: int, least_new: int = 1, *,
                  mode: str) -> None:
    """InputError for a request no decoder can run: an empty prompt, a token outside the
    vocabulary, fewer new tokens than ``least_new`` (a decoder makes at least one; ``serve``
    answers a request for none itself), or more cache slots (``need``, or ``need(prompt_len,
    max_new_tokens)`` once both are known to be whole numbers) than the decoder has (``slots``; the
    slots past the tokens are named for ``mode``). Token ids and counts must be integers (a library
    caller's text or float is refused here, not failed on deep in a step)."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__") \
            or not all(integer_like(t) for t in prompt_ids):
        raise InputError("prompt_ids must be a sequence of integer token ids (text goes through the tokenizer: "
                         "Engine.run takes {'text': ...})")
    if not integer_like(max_new_tokens):
        raise InputError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if len(prompt_ids) == 0:
        raise InputError("empty prompt: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    if max_new_tokens < least_new:
        raise InputError(f"max_new_tokens must be >= {least_new}, got {max_new_tokens}")
    if callable(need):
        need = need(len(prompt_ids), max_new_tokens)
    if need > slots:
        fix = ("raise ctx= in the engine spec, or run and serve's --ctx" if need <= MAX_CTX else
               f"more than any ctx= holds, {MAX_CTX}: lower the new tokens or shorten the prompt")
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + {max_new_tokens} new tokens + "
                         f"{need - len(prompt_ids) - max_new_tokens} slots for {room_words(mode)} need {need} cache "
                         f"slots; the engine has {slots} ({fix})")


def integer_like(v) -> bool:
    """An int or an integer scalar (numpy, a 0-d tensor), not a bool."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


@dataclass
class GenerationResult:
    output_ids: list[int]
    steps: int  # target forward passes after prefill (verification passes)
    tau: float  # output tokens per verification pass (prefill token excluded)
    seconds: float  # wall time of the whole request (prefill included)
    lattice_steps: list[dict] = field(default_factory=list)
    prefill_seconds: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # draft tokens accepted per step
    stop_reason: str = "length"  # "length" or "eos"
    # per step: rows, GPU ms (CUDA events; None off CUDA), wall ms, drafting ms, verify ms, Q-pass ms
    step_times: list[tuple] = field(default_factory=list)
    tlv: dict | None = None  # mode tlv: the cycles' statistics (engine/tlv.py TLVStats.to_json)

    def step_timing(self) -> dict | None:
        """The decode loop's steps: wall time per loop iteration split into drafting (tree build
        included), the verify forward and the rest (acceptance, KV compaction, GDN commit, host);
        on CUDA also GPU time per step (CUDA events from the step's input copies to the end of its
        graph) and the outside time (wall - GPU). Per rows (the graph bucket a step ran) the
        median GPU ms and the mean verify ms."""
        return step_timing(self.step_times)

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        dt = self.seconds - self.prefill_seconds
        return (len(self.output_ids) - 1) / dt if dt > 0 and len(self.output_ids) > 1 else 0.0


def step_timing(times: list[tuple]) -> dict | None:
    """Summary of the per-step tuples (rows, GPU ms or None, wall ms[, drafting ms, verify ms,
    Q-pass ms]) (:meth:`GenerationResult.step_timing`). GPU fields only when every step has one."""
    if not times:
        return None
    import statistics

    n = len(times)
    wall = sum(t[2] for t in times) / n
    out = {"steps": n, "wall_ms": wall}
    cuda = all(t[1] is not None for t in times)
    if cuda:
        gpu = sum(t[1] for t in times) / n
        out.update({"gpu_ms": gpu, "outside_ms": wall - gpu})
    split = all(len(t) >= 6 for t in times)
    if split:
        draft, verify, qpass = (sum(t[i] for t in times) / n for i in (3, 4, 5))
        out.update({"draft_ms": draft, "verify_ms": verify, "rest_ms": wall - draft - verify - qpass})
        if qpass:
            out["qpass_ms"] = qpass
    by = {}
    for t in times:
        by.setdefault(t[0], []).append(t)
    out["by_rows"] = []
    for r, v in sorted(by.items()):
        row = {"rows": r, "steps": len(v)}
        if cuda:
            row["gpu_ms"] = statistics.median(t[1] for t in v)
        if split:
            row["verify_ms"] = sum(t[4] for t in v) / len(v)
        out["by_rows"].append(row)
    return out


# prompt lengths a warm-up prefills: every Triton specialisation class of the step kernels (1 row, a
# multiple of 16, other; 16/32/64-row tiles) and a long prompt's chunks
WARMUP_PROMPTS = (1, 5, 16, 17, 40, 64, 600)


def row_buckets(rows: int, least: int = 1) -> list[int]:
    """The row counts CUDA graphs are captured for up to ``rows`` (powers of two, then ``rows``
    itself), none below ``least``: a pass pads to the smallest that holds it."""
    top = max(least, rows)
    return sorted({b for b in (2, 4, 8, 16, 32, 64, 128, 256) if least <= b < top} | {top})


def _kv_len(max_seq: int, n: int) -> int:
    return min(max_seq, ((n + 63) // 64) * 64)


class Decoder:
    """Runs one request at a time on ``model`` with ``drafter`` (None for AR); ``mode`` is one of
    ``EngineSpec``'s modes (ar, chain, tree; tlv is :class:`specpilot.engine.tlv.TLVDecoder`)."""

    def __init__(self, model: Transformer, mode: str = "ar", drafter=None, *, nodes: int = 32, depth: int = 8,
                 topk: int = 8, eos_ids=(), runner=None):
        if mode != "ar" and drafter is None:
            raise InputError(f"mode {mode} needs a drafter")
        self.model, self.mode, self.drafter = model, mode, drafter
        self.nodes, self.depth, self.topk = nodes, depth, topk if mode in ("tree", "tlv") else 1
        self.eos_ids = set(eos_ids or ())
        self.runner = runner  # optional CUDA-graph runner: AR steps, and verify steps padded to a bucket
        self.verify_buckets = row_buckets(self.verify_rows())
        self.threads = 0  # > 0: torch CPU threads while generating (restored afterwards)
        # prompt rows per prefill forward: chunks bound the torch attention's score memory; the fused
        # attention kernel holds no scores, so there a prompt of up to 2048 rows goes in one forward
        fused_attn = all(getattr(b.mixer, "fused", True) for b in model.layers) and model.device.type == "cuda"
        self.prefill_chunk = 2048 if fused_attn else 512
        self._times = None   # CUDA: (rows, start event, end event, ...) of the request's steps
        self._verify = None  # (rows, wall ms) of the last verify forward
        self._draft_ms = 0.0  # drafting + tree build of the last step
        self._qpass_ms = 0.0  # a TLV cycle's Q pass (engine/tlv.py sets both for its step)

    def _sync(self):
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def warm_up(self) -> float:
        """Compile and capture at load what a request can hit (CUDA): the AR graph, every verify
        bucket's graph and its commit graphs, and short generations over :data:`WARMUP_PROMPTS`
        (prefill chunks, the drafter, eager steps); returns the seconds taken (0 off CUDA). The
        generations leave the cache dirty; a request's prefill overwrites what it reads."""
        m = self.model
        if m.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        if self.runner is not None:
            self.runner.get(1)
            if self.mode != "ar":
                for b in self.verify_buckets:
                    self.runner.get(b)
                # accepted rows: the pending token and a root path of the tree (TLV: C, up to depth + 1
                # nodes, and a path of the subtree under it)
                most = 2 * self.depth + 2 if self.mode == "tlv" else self.depth + 1
                self.runner.capture_commits(self.verify_buckets, most, self.mode in ("tree", "tlv"))
        V = m.spec.vocab_size
        for n in WARMUP_PROMPTS:
            if self.capacity_needed(n, 4) <= m.max_seq:
                self.generate([(7 * i) % 31 % V for i in range(n)], 4)
        self._sync()
        return time.perf_counter() - t0

    def verify_rows(self) -> int:
        """The most rows a verification pass of this mode feeds (the pending token included)."""
        return request_rows(self.mode, self.nodes, self.depth)

    def capacity_needed(self, prompt_len: int, max_new: int) -> int:
        return prompt_len + max_new + cache_room(self.mode, self.nodes, self.depth)

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> int:
        m, dev = self.model, self.model.device
        n = len(prompt_ids)
        m.reset()
        ids = torch.tensor(prompt_ids, device=dev)
        # chunks bound the attention scores' memory ([heads, chunk, kv] fp32) on long prompts
        for a in range(0, n, self.prefill_chunk):
            b = min(n, a + self.prefill_chunk)
            pos = torch.arange(a, b, device=dev)
            kv = _kv_len(m.max_seq, b)
            mask = torch.arange(kv, device=dev)[None] <= pos[:, None]
            inp = StepInput(ids[a:b], pos, pos, mask, "seq")
            if b < n:
                m.hidden(inp, kv_len=kv)    # fills the cache; only the last chunk's last row is read
            else:
                first = m.greedy(inp, kv_len=kv, last=True)
        return int(first[0])

    @torch.no_grad()
    def step(self, context: list[int], n_cache: int, mode: str,
             room: int | None = None) -> tuple[list[int], Lattice, "treelib.DraftTree"]:
        """One verification pass; returns (committed tokens incl. bonus, lattice, tree). ``room``:
        the tokens the request can still take; nodes deeper than it could use are not verified
        (the lattice is returned whole)."""
        pending = context[-1]
        t0 = time.perf_counter()
        if mode == "ar":
            lat, tree = Lattice.empty(), treelib.chain_tree([])
        else:
            lat = self.drafter.propose(context, n_cache, self.depth, self.topk)
            if mode == "chain":
                tree = treelib.chain_tree(lat.top1(), [r[0] for r in lat.logprobs])
            else:
                tree = treelib.build_best_first(lat.tokens, lat.logprobs, lat.transitions, self.nodes)
            if room is not None:
                tree = treelib.within_depth(tree, room - 1)
        self._draft_ms = (time.perf_counter() - t0) * 1e3
        _, toks = self.verify_tree(pending, tree, n_cache, mode)
        return toks, lat, tree

    def verify_tree(self, pending: int, tree, n_cache: int, mode: str) -> tuple[list[int], list[int]]:
        """Verify ``tree`` under the pending token with the exact weights, accept the longest
        matching root path plus the bonus token and commit it (KV compaction, GDN state); returns
        (accepted node indices, committed tokens)."""
        return self.accept_commit(tree, self.verify_predictions(pending, tree, n_cache, mode), n_cache, mode)

    def verify_predictions(self, pending: int, tree, n_cache: int, mode: str) -> list[int]:
        """The target's argmax after the pending token and after every node of ``tree`` (one
        pass that writes the rows' KV into the slots after the committed prefix). On CUDA the
        step's events bracket the device work: a graph step's inputs are built on the host
        before its start event (that time is outside the step, as the tree build is)."""
        T = 1 + len(tree)
        t0 = time.perf_counter()
        timed = self._times is not None
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if T > 1 and self.runner is not None:
            rows = next(b for b in self.verify_buckets if b >= T)
            preds = self._graph_verify(pending, tree, n_cache, (start, end) if timed else None)
        else:
            rows = T
            if timed:
                start.record()
            if self.runner is not None:
                preds = [self.runner.ar_step(pending, n_cache)]
            else:
                preds = self._eager_verify(pending, tree, n_cache, mode)
            if timed:
                end.record()
        # the predictions are host lists, so the wall clock has waited for the forward
        self._verify = (rows, (time.perf_counter() - t0) * 1e3)
        if timed:
            self._times.append((rows, start, end))
        return preds

    def accept_commit(self, tree, preds: list[int], n_cache: int, mode: str) -> tuple[list[int], list[int]]:
        """Accept from the exact pass's ``preds`` and keep the accepted rows (KV, GDN state)."""
        m = self.model
        path, toks = treelib.accept_predictions(tree, preds)
        rows = [0] + [1 + p for p in path]
        if len(tree):
            gdn_rows = "tree" if mode in ("tree", "tlv") else "chain"
            if self.runner is None or not self.runner.commit(n_cache, rows, gdn_rows):
                m.commit(n_cache, rows, gdn_rows)
        return path, toks

    @staticmethod
    def _verify_mask(tree, n_cache: int, rows: int, width: int, pin: bool = False) -> torch.Tensor:
        """bool [rows, width] (CPU; ``pin``: in pinned memory, for an asynchronous copy): row 0 (the
        pending token) and the ``len(tree)`` node rows attend the committed cache, the root and
        their ancestors; rows past them (graph padding) attend slot 0 only. Filled through numpy:
        a torch op per slice costs more host time than the whole fill."""
        T = 1 + len(tree)
        mask = torch.empty(rows, width, dtype=torch.bool, pin_memory=pin)
        a = mask.numpy()
        a.fill(False)
        a[:T, :n_cache + 1] = True
        if len(tree):
            a[1:T, n_cache + 1:n_cache + T] = treelib.ancestor_mask(tree)
        a[T:, 0] = True
        return mask

    def _eager_verify(self, pending: int, tree, n_cache: int, mode: str, keep_state: bool = False) -> list[int]:
        """The verify pass of ``1 + len(tree)`` rows as one eager forward (no CUDA graph);
        ``keep_state``: a lone row runs as a one-row chain, so no GDN state advances (the Q pass)."""
        m, dev = self.model, self.model.device
        T = 1 + len(tree)
        kv = _kv_len(m.max_seq, n_cache + T)
        slots = n_cache + torch.arange(T, device=dev)
        pos = torch.tensor([n_cache] + [n_cache + 1 + d for d in tree.depth], device=dev)
        mask = self._verify_mask(tree, n_cache, T, kv)
        tree_rows = mode in ("tree", "tlv") and len(tree)
        gdn_rows = "tree" if tree_rows else ("chain" if T > 1 or keep_state else "seq")
        paths = row_paths([-1] + [p + 1 for p in tree.parents]) if gdn_rows == "tree" else None
        tokens = torch.tensor([pending] + list(tree.tokens), device=dev)
        return m.greedy(StepInput(tokens, pos, slots, mask.to(dev), gdn_rows, paths), kv_len=kv).tolist()

    def _graph_verify(self, pending: int, tree, n_cache: int, events=None) -> list[int]:
        """The verify pass of ``1 + len(tree)`` rows replayed from the CUDA graph of the smallest
        bucket that holds them (:meth:`padded_rows`); ``events`` (start, end): recorded around the
        device work, after the inputs are built on the host."""
        T = 1 + len(tree)
        inputs = self.padded_rows(pending, tree, n_cache, next(b for b in self.verify_buckets if b >= T))
        if events:
            events[0].record()
        out = self.runner.run(*inputs)
        if events:
            events[1].record()
        return out[:T].tolist()

    def padded_rows(self, pending: int, tree, n_cache: int, rows: int):
        """The inputs (tokens, pos, slots, mask over the whole cache, GDN paths or None) of a pass over
        the pending token and ``tree`` padded to ``rows`` rows, as host tensors (pinned on CUDA:
        :meth:`GraphRunner.run` copies them without a host round trip). Padding rows sit after the
        tree (slots and cache positions no real row attends), attend to slot 0 only, walk only
        themselves in GDN layers, and their predictions are dropped; the KV they write lies past the
        committed prefix and is overwritten by later steps."""
        pin = self.model.device.type == "cuda"
        T = 1 + len(tree)
        ids = torch.empty(3, rows, dtype=torch.long, pin_memory=pin)
        a = ids.numpy()
        a[0, 0], a[0, 1:T], a[0, T:] = pending, tree.tokens, 0
        a[1, 0], a[1, 1:T], a[1, T:] = n_cache, treelib.positions(tree, n_cache + 1), n_cache
        a[2] = np.arange(n_cache, n_cache + rows)
        mask = self._verify_mask(tree, n_cache, rows, self.model.max_seq, pin)
        paths = None
        if self.model.spec.is_hybrid:
            paths = row_paths([-1] + [p + 1 for p in tree.parents] + [-1] * (rows - T))
            paths = paths.pin_memory() if pin else paths
        return ids[0], ids[1], ids[2], mask, paths

    def generate(self, prompt_ids: list[int], max_new_tokens: int, record_lattice: bool = False,
                 request=0) -> GenerationResult:
        with torch_threads(self.threads):
            return self._generate(prompt_ids, max_new_tokens, record_lattice, request)

    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Refuse a request this decoder cannot run (InputError)."""
        check_request(prompt_ids, max_new_tokens, self.model.spec.vocab_size, self.capacity_needed,
                      self.model.max_seq, mode=self.mode)

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], max_new_tokens: int, record_lattice: bool = False,
                  request=0) -> GenerationResult:
        self.check(prompt_ids, max_new_tokens)
        prompt_ids = [int(t) for t in prompt_ids]
        if self.drafter is not None:
            self.drafter.reset(self.model, prompt_ids)
        self._sync()
        t0 = time.perf_counter()
        first = self.prefill(prompt_ids)
        self._sync()
        t_prefill = time.perf_counter() - t0
        full = [first]  # every committed token after the prompt (may run past the limit)
        n_cache = len(prompt_ids)
        steps, accepts, lattice = 0, [], []
        stop, limit = "length", max_new_tokens
        if first in self.eos_ids:
            stop, limit = "eos", 1
        self._times = [] if self.model.device.type == "cuda" else None
        walls, splits = [], []
        if (self.mode == "ar" and self.runner is not None and hasattr(self.runner, "ar_graph") and not record_lattice
                and len(full) < limit):
            toks, stop, limit, walls = self._ar_pipelined(first, n_cache, limit, stop)
            full.extend(toks)
            steps, accepts, splits = len(toks), [0] * len(toks), [(1, 0.0, None, 0.0)] * len(toks)
        while len(full) < limit:
            t_step = time.perf_counter()
            ctx = prompt_ids + full
            self._draft_ms, self._qpass_ms, self._verify = 0.0, 0.0, None
            toks, lat, tree = self.step(ctx, n_cache, self.mode, limit - len(full))
            rows, verify = self._verify or (1, 0.0)
            splits.append((rows, self._draft_ms, verify, self._qpass_ms))
            if record_lattice:
                lattice.append(self.lattice_row(request, steps, lat, len(full)))
            steps += 1
            accepts.append(len(toks) - 1)
            n_cache += len(toks)
            start = len(full)
            full.extend(toks)
            for i, t in enumerate(toks):
                if t in self.eos_ids and start + i < limit:
                    stop, limit = "eos", start + i + 1
                    break
            walls.append((time.perf_counter() - t_step) * 1e3)
        self._sync()
        seconds = time.perf_counter() - t0
        times, self._times = self._times, None
        # a step's entry: (rows, start, end[, start, end of more device work: TLV's Q pass])
        gpu = ([sum(t[i].elapsed_time(t[i + 1]) for i in range(1, len(t), 2)) for t in times] if times
               else [None] * len(walls))
        step_times = [(rows, g, w, draft, g if verify is None else verify, qpass)
                      for g, w, (rows, draft, verify, qpass) in zip(gpu, walls, splits)]
        out = full[:limit]
        if record_lattice:
            # fill each step's target from the committed stream; extend it by plain AR where the
            # last steps need more tokens than the request produced (target >= m + 1 tokens)
            need_len = max((r["_at"] + r["_m"] + 1 for r in lattice), default=0)
            while len(full) < need_len and n_cache + 2 < self.model.max_seq:
                toks, _, _ = self.step(prompt_ids + full, n_cache, "ar")
                n_cache += len(toks)
                full.extend(toks)
            for r in lattice:
                at, mm = r.pop("_at"), r.pop("_m")
                r["target"] = full[at:at + max(mm + 1, 1)]
                r["remaining"] = limit - at   # what the step could deliver: replay caps its tau there
        # tau: tokens the verification passes delivered (the prefill's first token excluded), per pass;
        # tokens a last pass committed past EOS or the limit are not counted (accept_lengths keeps them)
        tau = (len(out) - 1) / steps if steps else 1.0
        return GenerationResult(out, steps, tau, seconds, lattice, t_prefill, accepts, stop, step_times,
                                self.request_summary())

    # AR steps queued ahead of the host: EOS is read this many steps late (the extra steps' tokens
    # are dropped), so the GPU never waits for the host between steps
    AR_LAG = 4

    def _ar_pipelined(self, first: int, n_cache: int, limit: int, stop: str):
        """AR decoding through the runner's one-row graph without a host round trip per step: after
        each replay the next step's inputs are advanced on the device (the argmax becomes the next
        token, position and slot move on, the mask opens one more slot) and the token is copied to
        pinned host memory; the host reads tokens ``AR_LAG`` steps behind to find EOS. Returns
        (tokens after ``first``, stop reason, limit, per-step wall ms)."""
        g, out = self.runner.ar_graph(n_cache, first)
        inp = self.runner.get(1)[1]
        n = limit - 1                       # tokens still to produce
        host = torch.empty(n, dtype=torch.long, pin_memory=True)
        ends, toks = [], []
        t0 = time.perf_counter()
        launched = 0
        while len(toks) < n:
            if launched < n:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                self._times.append((1, a, b))
                host[launched].copy_(out[0], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                ends.append(done)
                inp.tokens.copy_(out[:1])
                inp.pos.add_(1)
                inp.slots.add_(1)
                inp.mask.index_fill_(1, inp.pos, True)
                launched += 1
            if launched < n and launched - len(toks) <= self.AR_LAG:
                continue
            ends[len(toks)].synchronize()
            t = int(host[len(toks)])
            toks.append(t)
            if t in self.eos_ids:
                stop, limit = "eos", len(toks) + 1
                break
        self._sync()
        del self._times[len(toks):]        # steps queued past EOS
        wall = (time.perf_counter() - t0) * 1e3 / max(len(toks), 1)
        return toks, stop, limit, [wall] * len(toks)

    def lattice_row(self, request, step: int, lat: Lattice, at: int) -> dict:
        """The ``specpilot.lattice/1`` row of the step just run; ``target`` is filled at the end of
        the request from the ``_m`` + 1 committed tokens after position ``_at``."""
        return {"schema": "specpilot.lattice/1", "request": request, "step": step, "tokens": lat.tokens,
                "logprobs": lat.logprobs, "transitions": lat.transitions, "target": None, "_at": at, "_m": lat.m}

    def request_summary(self) -> dict | None:
        """Mode-specific statistics of the request just generated (None here; TLV's cycles)."""
        return None
