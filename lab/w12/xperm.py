"""Experiments on the wgmma ring (``tma=3``, :mod:`specpilot.kernels.w12.mma_tma`) at 8-32 rows,
each a kernel flag of that module's ``launch`` that no routing sets:

* ``xperm``: x already in MMA k order in global memory (here permuted on the host; in a step the
  kernel before would write it so), so the TMA copy of x is the ``wgmma`` B operand as it lands and
  a record costs the group no x load, restage store and CTA barrier before its ``wgmma``;
* ``no_x``: ``xperm`` without any x copy (wrong sums; what the x bytes cost);
* ``wide``: the record boxes as 1 KB rows (``[BLOCK_N / 16, 256]`` words) instead of 64-byte rows;
* ``xperm_pair``: two records per step (both waits, both decodes, two ``wgmma`` retired together),
  one K group.

    python lab/w12/xperm.py [--shapes llama8b.qkv,...] [--rows 8,32] [--reps 50]

Per (shape, rows, config, pass): every variant's output checked bit for bit against the restaging
kernel's (same fragments, same wgmma order; ``no_x`` excepted), all timed interleaved in CUDA
graphs with L2 flushed, beside the routed Q and exact passes. Results: ``lab/results/xperm.json``
(and ``$OUT``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, print_table, time_interleaved, write_results  # noqa: E402
from w12_gemm import random_layer, select_shapes  # noqa: E402

LLAMA = "llama8b.qkv,llama8b.o,llama8b.gate_up,llama8b.down"

# (block_n, num_warps, kgroups, depth, split_k) per layer: the table's wgmma entries and the
# fastest of qpass_configs' wgmma grid at 32 rows
CONFIGS = {
    "llama8b.qkv": [(64, 4, 4, 12, 1), (64, 4, 1, 4, 1), (64, 4, 1, 8, 1)],
    "llama8b.o": [(64, 4, 2, 10, 2), (64, 4, 1, 4, 2), (64, 4, 1, 8, 2)],
    "llama8b.gate_up": [(128, 8, 1, 4, 1), (64, 4, 1, 4, 1), (64, 4, 1, 6, 1)],
    "llama8b.down": [(64, 4, 4, 12, 2), (64, 4, 1, 4, 2), (64, 4, 1, 8, 2)],
}


def mma_order(x):
    """x ``[M, K]`` with each 64-k tile in the order :func:`fragments.x_store` restages it:
    ``[t, j, s, c] -> [j, s, t, c]`` (t, j: 4; s, c: 2)."""
    m, k = x.shape
    return x.view(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k).contiguous()


def launcher(x, kp, cfg, qpass: bool, xperm: bool, nox: bool = False, wide: bool = False, pair: bool = False):
    import torch

    from specpilot.kernels.w12 import mma_tma
    from specpilot.kernels.w12.gluon_common import aligned_x, esc_chunk, split_grid

    m = x.shape[0]
    n, kt = kp.shape[0], kp.k_tiles
    xa, _ = aligned_x(x, kt)
    xm = mma_order(xa) if xperm else None
    grid = split_grid(m, n, kt, cfg.block_n, cfg.split_k, x.device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    esc = esc_chunk(grid[0])

    def run():
        mma_tma.launch(xa, kp, out, qpass, cfg, grid, esc, x_mma=xm, nox=nox, wide=wide, pair=pair)
        return out
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=LLAMA)
    ap.add_argument("--rows", default="32")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    shapes = select_shapes(args.shapes)
    ms = [int(v) for v in args.rows.split(",")]

    import torch

    from specpilot.kernels.w12.mma import MmaConfig
    from specpilot.kernels.w12.routing import w12_linear

    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = L2Flusher()
    rows = []
    t0 = time.time()
    for name, k, n in shapes:
        w, packed, kp, _ = random_layer(name, k, n, dev)
        for m in ms:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            q_routed, ex_routed = (lambda: w12_linear(x, kp, qpass=True)), (lambda: w12_linear(x, kp))
            for bn, warps, kg, depth, split in CONFIGS.get(name, []):
                if kg == 4 and m > 32:
                    continue
                cfg = MmaConfig(block_n=bn, num_warps=warps, tma=3, kgroups=kg, depth=depth, split_k=split)
                for qpass in (True, False):
                    variants = {"restage": launcher(x, kp, cfg, qpass, False),
                                "xperm": launcher(x, kp, cfg, qpass, True),
                                "wide": launcher(x, kp, cfg, qpass, False, wide=True),
                                "wide_xperm": launcher(x, kp, cfg, qpass, True, wide=True),
                                "no_x": launcher(x, kp, cfg, qpass, True, nox=True)}
                    if kg == 1:
                        variants["xperm_pair"] = launcher(x, kp, cfg, qpass, True, pair=True)
                    ref = variants["restage"]().clone()
                    same = {}
                    for vn, fn in variants.items():
                        if vn == "no_x":
                            continue
                        y = fn().clone()
                        torch.cuda.synchronize()
                        same[vn] = bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))
                    times = time_interleaved(list(variants.values()) + [q_routed if qpass else ex_routed],
                                             reps=args.reps, flush=flush)
                    row = {"shape": name, "m": m, "pass": "q" if qpass else "exact", "config": cfg.key(),
                           **{f"{vn}_us": round(t, 2) for vn, t in zip(variants, times)},
                           "routed_us": round(times[-1], 2), "same_bits": all(same.values())}
                    row.setdefault("xperm_pair_us", None)
                    rows.append(row)
                    print(f"{name:16s} m={m:2d} {row['pass']:5s} {cfg.key():28s} "
                          + " ".join(f"{vn} {t:6.2f}" for vn, t in zip(list(variants) + ["routed"], times))
                          + f" same={same} ({time.time() - t0:.0f}s)", flush=True)
                    write_results("xperm", rows, {"partial": True})
        w = kp = None
        torch.cuda.empty_cache()
    write_results("xperm", rows, {"reps": args.reps, "weights": "randn*0.02 bf16"})
    print_table(rows, ["shape", "m", "pass", "config", "restage_us", "xperm_us", "wide_us", "wide_xperm_us",
                       "xperm_pair_us", "no_x_us", "routed_us", "same_bits"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
