"""The bf16 warp-K GEMM (``kernels/verify/warpk.py``) against cuBLAS and the routed verify GEMM
(``kernels/verify/blas.linear``: the skinny kernel or cuBLAS/cuBLASLt per the table) for 1..32 rows:
each config checked against ``x @ W.T`` in fp32 and run to run, then timed (CUDA graphs, L2 flushed
by reading), the best re-timed interleaved beside both.

    python lab/verify/warpk.py [--rows 1,2,4,8,16,32] [--layers 4096x6144,...] [--quick]

Writes lab/results/warpk.json (and $OUT).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lab.verify.skinny import LAYERS  # noqa: E402


def configs(k: int, n: int, m: int, quick: bool):
    from specpilot.kernels.verify.warpk import SLICE_K, WarpKConfig

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kt = k // SLICE_K
    out = []
    for rows, warps, depth in itertools.product((16, 32), (4, 8) if not quick else (4,), (2, 3, 4)):
        blocks = -(-n // rows)
        splits = {1}
        for target in (2, 4):   # programs per SM
            splits.add(max(1, min(kt // (warps * depth), -(-target * sms // blocks))))
        for s in sorted(splits):
            out.append(WarpKConfig(rows, warps, depth, s))
    return out


def main() -> None:
    from lab.common import L2Flusher, bootstrap, parse_int_list, time_interleaved, write_results
    from lab.verify.blas_backend import blas_call, operands
    from specpilot.kernels.verify import blas
    from specpilot.kernels.verify.warpk import warpk_linear

    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--layers", default="", help="KxN,... (default: the Llama-3.1-8B and Qwen3.5-9B layers)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows_list = parse_int_list(args.rows, 1, 32, "rows")
    layers = [tuple(int(v) for v in s.split("x")) for s in args.layers.split(",") if s] or LAYERS
    import torch.nn.functional as F

    flush = L2Flusher()
    out = []
    for k, n, m, x, w in operands(layers, rows_list):
        ref = F.linear(x.float(), w.float())
        tol = 2e-2 * float(ref.abs().max()) + 1e-3
        best = None
        for c in configs(k, n, m, args.quick):
            y = warpk_linear(x, w, c)
            err = float((y.float() - ref).abs().max())
            if err > tol or not torch.equal(y, warpk_linear(x, w, c)):
                print("WRONG", k, n, m, c.key(), err, flush=True)
                out.append({"kind": "wrong", "k": k, "n": n, "rows": m, "config": c.key(), "max_err": err})
                continue
            us = time_interleaved([lambda c=c: warpk_linear(x, w, c)], flush=flush, rounds=1, reps=20)[0]
            if best is None or us < best[1]:
                best = (c, us, err)
        if best is None:
            continue
        c, _, err = best
        final = time_interleaved([blas_call(x, w, "cublas"), lambda: blas.linear(x, w), lambda c=c: warpk_linear(x, w, c)],
                                 flush=flush, rounds=5, reps=50)
        torch.backends.cuda.preferred_blas_library("cublas")
        row = {"kind": "layer", "k": k, "n": n, "rows": m, "cublas_us": final[0], "routed_us": final[1],
               "warpk_us": final[2], "vs_cublas": final[0] / final[2], "vs_routed": final[1] / final[2],
               "warpk_tbps": n * k * 2 / final[2] / 1e6, "config": c.key(), "max_err": err}
        out.append(row)
        print({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
        write_results("warpk", out)


if __name__ == "__main__":
    main()
