"""Continuous batching of a hybrid target on the H200: the batch decoder's tree-mode loop over
Qwen3.5-9B shapes (random bf16 weights), with the bucket CUDA graphs and without, and with a
batch's prompt chunks through the GDN layers in one variable-length pass or one request at a
time, in one process.

    python benchmarks/batch_hybrid_gpu.py [--batch 16] [--new 128] [--model qwen3.5-9b] [--device cuda]

``--batch`` requests decode together in tree mode (n-gram drafter, one 64-node budget shared by
the step, depth 8, top-8), each prompt a random 24-48 token pattern repeated three times so the
drafter proposes trees (random weights accept almost none: tau near 1, so this measures steps).
Per setting the decoder warms up as the engine does at load (every bucket graph captured, the
tree builder at every request bucket, a synthetic workload), then runs the requests twice: a
first request after load should be as fast as the tenth, so pass 1 should match pass 2. Per pass:
tokens/s over the pass (prefill included), verify steps, rows per verify step, steps run eagerly,
bucket graphs captured during the pass, prefill passes and their wall time; and whether the
settings gave the same tokens.

Writes results/batch_hybrid_gpu.json (``--device cpu --model tiny-hybrid`` is a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap  # noqa: E402

bootstrap()

from common import log, print_table, write_results  # noqa: E402


def build(model: str, device: str, ctx: int):
    """The engine's target as ``run --random-weights`` loads it (fused kernels on CUDA)."""
    from specpilot.engine.api import load_target
    from specpilot.engine.spec import EngineSpec

    return load_target(EngineSpec.parse(f"engine:model={model},random=1,device={device},ctx={ctx}")).model


def prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rnd = random.Random(1)
    return [[rnd.randrange(min(vocab, 32000)) for _ in range(24 + 8 * (i % 4))] * 3 for i in range(n)]


def loop(m, batch: int, new: int, graphs: bool, batch_prefill: bool) -> tuple[list[dict], list[list[int]]]:
    import torch

    from specpilot.engine.batch.requests import Request
    from specpilot.engine.batch.scheduler import BatchDecoder
    from specpilot.engine.batch.stats import BatchStats
    from specpilot.engine.gated_deltanet import GatedDeltaNet

    GatedDeltaNet.batch_prefill = batch_prefill
    dec = BatchDecoder(m, "tree", "ngram", nodes=64, depth=8, topk=8, batch=batch, graphs=graphs)
    ps, out, outputs = prompts(batch, m.spec.vocab_size), [], []
    cuda = m.device.type == "cuda"
    warm = dec.warm_up()
    log(f"graphs={graphs}: warm-up {warm:.1f} s, {len(dec.runner.graphs) if dec.runner else 0} bucket graphs")
    for p in range(2):
        dec.stats = BatchStats()
        reqs = [Request(ids, new, id=(p, i)) for i, ids in enumerate(ps)]
        before = set(dec.runner.graphs) if dec.runner is not None else set()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = dec.generate_many(reqs)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        st = dec.stats
        outputs = [r.output_ids for r in res]
        after = set(dec.runner.graphs) if dec.runner is not None else set()
        row = {"kind": "loop", "graphs": graphs, "batch_prefill": batch_prefill, "pass": p + 1, "batch": batch,
               "warm_up_s": warm, "seconds": dt,
               "tokens": st.tokens, "tokens_per_s": st.tokens / dt, "verify_steps": st.verify_steps,
               "rows_per_verify_step": st.verify_rows / max(1, st.verify_steps), "tau": st.tau(),
               "eager_steps": st.eager_steps, "prefill_passes": st.prefill_passes,
               "prefill_seconds": st.prefill_seconds,
               "bucket_graphs": len(after), "captured_in_pass": sorted(after - before),
               "graphs_captured_in_pass": len(after - before)}
        out.append(row)
        log(f"graphs={graphs} batch_prefill={batch_prefill} pass {p + 1}: {row['tokens_per_s']:.1f} tokens/s, "
            f"{st.verify_steps} verify steps, {row['rows_per_verify_step']:.1f} rows each, {st.eager_steps} eager, "
            f"{st.prefill_passes} prefill passes {st.prefill_seconds:.3f} s, "
            f"{len(row['captured_in_pass'])} graphs captured")
    del dec
    if cuda:
        torch.cuda.empty_cache()
    return out, outputs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    args = ap.parse_args()
    import torch

    torch.set_grad_enabled(False)
    m = build(args.model, args.device, ctx=256 + args.new + 128)
    rows, outs = [], {}
    for graphs, batch_prefill in ((True, True), (True, False), (False, True)):
        got, outs[graphs, batch_prefill] = loop(m, args.batch, args.new, graphs and m.device.type == "cuda",
                                                batch_prefill)
        rows += got
    same = outs[True, True] == outs[False, True]
    same_prefill = outs[True, True] == outs[True, False]
    extra = {"model": f"{args.model} (random {'bf16' if m.device.type == 'cuda' else 'fp32'})",
             "mode": "tree, ngram drafter, shared 64-node budget, depth 8, top-8",
             "new_tokens": args.new, "outputs_equal_graphs_vs_eager": same,
             "outputs_equal_batch_prefill_vs_per_request": same_prefill}
    write_results("batch_hybrid_gpu", rows, extra)
    print_table(rows, ["graphs", "batch_prefill", "pass", "warm_up_s", "tokens_per_s", "verify_steps",
                       "prefill_passes", "prefill_seconds", "eager_steps"])
    print(f"outputs equal with and without graphs: {same}; with the batch prefill and per request: {same_prefill}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
