"""TLV on a GPU (Hopper: H100, H200): the Q pass against the exact pass of the same rows, and the cycle's time split.

    SPECPILOT_GIT_SHA=<hash> python3 benchmarks/tlv_gpu.py [--configs llama-bf16,llama-w12,qwen-bf16,...]

For each target (random weights, std 0.02; Llama-3.1-8B shapes in bf16 with a W12 copy for the Q
pass and with W12 weights; Qwen3.5-9B shapes in bf16), with the Q pass's W12 view (``qview=w12``)
and with its e4m3 copy (``qview=fp8``, the ``-fp8`` configs), the engine ``specpilot run --mode
tlv`` loads
(``load_engine``: self-drafter of 2 layers, 32 nodes, depth 8, top-4, CUDA graphs for both passes):

* the Q pass's CUDA graph against the exact pass's graph at 8, 16, 32 and 33 rows (the same inputs,
  CUDA events, median of ``--reps`` replays), and the AR step's graph beside them;
* a 1000-token prompt and ``--max-new`` TLV tokens: the cycle's split (draft 1, Q pass, draft 2,
  exact pass, append; wall ms), tau per exact pass, the Q pass's top-1 agreement with the exact
  pass, decode tokens/s, against an AR decode of the same prompt on the same model and graphs;
  whether TLV's tokens equal AR's (bf16 on the GPU: the verify GEMMs may round unlike the AR
  step's, so a near tie can flip): the first mismatch, AR's two candidates' logits there, and a
  tree run's first mismatch on the same model beside it.

Random weights accept almost nothing (tau near 1) and agree less between the passes than trained
weights do: this measures time, not acceptance. The paper's H100 split for a 27B target is in the
results' ``paper_h100_split_ms``. Writes results/tlv_gpu.json.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap  # noqa: E402

bootstrap()

from common import print_table, section, write_results  # noqa: E402
from hybrid_gpu import logit_gap  # noqa: E402
from verify_step import FixedDrafter  # noqa: E402

CONFIGS = {"llama-bf16": ("llama-3.1-8b", False, "w12"), "llama-w12": ("llama-3.1-8b", True, "w12"),
           "qwen-bf16": ("qwen3.5-9b", False, "w12"), "llama-bf16-fp8": ("llama-3.1-8b", False, "fp8"),
           "llama-w12-fp8": ("llama-3.1-8b", True, "fp8"), "qwen-bf16-fp8": ("qwen3.5-9b", False, "fp8")}
Q_VIEWS = {("w12", True): "the target's W12 records", ("w12", False): "a W12 copy of the bf16 projections",
           ("fp8", True): "an e4m3 copy of the W12 projections", ("fp8", False): "an e4m3 copy of the bf16 projections"}
PAPER_SPLIT = {"draft1": 1.05, "qpass": 11.5, "draft2": 1.05, "exact": 14.9, "append": 1.6}
GRAPH_ROWS = (8, 16, 32, 33)   # 33: a 32-node tree and its pending token, the cycle's own passes


def graph_ms(runner, dec, rows: int, n_cache: int, reps: int) -> float:
    """Median ms of ``reps`` replays of ``runner``'s graph of ``rows`` rows, its inputs a best-first
    tree of ``rows - 1`` nodes (the fixed random lattice of ``verify_step.FixedDrafter``) under the
    pending token at ``n_cache``."""
    from specpilot.engine.graphs import time_replays
    from specpilot.kernels import tree as treelib

    lat = FixedDrafter(dec.model.spec.vocab_size).lattice
    tree = treelib.build_best_first(lat.tokens, lat.logprobs, lat.transitions, rows - 1)
    runner.run(*dec.padded_rows(5, tree, n_cache, rows))
    return statistics.median(time_replays(runner.get(rows)[0], reps))


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def measure(name: str, args) -> dict:
    import torch

    from specpilot.engine.api import load_engine
    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import time_replays

    model, w12, qview = CONFIGS[name]
    t0 = time.perf_counter()
    e = load_engine(f"engine:model={model},random=1,mode=tlv,drafter=self,draft_layers=2,nodes={args.nodes},"
                    f"depth=8,topk=4,device=cuda,ctx={args.prompt_len + args.max_new + 128},w12={int(w12)},"
                    f"qview={qview}")
    load_s = time.perf_counter() - t0
    dec = e.decoder
    V = e.model.spec.vocab_size
    rnd = random.Random(0)
    prompt = [rnd.randrange(V) for _ in range(args.prompt_len)]
    tlv = dec.generate(prompt, args.max_new)
    ar = Decoder(e.model, "ar", runner=dec.runner).generate(prompt, args.max_new)
    tree = Decoder(e.model, "tree", dec.drafter, nodes=args.nodes, depth=8, topk=4, runner=dec.runner
                   ).generate(prompt, args.max_new)
    same = tlv.output_ids == ar.output_ids
    first = first_mismatch(tlv.output_ids, ar.output_ids)
    first_tree = first_mismatch(tree.output_ids, ar.output_ids)
    n_cache = args.prompt_len
    graphs = []
    for rows in GRAPH_ROWS:
        q = graph_ms(dec.qrunner, dec, rows, n_cache, args.reps)
        x = graph_ms(dec.runner, dec, rows, n_cache, args.reps)
        graphs.append({"rows": rows, "qpass_ms": q, "exact_ms": x, "q_over_exact": q / x})
    ar_ms = statistics.median(time_replays(dec.runner.ar_graph(n_cache, 5)[0], args.reps))
    st = tlv.tlv
    row = {"config": name, "model": model, "weights": "w12" if w12 else "bf16", "qview": qview,
           "q_view": Q_VIEWS[qview, w12],
           "q_view_extra_gb": dec.qview.extra_bytes() / 1e9, "load_s": load_s,
           "warmup_s": e.info.get("warmup_seconds"), "ar_step_ms": ar_ms, "graphs": graphs,
           "cycle_ms": st["time_ms"], "cycle_total_ms": st["cycle_ms"], "tau_per_exact_pass": tlv.tau,
           "q_top1_agreement": st["q_top1_agreement"], "mean_commit_chain": st["mean_commit_chain"],
           "cycles": st["cycles"], "tlv_decode_tokens_per_s": tlv.decode_tokens_per_second,
           "ar_decode_tokens_per_s": ar.decode_tokens_per_second, "equals_ar": same, "first_mismatch": first,
           "tree_first_mismatch": first_tree, "step_timing": tlv.step_timing()}
    if first is not None:   # how close AR's two candidates were there (a bf16 rounding tie, or a bug)
        row["at_mismatch"] = logit_gap(e.model, prompt + ar.output_ids[:first], ar.output_ids[first],
                                       tlv.output_ids[first])
    print_table(graphs, ["rows", "qpass_ms", "exact_ms", "q_over_exact"])
    print({k: row.get(k) for k in ("cycle_ms", "tau_per_exact_pass", "q_top1_agreement", "tlv_decode_tokens_per_s",
                                   "ar_decode_tokens_per_s", "equals_ar", "first_mismatch", "tree_first_mismatch",
                                   "at_mismatch", "ar_step_ms")}, flush=True)
    del e, dec
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown config {bad[0]!r}; choose from {', '.join(CONFIGS)}")
    rows = []
    meta = {"nodes": args.nodes, "depth": 8, "topk": 4, "drafter": "self, 2 layers", "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new, "reps": args.reps, "weights_init": "random, std 0.02",
            "paper_h100_split_ms": PAPER_SPLIT, "paper_q_over_exact": PAPER_SPLIT["qpass"] / PAPER_SPLIT["exact"]}
    errors = []
    for name in names:
        row = section(name, lambda: measure(name, args), errors)
        if row is not None:
            rows.append(row)
        write_results("tlv_gpu", rows, dict(meta, errors=errors))   # after each config: a time-out keeps the rest


if __name__ == "__main__":
    main()
