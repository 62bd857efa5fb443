"""The AR decode loop's steps one by one: what the loop's mean step time holds beyond the step graph.

``benchmarks/verify_step.py`` reports AR tokens/s from the loop's wall time and, per rows bucket,
the median GPU time of a step. Where the mean is above the median, some steps are slow; this prints
how they are spread over the loop: percentiles of the steps' GPU and wall ms, the mean of every
32-step window, the slowest steps with their index, and the SM clock and power over the run
(``engine/clocks.py``).
Llama-3.1-8B shapes, random weights, a 1000-token prompt, 256 new tokens twice, bf16 and, with
``--w12``, the same weights converted to W12.

    python lab/verify/ar_steps.py [--w12] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, write_results  # noqa: E402


def summarize(weights: str, run: int, res) -> dict:
    gpu = [t[1] for t in res.step_times]
    wall = [t[2] for t in res.step_times]
    q = statistics.quantiles(gpu, n=100)
    order = sorted(range(len(gpu)), key=lambda i: -gpu[i])[:6]
    return {"weights": weights, "run": run, "tokens_per_s": res.decode_tokens_per_second,
            "gpu_mean": statistics.fmean(gpu), "gpu_p50": q[49], "gpu_p10": q[9], "gpu_p90": q[89],
            "gpu_max": max(gpu), "wall_mean": statistics.fmean(wall), "wall_p50": statistics.median(wall),
            "windows_gpu": [round(statistics.fmean(gpu[i:i + 32]), 3) for i in range(0, len(gpu), 32)],
            "slowest": [(i, round(gpu[i], 3), round(wall[i], 3)) for i in order]}


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--w12", action="store_true")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    import torch

    from lab.verify.step_parts import random_target
    from specpilot.engine.clocks import ClockWatch
    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner

    torch.set_grad_enabled(False)
    model = random_target("llama-3.1-8b", 1400)
    prompt = [(977 * i + 13) % 120000 for i in range(1000)]
    rows = []
    for weights in ["bf16"] + (["w12"] if args.w12 else []):
        if weights == "w12":
            from specpilot.engine.w12_loader import convert_engine_model

            convert_engine_model(model)
        model.set_decode("fused")
        dec = Decoder(model, "ar", runner=GraphRunner(model))
        dec.warm_up()
        for run in range(2):
            with ClockWatch(model.device) as watch:
                res = dec.generate(prompt if run == 0 else prompt[::-1], args.tokens)
            row = summarize(weights, run, res)
            row["gpu_clocks"] = watch.summary()
            rows.append(row)
            print(row, flush=True)
        del dec
        torch.cuda.empty_cache()
    write_results("ar_steps", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
