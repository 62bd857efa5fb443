"""The cost model closed against ``specpilot run``: the procedure ``cost_model_cpu.py`` and
``cost_model_gpu.py`` share.

For ar, chain and, at each node budget, tree and tlv: ``specpilot run`` on the same prompts with its
lattice recorded; ``specpilot replay`` of that lattice with the run's own policy (``chain``,
``best-first:N``, ``tlv:N``); one ``specpilot probe rows`` over the row counts the runs verify, at
the runs' mean context; then ``specpilot ceiling --check RUN --replay --rows-probe --ar-run``. Each
row holds the predicted and the measured speedup over AR side by side, the error, the verdict at
the tolerance and the term ``--check`` names when it fails, with every term's two numbers, and
whether the run's outputs equal AR's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table

# the specpilot command of the interpreter running this script (its venv)
SPECPILOT = [str(Path(sys.executable).parent / "specpilot")]


def sp(*args, ok=(0,)) -> subprocess.CompletedProcess:
    p = subprocess.run([*SPECPILOT, *map(str, args)], capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"specpilot {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p


def add_arguments(ap, max_new: int, nodes: str, tolerance: float) -> None:
    """The options both scripts take: new tokens, node budgets, probe repetitions, tolerance, --keep."""
    ap.add_argument("--max-new", type=int, default=max_new)
    ap.add_argument("--nodes", default=nodes, help="node budgets for tree and tlv (comma list)")
    ap.add_argument("--reps", type=int, default=20, help="rows probe repetitions per row count (median)")
    ap.add_argument("--tolerance", type=float, default=tolerance)
    ap.add_argument("--keep", default=None, help="keep the run, lattice, replay and probe files in this folder")


def work_dir(keep: str | None, prefix: str) -> Path:
    work = Path(keep or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def check_modes(work: Path, run_args: list, probe_args: list, budgets: list[int], max_new: int,
                tolerance: float, reps: int, meta: dict) -> tuple[list[dict], dict]:
    """Run every mode with ``run_args`` (model, device, prompts, drafter...), probe rows with
    ``probe_args`` (model, device...), check each run; returns the rows and ``meta`` with the probe
    and the seconds taken added."""
    configs = [("ar", "ar", None, None), ("chain", "chain", None, "chain")]
    configs += [(f"tree N={n}", "tree", n, f"best-first:{n}") for n in budgets]
    configs += [(f"tlv N={n}", "tlv", n, f"tlv:{n}") for n in budgets]
    t_start = time.time()
    runs = {}
    for cname, mode, n, policy in configs:
        t0 = time.time()
        run, lat = work / f"{mode}{n or ''}.json", work / f"{mode}{n or ''}.jsonl"
        extra = ["--nodes", n] if n else []
        sp("run", *run_args, "--max-new-tokens", max_new, "--mode", mode, *extra, "--format", "json", "--out", run,
           *(["--lattice-out", lat] if policy else []))
        if policy:
            sp("replay", lat, "--policy", policy, "--format", "json", "--out", work / f"replay_{mode}{n or ''}.json")
        runs[cname] = (mode, n, policy, run, time.time() - t0)
        print(f"{cname}: run + replay {time.time() - t0:.0f} s", flush=True)

    docs = {k: json.loads(v[3].read_text()) for k, v in runs.items()}
    ar_doc = docs["ar"]
    prompt_len = sum(len(r["prompt_ids"]) for r in ar_doc["results"]) / len(ar_doc["results"])
    context = int(prompt_len + max_new / 2)
    max_rows = max(b["rows"] for d in docs.values() for b in d["step_timing"]["by_rows"])
    rows = sorted({1, 2, 4, 8, 16, 32, 64, max_rows} & set(range(1, max_rows + 1)) | {max_rows})
    t0 = time.time()
    probe = work / "rows.json"
    sp("probe", "rows", *probe_args, "--rows", ",".join(map(str, rows)), "--context", context, "--reps", reps,
       "--format", "json", "--out", probe)
    print(f"probe rows {rows} at context {context}: {time.time() - t0:.0f} s", flush=True)
    meta = dict(meta, probe_rows=rows, probe_context=context, probe=json.loads(probe.read_text())["points"])

    out = []
    ref = [r["output_ids"] for r in ar_doc["results"]]
    for cname, (mode, n, policy, run, secs) in runs.items():
        d = docs[cname]
        args_check = ["ceiling", "--check", run, "--rows-probe", probe, "--ar-run", runs["ar"][3],
                      "--tolerance", tolerance, "--format", "json"]
        if policy:
            args_check += ["--replay", work / f"replay_{mode}{n or ''}.json"]
        p = sp(*args_check, ok=(0, 1))
        c = json.loads(p.stdout)
        terms = {t["term"]: {"predicted": t["predicted"], "measured": t["measured"],
                             "speedup_if_measured": t["speedup_if_measured"]} for t in c["terms"]}
        out.append({"config": cname, "mode": mode, "nodes": n, "policy": policy,
                    "predicted_speedup": c["predicted_speedup"], "measured_speedup": c["measured_speedup"],
                    "error": c["error"], "passed": c["passed"], "term_off": c["term_off"],
                    "tau_run": d["tau"], "tau_replay": terms["tau"]["predicted"],
                    "tokens_per_s": d["tokens_per_s"], "steps": d["steps"], "tokens": d["tokens"],
                    "equals_ar": [r["output_ids"] for r in d["results"]] == ref,
                    "step_timing": {k: v for k, v in d["step_timing"].items() if k != "by_rows"},
                    "tlv_cycle_ms": c["tlv_cycle_ms"], "q_top1_agreement": (d.get("tlv") or {}).get("q_top1_agreement"),
                    "qview": (d.get("tlv") or {}).get("qview"),
                    "terms": terms, "run_seconds": secs})
        print(f"{cname}: predicted {c['predicted_speedup']:.3f}x measured {c['measured_speedup']:.3f}x "
              f"({100 * c['error']:+.1f}%) {'pass' if c['passed'] else 'FAIL: ' + str(c['term_off'])}", flush=True)
    meta["seconds"] = time.time() - t_start
    print_table(out, ["config", "tau_run", "tau_replay", "predicted_speedup", "measured_speedup", "error", "passed",
                      "term_off", "equals_ar"])
    return out, meta
