"""Tune the fused decode kernels where they run: inside the engine's AR step (CUDA graph, PDL chain).

The isolated sweep (lab/decode/sweep.py, one kernel, L2 flushed) does not see how a config
overlaps with its neighbours under programmatic dependent launch. Here Llama-3.1-8B shapes with
random bf16 weights (context 1024, as engine_step_profile.py) take ``decode=fused``; for each of
the four kernels in turn (coordinate descent), each of the isolated sweep's best ``--top``
configs is put in the table, the AR step is captured and its replays timed (CUDA events, median),
and the fastest is kept. Prints the resulting entries for ``kernels/decode/tuned/<arch>.json``.

    python lab/decode/tune_engine.py [--top 6] [--reps 300] [--certified]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import RESULTS, write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=6, help="candidates per kernel from lab/results/decode_sweep.json")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--certified", action="store_true", help="with head=certified")
    args = ap.parse_args()
    import torch

    from specpilot.engine.graphs import GraphRunner, time_replays
    from specpilot.engine.model import Transformer
    from specpilot.kernels.decode import gemv
    from specpilot.models import load_model_spec

    sweep = json.loads((RESULTS / "decode_sweep.json").read_text())["rows"]
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

    kernels = (("silu", 28672, 4096), ("resid", 4096, 14336), ("rope", 6144, 4096), ("resid", 4096, 4096))
    table = {key: gemv.config_for(*key) for key in kernels}
    table_config_for = gemv.config_for
    # the candidate in place of the table's config (the kernels ask config_for at capture)
    gemv.config_for = lambda epi, n, k, device=None: table.get((epi, n, k)) or table_config_for(epi, n, k, device)
    trials = []
    with torch.no_grad():
        base = step_ms()
        trials.append({"kernel": None, "config": "table", "step_ms": base})
        print(f"start: {base:.3f} ms/step", flush=True)
        for kind, n, k in kernels:
            rows = sorted((r for r in sweep if r["kernel"] == kind and r["n"] == n and r["k"] == k and r["correct"]),
                          key=lambda r: r["fused_us"])[: args.top]
            best = (table[(kind, n, k)], base)
            for r in rows:
                cfg = parse(r["config"])
                if cfg == best[0]:
                    continue
                table[(kind, n, k)] = cfg
                ms = step_ms()
                trials.append({"kernel": kind, "n": n, "k": k, "config": cfg.key(), "isolated_us": r["fused_us"],
                               "step_ms": ms})
                print(f"{kind} {n}x{k} {cfg.key()}: {ms:.3f} ms/step", flush=True)
                if ms < best[1]:
                    best = (cfg, ms)
            table[(kind, n, k)] = best[0]
            base = best[1]
            print(f"{kind} {n}x{k}: keep {best[0].key()} ({best[1]:.3f} ms/step)", flush=True)
    final = step_ms()
    entries = [{"kernel": "gemv", "epilogue": kd, "n": n, "k": k, "config": c.__dict__}
               for (kd, n, k), c in table.items()]
    for e in entries:   # for kernels/decode/tuned/<arch>.json
        print(json.dumps(e))
    print(f"final {final:.3f} ms/step")
    write_results("tune_engine", trials, {"model": spec.name, "context": context, "head":
                                          "certified" if args.certified else "linear",
                                          "final_step_ms": final, "entries": entries,
                                                 "method": "AR step CUDA graph, CUDA events, median of "
                                                           f"{args.reps} replays"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
