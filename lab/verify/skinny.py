"""The skinny GEMM (``kernels/verify/skinny.py``) against cuBLAS and cuBLASLt ``F.linear`` for
2..64 rows: its config sweep per (layer, rows), the winner re-timed beside both libraries.

    python lab/verify/skinny.py [--rows 4,8,16,32,64] [--quick] [--steps llama-3.1-8b,qwen3.5-9b]

Times every config of the sweep per (layer, rows) against cuBLAS and cuBLASLt in the same
process (CUDA graphs, L2 flushed by reading, interleaved rounds) and proposes table entries where
it wins. ``--steps``: whole steps (random bf16 weights, context 1024, CUDA graphs; one request of
4..64 rows, and 4/16/32 requests x 1 row for dense models) without the proposed entries (cuBLAS
everywhere) and with them, alternating, two rounds. Writes lab/results/skinny.json.
"""

from __future__ import annotations

import argparse
import itertools
from contextlib import contextmanager
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from specpilot.kernels.verify import skinny  # noqa: E402
from specpilot.kernels.verify.skinny import SkinnyConfig, skinny_linear  # noqa: E402


# (k, n) of the engine's dense projections: Llama-3.1-8B (q/k/v, o, gate/up, down), then Qwen3.5-9B's
# others (GDN in_proj, gated attention's q/k/v, gate/up, down)
LAYERS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 12352), (4096, 10240), (4096, 24576),
          (12288, 4096)]


@contextmanager
def tile(bn: int, bk: int, warps: int):
    """The kernel's tile constants for the configs the sweep tries beyond the routed ones."""
    saved = (skinny.BLOCK_N, skinny.BLOCK_K, skinny.WARPS)
    skinny.BLOCK_N, skinny.BLOCK_K, skinny.WARPS = bn, bk, warps
    try:
        yield
    finally:
        skinny.BLOCK_N, skinny.BLOCK_K, skinny.WARPS = saved


