"""What a bucket's free slots cost: an AR step of n running requests in bucket (B, 1) (B > n: the
slots n..B-1 hold no request and get padding rows) with the padding rows writing at the free
slots' last cache positions against their first (``assemble(held=...)``, what the scheduler
lays out). The attention walks each slot's cache up to the highest position its rows write, so the
first layout reads a free slot's whole cache, the second one tile.

Llama-3.1-8B shapes, random bf16, every running request at ``--context`` tokens in a cache of
``--max-seq`` slots (2048: the engine's default), the bucket's CUDA graph replayed on each layout
(interleaved rounds, CUDA events, median); the real rows' argmax must match between layouts.
Measured (H200): 9 requests in bucket 16 5.22 -> 4.89 ms, 17 in bucket 32 6.17 -> 5.59 ms, same tokens.

    python lab/batch/free_slots.py [--cases 16x9,32x17] [--context 1024] [--max-seq 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, print_table, write_results  # noqa: E402


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--cases", default="16x9,32x17", help="BxN: bucket of B requests, N of them running")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from lab.verify.step_parts import random_cache, random_target
    from specpilot.engine.batch.graphs import BatchGraphRunner
    from specpilot.engine.batch.probe import chain_rows
    from specpilot.engine.batch.step import assemble
    from specpilot.engine.graphs import time_replays

    torch.set_grad_enabled(False)
    model = random_target(args.model, args.max_seq - 128)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for case in args.cases.split(","):
        B, n = (int(v) for v in case.split("x"))
        cache = random_cache(model, B)
        runner = BatchGraphRunner(model, cache)
        blocks = chain_rows(n, 1, args.context, model.spec.vocab_size, gen)
        cpu = torch.device("cpu")
        layouts = {"free slots at their last positions": assemble(blocks, cache.max_seq, cpu, pad=(B, 1))[0],
                   "free slots at their first positions": assemble(blocks, cache.max_seq, cpu, pad=(B, 1),
                                                                   held={s: 0 for s in range(n, B)})[0]}
        outs = {name: runner.run(inp, B, 1)[:n].tolist() for name, inp in layouts.items()}
        same = len({tuple(o) for o in outs.values()}) == 1
        g = runner.graphs[(B, 1)][0]
        times = {name: [] for name in layouts}
        for _ in range(args.rounds):
            for name, inp in layouts.items():
                runner.run(inp, B, 1)
                torch.cuda.synchronize()
                times[name].append(statistics.median(time_replays(g, 100)))
        for name, ts in times.items():
            rows.append({"bucket": B, "running": n, "layout": name, "step_ms": round(statistics.median(ts), 3),
                         "same_tokens": same})
            print(rows[-1], flush=True)
        del runner, cache
        torch.cuda.empty_cache()
    print_table(rows, ["bucket", "running", "layout", "step_ms", "same_tokens"])
    write_results("free_slots", rows, {"context": args.context, "max_seq": args.max_seq})
    return 0


if __name__ == "__main__":
    sys.exit(main())
