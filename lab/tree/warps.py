"""Warps per program of the batched tree builder's level-sort kernel (kernel="levels"): exactness and time (H200).
The frontier kernel's warps are swept by lab/tree/compare.py.

    python lab/tree/warps.py [WARPS ...]   (default: 1 2 4 8)

32 requests x 32 nodes from 16 x 16 lattices (issue 6's case), marginal and parent-conditioned;
every variant must equal the num_warps=4 result exactly; times from CUDA-graph replays.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, capture_and_time, print_table, write_results  # noqa: E402


def main() -> int:
    import torch

    from lab.tree.levels import build_batched_levels
    from specpilot.kernels.tree.batched import alloc

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    flush = L2Flusher()
    warps = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8]
    rows = []
    for B, m, K, n in ((32, 16, 16, 32), (8, 8, 16, 32), (1, 16, 16, 32)):
        for trans in (False, True):
            tok = torch.randint(0, 150000, (B, m, K), device=dev, generator=g)
            lp = torch.log_softmax(torch.randn(B, m, K, device=dev, generator=g) * 2, -1).sort(-1, descending=True).values
            tr = torch.log_softmax(torch.randn(B, m - 1, K, K, device=dev, generator=g) * 2, -1) if trans else None
            ref = build_batched_levels(tok, lp, tr, n, num_warps=4)
            ref = (ref.tokens.clone(), ref.parents.clone())
            for w in warps:
                out = alloc(B, n, dev)
                fn = lambda: build_batched_levels(tok, lp, tr, n, out=out, num_warps=w)  # noqa: E731
                fn()
                exact = bool(torch.equal(out.tokens, ref[0]) and torch.equal(out.parents, ref[1]))
                us, _ = capture_and_time(fn, reps=200, warmup=10, flush=flush)
                rows.append({"requests": B, "positions": m, "candidates": K, "nodes": n,
                             "scores": "parent-conditioned" if trans else "marginal", "num_warps": w,
                             "graph_us": round(us, 2), "exact_vs_warps4": exact})
                print(rows[-1], flush=True)
    write_results("tree_builder_warps", rows)
    print_table(rows, ["requests", "positions", "scores", "num_warps", "graph_us", "exact_vs_warps4"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
