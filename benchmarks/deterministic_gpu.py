"""Deterministic (row-invariant) steps on the GPU: do chain, tree and tlv give the AR mode's tokens
in bf16, and what do the row-invariant kernels cost, against the default kernels in the same run.

    SPECPILOT_GIT_SHA=<hash> python3 benchmarks/deterministic_gpu.py [--models qwen3.5-9b,llama-3.1-8b]

Random bf16 weights at each model's real shapes, CUDA graphs, one request, a 300-token prompt (150
random tokens twice: the n-gram drafter finds matches), 128 new tokens.

* ``tokens``: for ``deterministic=1`` and for the default kernels, AR's output and each speculative
  mode's (chain with the n-gram drafter; tree and tlv with a self drafter of every layer but the
  last, whose drafts are mostly the target's own greedy tokens, so long drafts are accepted and
  the deep rows of a tree decide tokens): whether it equals AR's, the first position where it does not, tau.
* ``speed``: AR decode tokens/s (``run --mode ar``'s figure) and ``probe rows`` (T_step(N) and
  c(N) against each path's own AR step) with and without ``deterministic``.

Writes results/deterministic_gpu.json (rewritten after each model).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bootstrap, print_table, write_results  # noqa: E402

bootstrap()

NEW = 128
ROWS = [1, 2, 4, 8, 16, 32, 64]
CONTEXT = 1024


def _prompt():
    import torch

    half = [int(t) for t in torch.randint(5, 20000, (150,), generator=torch.Generator().manual_seed(1))]
    return half + half


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _free():
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def run_model(model: str) -> tuple[list[dict], list[dict]]:
    from specpilot.engine.api import load_engine
    from specpilot.engine.rows import measure_rows
    from specpilot.models import load_model_spec

    layers = load_model_spec(model).num_layers
    prompt = _prompt()
    token_rows, speed_rows = [], []
    for det in (1, 0):
        base = f"engine:model={model},random=1,device=cuda,ctx=1536,deterministic={det}"
        t0 = time.perf_counter()
        e = load_engine(base + ",mode=ar")
        load_s = time.perf_counter() - t0
        e.generate(prompt, 16)   # a warm-up request, not measured
        ar = e.generate(prompt, NEW)
        probe = measure_rows(e.model, ROWS, CONTEXT, reps=30, warmup=5)
        speed_rows.append({"model": model, "deterministic": bool(det), "ar_path": probe.ar_path,
                           "ar_decode_tokens_per_s": round(ar.decode_tokens_per_second, 1),
                           "ar_step_ms": round(probe.ar_ms, 4), "load_seconds": round(load_s, 1),
                           "points": [{"rows": p["rows"], "step_ms": p["step_ms"], "c": p["c"]} for p in probe.points]})
        del e
        _free()
        token_rows.append({"model": model, "deterministic": bool(det), "mode": "ar", "drafter": None,
                           "equal_to_ar": True, "first_difference": None, "tau": 1.0, "tokens": len(ar.output_ids)})
        modes = [("chain", "ngram", ",drafter=ngram,depth=8"),
                 ("tree", "self(all layers but the last)", f",drafter=self,draft_layers={layers - 1},nodes=32,depth=8"),
                 ("tlv", "self(all layers but the last)", f",drafter=self,draft_layers={layers - 1},nodes=32,depth=8")]
        if not det:
            modes = modes[1:2]       # the default kernels' baseline: the mode whose deep rows decide tokens
        for mode, drafter, extra in modes:
            e = load_engine(base + f",mode={mode}{extra}")
            r = e.generate(prompt, NEW)
            diff = _first_difference(r.output_ids, ar.output_ids)
            token_rows.append({"model": model, "deterministic": bool(det), "mode": mode, "drafter": drafter,
                               "equal_to_ar": diff is None, "first_difference": diff, "tau": round(r.tau, 3),
                               "tokens": len(r.output_ids)})
            del e
            _free()
    return token_rows, speed_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3.5-9b,llama-3.1-8b")
    args = ap.parse_args()
    tokens, speed = [], []
    for model in args.models.split(","):
        t, s = run_model(model)
        tokens += t
        speed += s
        write_results("deterministic_gpu", tokens, {"new_tokens": NEW, "context_for_probe": CONTEXT, "speed": speed})
        print_table(t, ["model", "deterministic", "mode", "drafter", "equal_to_ar", "first_difference", "tau"])
        print_table([{k: v for k, v in r.items() if k != "points"} | {f"c({p['rows']})": p["c"] for p in r["points"]}
                     for r in s], ["model", "deterministic", "ar_path", "ar_decode_tokens_per_s", "ar_step_ms"]
                    + [f"c({n})" for n in ROWS])


if __name__ == "__main__":
    main()
