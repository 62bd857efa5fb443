"""cuBLAS against cuBLASLt (``torch.backends.cuda.preferred_blas_library``) for the GEMMs of verify
steps and batched steps: each layer alone, then whole steps (``probe rows`` for one request,
``probe rows --batch`` for 16 requests x 1 row), every backend timed in the same process.

    python lab/verify/blas_backend.py [--rows 1,16,32,33,64] [--models llama-3.1-8b,qwen3.5-9b]

Layers: the seven of shared/GPU.md plus the Llama-3.1-8B LM head, bf16, CUDA graphs, L2 flushed
by reading, interleaved rounds. Steps: random bf16 weights, context 1024, CUDA graphs. Writes
lab/results/blas_backend.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import L2Flusher, bootstrap, parse_int_list, print_table, time_interleaved, write_results  # noqa: E402

bootstrap()

LAYERS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (5120, 7168), (5120, 34816), (17408, 5120),
          (4096, 128256)]
BACKENDS = ("cublas", "cublaslt")


def operands(layers_kn, rows_list):
    """(k, n, rows, x, w) for each layer [n, k] (random bf16, std 0.02) and row count, on CUDA."""
    import torch

    for k, n in layers_kn:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in rows_list:
            yield k, n, rows, torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), w
        del w


def blas_call(x, w, backend: str):
    """``F.linear(x, w)`` on ``backend`` (the preference is read when the GEMM is launched, so a
    graph captured from this call holds that backend's kernel)."""
    import torch
    import torch.nn.functional as F

    def fn():
        torch.backends.cuda.preferred_blas_library(backend)
        return F.linear(x, w)
    return fn


def layers(rows_list) -> list[dict]:
    import torch
    import torch.nn.functional as F

    flush = L2Flusher()
    out = []
    for k, n, rows, x, w in operands(LAYERS, rows_list):
        us = time_interleaved([blas_call(x, w, be) for be in BACKENDS], flush=flush)
        ref = F.linear(x.float(), w.float())
        errs = [float((blas_call(x, w, be)().float() - ref).abs().max()) for be in BACKENDS]
        out.append({"kind": "layer", "k": k, "n": n, "rows": rows, "cublas_us": us[0], "cublaslt_us": us[1],
                    "lt_over_cublas": us[1] / us[0], "max_err_cublas": errs[0], "max_err_lt": errs[1]})
        print(out[-1], flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def steps(models, rows_list) -> list[dict]:
    import torch

    from specpilot.engine.api import load_target
    from specpilot.engine.batch.probe import measure_rows_batched
    from specpilot.engine.rows import measure_rows
    from specpilot.engine.spec import EngineSpec

    out = []
    for name in models:
        target = load_target(EngineSpec.parse(f"engine:model={name},random=1,device=cuda,ctx={1024 + 128}"))
        for be in BACKENDS:
            torch.backends.cuda.preferred_blas_library(be)
            res = measure_rows(target.model, rows_list, 1024, reps=30, warmup=5)
            for p in res.points:
                out.append({"kind": "step", "model": name, "backend": be, "batch": 1, "rows": p["rows"],
                            "step_ms": p["step_ms"], "c": p["c"]})
                print(out[-1], flush=True)
            if not target.model.spec.is_hybrid:
                bres = measure_rows_batched(target.model, 16, [1], 1024, reps=30, warmup=5)
                for p in bres.points:
                    out.append({"kind": "step", "model": name, "backend": be, "batch": 16, "rows": p["rows"],
                                "step_ms": p["step_ms"], "c": p["c"]})
                    print(out[-1], flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
        del target
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,32,33,64")
    ap.add_argument("--models", default="llama-3.1-8b,qwen3.5-9b")
    ap.add_argument("--skip-layers", action="store_true")
    args = ap.parse_args()
    rows_list = parse_int_list(args.rows, 1, 256, "blas_backend: --rows")
    out = [] if args.skip_layers else layers(rows_list)
    write_results("blas_backend", out)
    out += steps([m for m in args.models.split(",") if m], rows_list)
    write_results("blas_backend", out)
    print_table([r for r in out if r["kind"] == "layer"], ["k", "n", "rows", "cublas_us", "cublaslt_us", "lt_over_cublas"])
    print_table([r for r in out if r["kind"] == "step"], ["model", "backend", "batch", "rows", "step_ms", "c"])


if __name__ == "__main__":
    main()
