"""Where the W12 restore + cuBLAS path (kernels/w12/restore.py) overtakes the W12 kernels: the row
bound of the ``restore`` rule in ``kernels/w12/tuned/<arch>.json``.

Per layer of the seven (benchmarks/w12_gemm.py) and row count: the W12 kernels as the engine runs
them without the rule (the route's kernel, in launches of at most 256 rows), the restore alone,
restore + cuBLAS, and cuBLAS on the bf16 weight; CUDA graphs, L2 flushed by reading, interleaved
(median of rounds). The restore + cuBLAS output is checked bit for bit against cuBLAS.

    python lab/w12/restore_rows.py [--rows 64,96,128,192,256,512,1000] [--shapes ...]
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

def kernel_path(x, kp):
    """The W12 kernels as routed with the restore rule left out, in launches of at most
    ``KERNEL_MAX_ROWS`` rows (the engine's chunks)."""
    import torch

    from specpilot.engine.w12_loader import KERNEL_MAX_ROWS
    from specpilot.kernels import tuning
    from specpilot.kernels.w12 import routing

    rules = [r for r in tuning.table("w12", tuning.device_arch(x.device))["route"] if r["kernel"] != "restore"]

    def one(xc):
        return routing.LAUNCHERS[routing.route(xc, kp, rules)](xc, kp)

    if x.shape[0] <= KERNEL_MAX_ROWS:
        return one(x)
    return torch.cat([one(x[a:a + KERNEL_MAX_ROWS]) for a in range(0, x.shape[0], KERNEL_MAX_ROWS)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,96,128,192,256,512,1000")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ms = parse_int_list(args.rows, 1, 1 << 16, "--rows")
    shapes = select_shapes(args.shapes)

    import torch
    import torch.nn.functional as F

    from specpilot.kernels.w12.restore import restore, w12_restore_linear

    dev = torch.device("cuda")
    flush = L2Flusher()
    rows = []
    for name, k, n in shapes:
        w, _, kp, _ = random_layer(name, k, n, dev)
        for m in ms:
            x = (torch.randn(m, k, device=dev) * 0.5).bfloat16()
            same = torch.equal(w12_restore_linear(x, kp).view(torch.int16), F.linear(x, w).view(torch.int16))
            kern_us, rest_us, both_us, cublas_us = time_interleaved(
                [lambda: kernel_path(x, kp), lambda: restore(kp), lambda: w12_restore_linear(x, kp),
                 lambda: F.linear(x, w)], reps=args.reps, flush=flush)
            rows.append({"shape": name, "k": k, "n": n, "m": m, "kernels_us": round(kern_us, 2),
                         "restore_us": round(rest_us, 2), "restore_cublas_us": round(both_us, 2),
                         "cublas_us": round(cublas_us, 2), "restore_wins": both_us < kern_us,
                         "equals_cublas": same})
            print(rows[-1], flush=True)
        w = kp = None
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "m", "kernels_us", "restore_us", "restore_cublas_us", "cublas_us", "restore_wins",
                       "equals_cublas"])
    write_results("w12_restore_rows", rows, {"method": "CUDA graphs, L2 flushed by reading, interleaved medians"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
