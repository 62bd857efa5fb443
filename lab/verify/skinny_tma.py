"""Unrouted: the skinny GEMM ``y = x @ W.T`` (2..64 rows) with its tiles fetched by the Hopper
tensor memory accelerator (host-side ``TensorDescriptor``s), in two schedules:

* ``grid``: ``kernels/verify/skinny.py``'s grid (one program per (weight block, K split)) with the
  pointer loads replaced by descriptor loads: one TMA instruction per tile instead of a cp.async
  per 16 bytes per thread, so a program keeps more bytes in flight for the same registers;
* ``stream``: a persistent stream-K schedule: ``programs`` programs take equal runs of the layer's
  (weight block, K tile) pairs in order, so every SM streams the same number of weight tiles (the
  grid schedule leaves SMs idle on layers whose blocks are not a multiple of the SM count: 96
  blocks for Llama's q/k/v on 132 SMs). A block whose tiles one program holds is stored directly;
  one split over several programs is summed by the last of them in program order, so results are
  bitwise identical run to run.

Both accumulate in fp32 on the tensor cores, weights on the MMA's long side. The first weight tile
is loaded before the PDL wait (weights are constant). The plain reference is
:func:`specpilot.kernels.verify.naive.linear`; ``main`` sweeps the configs per layer and rows
against cuBLAS, cuBLASLt and the routed path, then times whole Llama steps with its winners.

Why it is not routed (H200, Llama-3.1-8B layers, 16 and 32 rows, L2 flushed, the best of about
20 configs each): 0.95-1.01x of cuBLAS on every layer (q/k/v 17.6 vs 17.4 us, o 15.4 vs 15.2,
gate/up 59.4 vs 57.5, down 33.5 vs 32.7 at 16 rows), stream-K winning only down at 16 rows
(1.06x over the routed cuBLASLt); whole steps with that entry: 4.849 vs 4.865 ms at 16 rows,
5.408 vs 5.433 ms for 16 requests x 1 row. Descriptor loads keep more bytes in flight per
register, but the layers stay at cuBLAS's 2.2-4.1 TB/s, below the one-row GEMV's stream.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.kernels import workspace
from specpilot.kernels.triton_env import interpreting, pdl_args, tl, triton
from specpilot.kernels.verify import common
from specpilot.kernels.verify.skinny import MAX_ROWS, _mma, row_tile
from specpilot.kernels.w12.common import split_chunk, sum_splits

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root, for lab

from specpilot.kernels.verify.ring import schedule as stream_schedule  # noqa: E402 - the same stream-K split

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _store(acc, y_ptr, ws_ptr, cnt_ptr, blk_id, slot, parts, n0, M, N, stride_y,
               MAXP, MP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
        """Block ``blk_id``'s result: stored when one program holds all its tiles (``parts == 1``),
        else partial ``slot`` of ``parts`` into the workspace; the last to arrive sums them in slot
        order."""
        rn = n0 + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, MP)
        out = y_ptr + rm[None, :] * stride_y + rn[:, None]
        omask = (rn < N)[:, None] & (rm < M)[None, :]
        if parts == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            tile = tl.arange(0, BLOCK_N)[:, None] * MP + rm[None, :]
            blk = ws_ptr + blk_id * (MAXP * BLOCK_N * MP)   # under 2**31 values for any layer here
            tl.store(blk + slot * (BLOCK_N * MP) + tile, acc, cache_modifier=".cg")
            if tl.atomic_add(cnt_ptr + blk_id, 1, sem="acq_rel") == parts - 1:
                total = sum_splits(blk, tile, parts, BLOCK_N, MP, SPLIT_CHUNK)
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=omask)
                tl.store(cnt_ptr + blk_id, 0)

    @triton.jit
    def _grid_kernel(x_desc, w_desc, y_ptr, ws_ptr, cnt_ptr, M, N, KT, TILES, SPLIT, stride_y,
                     MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                     STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        t0 = pid_k * TILES
        t1 = tl.minimum(t0 + TILES, KT)
        w = w_desc.load([n0, t0 * BLOCK_K])
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        acc = _mma(tl.zeros((BLOCK_N, MP), dtype=tl.float32), w, x_desc.load([0, t0 * BLOCK_K]), UPCAST)
        for t in tl.range(t0 + 1, t1, num_stages=STAGES):
            acc = _mma(acc, w_desc.load([n0, t * BLOCK_K]), x_desc.load([0, t * BLOCK_K]), UPCAST)
        _store(acc, y_ptr, ws_ptr, cnt_ptr, pid_n, pid_k, SPLIT, n0, M, N, stride_y, SPLIT, MP, BLOCK_N, SPLIT_CHUNK)

    @triton.jit
    def _stream_kernel(x_desc, w_desc, y_ptr, ws_ptr, cnt_ptr, M, N, KT, U, PER, stride_y,
                       MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAXP: tl.constexpr,
                       SPLIT_CHUNK: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
        p = tl.program_id(0)
        u0 = p * PER
        u1 = tl.minimum(u0 + PER, U)
        b0 = u0 // KT
        w = w_desc.load([b0 * BLOCK_N, (u0 - b0 * KT) * BLOCK_K])
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        for b in range(b0, (u1 - 1) // KT + 1):
            s = tl.maximum(u0, b * KT)
            e = tl.minimum(u1, b * KT + KT)
            n0 = b * BLOCK_N
            if b == b0:
                acc = _mma(tl.zeros((BLOCK_N, MP), dtype=tl.float32), w, x_desc.load([0, (s - b * KT) * BLOCK_K]),
                           UPCAST)
                s += 1
            else:
                acc = tl.zeros((BLOCK_N, MP), dtype=tl.float32)
            for u in tl.range(s, e, num_stages=STAGES):
                k0 = (u - b * KT) * BLOCK_K
                acc = _mma(acc, w_desc.load([n0, k0]), x_desc.load([0, k0]), UPCAST)
            first = (b * KT) // PER
            _store(acc, y_ptr, ws_ptr, cnt_ptr, b, p - first, (b * KT + KT - 1) // PER - first + 1, n0, M, N,
                   stride_y, MAXP, MP, BLOCK_N, SPLIT_CHUNK)


@dataclass(frozen=True)
class TmaConfig:
    """``schedule`` ``grid`` (``split`` programs along K per weight block) or ``stream``
    (``programs`` persistent programs; 0: one per SM); tiles of ``block_n`` weight rows x
    ``block_k`` columns, ``warps``, ``stages`` (TMA loads in flight)."""

    schedule: str = "grid"
    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 4
    split: int = 1
    programs: int = 0

    def key(self) -> str:
        s = f"s{self.split}" if self.schedule == "grid" else f"p{self.programs}"
        return f"{self.schedule}-n{self.block_n}-k{self.block_k}-w{self.warps}-st{self.stages}-{s}"


def aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether TMA descriptors can describe x and w (contiguous, one dtype, 16-byte aligned rows)."""
    return (x.is_contiguous() and w.is_contiguous() and x.dtype == w.dtype and x.shape[-1] % 8 == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def tma_linear(x: torch.Tensor, w: torch.Tensor, cfg: TmaConfig = TmaConfig()) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (1 <= M <= 64) and w [N, K], both contiguous bf16/fp16, K a
    multiple of 8 (TMA strides are 16-byte aligned)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"takes 1..{MAX_ROWS} rows, got {M}")
    if not aligned(x, w):
        raise ValueError("x and w must be contiguous, of one dtype, 16-byte aligned, K a multiple of 8")
    mp = row_tile(M)
    bn, bk = cfg.block_n, cfg.block_k
    kt = triton.cdiv(K, bk)
    nb = triton.cdiv(N, bn)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [mp, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    opts = dict(num_warps=cfg.warps, **pdl_args(common.USE_PDL, x))
    if cfg.schedule == "grid":
        tiles = triton.cdiv(kt, max(1, min(cfg.split, kt)))
        split = triton.cdiv(kt, tiles)
        ws = workspace.scratch(x.device, "skinny_tma.partials", nb * split * bn * mp) if split > 1 else y
        cnt = workspace.counters(x.device, "skinny_tma.blocks", nb) if split > 1 else y
        _grid_kernel[(nb, split)](x_desc, w_desc, y, ws, cnt, M, N, kt, tiles, split, y.stride(0), MP=mp,
                                  BLOCK_N=bn, BLOCK_K=bk, SPLIT_CHUNK=split_chunk(split, bn * mp),
                                  STAGES=cfg.stages, UPCAST=interpreting(), **opts)
        return y
    if cfg.schedule != "stream":
        raise ValueError(f"schedule grid or stream, got {cfg.schedule!r}")
    sms = 132 if x.device.type != "cuda" else torch.cuda.get_device_properties(x.device).multi_processor_count
    per, progs, slots = stream_schedule(nb, kt, cfg.programs or sms)
    maxp = triton.next_power_of_2(slots)
    ws = workspace.scratch(x.device, "skinny_tma.partials", nb * maxp * bn * mp)
    cnt = workspace.counters(x.device, "skinny_tma.blocks", nb)
    _stream_kernel[(progs,)](x_desc, w_desc, y, ws, cnt, M, N, kt, nb * kt, per, y.stride(0), MP=mp, BLOCK_N=bn,
                             BLOCK_K=bk, MAXP=maxp, SPLIT_CHUNK=split_chunk(slots, bn * mp), STAGES=cfg.stages,
                             UPCAST=interpreting(), **opts)
    return y


# (k, n): Llama-3.1-8B's q/k/v, o, gate/up, down; then Qwen3.5-9B's GDN in_proj, gate/up, down
LAYERS = {"llama": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
          "qwen": [(4096, 12352), (4096, 24576), (12288, 4096)]}


def sweep_configs(k: int, n: int, rows: int, sms: int, quick: bool) -> list[TmaConfig]:
    """The configs tried for a layer [n, k] at ``rows`` rows (shared memory under 200 KB)."""
    mp = row_tile(rows)
    out = []
    for bn, bk, st in ((64, 128, 3), (64, 128, 4), (64, 128, 6), (64, 256, 3), (64, 256, 4), (128, 128, 4)):
        if (bn + mp) * bk * 2 * st > 200 * 1024:
            continue
        nb, kt = -(-n // bn), -(-k // bk)
        for target in ((1, 2) if quick else (1, 2, 4)):
            out.append(TmaConfig("grid", bn, bk, 4, st, split=max(1, min(kt, round(target * sms / nb)))))
        for progs in ((sms,) if quick else (sms, 2 * sms)):
            out.append(TmaConfig("stream", bn, bk, 4, st, programs=progs))
    return list(dict.fromkeys(out))


def steps(entries: dict, rows_list: list[int], rounds: int = 2) -> list[dict]:
    """Whole Llama-3.1-8B steps (random bf16, context 1024, CUDA graphs) with the product's routing and
    with the TMA winners routed for the layers and row tiles they won, alternating."""
    from specpilot.engine.api import load_target
    from specpilot.engine.batch.probe import measure_rows_batched
    from specpilot.engine.rows import measure_rows
    from specpilot.engine.spec import EngineSpec
    from specpilot.kernels.verify import blas

    routed = blas.linear

    def with_tma(h, w):
        cfg = entries.get((w.shape[0], w.shape[1], row_tile(h.shape[0]))) if h.is_cuda else None
        if cfg is None or not aligned(h, w):
            return routed(h, w)
        return tma_linear(h, w, cfg)

    target = load_target(EngineSpec.parse(f"engine:model=llama-3.1-8b,random=1,device=cuda,ctx={1024 + 128}"))
    out = []
    try:
        for rnd in range(rounds):
            for mode in ("routed", "tma"):
                blas.linear = with_tma if mode == "tma" else routed
                res = measure_rows(target.model, rows_list, 1024, reps=30, warmup=5)
                for p in res.points:
                    out.append({"kind": "step", "mode": mode, "round": rnd, "batch": 1, "rows": p["rows"],
                                "step_ms": p["step_ms"], "c": p["c"]})
                    print(out[-1], flush=True)
                for b in (16, 32):
                    bres = measure_rows_batched(target.model, b, [1], 1024, reps=30, warmup=5)
                    for p in bres.points:
                        out.append({"kind": "step", "mode": mode, "round": rnd, "batch": b, "rows": p["rows"],
                                    "step_ms": p["step_ms"], "c": p["c"]})
                        print(out[-1], flush=True)
    finally:
        blas.linear = routed
    return out


def main() -> None:
    import argparse

    import torch.nn.functional as F

    from lab.common import L2Flusher, bootstrap, parse_int_list, time_interleaved, write_results
    from lab.verify.blas_backend import blas_call, operands
    from specpilot.kernels.verify import blas

    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32")
    ap.add_argument("--models", default="llama")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", default="", help="rows of the whole Llama steps to time (none: skip)")
    args = ap.parse_args()
    rows_list = parse_int_list(args.rows, 1, 64, "rows")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = L2Flusher()
    out, entries = [], {}
    layers = [kn for m in args.models.split(",") for kn in LAYERS[m]]
    for k, n, rows, x, w in operands(layers, rows_list):
        ref = F.linear(x.float(), w.float())
        best = None
        for cfg in sweep_configs(k, n, rows, sms, args.quick):
            try:
                y = tma_linear(x, w, cfg)
                err = float((y.float() - ref).abs().max())
                same = bool(torch.equal(y, tma_linear(x, w, cfg)))
                us = time_interleaved([lambda c=cfg: tma_linear(x, w, c)], flush=flush, rounds=1, reps=20)[0]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print("skip", cfg.key(), type(e).__name__, str(e)[:120], flush=True)
                continue
            if best is None or us < best[1]:
                best = (cfg, us, err, same)
        cfg, _, err, same = best
        final = time_interleaved([blas_call(x, w, "cublas"), blas_call(x, w, "cublaslt"),
                                  lambda: blas.linear(x, w), lambda: tma_linear(x, w, cfg)],
                                 flush=flush, rounds=5, reps=50)
        torch.backends.cuda.preferred_blas_library("cublas")
        floor_us = n * k * 2 / 4.2e6
        row = {"kind": "layer", "k": k, "n": n, "rows": rows, "cublas_us": final[0], "cublaslt_us": final[1],
               "routed_us": final[2], "tma_us": final[3], "tma_vs_cublas": final[0] / final[3],
               "tma_vs_routed": final[2] / final[3], "tma_of_floor_4p2": floor_us / final[3],
               "config": cfg.key(), "max_err": err, "repeatable": same}
        out.append(row)
        if final[3] < final[2]:
            entries[(n, k, row_tile(rows))] = cfg
        print({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
        write_results("skinny_tma", out)
    if args.steps:
        out += steps(entries, parse_int_list(args.steps, 1, 64, "steps"))
        write_results("skinny_tma", out)
        by = {}
        for r in out:
            if r["kind"] == "step":
                by.setdefault((r["batch"], r["rows"], r["mode"]), []).append(r["step_ms"])
        for (b, n, mode), v in sorted(by.items()):
            if mode == "routed":
                print(f"batch {b} rows {n}: routed {min(v):.3f} ms, tma {min(by[(b, n, 'tma')]):.3f} ms")


if __name__ == "__main__":
    main()
