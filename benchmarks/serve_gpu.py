"""``specpilot serve`` under load on the H200: closed loop at 1/8/32 clients (``--levels``), the
batched engine (``--batch 32``) side by side with the same engine unbatched (``--batch 1``).

    SPECPILOT_GIT_SHA=<hash> python3 benchmarks/serve_gpu.py [--max-new 128] [--prompt-len 512]

Llama-3.1-8B shapes, random bf16 weights, AR decoding, fixed random token-id prompts, streaming
requests with ignore_eos (every request generates --max-new tokens). Reports output tokens/s,
TTFT / ITL / end-to-end p50 and p99 per concurrency, and the throughput at the most clients
(``--levels``) over one client and over the unbatched server. Writes results/serve_gpu.json.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bootstrap, print_table, write_results  # noqa: E402
from serve_bench import sweep  # noqa: E402

bootstrap()


def summarize(tput: dict, levels: list[int]) -> dict:
    """Output tokens/s at the most clients over one client (batched server), and batched over
    unbatched at the most clients; ``tput``: (server, clients) -> tokens/s. None where a run is missing."""
    top = max(levels)

    def ratio(a, b):
        return tput[a] / tput[b] if a in tput and b in tput and tput[b] else None

    return {"top_clients": top, "scaling_top_vs_1": ratio(("batch 32", top), ("batch 32", 1)),
            "batched_vs_unbatched_at_top": ratio(("batch 32", top), ("batch 1", top))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--levels", default="1,8,32")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    rnd = random.Random(0)
    prompts = [[rnd.randrange(128256) for _ in range(args.prompt_len)] for _ in range(64)]
    base = ["--model", "llama-3.1-8b", "--random-weights", "--device", "cuda", "--mode", "ar",
            "--ctx", str(args.prompt_len + args.max_new + 64)]
    rows = sweep(base + ["--batch", "32"], prompts, levels, args.max_new, lambda c: max(4, 2 * c), "batch 32",
                 warmup=32)
    rows += sweep(base + ["--batch", "1"], prompts, levels, args.max_new, lambda c: max(4, min(2 * c, 16)),
                  "batch 1", warmup=2)
    summary = summarize({(r["server"], r["concurrency"]): r["output_throughput"] for r in rows}, levels)
    flat = [{"server": r["server"], "clients": r["concurrency"], "requests": r["completed"], "failed": r["failed"],
             "output_tokens_per_s": r["output_throughput"], "ttft_p50_ms": r["ttft_ms"]["p50"],
             "ttft_p99_ms": r["ttft_ms"]["p99"], "itl_p50_ms": r["itl_ms"]["p50"], "itl_p99_ms": r["itl_ms"]["p99"],
             "e2e_p50_ms": r["e2e_ms"]["p50"], "e2e_p99_ms": r["e2e_ms"]["p99"], "server_exit": r["server_exit"],
             "detail": r} for r in rows]
    write_results("serve_gpu", flat, {"model": "llama-3.1-8b (random bf16)", "mode": "ar",
                                      "max_new_tokens": args.max_new, "prompt_len": args.prompt_len,
                                      "summary": summary})
    print_table(flat, ["server", "clients", "output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms",
                       "e2e_p99_ms"])
    print(summary)


if __name__ == "__main__":
    main()
