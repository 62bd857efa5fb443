"""Where an eager batched step's time goes: ``B`` decoding requests x 1 row plus one prompt chunk of
``P`` rows (what prompt admission puts into a verify step; such a step runs without bucket graphs),
its wall time as the scheduler runs it (assembly, the forward, the argmax copy) against the same
forward replayed from a CUDA graph (the device's share), and the host's profile of the eager
forward (cProfile: the functions with the most own time and the most cumulative time).

    python lab/batch/eager_profile.py [--model llama-3.1-8b] [--batch 16] [--prompt 96] [--reps 20]

Llama-3.1-8B shapes, random bf16, context 1024 per decoding request.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, write_results  # noqa: E402


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch

    from lab.verify.step_parts import random_cache, random_target
    from specpilot.engine.batch.probe import chain_rows
    from specpilot.engine.batch.step import assemble, prefill_rows
    from specpilot.engine.graphs import capture, time_replays

    ctx, B, P = 1024, args.batch, args.prompt
    model = random_target(args.model, ctx)
    cache = random_cache(model, B + 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, model.spec.vocab_size, (P,), generator=gen).tolist()
    blocks = chain_rows(B, 1, ctx, model.spec.vocab_size, gen) + [prefill_rows(B, prompt, 0, P, True)]
    dev = model.device

    def step():
        inp, kv, need = assemble(blocks, cache.max_seq, dev)
        flat = [i for n in need for i in n]
        return model.greedy_batch(inp, cache, kv, rows=torch.tensor(flat, device=dev)).tolist()

    for _ in range(3):   # compile
        step()
    torch.cuda.synchronize()
    walls, asm = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        assemble(blocks, cache.max_seq, dev)
        torch.cuda.synchronize()
        asm.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t0) * 1e3)

    inp, kv, need = assemble(blocks, cache.max_seq, dev)
    rows = torch.tensor([i for n in need for i in n], device=dev)
    g, _ = capture(lambda: model.greedy_batch(inp, cache, kv, rows=rows), 2)
    graph_ms = statistics.median(time_replays(g, args.reps, 5))

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25)
        out[key] = buf.getvalue()
        print(f"---- cProfile, 5 eager steps, by {key}\n{out[key]}", flush=True)
    row = {"model": args.model, "batch": B, "prompt_rows": P, "rows": B + P, "context": ctx,
           "eager_step_ms": statistics.median(walls), "assemble_ms": statistics.median(asm),
           "graph_replay_ms": graph_ms}
    print(row, flush=True)
    write_results("eager_profile", [row], {"profile": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
