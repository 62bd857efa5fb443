"""What a hybrid's verify buckets hold in GPU memory, and what they cost a step: the GDN layers'
projection and conv rows (what a walking bucket's commit reads) in buffers every bucket shares
(``shared``, the product) against each bucket keeping its own rows in its graph memory (``own``:
the runner with no shared buffers, the walk as it was).

Qwen3.5-9B shapes, random bf16, ``--batch`` requests: the buckets a tree-mode decoder with a
shared ``--nodes``-node budget captures at load (every request bucket x every row bucket), each
variant on its own runner over one cache; per variant the memory the captures leave allocated,
the capture time, and the step time of ``--time-rows`` verify buckets at ``--batch`` requests
(CUDA events, median, the variants interleaved over ``--rounds``); both variants' replays must
give the same argmax.

    python lab/batch/bucket_memory.py [--batch 16] [--nodes 64] [--time-rows 4,8,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, parse_int_list, print_table, write_results  # noqa: E402


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--time-rows", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    time_rows = parse_int_list(args.time_rows, 2, 256, "bucket_memory: --time-rows")
    import torch

    from lab.verify.step_parts import random_cache, random_target
    from specpilot.engine.batch.graphs import BatchGraphRunner, sizes
    from specpilot.engine.batch.scheduler import BatchDecoder
    from specpilot.engine.graphs import time_replays

    torch.set_grad_enabled(False)
    model = random_target(args.model, args.context)
    cache = random_cache(model, args.batch)
    rows_per_request = BatchDecoder(model, "tree", "ngram", nodes=args.nodes, depth=8, topk=8, batch=args.batch,
                                    graphs=False).rows_per_request
    shapes = [(B, N) for B in sizes(args.batch) for N in sizes(rows_per_request)]
    walking = [(B, N) for B, N in shapes if N > 1]
    n_gdn = len(model.gdn_layers())
    runners, rows = {}, []
    for variant in ("own", "shared"):
        runner = BatchGraphRunner(model, cache)
        if variant == "own":
            runner._keep = lambda T: [None] * n_gdn
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        runner.prepare(shapes)
        torch.cuda.synchronize()
        rows.append({"variant": variant, "buckets": len(shapes), "walking_rows": sum(B * N for B, N in walking),
                     "held_gb": round((torch.cuda.memory_allocated() - before) / 1e9, 2),
                     "capture_s": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
        runners[variant] = runner
    same = all(torch.equal(runners["own"].replay(args.batch, N), runners["shared"].replay(args.batch, N))
               for N in time_rows)
    times = {(v, N): [] for v in runners for N in time_rows}
    for _ in range(args.rounds):
        for N in time_rows:
            for v, runner in runners.items():
                runner.replay(args.batch, N)
                times[(v, N)].append(statistics.median(time_replays(runner.graphs[(args.batch, N)][0], 50)))
    for row in rows:
        for N in time_rows:
            row[f"{args.batch}x{N}_ms"] = round(statistics.median(times[(row["variant"], N)]), 3)
        row["same_argmax"] = same
    print_table(rows, list(rows[0]))
    write_results("bucket_memory", rows, {"model": args.model, "batch": args.batch, "nodes": args.nodes,
                                          "context": args.context})
    return 0


if __name__ == "__main__":
    sys.exit(main())
