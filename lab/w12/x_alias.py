"""Does the x traffic bind the W12 tensor-core kernels at 16-32 rows? A diagnostic.

For each layer (all of ``benchmarks/w12_gemm.py``'s but 5120 -> 34816) and 16 and 32 rows, it times
``w12_linear`` as routed, the ``warpk`` and ``mma`` kernels at their default configs and cuBLAS,
each with real x (distinct rows) and with x aliased to its first row (stride 0, so every x load of
every program reads the same 8-10 KB). A kernel whose time falls with aliased x pays for reading
x. Caveat, seen on the H200: aliased x can also be *slower* (the ``mma`` kernel, whose x goes
through ``cp.async`` or TMA into shared memory, by up to 64 %, and cuBLAS by up to 20 %;
presumably every SM then reads the same few lines of one L2 slice), so only a fall in time says
something. Outputs are checked against the fp32 reference of the aliased x.

    python lab/w12/x_alias.py          # writes lab/results/w12_x_alias.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import write_results  # noqa: E402


def main() -> int:
    import torch
    import torch.nn.functional as F

    from common import L2Flusher, time_interleaved
    from specpilot.kernels.w12 import mma, warpk
    from specpilot.kernels.w12.routing import w12_linear
    from w12_gemm import SHAPES, random_layer, routed_path, tolerance

    if not torch.cuda.is_available():
        print("x_alias: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = L2Flusher()
    rows, t0 = [], time.time()
    for name, k, n in SHAPES:
        if name == "27b.gate_up":
            continue
        w, _, kp, _ = random_layer(name, k, n, dev)
        for m in (16, 32):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            xa = x[:1].expand(m, k)
            ref = xa.float() @ w.float().T
            kernels = {"routed": lambda xx: w12_linear(xx, kp),
                       "warpk": lambda xx: warpk.w12_warpk(xx, kp, config=warpk.default_config(m, n, k)),
                       "mma": lambda xx: mma.w12_mma(xx, kp, config=mma.default_config(m, n, k)),
                       "cublas": lambda xx: F.linear(xx, w)}
            r = {"shape": name, "k": k, "n": n, "m": m, "path": routed_path(x, kp)}
            for key, fn in kernels.items():
                y = fn(xa)
                r[key + "_alias_ok"] = bool(((y.float() - ref).abs() <= tolerance(ref)).all())
                real, alias = time_interleaved([lambda: fn(x), lambda: fn(xa)], reps=30, flush=flush)
                r[key + "_us"], r[key + "_alias_us"] = round(real, 2), round(alias, 2)
            rows.append(r)
            print(f"{name:16s} m={m:2d} " + "  ".join(f"{key} {r[key + '_us']:6.2f} -> {r[key + '_alias_us']:6.2f}"
                                                  for key in kernels) + f"  ({time.time() - t0:.0f}s)", flush=True)
        w = kp = None
        torch.cuda.empty_cache()
    write_results("w12_x_alias", rows, {"method": "cuda graph, L2 flushed by reading 256 MB, median of 3 x 30"})
    return 0 if all(v for r in rows for key, v in r.items() if key.endswith("_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
