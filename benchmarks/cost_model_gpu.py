"""The cost model closed on the H200: predicted against measured speedup for ar, chain, tree and tlv.

    SPECPILOT_GIT_SHA=<hash> python3 benchmarks/cost_model_gpu.py [--model llama-3.1-8b] [--prompts 4]

The procedure of ``cost_check.py`` (run, replay, probe rows, ``ceiling --check`` per mode) on random
weights of a catalog model's shapes (bf16, CUDA graphs, ``--prompts`` prompts of ``--prompt-len``
random token ids; the --model's vocabulary must hold ids 1000..30000): the self-drafter of 2 layers, tree and tlv at one node budget, at a 5%
tolerance. Random weights accept almost nothing (tau near 1), so this checks c(N), the drafting
and the outside time, not acceptance. Writes results/cost_model_gpu_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bootstrap, write_results  # noqa: E402
from cost_check import add_arguments, check_modes, work_dir  # noqa: E402

bootstrap()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run of a tiny model)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    add_arguments(ap, max_new=64, nodes="32", tolerance=0.05)
    args = ap.parse_args()
    budgets = [int(x) for x in args.nodes.split(",")]
    work = work_dir(args.keep, "cost_model_gpu_")
    prompts = work / "prompts.jsonl"
    rnd = random.Random(0)
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i,
                                           "prompt_ids": [rnd.randrange(1000, 30000) for _ in range(args.prompt_len)]})
                               + "\n" for i in range(args.prompts)))
    model = ["--model", args.model, "--random-weights", "--device", args.device]
    run_args = model + ["--drafter", "self", "--draft-layers", 2, "--depth", 8, "--topk", 4, "--prompts", prompts]
    meta = {"model": f"{args.model} shapes, random bf16 weights", "prompts": args.prompts,
            "prompt_len": args.prompt_len, "max_new_tokens": args.max_new, "dtype": "bfloat16",
            "drafter": "self, 2 layers", "depth": 8, "topk": 4, "tolerance": args.tolerance}
    out, meta = check_modes(work, run_args, model, budgets, args.max_new, args.tolerance, args.reps, meta)
    write_results(f"cost_model_gpu_{args.model.replace('.', '').replace('-', '_')}", out, meta)


if __name__ == "__main__":
    main()
