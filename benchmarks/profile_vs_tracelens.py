"""``specpilot profile`` against TraceLens on public traces this project does not ship (CPU only).

For each trace (PyTorch profiler JSON from AMD-AGI/TraceLens's test data: Hugging Face, vLLM and
SGLang LLM serving, dense and MoE, H100/B200/MI300X), this runs TraceLens's inference perf report
(``TraceLens.Reporting.generate_perf_report_pytorch_inference --enable_pseudo_ops``, with the graph
capture folder where the trace replays CUDA/HIP graphs) and ``specpilot profile`` on the same
file, and compares:

- GPU busy time: TraceLens ``gpu_timeline.csv`` busy_time against specpilot's kernel busy time over
  the whole trace (``--step-mode whole``; both leave out kernels launched before the trace began);
- class shares of kernel time: TraceLens's op categories (``unified_perf_summary.csv``: GEMM,
  attention = InferenceAttention/SDPA/FlashAttention, MoE = MoE_*) against specpilot's classes
  (linear + lm_head, attention, moe) as shares of all kernel time. Where TraceLens has no MoE
  category for the trace's MoE backend (its pseudo-ops cover some backends), the ops named for MoE
  (``vllm::moe_forward``: routing, expert GEMMs and finalize) are compared with moe + moe_routing
  instead (``moe_by_op``);
- steps: specpilot's automatic steps against the trace's own step annotations (ProfilerStep#N,
  vLLM/SGLang step ranges);
- that no efficiency above 100 % is printed without its flag (with --model where a catalog model
  matches the trace).

TraceLens is not a dependency: install it into a separate virtual environment and pass its
interpreter; point ``--traces`` at a TraceLens checkout (the traces are read from
``tests/traces/...`` inside it and never copied here).

    python benchmarks/profile_vs_tracelens.py --tracelens-python /path/to/venv/bin/python \\
        --traces /path/to/TraceLens
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

REPO = "AMD-AGI/TraceLens"
# (path inside the TraceLens repository, graph capture folder or None, specpilot model for floors or None)
TRACES = [
    ("tests/traces/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz", None, None),
    ("tests/traces/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz", None, None),
    ("tests/traces/b200/eager_trace.json.gz", None, None),
    ("tests/traces/inference/sglang_prefilldecode/sglang_Qwen3-8B_prefilldecode.json.gz", None, "qwen3-8b"),
    ("tests/traces/inference/vllm_decode_full/graph_execution.json.gz", "tests/traces/inference/vllm_decode_full/capture_traces", None),
    ("tests/traces/inference/vllm_prefilldecode_piecewise/graph_execution.json.gz",
     "tests/traces/inference/vllm_prefilldecode_piecewise/capture_traces", None),
]
ATTENTION = re.compile(r"attention|sdpa|flash", re.IGNORECASE)


def tracelens(python: str, trace: Path, capture: Path | None, out: Path) -> dict:
    cmd = [python, "-m", "TraceLens.Reporting.generate_perf_report_pytorch_inference", "--profile_json_path", str(trace),
           "--enable_pseudo_ops", "--output_csvs_dir", str(out)]
    if capture is not None:
        cmd += ["--capture_folder", str(capture)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"TraceLens failed on {trace}: {proc.stderr.strip().splitlines()[-1:]}")
    busy = next(float(r["time ms"]) for r in csv.DictReader(open(out / "gpu_timeline.csv")) if r["type"] == "busy_time")
    cats: dict[str, float] = {}
    moe_ops = 0.0  # kernel time of ops named for MoE, whatever their category
    for r in csv.DictReader(open(out / "unified_perf_summary.csv")):
        v = float(r.get("Kernel Time (µs)_sum") or "0") / 1e3
        cats[r["op category"]] = cats.get(r["op category"], 0.0) + v
        if "moe" in r["name"].lower():
            moe_ops += v
    total = sum(cats.values())
    gemm = cats.get("GEMM", 0.0)
    attn = sum(v for k, v in cats.items() if ATTENTION.search(k))
    moe = sum(v for k, v in cats.items() if k.lower().startswith("moe"))
    return {"busy_ms": busy, "kernel_ms": total, "categories_ms": cats, "seconds": seconds,
            "moe_ops_share": moe_ops / total if total else 0.0,
            "share": {"gemm": gemm / total if total else 0.0, "attention": attn / total if total else 0.0,
                      "moe": moe / total if total else 0.0}}


def specpilot(trace: Path, *args: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "specpilot", "profile", str(trace), "--format", "json", "--top", "0",
                           *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"specpilot failed on {trace}: {proc.stderr.strip()}")
    d = json.loads(proc.stdout)
    d["_seconds"] = time.perf_counter() - t0
    return d


def annotation_steps(trace: Path) -> int | None:
    """How many step annotations the trace itself has (the families specpilot looks for)."""
    from specpilot.probes import steps as st
    from specpilot.probes.traces.kineto import KinetoTrace

    tr = KinetoTrace(trace)
    ranges = [r for r in tr.ranges if not r.gpu and not r.name.startswith("nn.Module")]
    found = st.auto_step_range(ranges)
    return None if found is None else len(st.select_step_ranges(ranges, found[0], str(trace)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tracelens-python", required=True, help="python of a venv with TraceLens installed")
    ap.add_argument("--traces", required=True, help="a TraceLens checkout (the repository's working tree)")
    args = ap.parse_args()
    from common import write_results

    root = Path(args.traces)
    rows = []
    for rel, capture, model in TRACES:
        trace = root / rel
        if not trace.is_file():
            print(f"skip {rel}: not in {root}", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            tl = tracelens(args.tracelens_python, trace, root / capture if capture else None, Path(tmp))
        whole = specpilot(trace, "--step-mode", "whole")
        auto = specpilot(trace, *(["--model", model] if model else []))
        cls = whole["classes"]
        total = sum(c["ms"] for c in cls.values() if c["ms"])
        ours = {"gemm": (cls.get("linear", {}).get("ms", 0.0) + cls.get("lm_head", {}).get("ms", 0.0)) / total,
                "attention": cls.get("attention", {}).get("ms", 0.0) / total,
                "moe": cls.get("moe", {}).get("ms", 0.0) / total}
        if tl["share"]["moe"] == 0 and tl["moe_ops_share"] > 0:
            routing = cls.get("moe_routing", {}).get("ms", 0.0) / total
            row_moe_by_op = {"tracelens_moe_ops_share": tl["moe_ops_share"], "specpilot_moe_and_routing_share":
                             ours["moe"] + routing, "difference_points": 100 * (ours["moe"] + routing - tl["moe_ops_share"])}
        else:
            row_moe_by_op = None
        unflagged = [k for k, c in auto["classes"].items() if (c.get("efficiency") or 0) > 1 and not c.get("flag")]
        annotated = annotation_steps(trace)
        row = {"repo": REPO, "path": rel, "gpu": (auto.get("gpu") or {}).get("name"),
               "tracelens_busy_ms": tl["busy_ms"], "specpilot_busy_ms": whole["kernel_busy_ms"],
               "busy_difference": whole["kernel_busy_ms"] / tl["busy_ms"] - 1 if tl["busy_ms"] else None,
               "tracelens_share": tl["share"], "specpilot_share": ours,
               "share_difference_points": {k: 100 * (ours[k] - tl["share"][k]) for k in ours},
               "moe_by_op": row_moe_by_op, "tracelens_categories_ms": tl["categories_ms"], "specpilot_classes_ms": {k: c["ms"] for k, c in cls.items()},
               "orphans": whole["trace"]["orphans"], "annotated_steps": annotated, "auto_steps": auto["steps"],
               "auto_step_detail": auto["step_detail"], "steps_agree": annotated is None or annotated == auto["steps"],
               "model": model, "unflagged_efficiency_above_100": unflagged, "warnings": auto["warnings"],
               "tracelens_seconds": tl["seconds"], "specpilot_seconds": whole["_seconds"]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("path", "busy_difference", "share_difference_points", "steps_agree")}),
              flush=True)
    import importlib.metadata as md

    def version(python, pkg):
        out = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version('{pkg}'))"],
                             capture_output=True, text=True)
        return out.stdout.strip() or None

    env = {"tracelens_version": version(args.tracelens_python, "TraceLens"),
           "specpilot_version": md.version("specpilot"),
           "criteria": {"busy_within": 0.005, "share_within_points": 2.0}}
    path = write_results("profile_vs_tracelens", rows, extra=env)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
