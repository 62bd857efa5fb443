"""The stream-K TMA-ring GEMM (``kernels/verify/ring.py``) against cuBLAS: each Llama-3.1-8B layer
alone (CUDA graphs, L2 flushed, checked against fp32 and bitwise run to run) over a grid of
configs, then whole verify steps (one request of 16/33/64 rows, 16 requests x 1 row) with the ring
routed for every dense projection of 9 or more rows, the per-layer winners as configs.

    python lab/verify/ring.py [--rows 16,32,64] [--cases 1x16,1x33,1x64,16x1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import L2Flusher, bootstrap, parse_int_list, print_table, time_interleaved, write_results  # noqa: E402

# the ring everywhere, or cuBLAS kept for the projections named (n, k)
VARIANTS = {"cublas": set(), "ring": set(), "ring-no-o": {(4096, 4096)},
            "ring-no-o-down": {(4096, 4096), (4096, 14336)}}
LLAMA = {"qkv": (4096, 6144), "o": (4096, 4096), "gu": (4096, 28672), "down": (14336, 4096)}   # (k, n)


def configs(quick: bool):
    from specpilot.kernels.verify.ring import RingConfig

    if quick:
        return [RingConfig(128, 8, 1, 0, 1), RingConfig(128, 8, 1, 0, 0)]
    # (block_n, stages, programs per SM, consumer registers, wgmmas in flight, 64-column boxes per
    # stage): what fits an SM's 227 KB of shared memory
    grid = [(64, 12, 1, 0, 1, 1), (64, 8, 1, 0, 1, 2), (64, 6, 1, 0, 1, 2), (64, 4, 1, 0, 1, 4),
            (128, 6, 1, 0, 1, 2), (128, 4, 1, 0, 1, 2), (128, 3, 1, 0, 1, 4), (64, 4, 2, 128, 1, 2),
            (64, 3, 2, 128, 1, 2), (64, 2, 2, 128, 1, 4)]
    return [RingConfig(*g) for g in grid]


def checked(run, ref, blas_err: float, label: str) -> float | None:
    """The largest error of ``run()`` against the fp32 product ``ref``, or None (printed with
    ``label``) where the config does not compile or fit, is off by more than twice cuBLAS's error,
    or differs between two runs."""
    import torch

    try:
        y = run()
        err = float((y.float() - ref).abs().max())
        same = bool(torch.equal(y, run()))
    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
        print("skip", label, type(e).__name__, str(e)[:160], flush=True)
        return None
    if err > 2 * blas_err + 1e-2 or not same:
        print("WRONG", label, err, blas_err, same, flush=True)
        return None
    return err


def against_cublas_and_ring(label: str, run, candidates, rows_text: str, names, ring_cfgs) -> list[dict]:
    """Each Llama-3.1-8B layer of ``names`` at each row count of ``rows_text``: the fastest of
    ``candidates`` (configs of ``run(x, w, cfg)`` that pass :func:`checked`) beside cuBLAS and the
    ring (its first config of ``ring_cfgs`` that fits the rows), CUDA graphs with L2 flushed, timed
    interleaved. Rows: layer, rows, k, n, ``blas_us``, ``ring_us``, ``us``, config, ``vs_blas``,
    ``vs_ring``, ``tb_s`` (the weight bytes over the time)."""
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.verify import blas
    from specpilot.kernels.verify.ring import ring_linear

    torch.set_grad_enabled(False)
    flush = L2Flusher()
    out = []
    for name in names:
        k, n = LLAMA[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in parse_int_list(rows_text, 1, 64, f"{label}: --rows"):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            blas_err = float((F.linear(x, w).float() - ref).abs().max())
            cands = [c for c in candidates
                     if checked(lambda c=c: run(x, w, c), ref, blas_err, f"{name} {m} {c.key()}") is not None]
            if not cands:
                continue
            ring = next((c for c in ring_cfgs
                         if checked(lambda c=c: ring_linear(x, w, c), ref, blas_err, f"{name} {m} ring {c.key()}")
                         is not None), None)
            fns = ([lambda: blas.linear(x, w)] + ([lambda: ring_linear(x, w, ring)] if ring else [])
                   + [lambda c=c: run(x, w, c) for c in cands])
            t = time_interleaved(fns, flush=flush, rounds=3, reps=30)
            t_ring, t_c = (t[1], t[2:]) if ring else (None, t[1:])
            i = min(range(len(cands)), key=lambda j: t_c[j])
            row = {"layer": name, "rows": m, "k": k, "n": n, "blas_us": t[0], "ring_us": t_ring, "us": t_c[i],
                   "config": cands[i].key(), "vs_blas": t[0] / t_c[i], "vs_ring": t_ring / t_c[i] if ring else None,
                   "tb_s": n * k * 2 / t_c[i] / 1e6}
            out.append(row)
            print({a: round(b, 3) if isinstance(b, float) else b for a, b in row.items()}, flush=True)
        del w
    print_table(out, ["layer", "rows", "blas_us", "ring_us", "us", "config", "vs_blas", "vs_ring"])
    write_results(label, out)
    return out


def sweep_main(label: str, run, candidates, ring_cfgs) -> int:
    """A ring variant's command line (``--rows``, ``--layers``): :func:`against_cublas_and_ring`."""
    ap = argparse.ArgumentParser(prog=label)
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--layers", default=",".join(LLAMA))
    args = ap.parse_args()
    bad = [x for x in args.layers.split(",") if x not in LLAMA]
    if bad:
        raise SystemExit(f"{label}: --layers: unknown layer {bad[0]!r}; choose from {', '.join(LLAMA)}")
    against_cublas_and_ring(label, run, candidates, args.rows, args.layers.split(","), ring_cfgs)
    return 0


