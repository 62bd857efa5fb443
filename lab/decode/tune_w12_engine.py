"""Tune the Gluon W12 fused decode kernels inside the engine's AR step (the setup of
``benchmarks/decode_w12_engine.py``): one kernel at a time, each of :data:`CANDIDATES` in place of
the table's config, the step re-captured and timed, the fastest kept; prints the entries for
``kernels/decode/tuned/<arch>.json``.

    python lab/decode/tune_w12_engine.py [--reps 100] [--context 1024] [--head linear|certified]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lab.common import bootstrap  # noqa: E402

bootstrap()

from decode_w12_engine import KERNELS, build_engines, step_ms  # noqa: E402  (benchmarks/)

from lab.common import write_results  # noqa: E402

# (pairs, warps, depth, maxnreg) of the Gluon kernels tried per kernel
CANDIDATES = ((4, 4, 4, None), (4, 4, 4, 96), (8, 4, 4, None), (8, 4, 4, 96), (8, 4, 3, None), (8, 4, 2, None),
              (8, 8, 2, None), (8, 2, 4, None), (4, 8, 2, None), (4, 2, 4, None), (16, 4, 2, None), (16, 4, 3, None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--head", choices=["linear", "certified"], default="linear")
    args = ap.parse_args()
    import torch

    from specpilot.kernels.decode import gemv_w12_gluon

    if not torch.cuda.is_available():
        print("tune_w12_engine: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    spec, _, w12, _ = build_engines(args.context, args.head)
    table = {key: gemv_w12_gluon.config_for(*key, device="cuda") for key in KERNELS}
    table_config_for = gemv_w12_gluon.config_for
    # the candidate in place of the table's config (the kernels ask config_for at capture)
    gemv_w12_gluon.config_for = lambda epi, n, k, device=None: table.get((epi, n, k)) or table_config_for(epi, n, k,
                                                                                                          device)
    trials = []
    base_ms = step_ms(w12, "fused", args.context, args.reps)
    print(f"tune: start {base_ms:.3f} ms/step", flush=True)
    for key in KERNELS:
        best = (table[key], base_ms)
        for p, w, d, r in CANDIDATES:
            cfg = gemv_w12_gluon.GluonFusedConfig(p, w, d, r)
            if cfg == best[0] or (key[0] == "rope" and 64 % p):
                continue
            table[key] = cfg
            try:
                ms = step_ms(w12, "fused", args.context, args.reps)
            except Exception as e:  # a variant that does not compile or fit is skipped, and said
                print(f"  {key} {cfg.key()}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
                trials.append({"kernel": list(key), "config": cfg.key(), "error": str(e)[:200]})
                continue
            regs = gemv_w12_gluon.COMPILED.get((*key, cfg.key()))
            trials.append({"kernel": list(key), "config": cfg.key(), "step_ms": round(ms, 4), "regs_spills": regs})
            print(f"  {key} {cfg.key()}: {ms:.3f} ms/step {regs}", flush=True)
            if ms < best[1]:
                best = (cfg, ms)
        table[key] = best[0]
        base_ms = best[1]
        print(f"tune: {key} keeps {best[0].key()} ({best[1]:.3f} ms/step)", flush=True)
    entries = [{"kernel": "gemv-w12-gluon", "epilogue": epi, "n": n, "k": k, "config": table[(epi, n, k)].__dict__}
               for epi, n, k in KERNELS]
    for e in entries:
        print(json.dumps(e))
    write_results("tune_w12_engine", trials, {"model": spec.name, "context": args.context, "head": args.head,
                                              "entries": entries, "step_ms": round(base_ms, 4)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
