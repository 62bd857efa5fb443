"""The bf16 warp-K GEMM (``kernels/verify/warpk.py``) against cuBLAS and the routed verify GEMM
(``kernels/verify/blas.linear``: the skinny kernel or cuBLAS/cuBLASLt per the table) for 1..32 rows:
each depth (register sets per warp) checked against ``x @ W.T`` in fp32 and run to run, then timed
(CUDA graphs, L2 flushed by reading), the best re-timed interleaved beside both.

    python lab/verify/warpk.py [--rows 1,2,4,8,16,32] [--layers 4096x6144,...]

Writes lab/results/warpk.json (and $OUT).

A first sweep (H200, Llama-3.1-8B layers, 1/4/16/32 rows) also tried 32 weight rows per program, 8
warps and split-K across programs (to 2 and 4 programs per SM): none won at 1-4 rows (16 rows, 4
warps, depth 4, no split on every layer: q/k/v 17.8 vs cuBLAS 18.0 us, o 13.6 vs 15.0, gate/up 60.0
vs 58.4, down 32.5 vs 33.6 at 4 rows); at 16 rows 32-row programs won on q/k/v and gate/up but
stayed slower than cuBLAS (19.4 vs 17.6, 68.5 vs 58.9 us), and at 32 rows every config was
0.64-0.90x of cuBLAS (each warp loads its x slice from L1/L2 for every weight slice: at 32 rows
twice the weight's bytes; the W12 warp-K kernel measured x traffic binding it there, docs/w12.md). The product kernel keeps 16 rows, 4 warps, no
split; whole steps decide where it runs (``lab/verify/step_parts.py --variants warpk:...``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lab.verify.skinny import LAYERS  # noqa: E402


DEPTHS = (2, 3, 4)   # register sets per warp (the product runs warpk.DEPTH)


def main() -> None:
    from lab.common import L2Flusher, bootstrap, parse_int_list, time_interleaved, write_results
    from lab.verify.blas_backend import blas_call, operands
    from specpilot.kernels.verify import blas
    from specpilot.kernels.verify.warpk import _launch

    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--layers", default="", help="KxN,... (default: the Llama-3.1-8B and Qwen3.5-9B layers)")
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
        for c in DEPTHS:
            y = _launch(x, w, c)
            err = float((y.float() - ref).abs().max())
            if err > tol or not torch.equal(y, _launch(x, w, c)):
                print("WRONG", k, n, m, c, err, flush=True)
                out.append({"kind": "wrong", "k": k, "n": n, "rows": m, "depth": c, "max_err": err})
                continue
            us = time_interleaved([lambda c=c: _launch(x, w, c)], flush=flush, rounds=1, reps=20)[0]
            out.append({"kind": "depth", "k": k, "n": n, "rows": m, "depth": c, "warpk_us": us})
            if best is None or us < best[1]:
                best = (c, us, err)
        if best is None:
            continue
        c, _, err = best
        final = time_interleaved([blas_call(x, w, "cublas"), lambda: blas.linear(x, w), lambda c=c: _launch(x, w, c)],
                                 flush=flush, rounds=5, reps=50)
        torch.backends.cuda.preferred_blas_library("cublas")
        row = {"kind": "layer", "k": k, "n": n, "rows": m, "cublas_us": final[0], "routed_us": final[1],
               "warpk_us": final[2], "vs_cublas": final[0] / final[2], "vs_routed": final[1] / final[2],
               "warpk_tbps": n * k * 2 / final[2] / 1e6, "depth": c, "max_err": err}
        out.append(row)
        print({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
        write_results("warpk", out)


if __name__ == "__main__":
    main()
