"""Where a step's time goes, kernel by kernel, inside its CUDA graph: the fused AR step (1 row), one
request's verify steps of 16 and 32 rows, and a batched AR step of 16 requests, Llama-3.1-8B
shapes (random bf16, context 1024) on the GPU.

Each step's graph is replayed under the PyTorch profiler (CUPTI sees the kernels inside graph
replays), one replay at a time with an idle millisecond between them, so the kernels split into
steps by that gap. Per step: its span (first kernel start to last kernel end), the kernels' summed
time (more than the span where programmatic dependent launch overlaps neighbours), and per kernel
class (GEMM, attention, small row kernels, LM head, argmax, other) the summed time and count; then
the ten longest kernels by name. What a multi-row step loses against the AR step shows up as a
class that grows, or as span not covered by kernels (launch gaps).

    python lab/verify/step_kernels.py [--replays 10] [--trace-dir DIR] [--cases 1x1,16x1] [--variant warpk:8]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, write_results  # noqa: E402

CLASSES = [("lm_head+argmax", r"argmax|_head"), ("attention", r"attn|attention|split_kv|merge"),
           ("gemm", r"gemm|gemv|xmma|cutlass|sm90|skinny|Kernel2|splitK|_mma|ampere|matmul"),
           ("rows", r"rms|norm|rope|silu|store|_rows")]


def classify(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name, re.I):
            return cls
    return "other"


def steps_of(trace: dict, gap_us: float = 300.0) -> list[list[dict]]:
    """The trace's GPU kernels split into replays at idle gaps longer than ``gap_us``."""
    ks = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    out, cur, end = [], [], None
    for k in ks:
        if end is not None and k["ts"] - end > gap_us:
            out.append(cur)
            cur = []
        cur.append(k)
        end = max(end or 0.0, k["ts"] + k["dur"])
    if cur:
        out.append(cur)
    return out


def summarize(label: str, steps: list[list[dict]]) -> dict:
    steps = steps[1:] if len(steps) > 2 else steps   # the first replay after profiling starts is cold
    per = defaultdict(list)
    names = defaultdict(float)
    spans, busy, counts = [], [], []
    for st in steps:
        spans.append(max(k["ts"] + k["dur"] for k in st) - min(k["ts"] for k in st))
        busy.append(sum(k["dur"] for k in st))
        counts.append(len(st))
        cls = defaultdict(float)
        for k in st:
            cls[classify(k["name"])] += k["dur"]
            names[k["name"][:90]] += k["dur"] / len(steps)
        for c, v in cls.items():
            per[c].append(v)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    row = {"step": label, "span_us": med(spans), "kernel_us": med(busy), "kernels": med(counts),
           **{f"{c}_us": med(v) for c, v in sorted(per.items())},
           "top": sorted(([n, round(v, 1)] for n, v in names.items()), key=lambda x: -x[1])[:12]}
    return row


def profile_graph(g, replays: int, trace_path: Path | None) -> list[list[dict]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
            time.sleep(0.002)
    path = trace_path or Path("/tmp/step_kernels_trace.json")
    prof.export_chrome_trace(str(path))
    return steps_of(json.loads(path.read_text()))


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--cases", default="1x1,1x16,1x32,16x1", help="BxN: B requests of N rows (B=1: one request)")
    ap.add_argument("--variant", default="product", help="a lab/verify/step_parts.py variant to profile")
    args = ap.parse_args()
    import torch

    from lab.verify.step_parts import random_target, step_graph, variant

    torch.set_grad_enabled(False)
    ctx = 1024
    model = random_target(args.model, ctx)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tdir = Path(args.trace_dir) if args.trace_dir else None
    if tdir:
        tdir.mkdir(parents=True, exist_ok=True)
    rows = []
    caches = {}
    for case in args.cases.split(","):
        B, T = (int(v) for v in case.split("x"))
        label = f"1 request x {T} rows" if B == 1 else f"{B} requests x {T} rows"
        with variant(args.variant):
            runner, g = step_graph(model, B, T, ctx, caches, gen)
            rows.append(summarize(label, profile_graph(g, args.replays, tdir and tdir / f"b{B}r{T}.json")))
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "top"}, flush=True)
        del runner, g
    for r in rows:
        print(f"\n{r['step']}: span {r['span_us']:.0f} us, kernels {r['kernel_us']:.0f} us ({r['kernels']} kernels)")
        for n, v in r["top"]:
            print(f"  {v:8.1f}  {n}")
    write_results("step_kernels", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