def layers(rows_list, quick, flush):
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.verify import blas
    from specpilot.kernels.verify.ring import ring_linear

    rows_out, best = [], {}
    for name, (k, n) in LLAMA.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            blas_err = float((F.linear(x, w).float() - ref).abs().max())
            cands = []
            for cfg in configs(quick):
                err = checked(lambda c=cfg: ring_linear(x, w, c), ref, blas_err, f"{name} {m} {cfg.key()}")
                if err is None:
                    continue
                us = time_interleaved([lambda c=cfg: ring_linear(x, w, c)], flush=flush, rounds=1, reps=20)[0]
                cands.append((us, cfg, err))
            cands.sort(key=lambda t: t[0])
            print(name, m, " ".join(f"{c.key()}={us:.1f}" for us, c, _ in cands), flush=True)
            top = [c for _, c, _ in cands[:3]]
            fns = [lambda: blas.linear(x, w)] + [lambda c=c: ring_linear(x, w, c) for c in top]
            t = time_interleaved(fns, flush=flush, rounds=5, reps=50)
            i = min(range(len(top)), key=lambda j: t[j + 1])
            row = {"layer": name, "k": k, "n": n, "rows": m, "routed_us": t[0], "ring_us": t[i + 1],
                   "speedup": t[0] / t[i + 1], "config": top[i].key(), "tb_s": n * k * 2 / t[i + 1] / 1e6,
                   "max_err": cands[0][2], "blas_err": blas_err}
            best[(n, k, m)] = top[i]
            rows_out.append(row)
            print({a: round(b, 3) if isinstance(b, float) else b for a, b in row.items()}, flush=True)
        del w
    return rows_out, best


def steps(best, cases, rounds, model_name="llama-3.1-8b", fixed=None):
    from lab.verify.step_parts import patched, random_target, time_cases
    from specpilot.kernels.verify import blas
    from specpilot.kernels.verify.ring import RingConfig, ring_linear, supported

    model = random_target(model_name, 1024)
    plain = blas.linear

    skip = set()

    def routed(h, w, batched=False):
        m = h.shape[0]
        if m >= 9 and supported(h, w) and tuple(w.shape) not in skip:
            key = min(((n, k, r) for (n, k, r) in best if (n, k) == tuple(w.shape) and r >= m),
                      key=lambda t: t[2], default=None)
            return ring_linear(h, w, fixed or (best[key] if key else RingConfig()))
        return plain(h, w, batched)

    @contextmanager
    def routing(name):
        skip.clear()
        skip.update(VARIANTS[name])
        with patched(blas, "linear", routed if name != "cublas" else plain):
            yield

    times = time_cases(model, cases, {v: (lambda v=v: routing(v)) for v in VARIANTS}, rounds)
    out = []
    for c in cases:
        row = {"case": c}
        for v in VARIANTS:
            row[f"{v}_ms"] = statistics.median(times[(c, v)])
        out.append(row)
    return out


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--cases", default="1x16,1x32,1x33,1x64,16x1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--steps-only", default="", help="models whose whole steps to time with --config alone")
    ap.add_argument("--config", default="64,4,1,0,1,4", help="block_n,stages,per_sm,regs,inflight,kboxes")
    args = ap.parse_args()
    import torch

    torch.set_grad_enabled(False)
    if args.steps_only:
        from specpilot.kernels.verify.ring import RingConfig

        fixed = RingConfig(*(int(v) for v in args.config.split(",")))
        out = []
        for name in args.steps_only.split(","):
            st = steps({}, args.cases.split(","), args.rounds, name, fixed)
            for r in st:
                r["model"] = name
            out += st
            print_table(st, ["case"] + [f"{v}_ms" for v in VARIANTS])
        write_results("ring_steps", out)
        return 0
    rows_list = parse_int_list(args.rows, 9, 64, "ring: --rows")
    flush = L2Flusher()
    rows, best = layers(rows_list, args.quick, flush)
    print_table(rows, ["layer", "rows", "routed_us", "ring_us", "speedup", "tb_s", "config"])
    write_results("ring_layers", rows)
    if not args.no_steps:
        st = steps(best, args.cases.split(","), args.rounds)
        print_table(st, ["case"] + [f"{v}_ms" for v in VARIANTS])
        write_results("ring_steps", st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
