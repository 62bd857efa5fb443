"""How fast can a kernel merely *read* a layer's bytes, timed the way the GEMM benchmarks time?

    python benchmarks/read_floor.py            # -> results/read_floor.json

The W12 GEMM targets are ratios over cuBLAS at one row, where small layers are bound by fixed
latency (launch, DRAM ramp, tail) as much as by bytes. This benchmark measures that floor
directly, in the harness of ``w12_gemm.py`` (CUDA graph, L2 flushed by reading 256 MB before each
replay, CUDA events, median):

* ``empty_us``: a graph holding one kernel that reads nothing (the fixed cost of one timed launch);
* ``read_w12_us`` / ``read_bf16_us``: the fastest of a sweep of streaming-read kernels over exactly
  the layer's W12 record bytes and its bf16 weight bytes: plain loads (every byte loaded once in
  16-byte vectors, ``*_plain_us``) and TMA copies into a shared-memory ring, contiguous runs or a
  persistent grid-stride (``*_tma_us``, Hopper), each folded into one int per program;
* ``read_slices_us`` / ``read_whole_us``: the fastest read of the same records in the W12 kernels'
  access pattern (a program reads its 8 or 16 rows of each record of its K range: a 512 B-1 KB piece
  of the view and half that of nibbles per record), and with whole 12 KB records per program;
* ``cublas_us`` (``F.linear``) and ``w12_us`` (``w12_linear``) at each of ``--rows`` (default one row),
  in the same run (median of three interleaved runs).

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

from common import L2Flusher, parse_int_list, print_table, time_cuda_graph, time_interleaved, write_results  # noqa: E402
from w12_gemm import random_layer, select_shapes  # noqa: E402

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

    @triton.jit
    def _read_tma_kernel(desc, out, n_blocks, BLOCKS_PER_PROG, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
                         PERSIST: tl.constexpr):
        """TMA copies of ``[BLOCK_R, 32]`` int32 boxes (128-byte rows) into a ``STAGES``-deep
        shared-memory ring (Triton's pipeliner: mbarriers, one thread issues the copies), folded into
        one int per program. ``PERSIST``: program p takes boxes p, p + G, p + 2G... (G programs);
        else a contiguous run of ``BLOCKS_PER_PROG`` boxes."""
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK_R, 32), dtype=tl.int32)
        if PERSIST:
            for b in tl.range(pid, n_blocks, tl.num_programs(0), num_stages=STAGES):
                acc ^= desc.load([b * BLOCK_R, 0])
        else:
            b0 = pid * BLOCKS_PER_PROG
            for b in tl.range(b0, tl.minimum(b0 + BLOCKS_PER_PROG, n_blocks), num_stages=STAGES):
                acc ^= desc.load([b * BLOCK_R, 0])
        tl.store(out + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def read_configs():
    """(vectors per iteration, warps, stages, programs per SM)."""
    for block in (512, 1024, 2048):
        for warps in (4, 8):
            for stages in (1, 3):
                for per_sm in (1, 2, 4, 8, 16):
                    yield block, warps, stages, per_sm


def fastest(cases, flush, reps: int) -> tuple[float, str | None]:
    """``(us, label)`` of the fastest of ``cases``, ``(label, fn)`` pairs each timed in a CUDA graph."""
    best = (math.inf, None)
    for label, fn in cases:
        us = time_cuda_graph(fn, reps=reps, flush=flush)
        if us < best[0]:
            best = (us, label)
    return best


def best_read_us(buf, flush, sms: int, reps: int):
    """The fastest read of ``buf`` (int32, length a multiple of 4) over :func:`read_configs`."""
    import torch

    n_vec = buf.numel() // 4

    def cases():
        for block, warps, stages, per_sm in read_configs():
            progs = sms * per_sm
            vpp = (n_vec + progs - 1) // progs
            vpp = (vpp + block - 1) // block * block
            progs = (n_vec + vpp - 1) // vpp
            out = torch.empty(progs, dtype=torch.int32, device=buf.device)
            yield (f"block{block}-w{warps}-st{stages}-{per_sm}/sm",
                   lambda: _read_kernel[(progs,)](buf, out, n_vec, vpp, BLOCK=block, STAGES=stages, num_warps=warps))

    return fastest(cases(), flush, reps)


def tma_configs():
    """(box rows, warps, stages, programs per SM, persistent): 8-32 KB boxes, 2-4 stages."""
    for box in (64, 128, 256):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                for per_sm, persist in ((1, False), (2, False), (4, False), (1, True), (2, True)):
                    if box * 128 * stages * per_sm <= 200 * 1024:   # the ring fits the SM's shared memory
                        yield box, warps, stages, per_sm, persist


def tma_grid(n_blocks: int, sms: int, per_sm: int, persist: bool) -> tuple[int, int]:
    """(programs, boxes per program) of one TMA read: ``sms * per_sm`` programs striding over the
    boxes (persistent), or as many contiguous runs of boxes as cover them."""
    progs = max(1, min(n_blocks, sms * per_sm))
    if persist:
        return progs, 0
    bpp = -(-n_blocks // progs)
    return -(-n_blocks // bpp), bpp


def best_tma_read_us(buf, flush, sms: int, reps: int):
    """The fastest TMA read of ``buf`` (int32, length a multiple of 32) over :func:`tma_configs`;
    ``(inf, None)`` where Triton has no tensor descriptors or the GPU no TMA (before sm_90)."""
    import torch

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return math.inf, None
    if torch.cuda.get_device_capability(buf.device)[0] < 9 or buf.numel() % 32:
        return math.inf, None
    view = buf.view(-1, 32)

    def cases():
        for box, warps, stages, per_sm, persist in tma_configs():
            n_blocks = -(-view.shape[0] // box)
            progs, bpp = tma_grid(n_blocks, sms, per_sm, persist)
            desc = TensorDescriptor.from_tensor(view, [box, 32])
            out = torch.empty(progs, dtype=torch.int32, device=buf.device)
            yield (f"tma-box{box}-w{warps}-st{stages}-{per_sm}/sm{'-persist' if persist else ''}",
                   lambda: _read_tma_kernel[(progs,)](desc, out, n_blocks, bpp, BLOCK_R=box, STAGES=stages,
                                                      PERSIST=persist, num_warps=warps))

    return fastest(cases(), flush, reps)


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

    def cases(whole: bool):
        for rows, recs, warps, stages, per_sm in slice_configs():
            if (rows == 128) != whole:
                continue
            nb = n // rows
            split = max(1, min(kt, round(per_sm * sms / nb)))
            tpp = (kt + split - 1) // split
            split = (kt + tpp - 1) // tpp
            out = torch.empty(nb * split, dtype=torch.int32, device=rec.device)
            yield (f"rows{rows}-recs{recs}-w{warps}-st{stages}-s{split}",
                   lambda: _read_slices_kernel[(nb, split)](rec, out, kt, tpp, ROWS=rows, RECS=recs, STAGES=stages,
                                                            num_warps=warps))

    return {"slices": fastest(cases(False), flush, reps), "whole": fastest(cases(True), flush, reps)}


def main() -> int:
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.w12.routing import w12_linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--shapes", default="", help="comma-separated names from w12_gemm.SHAPES or HF_SHAPES (default: SHAPES)")
    ap.add_argument("--rows", default="1", help="comma list of x rows M at which cuBLAS and w12_linear are timed "
                    "against the floor (default 1)")
    ap.add_argument("--no-tma", action="store_true", help="skip the TMA read kernels")
    args = ap.parse_args()
    ms = parse_rows(args.rows)
    shapes = select_shapes(args.shapes or None)
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
    for name, k, n in shapes:
        w, _, kp, w12_bytes = random_layer(name, k, n, dev)
        rec = kp.rec64.view(torch.int32)
        bf16 = w.view(torch.int32).reshape(-1)
        floors = {}
        for key, buf in (("w12", rec), ("bf16", bf16)):
            plain = best_read_us(buf, flush, sms, args.reps)
            tma = (math.inf, None) if args.no_tma else best_tma_read_us(buf, flush, sms, args.reps)
            floors[key] = (min(plain, tma), plain, tma)
        pattern = best_slices_us(rec, n, kp.k_tiles, flush, sms, args.reps)
        (r_w12, cfg_w12), (r_bf16, cfg_bf16) = floors["w12"][0], floors["bf16"][0]
        base = {"shape": name, "k": k, "n": n, "w12_bytes": w12_bytes, "bf16_bytes": w.numel() * 2,
                "empty_us": round(empty_us, 2), "read_w12_us": round(r_w12, 2), "read_w12_config": cfg_w12,
                "read_w12_plain_us": round(floors["w12"][1][0], 2), "read_w12_tma_us": _us(floors["w12"][2][0]),
                "read_bf16_us": round(r_bf16, 2), "read_bf16_config": cfg_bf16,
                "read_bf16_plain_us": round(floors["bf16"][1][0], 2), "read_bf16_tma_us": _us(floors["bf16"][2][0]),
                "read_slices_us": round(pattern["slices"][0], 2), "read_slices_config": pattern["slices"][1],
                "read_whole_us": round(pattern["whole"][0], 2), "read_whole_config": pattern["whole"][1],
                "read_w12_TBps": round(rec.numel() * 4 / r_w12 / 1e6, 3),
                "read_bf16_TBps": round(w.numel() * 2 / r_bf16 / 1e6, 3)}
        for m in ms:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            c_us, w_us = time_interleaved([lambda: F.linear(x, w), lambda: w12_linear(x, kp)], reps=args.reps,
                                          flush=flush)
            row = {**base, "m": m, "cublas_us": round(c_us, 2), "w12_us": round(w_us, 2),
                   "ceiling": round(c_us / r_w12, 3), "speedup": round(c_us / w_us, 3),
                   "w12_vs_floor": round(r_w12 / w_us, 3), "cublas_vs_floor": round(r_bf16 / c_us, 3)}
            rows.append(row)
            print(row, flush=True)
        w = kp = rec = bf16 = None
        torch.cuda.empty_cache()

    def geo(key, m):
        vals = [r[key] for r in rows if r["m"] == m]
        return round(math.exp(sum(math.log(v) for v in vals) / len(vals)), 3)

    summary = {"empty_us": round(empty_us, 2)}
    for m in ms:
        summary.update({f"geomean_ceiling_m{m}": geo("ceiling", m), f"geomean_speedup_m{m}": geo("speedup", m),
                        f"geomean_w12_vs_floor_m{m}": geo("w12_vs_floor", m),
                        f"geomean_cublas_vs_floor_m{m}": geo("cublas_vs_floor", m)})
    write_results("read_floor", rows, {"summary": summary, "reps": args.reps,
                                    "method": "cuda graph, L2 flushed by reading 256 MB, CUDA events, median; "
                                              "cuBLAS and w12_linear median of 3 interleaved runs"})
    print_table(rows, ["shape", "m", "read_w12_us", "read_w12_plain_us", "read_w12_tma_us", "read_slices_us",
                       "read_bf16_us", "cublas_us", "w12_us", "ceiling", "speedup", "w12_vs_floor",
                       "cublas_vs_floor"])
    print(summary)
    return 0


def _us(v: float):
    return None if math.isinf(v) else round(v, 2)


def parse_rows(text: str) -> list[int]:
    """``--rows``: a comma list of x row counts 1-64 (exit 2 otherwise)."""
    return parse_int_list(text, 1, 64, "read_floor: --rows")


if __name__ == "__main__":
    sys.exit(main())
