"""An FP8 Q pass: the TLV Q pass's projections as FP8 (e4m3) tensor-core GEMMs (``torch._scaled_mm``)
against the routed W12 QPASS kernels and the exact pass's bf16 GEMMs, per Llama-3.1-8B layer.

    python lab/w12/fp8_qpass.py [--rows 16,32,33,64] [--shapes llama8b.qkv,...] [--reps 50]

The W12 Q pass reads 8 bits a weight but its consumers decode each record before the tensor-core
product, which binds it above 8 rows (docs/tlv.md). Hopper multiplies e4m3 operands natively, so an
FP8 copy of the weights (per output channel scale, rounded to nearest) needs no decode; the
activations are quantized per row (``fp8``), or split into a high and a low e4m3 part stacked as
twice the rows (``fp8-hilo``: about bf16's precision, one GEMM reading the weights once). Per
(layer, rows): each variant's relative RMS error against ``x @ W.T`` in fp32 beside the W12 view's,
and its time in CUDA graphs with L2 flushed (interleaved rounds): the GEMM alone, and with the
activations' quantization (``+q``) in the graph. Results: ``lab/results/fp8_qpass.json`` and $OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, parse_int_list, print_table, time_interleaved, write_results  # noqa: E402
from w12_gemm import random_layer, select_shapes  # noqa: E402

LLAMA = "llama8b.qkv,llama8b.o,llama8b.gate_up,llama8b.down"
E4M3_MAX = 448.0


def quant_rows(t):
    """``t`` [R, K] as e4m3 with one float32 scale per row (amax / 448), rounded to nearest."""
    import torch

    s = t.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (t.float() / s).to(torch.float8_e4m3fn), s


def quant_hilo(x):
    """``x`` [M, K] as [2M, K] e4m3 rows: the high part, then the remainder, each row its own scale."""
    import torch

    hi, sh = quant_rows(x)
    lo, sl = quant_rows(x.float() - hi.float() * sh)
    return torch.cat([hi, lo]), torch.cat([sh, sl])


def rel_err(y, ref) -> float:
    return float(((y.float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt())


def run(args) -> int:
    import torch

    from specpilot.kernels.verify import blas
    from specpilot.kernels.w12 import decode
    from specpilot.kernels.w12.routing import w12_linear

    dev = torch.device("cuda")
    flush = L2Flusher()
    rows_out = []
    for name, k, n in select_shapes(args.shapes):
        w, packed, kp, _ = random_layer(name, k, n, dev)
        view = decode(packed, qpass=True).to(dev)
        wq, sw = quant_rows(w)
        sw_row = sw.view(1, n).contiguous()
        one = torch.ones((), device=dev)
        for m in args.rows:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w.float().T
            xq, sx = quant_rows(x)
            x2, s2 = quant_hilo(x)

            def fp8(a=xq, sa=sx):
                return torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=sw_row, out_dtype=torch.bfloat16)

            def fp8_hilo():
                y = torch._scaled_mm(x2, wq.t(), scale_a=s2, scale_b=sw_row, out_dtype=torch.bfloat16)
                return y[:m] + y[m:]

            def fp8_q():
                a, sa = quant_rows(x)
                return fp8(a, sa)

            def fp8_tensor():
                return torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            cases = {"bf16": lambda: blas.linear(x, w), "w12-q": lambda: w12_linear(x, kp, qpass=True),
                     "fp8": fp8, "fp8+q": fp8_q, "fp8-hilo": fp8_hilo, "fp8-tensor": fp8_tensor}
            row = {"shape": name, "k": k, "n": n, "m": m,
                   "err_w12_view": rel_err(x.float() @ view.float().T, ref),
                   "err_fp8": rel_err(fp8(), ref), "err_fp8_hilo": rel_err(fp8_hilo(), ref)}
            ok = {}
            for key, fn in cases.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    ok[key] = fn
                except Exception as e:   # a variant cuBLAS or torch refuses at this shape
                    row[f"{key}_error"] = str(e).splitlines()[0][:160]
            times = time_interleaved(list(ok.values()), rounds=3, reps=args.reps, flush=flush)
            for key, t in zip(ok, times):
                row[f"{key}_us"] = round(t, 2)
            base = row.get("bf16_us")
            for key in ok:
                if key != "bf16" and base:
                    row[f"{key}_vs_bf16"] = round(row[f"{key}_us"] / base, 3)
            rows_out.append(row)
            print({k2: v for k2, v in row.items()}, flush=True)
    print_table(rows_out, ["shape", "m", "bf16_us", "w12-q_us", "fp8_us", "fp8+q_us", "fp8-hilo_us", "fp8-tensor_us",
                           "err_w12_view", "err_fp8", "err_fp8_hilo"])
    per_m = {}
    for r in rows_out:
        d = per_m.setdefault(r["m"], {})
        for key in ("bf16_us", "w12-q_us", "fp8_us", "fp8+q_us", "fp8-hilo_us"):
            if key in r:
                d[key] = round(d.get(key, 0.0) + r[key], 2)
    print("sums per rows:", per_m)
    write_results("fp8_qpass", rows_out, {"sums_per_rows": per_m})
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,32,33,64")
    p.add_argument("--shapes", default=LLAMA)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    args.rows = parse_int_list(args.rows, 1, 128, "fp8_qpass: --rows")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
