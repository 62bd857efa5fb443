"""The W12 GEMM as users call it, ``w12_linear(x, kp)`` (the routed kernel and config), against
cuBLAS bf16 ``F.linear`` on the GPU, side by side in one run.

    python benchmarks/w12_gemm.py [--rows 1,2,4,8,16,32,64] [--shapes llama8b.qkv,...]   # -> results/w12_gemm.json

Per shape (K -> N) and M rows: encode a random bf16 weight (std 0.02) into W12 on the GPU, check
the restore bit for bit, check the product against ``x @ W.T`` in fp32 on fresh random inputs
(poisoned outputs) and run to run, then time W12 and cuBLAS, both captured in CUDA graphs with L2
flushed by reading 256 MB before each replay (median of three interleaved runs); the routed kernel
is in each row. Then a small Llama through ``convert_model``: logits and greedy tokens. The
kernels' config sweeps are ``lab/w12/sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


from common import bootstrap  # noqa: E402

bootstrap()

from common import L2Flusher, print_table, time_interleaved, write_results  # noqa: E402


SHAPES = [  # (name, K_in, N_out)
    ("llama8b.qkv", 4096, 6144), ("llama8b.o", 4096, 4096), ("llama8b.gate_up", 4096, 28672),
    ("llama8b.down", 14336, 4096), ("27b.qkv", 5120, 7168), ("27b.gate_up", 5120, 34816),
    ("27b.down", 17408, 5120),
]

# Projections transformers' Llama runs apart where the engine and SHAPES fuse them (q, k, v; gate,
# up): timed only when named in --shapes (benchmarks/w12_hf.py decodes with them).
HF_SHAPES = [("llama8b.kv", 4096, 1024), ("llama8b.up", 4096, 14336)]


def select_shapes(names: str | None) -> list:
    """``--shapes``: SHAPES by default, else the named ones of SHAPES and HF_SHAPES (exit 2 on an unknown name)."""
    if not names:
        return list(SHAPES)
    table = {s[0]: s for s in SHAPES + HF_SHAPES}
    bad = [v for v in names.split(",") if v not in table]
    if bad:
        print(f"w12_gemm: unknown shape {', '.join(bad)}; choose from {', '.join(table)}", file=sys.stderr)
        raise SystemExit(2)
    return [table[v] for v in names.split(",")]

def model_check() -> dict:
    """A small Llama (random weights) through ``convert_model`` on the GPU: logits and greedy tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpilot.kernels.w12.module import convert_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 4096, (1, 16), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        ref_gen = model.generate(ids, max_new_tokens=24, do_sample=False)
        rep = convert_model(model)
        out = model(ids).logits.float()
        gen = model.generate(ids, max_new_tokens=24, do_sample=False)
    return {"converted": len(rep.converted), "bits_per_weight": round(rep.bits_per_weight, 4),
            "max_abs_logit_diff": float((out - ref).abs().max()), "logit_scale": float(ref.abs().max()),
            "greedy_tokens_equal": bool(torch.equal(gen, ref_gen))}

def random_layer(name: str, k: int, n: int, dev):
    """A random bf16 layer (std 0.02), its W12 encoding checked bit for bit, the GPU layout and the
    bytes the kernel reads."""
    import torch

    from specpilot.kernels.w12 import decode, encode
    from specpilot.kernels.w12.pack import KernelPack

    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    packed = encode(w)
    assert torch.equal(decode(packed).view(torch.int16), w.view(torch.int16)), f"{name}: restore differs"
    kp = KernelPack.from_w12(packed, device=dev)
    return w, packed, kp, kp.rec64.numel() * 8 + kp.low_exp.numel() + kp.esc_row.numel() * 12

def row_inputs(w, m: int):
    """``m`` random bf16 rows for layer ``w``, the fp32 reference ``x @ w.T`` and the tolerance every
    kernel is checked against (bf16 output rounding plus fp32 summation order)."""
    import torch

    x = torch.randn(m, w.shape[1], device=w.device).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    return x, ref, tolerance(ref)

