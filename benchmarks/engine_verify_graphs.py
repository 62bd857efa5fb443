"""A tree verify step of the embedded engine: CUDA-graph replay (padded to a row bucket) vs eager.

Llama-3.1-8B shapes with random bf16 weights, context 1024 in the cache, a fixed best-first tree
of ``--nodes`` nodes built from a synthetic lattice (depth 8, 4 candidates per position). For each
way the decoder can run the verify pass (``Decoder._graph_verify`` through ``GraphRunner``, or the
eager forward the decoder uses without graphs) it times the whole pass as the decoder sees it: the
host builds the inputs, the GPU runs the rows, the argmax per row comes back (CUDA-synchronised
wall clock, median of ``--reps``). Both are checked to give the same predictions first. Chain
verifies (depth + 1 rows) the same way.

    python benchmarks/engine_verify_graphs.py [--nodes 32] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap  # noqa: E402

bootstrap()

from common import print_table, write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--model", default="llama-3.1-8b")
    args = ap.parse_args()
    import torch

    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.model import StepInput, Transformer
    from specpilot.kernels import tree as treelib
    from specpilot.models import load_model_spec

    torch.set_grad_enabled(False)
    spec = load_model_spec(args.model)
    context = 1024
    m = Transformer(spec, max_seq=context + 2 * args.nodes + 64, dtype=torch.bfloat16, device="cuda")
    m.init_random_fast(0).eval()
    m.set_attention("fused")
    m.set_decode("auto")
    dev = m.device
    pos = torch.arange(context, device=dev)
    g = torch.Generator().manual_seed(0)
    m.hidden(StepInput(torch.randint(0, spec.vocab_size, (context,), generator=g, device="cpu").to(dev), pos, pos,
                       torch.arange(m.max_seq, device=dev)[None] <= pos[:, None], "seq"), kv_len=m.max_seq)
    lp = torch.log_softmax(torch.randn(args.depth, 4, generator=g), -1).tolist()
    toks = torch.randint(0, spec.vocab_size, (args.depth, 4), generator=g).tolist()
    trees = {"tree": treelib.build_best_first(toks, lp, None, args.nodes),
             "chain": treelib.chain_tree([t[0] for t in toks], [r[0] for r in lp])}
    rows = []
    for mode, tree in trees.items():
        dec = Decoder(m, mode, drafter=object(), nodes=args.nodes, depth=args.depth, runner=GraphRunner(m))
        pending, n = 7, context

        def graph():
            return dec._graph_verify(pending, tree, n)

        def eager():
            return dec._eager_verify(pending, tree, n, mode)

        a, b = graph(), eager()
        same = a == b
        res = {}
        for name, fn in (("graph", graph), ("eager", eager)):
            for _ in range(3):
                fn()
            ts = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e3)
            res[name] = statistics.median(ts)
        T = 1 + len(tree)
        rows.append({"mode": mode, "rows": T, "bucket": next(x for x in dec.verify_buckets if x >= T),
                     "graph_ms": round(res["graph"], 3), "eager_ms": round(res["eager"], 3),
                     "speedup": round(res["eager"] / res["graph"], 2), "same_predictions": same})
        print(rows[-1], flush=True)
    print_table(rows, ["mode", "rows", "bucket", "graph_ms", "eager_ms", "speedup", "same_predictions"])
    write_results("engine_verify_graphs", rows, {"model": spec.name, "dtype": "bfloat16", "context": context,
                                                 "decode": "fused" if m.fused_decode else "layers",
                                                 "method": "decoder verify pass, host inputs to host argmax, "
                                                           f"CUDA-synchronised wall clock, median of {args.reps}"})
    return 0 if all(r["same_predictions"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
