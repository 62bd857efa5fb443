"""``specpilot compare --gpus 0,1`` for real, on a machine with two GPUs (the lent 2 x H200).

    python benchmarks/compare_two_gpus.py          # -> results/compare_two_gpus.json

The workload (``--worker``) is a fixed amount of bf16 matmul work on the GPU it is given, timed
inside the process with CUDA events; it prints ``{"items_per_s": ...}`` on its last line, so
``--metric items_per_s`` excludes Python start-up. Cases, each a full ``specpilot compare`` run with
``--gpus 0,1`` (both systems at once, one per GPU, then swapped):

* A/A: the same command on both sides (must not be approved);
* a candidate doing 3% less work (the issue's "true 3% gain").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bootstrap, environment, print_table, write_results  # noqa: E402

STEPS = 400


def worker(work: float) -> None:
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    n = int(round(STEPS * work))
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        a @ b
    e.record()
    e.synchronize()
    secs = s.elapsed_time(e) / 1e3
    # "items": the base's work per run, so less work per run reads as higher throughput
    print(json.dumps({"items_per_s": STEPS / secs, "gpu": torch.cuda.get_device_name(0)}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", default="12")
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return 0
    bootstrap()
    me = f"{sys.executable} {Path(__file__).resolve()}"
    cases = [("A/A", 1.0, 1.0), ("candidate 3% less work", 1.0, 0.97)]
    rows = []
    for name, wb, wc in cases:
        t = time.time()
        cmd = [sys.executable, "-m", "specpilot", "compare", "--base-cmd", f"{me} --worker {wb}", "--candidate-cmd", f"{me} --worker {wc}",
               "--metric", "items_per_s", "--gpus", "0,1", "--runs", args.runs, "--format", "json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        try:
            doc = json.loads(p.stdout)
        except json.JSONDecodeError:
            rows.append({"case": name, "exit": p.returncode, "error": (p.stderr or p.stdout)[-400:]})
            print(rows[-1], flush=True)
            continue
        rows.append({"case": name, "true_gain": round(wb / wc, 4), "exit": p.returncode, "gain": doc.get("gain"),
                     "ci_low": doc.get("ci_low"), "ci_high": doc.get("ci_high"), "noise": doc.get("noise"),
                     "threshold": doc.get("threshold"), "approved": doc.get("approved"),
                     "pairs": len(doc.get("samples", doc.get("pairs", [])) or []),
                     "plan": doc.get("plan"), "seconds": round(time.time() - t, 1)})
        print({k: rows[-1][k] for k in ("case", "gain", "ci_low", "noise", "approved", "seconds")}, flush=True)
        write_results("compare_two_gpus", rows, {"partial": True})
    write_results("compare_two_gpus", rows, {"command": "specpilot compare --gpus 0,1 --metric items_per_s",
                                            "workload": f"{STEPS} bf16 4096^3 matmuls per base run, CUDA events"})
    print_table(rows, ["case", "true_gain", "gain", "ci_low", "noise", "threshold", "approved", "seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
