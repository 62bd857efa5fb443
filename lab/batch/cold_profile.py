"""Where the first pass of a batched hybrid tree loop spends its time on the GPU: Triton compiles
(kernel, constexprs, seconds), bucket graph captures (B, N, seconds), and the slow steps.

    python lab/batch/cold_profile.py [--batch 16] [--new 96] [--model qwen3.5-9b]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab.common import bootstrap  # noqa: E402

bootstrap()

COMPILES: list[tuple[str, str, float]] = []


def hook_triton() -> None:
    import triton.compiler as tc
    import triton.compiler.compiler as tcc

    real = tcc.compile

    def timed(src, *a, **k):
        t0 = time.perf_counter()
        out = real(src, *a, **k)
        fn = getattr(src, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", str(fn))
        cx = {str(key): v for key, v in (getattr(src, "constants", None) or getattr(src, "constexprs", {}) or {}).items()}
        COMPILES.append((name, json.dumps(cx, default=str)[:300], time.perf_counter() - t0))
        return out

    tc.compile = timed
    tcc.compile = timed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warm", action="store_true", help="run the decoder's load-time warm-up first")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    hook_triton()
    import torch

    from specpilot.engine.batch import graphs as bg
    from specpilot.engine.batch.requests import Request
    from specpilot.engine.batch.scheduler import BatchDecoder

    from batch_hybrid_gpu import build, prompts   # benchmarks/ (on the path through lab.common)

    torch.set_grad_enabled(False)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    m = build(args.model, args.device, ctx=256 + args.new + 128)
    load = time.perf_counter() - t0
    n_load = len(COMPILES)
    captures = []
    real_capture = bg.BatchGraphRunner._capture

    def cap(self, B, N):
        t = time.perf_counter()
        c0 = len(COMPILES)
        out = real_capture(self, B, N)
        sync()
        captures.append((B, N, time.perf_counter() - t, len(COMPILES) - c0))
        return out

    bg.BatchGraphRunner._capture = cap
    dec = BatchDecoder(m, "tree", "ngram", nodes=64, depth=8, topk=8, batch=args.batch, graphs=True)
    if args.warm:
        c0 = len(COMPILES)
        print(f"warm-up {dec.warm_up():.1f} s, {len(COMPILES) - c0} compiles")
        n_load = len(COMPILES)
    steps = []
    real_step = BatchDecoder.step

    def step(self):
        t = time.perf_counter()
        c0 = len(COMPILES)
        r = real_step(self)
        sync()
        steps.append((time.perf_counter() - t, len(COMPILES) - c0, self.stats.verify_steps, self.stats.eager_steps))
        return r

    BatchDecoder.step = step
    for p in range(2):
        c0, s0 = len(COMPILES), len(steps)
        reqs = [Request(ids, args.new, id=(p, i)) for i, ids in enumerate(prompts(args.batch, m.spec.vocab_size))]
        sync()
        t = time.perf_counter()
        dec.generate_many(reqs)
        sync()
        dt = time.perf_counter() - t
        comp = COMPILES[c0:]
        print(f"pass {p + 1}: {dt:.1f} s, {len(steps) - s0} steps, {len(comp)} compiles "
              f"({sum(c[2] for c in comp):.1f} s)")
        slow = sorted(steps[s0:], reverse=True)[:12]
        print("  slowest steps (s, compiles, verify_steps, eager):", [(round(a, 2), b, c, d) for a, b, c, d in slow])
        for name, cx, sec in comp:
            print(f"  compiled {name} {sec:.2f} s {cx[:200]}")
    print(f"load {load:.1f} s with {n_load} compiles ({sum(c[2] for c in COMPILES[:n_load]):.1f} s)")
    print("captures (B, N, s, compiles):", [(b, n, round(s, 2), c) for b, n, s, c in captures])
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, cx, s in COMPILES[n_load:]:
        by[name][0] += 1
        by[name][1] += s
    print("compiles after load by kernel (count, s):")
    for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name}: {n} x, {s:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cold_profile.json"), "w") as f:
        json.dump({"load_s": load, "compiles": COMPILES, "captures": captures, "steps": steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
