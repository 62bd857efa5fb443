"""Tune the fused decode kernels where they run: inside the engine's AR step (CUDA graph, PDL chain).

The isolated sweep (benchmarks/decode_gemv.py, one kernel, L2 flushed) does not see how a config
overlaps with its neighbours under programmatic dependent launch. Here Llama-3.1-8B shapes with
random bf16 weights (context 1024, as engine_step_profile.py) take ``decode=fused``; for each of
the four kernels in turn (coordinate descent), each of the isolated sweep's best ``--top``
configs is put in the table, the AR step is captured and its replays timed (CUDA events, median),
and the fastest is kept. Prints the resulting ``TUNED`` table for kernels/decode/gemv.py.

    python benchmarks/decode_tune_engine.py [--top 6] [--reps 300] [--certified]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bootstrap  # noqa: E402

bootstrap()

from common import write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=6, help="candidates per kernel from results/decode_gemv.json")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--certified", action="store_true", help="with head=certified")
    args = ap.parse_args()
    import torch

    from specpilot.engine.graphs import GraphRunner, time_replays
    from specpilot.engine.model import Transformer
    from specpilot.kernels.decode import gemv
    from specpilot.models import load_model_spec

    sweep = json.loads((HERE / "results" / "decode_gemv.json").read_text())["rows"]
    spec = load_model_spec("llama-3.1-8b")
    context = 1024
    model = Transformer(spec, max_seq=context + 320, dtype=torch.bfloat16, device="cuda").init_random_fast(0).eval()
    model.set_attention("fused")
    model.set_head("certified" if args.certified else "linear")
    model.set_decode("fused")

    def parse(key):
        p, k, w, s = (int(v[1:]) for v in key.split("-"))
        return gemv.GemvConfig(p, k, w, s)

    def step_ms():
        runner = GraphRunner(model)
        g, _ = runner.ar_graph(context)
        ms = statistics.median(time_replays(g, args.reps))
        del runner, g
        return ms

    trials = []
    with torch.no_grad():
        base = step_ms()
        trials.append({"kernel": None, "config": "table", "step_ms": base})
        print(f"start: {base:.3f} ms/step", flush=True)
        for kind, n, k in (("silu", 28672, 4096), ("resid", 4096, 14336), ("rope", 6144, 4096), ("resid", 4096, 4096)):
            rows = sorted((r for r in sweep if r["kernel"] == kind and r["n"] == n and r["k"] == k and r["correct"]),
                          key=lambda r: r["fused_us"])[: args.top]
            best = (gemv.TUNED[(kind, n, k)], base)
            for r in rows:
                cfg = parse(r["config"])
                if cfg == best[0]:
                    continue
                gemv.TUNED[(kind, n, k)] = cfg
                ms = step_ms()
                trials.append({"kernel": kind, "n": n, "k": k, "config": cfg.key(), "isolated_us": r["fused_us"],
                               "step_ms": ms})
                print(f"{kind} {n}x{k} {cfg.key()}: {ms:.3f} ms/step", flush=True)
                if ms < best[1]:
                    best = (cfg, ms)
            gemv.TUNED[(kind, n, k)] = best[0]
            base = best[1]
            print(f"{kind} {n}x{k}: keep {best[0].key()} ({best[1]:.3f} ms/step)", flush=True)
    final = step_ms()
    table = {f"{kd}/{n}/{k}": c.key() for (kd, n, k), c in gemv.TUNED.items()}
    print("TUNED = {")
    for (kd, n, k), c in gemv.TUNED.items():
        print(f"    ({kd!r}, {n}, {k}): GemvConfig({c.pairs}, {c.block_k}, {c.warps}, {c.stages}),")
    print(f"}}  # final {final:.3f} ms/step")
    write_results("decode_tune_engine", trials, {"model": spec.name, "context": context, "head":
                                                 "certified" if args.certified else "linear",
                                                 "final_step_ms": final, "table": table,
                                                 "method": "AR step CUDA graph, CUDA events, median of "
                                                           f"{args.reps} replays"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
