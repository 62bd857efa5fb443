"""Tune the fused decode kernels where they run: inside the engine's AR step (CUDA graph, PDL chain).

The isolated sweep (lab/decode/sweep.py, one kernel, L2 flushed) does not see how a config
overlaps with its neighbours under programmatic dependent launch. Here a catalog model's shapes
(``--model``, Llama-3.1-8B by default) with random bf16 weights (context 1024, as
engine_step_profile.py) take ``decode=fused``; for each GEMV shape of the step in turn
(coordinate descent), each candidate config is put in the table, the AR step is captured and its
replays timed (CUDA events, median), and the fastest is kept. Candidates: the isolated sweep's best
``--top`` configs where ``lab/results/decode_sweep.json`` has the shape, else :data:`CANDIDATES`
(the configs the table already holds for other shapes, and the default). Prints the resulting
entries for ``kernels/decode/tuned/<arch>.json``.

    python lab/decode/tune_engine.py [--model qwen3.5-9b] [--top 6] [--reps 300] [--certified]
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


CANDIDATES = ["p8-k512-w4-s2", "p8-k512-w8-s1", "p4-k1024-w4-s1", "p4-k1024-w4-s3", "p8-k1024-w8-s1",
              "p4-k512-w4-s2", "p8-k1024-w4-s2"]


def gemv_shapes(model) -> list[tuple[str, int, int]]:
    """The (epilogue, N, K) of every fused GEMV in the model's AR step, once each."""
    from specpilot.engine.gated_deltanet import GatedDeltaNet

    seen = []
    for blk in model.layers:
        m = blk.mixer
        if isinstance(m, GatedDeltaNet):
            shapes = [("plain", *m.in_proj.weight.shape), ("resid", *m.out_proj.weight.shape)]
        elif m.qk_norm or m.gate:
            shapes = [("plain", *m.wqkv.weight.shape), ("resid", *m.wo.weight.shape)]
        else:
            shapes = [("rope", *m.wqkv.weight.shape), ("resid", *m.wo.weight.shape)]
        shapes += [("silu", *blk.w13.weight.shape), ("resid", *blk.w2.weight.shape)]
        seen += [s for s in shapes if s not in seen]
    return seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--top", type=int, default=6, help="candidates per kernel from lab/results/decode_sweep.json")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--certified", action="store_true", help="with head=certified")
    args = ap.parse_args()
    import torch

    from specpilot.engine.graphs import GraphRunner, time_replays
    from specpilot.engine.model import Transformer
    from specpilot.kernels.decode import gemv
    from specpilot.models import load_model_spec

    sweep_file = RESULTS / "decode_sweep.json"
    sweep = json.loads(sweep_file.read_text())["rows"] if sweep_file.exists() else []
    spec = load_model_spec(args.model)
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

    kernels = gemv_shapes(model)
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
            rows = rows or [{"config": c, "fused_us": None} for c in CANDIDATES]
            best = (table[(kind, n, k)], base)
            for r in rows:
                cfg = parse(r["config"])
                if cfg == best[0]:
                    continue
                table[(kind, n, k)] = cfg
                try:
                    ms = step_ms()
                except Exception as e:   # a config the shape cannot take
                    print(f"{kind} {n}x{k} {cfg.key()}: {type(e).__name__}: {e}", flush=True)
                    continue
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
