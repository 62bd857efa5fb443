"""A/B of the W12 decode on the GPU: the ``prmt``/``lop3`` form (``mma._decode_pairs_fast``) against
the plain one (``plain_decode=True``), in the kernel and tuned config ``w12_linear`` uses (the one-row
Gluon GEMV at M=1, the ``mma.sync`` kernel above), side by side with cuBLAS bf16 in one run.

    python lab/w12/decode_ab.py                     # M=1 -> lab/results/w12_decode_ab.json
    python lab/w12/decode_ab.py --rows 8,32 --name w12_decode_ab_mma

Per layer: encode a random bf16 weight (std 0.02), check both decodes against ``x @ W.T`` in fp32
and against each other bit for bit, then time both and ``F.linear`` in CUDA graphs with L2 flushed
(median of 3 interleaved runs of ``--reps`` replays).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, print_table, time_interleaved, write_results  # noqa: E402
from lab.w12 import committed  # noqa: E402
from w12_gemm import SHAPES, random_layer, row_inputs, speedup_summary  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--name", default="w12_decode_ab")
    ap.add_argument("--rows", default="1", help="comma list of M")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from lab.w12.variants import gemv_gluon, mma

    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = L2Flusher()
    rows = []
    ms = [int(v) for v in args.rows.split(",")]
    for name, k, n in SHAPES:
        w, _, kp, w12_bytes = random_layer(name, k, n, dev)
        for m in ms:
            x, ref, tol = row_inputs(w, m)
            if m == 1:
                run, fast = gemv_gluon.w12_gemv_gluon, committed.gluon_gemv_config(n, k)
            else:
                run, fast = mma.w12_mma, committed.mma_config(m, n, k)
            plain = replace(fast, plain_decode=True)
            yf = run(x, kp, config=fast)
            yp = run(x, kp, config=plain)
            ok = bool(((yf.float() - ref).abs() <= tol).all())
            same = bool(torch.equal(yf.view(torch.int16), yp.view(torch.int16)))
            f_us, p_us, c_us = time_interleaved(
                [lambda: run(x, kp, config=fast), lambda: run(x, kp, config=plain), lambda: F.linear(x, w)],
                reps=args.reps, flush=flush)
            rows.append({"shape": name, "k": k, "n": n, "m": m, "config": fast.key(), "w12_us": round(f_us, 2),
                         "plain_decode_us": round(p_us, 2), "cublas_us": round(c_us, 2),
                         "speedup": round(c_us / f_us, 3), "plain_speedup": round(c_us / p_us, 3),
                         "w12_TBps": round(w12_bytes / f_us / 1e6, 3), "correct": ok, "bitwise_equal_plain": same})
            print(f"{name:16s} m={m:2d} prmt {f_us:7.2f} plain {p_us:7.2f} cublas {c_us:7.2f} us  x{c_us / f_us:.3f} "
                  f"(plain x{c_us / p_us:.3f}){'' if ok and same else '  WRONG' if not ok else '  BITS DIFFER'}",
                  flush=True)
        w = kp = None
        torch.cuda.empty_cache()
    summary = speedup_summary(rows, ms, ("speedup", "plain_speedup"))
    write_results(args.name, rows, {"summary": summary, "reps": args.reps, "weights": "randn*0.02 bf16"})
    print_table(rows, ["shape", "m", "w12_us", "plain_decode_us", "cublas_us", "speedup", "plain_speedup", "w12_TBps"])
    print(json.dumps(summary))
    return 0 if all(r["correct"] and r["bitwise_equal_plain"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
