"""The TLV Q pass's projections (the W12 8-bit view, ``qpass=True``) per layer and rows: the routed
kernel and config (tuned for the exact pass, which reads 12 bits a weight) against candidates
picked for the Q pass's 8 bits: every ``mma`` / ``warpk`` entry of the layer in the table (any
rows), each with more K splits and deeper rings (a record of the Q pass is 8 KB instead of 12, so
a ring of the same depth holds a third fewer bytes in flight); with ``--family wgmma`` or ``all``
also (or only) a grid of wgmma rings on any layer (:func:`wgmma_grid`).

    python lab/w12/qpass_configs.py [--shapes llama8b.qkv,...] [--rows 16,32] [--reps 50] [--family table|wgmma|all]

Per (shape, rows): every candidate's Q pass checked against ``x @ view.T`` in fp32 (the view
decoded on the host, :func:`specpilot.kernels.w12.decode` with ``qpass=True``) and run to run, timed
in CUDA graphs with L2 flushed; the fastest re-timed interleaved with the routed Q pass and the
routed exact pass. Results: ``lab/results/qpass_configs.json`` (and ``$OUT``); the rows with
``q_best_us`` below ``q_routed_us`` are the Q-pass entries' candidates for ``kernels/w12/tuned``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, print_table, time_cuda_graph, time_interleaved, write_results  # noqa: E402
from w12_gemm import random_layer, routed_path, select_shapes, tolerance  # noqa: E402

LLAMA = "llama8b.qkv,llama8b.o,llama8b.gate_up,llama8b.down"


def wgmma_grid(m: int):
    """The wgmma ring (``tma=3``) on any layer: 64-row programs of one, two or four K groups (four
    only up to 32 x rows) or 128-row programs of one group, ring depths that are multiples of the
    groups, 1-4 K splits."""
    from specpilot.kernels.w12.mma import MmaConfig

    out = []
    for kg in (1, 2, 4):
        if kg == 4 and m > 32:
            continue
        for depth in (4, 6, 8, 12):
            if depth % kg:
                continue
            for split in (1, 2, 4):
                out.append(("mma", MmaConfig(block_n=64, num_warps=4, tma=3, kgroups=kg, depth=depth, split_k=split)))
    for depth in (4, 8):
        for split in (1, 2):
            out.append(("mma", MmaConfig(block_n=128, num_warps=8, tma=3, depth=depth, split_k=split)))
    return out


def candidates(n: int, k: int, m: int, family: str = "table"):
    """(kernel, config) pairs: the layer's table entries of ``mma`` and ``warpk`` (any rows) and
    their variants with more K splits and deeper rings (``family`` ``table``), the wgmma grid
    (``wgmma``, :func:`wgmma_grid`) or both (``all``), deduplicated, in that order."""
    from specpilot.kernels import tuning
    from specpilot.kernels.w12 import mma, warpk

    out = []
    if family == "wgmma":
        return wgmma_grid(m)

    def add(kernel, cfg):
        if (kernel, cfg) not in out:
            out.append((kernel, cfg))

    for e in tuning.table("w12", "sm90")["entries"]:
        if e.get("n") != n or e.get("k") != k or e["kernel"] not in ("mma", "warpk"):
            continue
        if e["kernel"] == "warpk" and m > 32:
            continue
        cls = mma.MmaConfig if e["kernel"] == "mma" else warpk.WarpKConfig
        base = cls(**e["config"])
        add(e["kernel"], base)
        for s in (2, 3, 4, 6, 8):
            if s > base.split_k:
                add(e["kernel"], replace(base, split_k=s))
        if e["kernel"] == "mma":
            top = 12 if base.tma else (6 if base.wsmem else 3)
            for d in (base.depth + 1, base.depth + 2, base.depth + 4):
                if d <= top and not (base.unroll and d > 3):
                    add("mma", replace(base, depth=d))
        else:
            for d in (2, 3, 4):
                if d != base.depth:
                    add("warpk", replace(base, depth=d))
    if family == "all":
        for kernel, cfg in wgmma_grid(m):
            add(kernel, cfg)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=LLAMA)
    ap.add_argument("--rows", default="32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--name", default="qpass_configs")
    ap.add_argument("--family", choices=("table", "wgmma", "all"), default="table",
                    help="candidates: the layer's table entries and their variants, the wgmma grid, or both")
    args = ap.parse_args()
    shapes = select_shapes(args.shapes)
    ms = [int(v) for v in args.rows.split(",")]

    import torch

    from specpilot.kernels.w12 import decode
    from specpilot.kernels.w12.routing import LAUNCHERS, w12_linear

    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = L2Flusher()
    rows, sweep = [], []
    t0 = time.time()
    for name, k, n in shapes:
        w, packed, kp, _ = random_layer(name, k, n, dev)
        view = decode(packed, qpass=True).to(dev)
        for m in ms:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ view.float().T
            tol = tolerance(ref)
            best = None
            for kernel, cfg in candidates(n, k, m, args.family):
                run = LAUNCHERS[kernel]
                try:
                    y = run(x, kp, qpass=True, config=cfg)
                    torch.cuda.synchronize()
                except Exception as e:   # a candidate that does not compile or launch is reported
                    sweep.append({"shape": name, "m": m, "config": cfg.key(), "error": str(e).splitlines()[0][:200]})
                    continue
                ok = bool(((y.float() - ref).abs() <= tol).all())
                det = bool(torch.equal(y.view(torch.int16), run(x, kp, qpass=True, config=cfg).view(torch.int16)))
                us = time_cuda_graph(lambda: run(x, kp, qpass=True, config=cfg), reps=args.reps, flush=flush)
                r = {"shape": name, "m": m, "kernel": kernel, "config": cfg.key(), "us": round(us, 2),
                     "correct": ok, "deterministic": det}
                sweep.append(r)
                if ok and det and (best is None or us < best[2]):
                    best = (kernel, cfg, us)
            if best is None:
                print(f"{name} m={m}: no correct candidate", flush=True)
                continue
            kernel, cfg, _ = best
            run = LAUNCHERS[kernel]
            qb, qr, ex = time_interleaved([lambda: run(x, kp, qpass=True, config=cfg),
                                           lambda: w12_linear(x, kp, qpass=True), lambda: w12_linear(x, kp)],
                                          reps=args.reps, flush=flush)
            row = {"shape": name, "n": n, "k": k, "m": m, "routed": routed_path(x, kp), "exact_us": round(ex, 2),
                   "q_routed_us": round(qr, 2), "q_best_us": round(qb, 2), "best_kernel": kernel,
                   "best_config": cfg.key(), "best_cfg": cfg.__dict__, "q_routed_over_exact": round(qr / ex, 3),
                   "q_best_over_exact": round(qb / ex, 3),
                   "candidates": sum(1 for r in sweep if r["shape"] == name and r["m"] == m)}
            rows.append(row)
            print(f"{name:16s} m={m:2d} exact {ex:7.2f} q routed {qr:7.2f} q best {qb:7.2f} us "
                  f"({qb / ex:.3f} of exact) {kernel} {cfg.key()} ({time.time() - t0:.0f}s)", flush=True)
            write_results(args.name, rows, {"partial": True, "sweep": sweep})
        w = kp = view = None
        torch.cuda.empty_cache()
    write_results(args.name, rows, {"reps": args.reps, "weights": "randn*0.02 bf16", "sweep": sweep})
    print_table(rows, ["shape", "m", "exact_us", "q_routed_us", "q_best_us", "q_best_over_exact", "best_config"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