def tolerance(ref):
    """Elementwise tolerance around the fp32 reference ``ref``: bf16 output rounding plus fp32
    summation order."""
    return 2.0 ** -7 * ref.abs() + 1e-3 * ref.abs().max()

def routed_path(x, kp) -> str:
    """Which kernel ``w12_linear(x, kp)`` runs (its routing, for the results' labels)."""
    from specpilot.kernels.w12 import gemm, routing

    (m, k), n = x.shape, kp.shape[0]
    path = routing.route(x, kp)
    return gemm.default_config(m, n, k, device=x.device).key() if path == "gemm" else path

def speedup_summary(rows: list[dict], ms, keys=("speedup",)) -> dict:
    """Per row count: the geometric mean of each ratio in ``keys`` over the shapes, and the lowest
    ``speedup``."""
    import math

    summary = {}
    for m in ms:
        for key in keys:
            sp = [r[key] for r in rows if r["m"] == m]
            if sp:
                summary[f"geomean_{key}_m{m}"] = round(math.exp(sum(map(math.log, sp)) / len(sp)), 3)
        sp = [r["speedup"] for r in rows if r["m"] == m]
        if sp:
            summary[f"min_speedup_m{m}"] = min(sp)
    return summary


def run(args) -> int:
    """What users get: ``w12_linear(x, kp)`` with no config (the kernel and config the routing table
    picks) against cuBLAS bf16 at M = 1..64, checked against the fp32 reference and run to run
    before timing, timed interleaved 3 times; and the small Llama through ``convert_model``."""
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.w12.routing import w12_linear

    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = L2Flusher()
    ms = [int(v) for v in (args.rows or "1,2,4,8,16,32,64").split(",")]
    shapes = args.shape_list
    rows = []
    for name, k, n in shapes:
        w, _, kp, w12_bytes = random_layer(name, k, n, dev)
        for m in ms:
            x, ref, tol = row_inputs(w, m)
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            y = w12_linear(x, kp, out=out)
            ok = bool(((y.float() - ref).abs() <= tol).all())
            det = bool(torch.equal(y.view(torch.int16), w12_linear(x, kp).view(torch.int16)))
            w_us, c_us = time_interleaved([lambda: w12_linear(x, kp), lambda: F.linear(x, w)], reps=args.reps,
                                          flush=flush)
            path = routed_path(x, kp)
            rows.append({"shape": name, "k": k, "n": n, "m": m, "path": path, "w12_us": round(w_us, 2),
                         "cublas_us": round(c_us, 2), "speedup": round(c_us / w_us, 3),
                         "w12_TBps": round(w12_bytes / w_us / 1e6, 3), "correct": ok, "deterministic": det})
            print(f"{name:16s} m={m:2d} {path:7s} w12 {w_us:8.2f} us  cublas {c_us:8.2f} us  x{c_us / w_us:.3f}"
                  f"{'' if ok and det else '  WRONG' if not ok else '  NONDETERMINISTIC'}", flush=True)
        w = kp = None  # free the layer before the next one
        torch.cuda.empty_cache()
    summary = speedup_summary(rows, ms)
    try:
        check = model_check()
    except Exception as e:  # reported, not fatal
        check = {"error": str(e).splitlines()[0][:300]}
    write_results("w12_gemm", rows, {"summary": summary, "reps": args.reps, "weights": "randn*0.02 bf16",
                                     "model_check": check})
    print_table(rows, ["shape", "m", "path", "w12_us", "cublas_us", "speedup", "w12_TBps"])
    print(json.dumps(summary))
    return 0 if all(r["correct"] and r["deterministic"] for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: the seven layers; "
                    "also llama8b.kv and llama8b.up, transformers' unfused projections)")
    ap.add_argument("--rows", default=None, help="comma list of M (default 1,2,4,8,16,32,64)")
    args = ap.parse_args()
    args.shape_list = select_shapes(args.shapes)   # an unknown name: exit 2 before any GPU work
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
