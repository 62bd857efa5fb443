"""Does restaging x bind the ``wgmma`` K groups at 16-32 rows? ``MmaConfig(..., x_pre=True)``.

The ``tma=3`` groups restage each record's x tile into MMA k order (a shared load, a permuted
store, a fence and a named barrier per record) because the decoded weights come in the record's
physical k order. With ``x_pre`` x is permuted once into MMA k order (:func:`mma_tma.mma_k_order`)
and the TMA stage is the ``wgmma`` B operand as it is. For each layer and row count this times, in
one interleaved run: the ``mma.TUNED`` entry, ``tma=3`` K-group configs with and without
``x_pre`` (the kernel alone, x permuted beforehand), the fastest ``x_pre`` one with the
permutation inside the timed graph (what ``w12_mma`` runs), and cuBLAS. Every ``x_pre`` output is
checked against the fp32 reference and for equal bits with the same config without ``x_pre``.

    python benchmarks/tools/w12_xpre.py [--rows 32,16] [--shapes llama8b.qkv,...]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bootstrap, parse_int_list, write_results  # noqa: E402

bootstrap()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,16")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--name", default="w12_mma_xpre")
    args = ap.parse_args()
    rows_list = parse_int_list(args.rows, 1, 32, "w12_xpre: --rows")
    import torch
    import torch.nn.functional as F

    from common import L2Flusher, time_interleaved
    from specpilot.kernels.w12 import mma, mma_tma
    from w12_gemm import random_layer, select_shapes, tolerance

    if not torch.cuda.is_available():
        print("w12_xpre: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    flush = L2Flusher()
    out_rows = []
    for name, k, n in select_shapes(args.shapes):
        w, _, kp, _ = random_layer(name, k, n, "cuda")
        kt = kp.k_tiles
        for m in rows_list:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ w.float().T
            tol = tolerance(ref)
            xa, _ = mma.aligned_x(x, kt)
            xp = mma_tma.mma_k_order(xa)
            base = mma.TUNED.get((n, k, mma.block_m_for(m))) or mma.default_config(m, n, k)
            cands = [mma.MmaConfig(64, s, 4, d, tma=3, kgroups=g) for g, d in ((4, 8), (4, 12), (2, 8), (2, 10))
                     for s in (1, 2, 3)]
            grid_of = {}

            def kernel_only(cfg, xin):
                bm, tps, split, nb, mb, ws, locks = mma.split_grid(m, n, kt, cfg.block_n, cfg.split_k, "cuda")
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                grid_of[cfg.key()] = (bm, tps, split, nb, mb, ws, locks)

                def run():
                    mma_tma.launch(xin, kp, out, False, cfg, (bm, tps, split, nb, mb, ws, locks),
                                   mma.esc_chunk(bm), x_ready=cfg.x_pre)
                    return out
                return run

            fns, labels = [lambda: F.linear(x, w)], ["cublas"]
            fns.append(lambda: mma.w12_mma(x, kp, config=base))
            labels.append(f"tuned {base.key()}")
            checks = []
            for c in cands:
                cp = replace(c, x_pre=True)
                plain, pre = kernel_only(c, xa), kernel_only(cp, xp)
                y0 = plain().clone()
                y1 = pre().clone()
                torch.cuda.synchronize()
                ok = bool(((y1.float() - ref).abs() <= tol).all())
                same = torch.equal(y0.view(torch.int16), y1.view(torch.int16))
                checks.append((c.key(), ok, same))
                fns += [plain, pre]
                labels += [c.key(), cp.key()]
            times = time_interleaved(fns, reps=args.reps, flush=flush)
            t = dict(zip(labels, times))
            best = min((c for c in cands), key=lambda c: t[replace(c, x_pre=True).key()])
            bp = replace(best, x_pre=True)
            whole = time_interleaved([lambda: mma.w12_mma(x, kp, config=bp), lambda: F.linear(x, w)],
                                     reps=args.reps, flush=flush)
            yw = mma.w12_mma(x, kp, config=bp)
            ok_w = bool(((yw.float() - ref).abs() <= tol).all())
            row = {"shape": name, "k": k, "n": n, "m": m, "cublas_us": round(t["cublas"], 2),
                   "tuned_config": base.key(), "tuned_us": round(t[f"tuned {base.key()}"], 2),
                   "variants": [{"config": key, "us": round(t[key], 2),
                                 "x_pre_us": round(t[replace(c, x_pre=True).key()], 2),
                                 "x_pre_correct": ok, "x_pre_same_bits": same}
                                for c, (key, ok, same) in zip(cands, checks)],
                   "best_x_pre": bp.key(), "best_x_pre_kernel_us": round(t[bp.key()], 2),
                   "best_x_pre_with_permute_us": round(whole[0], 2), "cublas_us_2": round(whole[1], 2),
                   "with_permute_correct": ok_w}
            out_rows.append(row)
            best_plain = min(cands, key=lambda c: t[c.key()])
            print(f"{name:13s} m={m:2d} cublas {t['cublas']:6.2f} tuned {row['tuned_us']:6.2f} "
                  f"best plain {t[best_plain.key()]:6.2f} ({best_plain.key()}) best x_pre {t[bp.key()]:6.2f} "
                  f"({bp.key()}) +permute {whole[0]:6.2f} (cublas {whole[1]:6.2f}) "
                  f"correct {all(c[1] for c in checks) and ok_w} same bits {all(c[2] for c in checks)}", flush=True)
    write_results(args.name, out_rows, {"reps": args.reps,
                                        "method": "cuda graph, L2 flushed by reading 256 MB, median of 3 "
                                                  "interleaved runs"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
