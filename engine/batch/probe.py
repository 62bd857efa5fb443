"""T_step(B, N): one batched verify step of B requests x N rows at a given context (``probe rows
--batch B``). Each request has its own cache slot holding ``context`` tokens; its N rows attend to
them and causally to each other; LM head and argmax included. On CUDA each N is a captured graph
of the batched step (:mod:`.graphs`; a hybrid's where its GDN layers run the row kernels), timed
with CUDA events; elsewhere, or with ``graphs=False``, an eager step (CUDA events around the
launches: the host's launch time counts where the GPU waits for it; the wall clock on the CPU).
c(N) = T(B, N) / T(B, 1): the batched AR step is the reference.
"""

from __future__ import annotations

import statistics

import torch

from specpilot.engine.batch.cache import BatchCache
from specpilot.engine.batch.step import Rows, assemble
from specpilot.errors import InputError


def chain_rows(B: int, N: int, context: int, vocab: int, gen) -> list[Rows]:
    """B requests (slots 0..B-1) of N random rows each at positions context.., causal among themselves."""
    import numpy as np

    local = np.tril(np.ones((N, N), dtype=bool))
    out = []
    for b in range(B):
        toks = torch.randint(0, vocab, (N,), generator=gen).tolist()
        out.append(Rows(b, toks, list(range(context, context + N)), list(range(context, context + N)), context, local,
                        "chain", None, tuple(range(N))))
    return out


def step_path(model) -> str:
    """The path a batched step runs, whatever its rows (:meth:`Transformer.hidden_batch`): ``fused``
    where the fused kernels take batched steps (``decode=fused``), else ``layers``."""
    from specpilot.engine.fused_verify import takes_batch

    return "fused" if takes_batch(model) else "layers"


def measure_rows_batched(model, batch: int, rows: list[int], context: int, reps: int = 50, warmup: int = 5,
                         progress=None, graphs: bool = True):
    """Median step time per row count N for ``batch`` requests (cache of >= context + max(rows) slots);
    ``graphs=False`` times eager steps where graphs would run."""
    from specpilot.engine.rows import RowsResult, faster_than_ar_warning, fill_random, slower_ar_warning
    from specpilot.machine import cpu_name

    if context < 1:
        raise InputError(f"--context must be >= 1, got {context}")
    if context + max(rows) > model.max_seq:
        raise InputError(f"context {context} + {max(rows)} rows exceed the cache ({model.max_seq} slots)")
    cuda = model.device.type == "cuda"
    from specpilot.engine.batch.graphs import replays

    graphs = graphs and cuda and replays(model)
    cache = BatchCache(model, batch)
    gen = torch.Generator(device="cpu").manual_seed(0)
    fill_random([t for lc in cache.layers for t in (lc.k, lc.v) if t is not None], gen, progress)   # non-zero KV
    order = sorted(set(rows) | {1})
    times = {}
    it = order if progress is None else progress(order, total=len(order), desc="rows", unit="N")
    for N in it:
        # a process's first step pays for allocation and lazy set-up: never time it (as measure_rows)
        warm = max(warmup, 1) if N == order[0] else warmup
        blocks = chain_rows(batch, N, context, model.spec.vocab_size, gen)
        if graphs:
            from specpilot.engine.batch.graphs import BatchGraphRunner
            from specpilot.engine.graphs import time_replays

            runner = BatchGraphRunner(model, cache)
            inp, _, _ = assemble(blocks, cache.max_seq, model.device, pad=(batch, N))
            runner.run(inp, batch, N)
            g = runner.graphs[(batch, N)][0]
            samples = time_replays(g, reps, warm)
            del runner, g
        else:
            inp, kv, _ = assemble(blocks, cache.max_seq, model.device)

            def once():
                model.greedy_batch(inp, cache, kv)
                for lc in cache.layers:
                    lc.stash.clear()

            from specpilot.engine.graphs import time_calls

            samples = time_calls(once, reps, warm, cuda)
        times[N] = statistics.median(samples)
    ar = times[1]
    path = step_path(model)
    points = [{"rows": N, "step_ms": times[N], "c": times[N] / ar, "path": path}
              for N in order if N in set(rows) or N == 1]
    gpu = torch.cuda.get_device_name(model.device) if cuda else None
    method = ("cuda graph per (requests, rows), CUDA events, median"
              + ("; hybrid: every verify row walks its GDN path" if model.spec.is_hybrid else "") if graphs else
              "eager, CUDA events, median" if cuda else "eager, wall clock, median")
    return RowsResult(model.spec.name, gpu, str(model.device), str(model.dtype).replace("torch.", ""), context, ar,
                      points, reps, method, cpu=None if cuda else cpu_name(),
                      ar_path=path,
                      warnings=[w for w in (slower_ar_warning(model), faster_than_ar_warning(points)) if w],
                      extra={"batch": batch, "ar_tokens_per_s": batch / ar * 1e3, "torch": torch.__version__,
                             "threads": torch.get_num_threads(), "warmup": warmup})


def probe_rows_batched(spec, rows: list[int], context: int, reps: int = 50, warmup: int = 5, progress=None):
    """:func:`measure_rows_batched` on the target ``spec`` describes, ``spec.batch`` requests."""
    from specpilot.engine.api import cpu_threads, load_target
    from specpilot.engine.rows import start
    from specpilot.machine import torch_threads

    max_seq = context + max(rows) + 64
    # the peak: the model's own one-request cache and the B slots' (a hybrid's spare one too) with
    # the rest that grows with the context, before either is made
    start(spec, max_seq, max(rows))
    threads = cpu_threads(spec) if spec.device == "cpu" else spec.threads   # as the engine runs
    with torch_threads(threads):
        target = load_target(spec, max_seq=max_seq)
        res = measure_rows_batched(target.model, spec.batch, rows, context, reps=reps, warmup=warmup,
                                   progress=progress)
    res.model = target.name
    res.extra.update({k: target.info[k] for k in ("w12", "attn", "head", "decode", "gdn", "deterministic")})
    return res
