"""A verify step's commit through the runner's commit graphs against the eager commit, in one
process: decode loops of chain and tree steps on random Qwen3.5-9B shapes (or ``--model``), the
same prompt, interleaved, with the per-step split of ``Decoder.step_timing`` (the commit is in
``rest_ms``) and the commit's own host and device time.

    python lab/decode/commit_graphs.py [--model qwen3.5-9b] [--modes chain,tree] [--reps 2]

Results: ``lab/results/commit_graphs.json`` (and ``$OUT``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import print_table, write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--modes", default="chain,tree")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    import torch

    from specpilot.engine.api import load_engine
    from specpilot.engine.model import Transformer

    rows = []
    for mode in args.modes.split(","):
        e = load_engine(f"engine:model={args.model},random=1,mode={mode},drafter=self,draft_layers=2,nodes=32,"
                        f"depth=8,topk=4,device=cuda,ctx={args.prompt_len + args.max_new + 128}")
        dec, runner = e.decoder, e.decoder.runner
        V = e.model.spec.vocab_size
        rnd = random.Random(0)
        prompt = [rnd.randrange(V) for _ in range(args.prompt_len)]
        graph_commit = runner.commit
        eager_model_commit = Transformer.commit
        host: dict[str, list] = {"graph": [], "eager": []}

        def timed(kind, fn):
            def call(*a):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = fn(*a)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host[kind].append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
                return r
            return call

        outs = {}
        for rep in range(args.reps):
            for kind in ("graph", "eager"):
                runner.commit = graph_commit if kind == "graph" else (lambda *a: False)
                r = e.generate(prompt, args.max_new)
                st = r.step_timing()
                outs.setdefault(kind, r.output_ids)
                rows.append({"mode": mode, "commit": kind, "rep": rep, "tokens_per_s": r.decode_tokens_per_second,
                             "steps": r.steps, "wall_ms": st["wall_ms"], "gpu_ms": st["gpu_ms"],
                             "draft_ms": st["draft_ms"], "verify_ms": st["verify_ms"], "rest_ms": st["rest_ms"]})
                print(rows[-1], flush=True)
        # the commit alone: one more loop of each with the commit timed (synchronised around it)
        for kind in ("graph", "eager"):
            runner.commit = timed("graph", graph_commit) if kind == "graph" else (lambda *a: False)
            Transformer.commit = timed("eager", eager_model_commit) if kind == "eager" else eager_model_commit
            e.generate(prompt, args.max_new)
        Transformer.commit = eager_model_commit
        for kind in ("graph", "eager"):
            rows.append({"mode": mode, "commit": kind, "rep": "commit alone", "commits": len(host[kind]),
                         "commit_host_ms": statistics.median(h for h, _ in host[kind]),
                         "commit_total_ms": statistics.median(t for _, t in host[kind])})
        rows.append({"mode": mode, "same_outputs": outs["graph"] == outs["eager"]})
        del e, dec, runner
        torch.cuda.empty_cache()
    write_results("commit_graphs", rows, {"model": args.model, "prompt_len": args.prompt_len,
                                          "max_new_tokens": args.max_new})
    print_table([r for r in rows if "wall_ms" in r],
                ["mode", "commit", "rep", "tokens_per_s", "wall_ms", "draft_ms", "verify_ms", "rest_ms"])
    print_table([r for r in rows if "commit_host_ms" in r], ["mode", "commit", "commits", "commit_host_ms",
                                                             "commit_total_ms"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