def sweep_configs(k: int, n: int, quick: bool) -> list[tuple]:
    """(block_n, block_k, warps, SkinnyConfig) to try for a layer [n, k]."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for bn, bk, w, st in itertools.product((64, 128), (128, 256), (4, 8), (3, 4)):
        if bn * bk * 2 * st > 200 * 1024:
            continue
        nb = -(-n // bn)
        kt = -(-k // bk)
        for target in ((2,) if quick else (1, 2, 4)):
            split = max(1, min(kt, round(target * sms / nb)))
            c = (bn, bk, w, SkinnyConfig(split, st))
            if c not in out:
                out.append(c)
    return out


def key(c: tuple) -> str:
    bn, bk, w, cfg = c
    return f"n{bn}-k{bk}-w{w}-{cfg.key()}"


SPANS = {4: [2, 4], 8: [5, 8], 16: [9, 16], 32: [17, 32], 64: [33, 64]}   # rows a measured point stands for
WIN = 1.03   # the skinny GEMM must beat the faster BLAS library by this much to take a span


def table_entries(points: list[dict]) -> list[dict]:
    """``kernels/verify/tuned`` entries for the points the skinny GEMM won with the kernel's tile
    (rows 4/8/16/32/64 stand for the row spans their tile covers); a winner on another tile is
    reported, not proposed."""
    routed = [skinny.BLOCK_N, skinny.BLOCK_K, skinny.WARPS]
    out = []
    for p in points:
        if p["kind"] == "layer" and p["rows"] in SPANS and p["speedup_vs_best_blas"] >= WIN:
            if p["tile"] != routed:
                print(f"winner outside the kernel's tile: {p['n']}x{p['k']} at {p['rows']} rows, {p['config']}")
                continue
            out.append({"kernel": "skinny", "n": p["n"], "k": p["k"], "rows": SPANS[p["rows"]],
                        "config": {"split": p["split"], "stages": p["stages"]},
                        "note": f"{p['skinny_us']:.1f} us vs cuBLAS {p['cublas_us']:.1f} / cuBLASLt "
                                f"{p['cublaslt_us']:.1f} us at {p['rows']} rows"})
    return out


MODES = ("cublas", "skinny")


def steps(models: list[str], entries: list[dict], rounds: int = 2, device: str = "cuda") -> list[dict]:
    from specpilot.engine.api import load_target
    from specpilot.engine.batch.probe import measure_rows_batched
    from specpilot.engine.rows import measure_rows
    from specpilot.engine.spec import EngineSpec
    from specpilot.kernels.verify import blas

    def proposed(arch, n, k, rows):
        for e in entries:
            if e["n"] == n and e["k"] == k and e["rows"][0] <= rows <= e["rows"][1]:
                return SkinnyConfig(**e["config"])
        return None

    table = blas._skinny
    out = []
    try:
        for name in models:
            target = load_target(EngineSpec.parse(f"engine:model={name},random=1,device={device},ctx={1024 + 128}"))
            for rnd in range(rounds):
                for mode in MODES:
                    blas._skinny = proposed if mode == "skinny" else (lambda arch, n, k, rows: None)
                    res = measure_rows(target.model, [4, 8, 16, 32, 33, 64], 1024, reps=30, warmup=5)
                    for p in res.points:
                        out.append({"kind": "step", "model": name, "mode": mode, "round": rnd, "batch": 1,
                                    "rows": p["rows"], "step_ms": p["step_ms"], "c": p["c"]})
                        print(out[-1], flush=True)
                    if not target.model.spec.is_hybrid:
                        for b in (4, 16, 32):
                            bres = measure_rows_batched(target.model, b, [1], 1024, reps=30, warmup=5)
                            for p in bres.points:
                                out.append({"kind": "step", "model": name, "mode": mode, "round": rnd, "batch": b,
                                            "rows": p["rows"], "step_ms": p["step_ms"], "c": p["c"]})
                                print(out[-1], flush=True)
            del target
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        blas._skinny = table
    return out


def main() -> None:
    from lab.common import L2Flusher, bootstrap, parse_int_list, time_interleaved, write_results
    from lab.verify.blas_backend import blas_call, operands

    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8,16,32,64")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", default="", help="models whose whole steps to time with and without the entries")
    args = ap.parse_args()
    rows_list = parse_int_list(args.rows, 1, 64, "rows")
    import torch.nn.functional as F

    flush = L2Flusher()
    out = []
    for k, n, rows, x, w in operands(LAYERS, rows_list):
        ref = F.linear(x.float(), w.float())
        base = time_interleaved([blas_call(x, w, "cublas"), blas_call(x, w, "cublaslt")], flush=flush, rounds=3,
                                reps=30)
        torch.backends.cuda.preferred_blas_library("cublas")

        def run(c):
            bn, bk, warps, cfg = c
            with tile(bn, bk, warps):
                return skinny_linear(x, w, cfg)

        best = None
        for c in sweep_configs(k, n, args.quick):
            try:
                err = float((run(c).float() - ref).abs().max())
                us = time_interleaved([lambda c=c: run(c)], flush=flush, rounds=1, reps=20)[0]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print("skip", key(c), type(e).__name__, str(e)[:80], flush=True)
                continue
            if best is None or us < best[1]:
                best = (c, us, err)
        c, _, err = best
        # the winner re-timed beside both BLAS libraries
        final = time_interleaved([blas_call(x, w, "cublas"), blas_call(x, w, "cublaslt"), lambda: run(c)],
                                 flush=flush, rounds=5, reps=50)
        torch.backends.cuda.preferred_blas_library("cublas")
        floor_us = n * k * 2 / 4.8e6
        row = {"kind": "layer", "k": k, "n": n, "rows": rows, "cublas_us": final[0], "cublaslt_us": final[1],
               "skinny_us": final[2], "speedup_vs_best_blas": min(final[0], final[1]) / final[2], "floor_us": floor_us,
               "skinny_of_floor": floor_us / final[2], "cublas_of_floor": floor_us / final[0],
               "config": key(c), "tile": list(c[:3]), "split": c[3].split, "stages": c[3].stages,
               "max_err": err, "sweep_base": base}
        out.append(row)
        print({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items() if a != "sweep_base"},
              flush=True)
        write_results("skinny", out, {"table_entries": table_entries(out)})   # a run cut short keeps its points
    entries = table_entries(out)
    if args.steps:
        out += steps([m for m in args.steps.split(",") if m], entries)
        write_results("skinny", out, {"table_entries": entries})
        summary = {}
        for r in out:
            if r.get("kind") == "step":
                summary.setdefault((r["model"], r["batch"], r["rows"], r["mode"]), []).append(r["step_ms"])
        for (m, b, n, mode), v in sorted(summary.items()):
            if mode == "cublas":
                print(f"{m} batch {b} rows {n}: " + ", ".join(
                    f"{md} {min(summary[(m, b, n, md)]):.3f} ms" for md in MODES))


if __name__ == "__main__":
    main()
