"""How fast can a kernel merely *read* a layer's bytes, timed the way the GEMM benchmarks time?

    python benchmarks/read_floor.py            # -> results/read_floor.json

The W12 GEMM targets are ratios over cuBLAS at one row, where small layers are bound by fixed
latency (launch, DRAM ramp, tail) as much as by bytes. This benchmark measures that floor
directly, in the harness of ``w12_gemm.py`` (CUDA graph, L2 flushed by reading 256 MB before each
replay, CUDA events, median):

* ``empty_us``: a graph holding one kernel that reads nothing (the fixed cost of one timed launch);
* ``read_w12_us`` / ``read_bf16_us``: the fastest of a sweep of streaming-read kernels (every byte
  loaded once in 16-byte vectors, folded into one int per program) over exactly the layer's W12
  record bytes and its bf16 weight bytes;
* ``read_slices_us`` / ``read_whole_us``: the fastest read of the same records in the W12 kernels'
  access pattern (a program reads its 8 or 16 rows of each record of its K range: a 512 B-1 KB piece
  of the view and half that of nibbles per record), and with whole 12 KB records per program;
* ``cublas_us`` (``F.linear``, one row) and ``w12_us`` (``w12_linear``, one row), in the same run.

``ceiling = cublas_us / read_w12_us`` is the speedup a W12 kernel would reach if it cost no more
than reading its bytes; ``w12_vs_floor = read_w12_us / w12_us`` is how close the real kernel is.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bootstrap  # noqa: E402

bootstrap()

from common import L2Flusher, print_table, time_cuda_graph, write_results  # noqa: E402
from w12_gemm import SHAPES, random_layer  # noqa: E402

from specpilot.kernels.triton_env import tl, triton  # noqa: E402

if triton is not None:
    @triton.jit
    def _read_kernel(src, out, n_vec, VEC_PER_PROG, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        """Program p folds 16-byte vectors [p * VEC_PER_PROG, (p + 1) * VEC_PER_PROG) into one int."""
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * VEC_PER_PROG
        end = tl.minimum(start + VEC_PER_PROG, n_vec)
        rows = tl.arange(0, BLOCK)
        lanes = tl.arange(0, 4)
        acc = tl.zeros((BLOCK, 4), dtype=tl.int32)
        for v in tl.range(start, end, BLOCK, num_stages=STAGES):
            r = v + rows
            acc ^= tl.load(src + r[:, None] * 4 + lanes[None, :], mask=(r < end)[:, None], other=0)
        tl.store(out + pid, tl.sum(tl.sum(acc, axis=1), axis=0))

    @triton.jit
    def _read_slices_kernel(src, out, KT, TILES_PER_PROG, ROWS: tl.constexpr, RECS: tl.constexpr,
                            STAGES: tl.constexpr):
        """The W12 kernels' access pattern: program ``(n, k)`` reads, for the records of its K range
        (``RECS`` per iteration), the view words (``ROWS * 64`` bytes) and nibble words (``ROWS * 32``)
        of its ``ROWS`` rows of one 128-row record tile (``ROWS = 128``: whole 12 KB records)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n0 = pid_n * ROWS
        tile = (n0 // 128).to(tl.int64) * KT
        r_in = n0 % 128
        t0 = pid_k * TILES_PER_PROG
        t1 = tl.minimum(t0 + TILES_PER_PROG, KT)
        ri = tl.arange(0, RECS)
        vo = r_in * 16 + tl.arange(0, ROWS * 16)
        qo = 2048 + r_in * 8 + tl.arange(0, ROWS * 8)
        acc_v = tl.zeros((RECS, ROWS * 16), dtype=tl.int32)
        acc_q = tl.zeros((RECS, ROWS * 8), dtype=tl.int32)
        for t in tl.range(t0, t1, RECS, num_stages=STAGES):
            rr = t + ri
            ok = (rr < t1)[:, None]
            base = (tile + rr) * 3072
            acc_v ^= tl.load(src + base[:, None] + vo[None, :], mask=ok, other=0)
            acc_q ^= tl.load(src + base[:, None] + qo[None, :], mask=ok, other=0)
        tl.store(out + pid_n * tl.num_programs(1) + pid_k,
                 tl.sum(tl.sum(acc_v, axis=1), axis=0) ^ tl.sum(tl.sum(acc_q, axis=1), axis=0))


def read_configs():
    """(vectors per iteration, warps, stages, programs per SM)."""
    for block in (512, 1024, 2048):
        for warps in (4, 8):
            for stages in (1, 3):
                for per_sm in (1, 2, 4, 8, 16):
                    yield block, warps, stages, per_sm


def best_read_us(buf, flush, sms: int, reps: int):
    """The fastest read of ``buf`` (int32, length a multiple of 4) over :func:`read_configs`."""
    import torch

    n_vec = buf.numel() // 4
    best = (math.inf, None)
    for block, warps, stages, per_sm in read_configs():
        progs = sms * per_sm
        vpp = (n_vec + progs - 1) // progs
        vpp = (vpp + block - 1) // block * block
        progs = (n_vec + vpp - 1) // vpp
        out = torch.empty(progs, dtype=torch.int32, device=buf.device)

        def run():
            _read_kernel[(progs,)](buf, out, n_vec, vpp, BLOCK=block, STAGES=stages, num_warps=warps)

        us = time_cuda_graph(run, reps=reps, flush=flush)
        if us < best[0]:
            best = (us, f"block{block}-w{warps}-st{stages}-{per_sm}/sm")
    return best


def slice_configs():
    """(rows per program, records per iteration, warps, stages, programs per SM)."""
    for rows in (8, 16, 128):
        for recs in (4, 8):
            for stages in (1, 3):
                for per_sm in (2, 4, 8):
                    yield rows, recs, 4, stages, per_sm


def best_slices_us(rec, n: int, kt: int, flush, sms: int, reps: int) -> dict:
    """The fastest read of the records in the W12 kernels' pattern (:func:`_read_slices_kernel`),
    per program shape: ``{"slices": (us, config), "whole": (us, config)}`` (8-16 rows / whole records)."""
    import torch

    best = {"slices": (math.inf, None), "whole": (math.inf, None)}
    for rows, recs, warps, stages, per_sm in slice_configs():
        nb = n // rows
        split = max(1, min(kt, round(per_sm * sms / nb)))
        tpp = (kt + split - 1) // split
        split = (kt + tpp - 1) // tpp
        out = torch.empty(nb * split, dtype=torch.int32, device=rec.device)

        def run():
            _read_slices_kernel[(nb, split)](rec, out, kt, tpp, ROWS=rows, RECS=recs, STAGES=stages,
                                             num_warps=warps)

        us = time_cuda_graph(run, reps=reps, flush=flush)
        key = "whole" if rows == 128 else "slices"
        if us < best[key][0]:
            best[key] = (us, f"rows{rows}-recs{recs}-w{warps}-st{stages}-s{split}")
    return best


def main() -> int:
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.w12.gemm import w12_linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--shapes", default="", help="comma-separated names from w12_gemm.SHAPES (default all)")
    ap.add_argument("--name", default="read_floor")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("read_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = L2Flusher()
    tiny = torch.zeros(4, dtype=torch.int32, device=dev)
    sink = torch.empty(1, dtype=torch.int32, device=dev)
    empty_us = time_cuda_graph(
        lambda: _read_kernel[(1,)](tiny, sink, 0, 1, BLOCK=512, STAGES=1, num_warps=4), reps=args.reps, flush=flush)
    print(f"empty kernel graph: {empty_us:.2f} us", flush=True)
    rows = []
    for name, k, n in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        w, _, kp, w12_bytes = random_layer(name, k, n, dev)
        rec = kp.rec64.view(torch.int32)
        r_w12, cfg_w12 = best_read_us(rec, flush, sms, args.reps)
        r_bf16, cfg_bf16 = best_read_us(w.view(torch.int32).reshape(-1), flush, sms, args.reps)
        pattern = best_slices_us(rec, n, kp.k_tiles, flush, sms, args.reps)
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        c_t, w_t = [], []
        for _ in range(3):
            c_t.append(time_cuda_graph(lambda: F.linear(x, w), reps=args.reps, flush=flush))
            w_t.append(time_cuda_graph(lambda: w12_linear(x, kp), reps=args.reps, flush=flush))
        c_us, w_us = sorted(c_t)[1], sorted(w_t)[1]
        row = {"shape": name, "k": k, "n": n, "m": 1, "w12_bytes": w12_bytes, "bf16_bytes": w.numel() * 2,
               "empty_us": round(empty_us, 2), "read_w12_us": round(r_w12, 2), "read_w12_config": cfg_w12,
               "read_bf16_us": round(r_bf16, 2), "read_bf16_config": cfg_bf16,
               "read_slices_us": round(pattern["slices"][0], 2), "read_slices_config": pattern["slices"][1],
               "read_whole_us": round(pattern["whole"][0], 2), "read_whole_config": pattern["whole"][1],
               "cublas_us": round(c_us, 2), "w12_us": round(w_us, 2),
               "read_w12_TBps": round(rec.numel() * 4 / r_w12 / 1e6, 3),
               "read_bf16_TBps": round(w.numel() * 2 / r_bf16 / 1e6, 3),
               "ceiling": round(c_us / r_w12, 3), "speedup": round(c_us / w_us, 3),
               "w12_vs_floor": round(r_w12 / w_us, 3), "cublas_vs_floor": round(r_bf16 / c_us, 3)}
        rows.append(row)
        print(row, flush=True)
        w = kp = rec = None
        torch.cuda.empty_cache()

    def geo(key):
        return round(math.exp(sum(math.log(r[key]) for r in rows) / len(rows)), 3)

    summary = {"empty_us": round(empty_us, 2), "geomean_ceiling_m1": geo("ceiling"),
               "geomean_speedup_m1": geo("speedup"), "geomean_w12_vs_floor": geo("w12_vs_floor"),
               "geomean_cublas_vs_floor": geo("cublas_vs_floor")}
    write_results(args.name, rows, {"summary": summary, "reps": args.reps,
                                    "method": "cuda graph, L2 flushed by reading 256 MB, CUDA events, median"})
    print_table(rows, ["shape", "read_w12_us", "read_slices_us", "read_whole_us", "read_bf16_us", "cublas_us",
                       "w12_us", "ceiling", "speedup", "w12_vs_floor", "cublas_vs_floor"])
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
