"""Sweeps of the W12 kernels' configs (the lab's variant kernels, :mod:`lab.w12.variants`) against
cuBLAS bf16 ``F.linear`` on the GPU, side by side in one run; the measured tables of
``kernels/w12/tuned/`` come from these (``benchmarks/w12_gemm.py`` times ``w12_linear`` as routed).

    python lab/w12/sweep.py --mode sweep    # every config of the general Triton kernel at every shape
    python lab/w12/sweep.py --mode final    # its tuned config per shape, re-timed
    python lab/w12/sweep.py --mode gemv --rows 1,2,4,8,16   # streaming-GEMV configs
    python lab/w12/sweep.py --mode gemv-gluon               # one-row Gluon GEMV configs
    python lab/w12/sweep.py --mode mma --rows 2,8,32,64     # tensor-core (Gluon) configs
    python lab/w12/sweep.py --mode wgmma --rows 8,16,32,64  # Hopper wgmma (Gluon) configs
    python lab/w12/sweep.py --mode warpk --rows 1,8,16      # tensor cores, K split across warps

Results go to ``lab/results/<name>.json`` (and ``$OUT``).

Per shape (K -> N) and M rows: encode a random bf16 weight (std 0.02) into W12 on the GPU, check
the restore bit for bit, check every variant against ``x @ W.T`` in fp32 on fresh random inputs
(poisoned outputs), check run-to-run bitwise determinism, then time W12 and cuBLAS, both captured
in CUDA graphs with L2 flushed by reading 256 MB before each replay (median).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import L2Flusher, print_table, time_cuda_graph, time_interleaved, write_results  # noqa: E402
from lab.w12 import committed  # noqa: E402
from w12_gemm import HF_SHAPES, SHAPES, model_check, random_layer, row_inputs, routed_path, select_shapes  # noqa: E402,F401
from w12_gemm import speedup_summary, tolerance  # noqa: E402,F401


MS = (1, 8, 32, 64)


def sweep_configs(m: int, kt: int, n: int, sms: int):
    """Candidate variants for one (shape, m); split-K chosen for about 1, 2 and 4 waves."""
    from lab.w12.variants.gemm import Config

    base = []
    if m == 1:
        for bn, bk, w in ((32, 256, 4), (64, 256, 4), (64, 512, 4), (32, 512, 4), (128, 256, 8), (64, 256, 8)):
            base.append(Config(bn, bk, 1, "gemv", w, 1, True))
        base += [Config(64, 512, 1, "gemv", 4, 1, False), Config(32, 256, 1, "gemv", 4, 1, False)]
    elif m <= 8:
        for bn, bk, w in ((16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 8)):
            base.append(Config(bn, bk, 1, "gemv", w, 1, True))
        for bn, bk, w in ((64, 128, 4), (128, 128, 4)):
            base.append(Config(bn, bk, 1, "dot8", w, 1, True))
            base.append(Config(bn, bk, 1, "dot8t", w, 1, True))
        base += [Config(128, 128, 1, "dot", 4, 1, False)]
    else:
        for bn, bk, w in ((64, 128, 4), (128, 128, 4), (128, 256, 8)):
            base.append(Config(bn, bk, 1, "dot8", w, 1, True))
        base += [Config(64, 128, 1, "dot8t", 4, 1, True), Config(128, 128, 1, "dot8t", 4, 1, True),
                 Config(128, 128, 1, "dot", 4, 1, False)]
    out = []
    for c in base:
        nb = (n + c.block_n - 1) // c.block_n
        seen = set()
        for target in (1, 2):
            split = max(1, min(kt // (c.block_k // 64), round(target * sms / nb)))
            if split in seen:
                continue
            seen.add(split)
            out.append(Config(c.block_n, c.block_k, split, c.mode, c.num_warps, c.num_stages, c.prefetch))
    return out


def gemv_configs(m: int, kt: int, n: int, sms: int):
    """Streaming-GEMV variants for one (shape, m), every input row in one program (weights decoded
    once): weight rows per program and warps, how loads are overlapped (register double buffer with
    2 records per step, or the compiler's cp.async pipeline with 3 stages of 1-2 records), and
    split-K for about 2, 4, 8 (and at one row 16) programs per SM, and at one row the escapes loaded
    at the start or at the end. Fewer variants above one row (compile time)."""
    from lab.w12.variants.gemv import GemvConfig

    tuned = committed.gemv_config(m, n, kt * 64)
    out = [tuned] if tuned is not None else []   # the committed choice competes too
    shapes = ((32, 2), (64, 2), (64, 4)) if m == 1 else ((32, 2), (64, 4))
    pipes = ((2, True, 1), (1, False, 3), (2, False, 3)) if m == 1 else ((2, True, 1), (2, False, 3))
    for bn, w in shapes:
        for recs, pf, stages in pipes:
            if kt % recs:
                continue
            nb = (n + bn - 1) // bn
            seen = set()
            for per_sm in ((2, 4, 8, 16) if m == 1 else (2, 4, 8)):
                split = max(1, min(kt // recs, round(per_sm * sms / nb)))
                if split in seen:
                    continue
                seen.add(split)
                for early in ((True, False) if m == 1 else (True,)):
                    cfg = GemvConfig(bn, recs, split, w, pf, 0, stages, early)
                    if cfg not in out:
                        out.append(cfg)
    return out


def mma_configs(m: int, kt: int, n: int, sms: int, tiles=((64, 4), (128, 4)), variants: str = "all"):
    """Tensor-core (Gluon) variants for one (shape, m): ``tiles`` (weight rows per program, warps;
    default 64 or 128 rows on 4 warps), weights 2 or 3 records ahead in registers (rotated or
    unrolled ring) or 2 or 4 ahead in a shared-memory ring (``wsmem``), split-K for about 1, 2, 4
    and 8 programs per SM; then the stream-K schedule (1, 2 or 4 programs per SM, ring depth 2 or
    4; above 8 rows, 16-row warp slices also capped at 128 registers). ``variants``: ``stream`` (the
    committed choice and the stream-K variants), ``chunk`` (it and unrolled rings of depth 2-3
    with x in chunks of 2 or 4 records) or ``tma`` (it and the TMA/mbarrier rings: a consumer
    warp per 16 rows, or the program's 4 or 8 warps as one consumer group, 4 or 6 stages) or
    ``tma-pair`` (it and the consumer group taking one or two records per step) or ``tma-wgmma``
    (it, the mma.sync group and the group on ``wgmma``, 4 or 6 stages, the decoded record in
    registers or through shared memory) or ``tma-narrow`` (it and 32-row programs of two consumer
    warps, ``tma=1``) or ``early`` (its ring, or the wsmem and unrolled register rings where it is a
    TMA one, at its split, half and twice it, with the epilogue's loads in the tail or early)."""
    from lab.w12.variants.mma import MmaConfig, block_m_for

    out = [committed.mma_config(m, n, kt * 64, sms)]
    if variants == "early":   # the epilogue's loads early or in the tail, on the committed ring or the register
        base = out[0]         # and wsmem rings at the committed split (TMA entries), and at half / twice it
        rings = [base] if not (base.tma or base.stream or base.x_chunk > 1) else [
            MmaConfig(base.block_n, base.split_k, 4, d, ws, u) for d, ws, u in ((2, True, False), (3, False, True))]
        for ring in rings:
            for split in sorted({ring.split_k, max(1, ring.split_k // 2), min(kt, 2 * ring.split_k)}):
                out += [c for c in (replace(ring, split_k=split, early_epilogue=e) for e in (False, True))
                        if c not in out]
        return out
    if variants == "tma":   # a consumer warp per 16 rows (64-row programs), or the warps as one group
        for bn, w, split in tile_splits(m, kt, n, sms, ((64, 4), (128, 8)), block_m_for):
            if bn == 64:
                out.append(MmaConfig(bn, split, 4, 4, tma=1))
            out += [MmaConfig(bn, split, w, stages, tma=2) for stages in (4, 6)]
        return out
    if variants == "tma-pair":   # the consumer group, one or two records per step (two: also 136 registers)
        for bn, w, split in tile_splits(m, kt, n, sms, ((64, 4),), block_m_for):
            out += [MmaConfig(bn, split, w, 4, tma=2), MmaConfig(bn, split, w, 4, False, True, tma=2),
                    MmaConfig(bn, split, w, 4, False, True, maxnreg=136, tma=2),
                    MmaConfig(bn, split, w, 6, False, True, tma=2)]
        return out
    if variants == "tma-narrow":   # 32-row programs: two consumer warps (tma=1), twice the programs
        for bn, w, split in tile_splits(m, kt, n, sms, ((32, 4),), block_m_for):
            out += [MmaConfig(bn, split, w, st, tma=1) for st in (4, 6)]
        return out
    if variants == "tma-wgmma":   # the consumer group on wgmma (tma=3, A in registers or shared memory)
        for bn, w, split in tile_splits(m, kt, n, sms, ((64, 4), (128, 8)), block_m_for):
            out += [MmaConfig(bn, split, w, 4, tma=2)] + [MmaConfig(bn, split, w, st, tma=3, a_smem=a)
                                                          for st in (4, 6) for a in (False, True)]
        return out
    if variants == "tma-kgroups":   # the wgmma group as 2 or 4 warpgroups taking every 2nd or 4th record,
        # 64-row programs at split-K 1-6, rings of 6-12 stages (the deeper, the more bytes in flight)
        for split in sorted({min(kt, s) for s in (1, 2, 3, 4, 6)}):
            out += [c for c in [MmaConfig(64, split, 4, st, tma=3, kgroups=2) for st in (6, 8, 10)]
                    + [MmaConfig(64, split, 4, st, tma=3, kgroups=4) for st in (8, 12)] if c not in out]
        return out
    if variants == "tma-kstream":   # four wgmma K groups on a stream-K run, one program per SM, beside
        # the same groups on the split-1 grid
        out += [c for st in (4, 8, 12) for c in (MmaConfig(64, 1, 4, st, tma=3, kgroups=4, stream=1),
                                                  MmaConfig(64, 1, 4, st, tma=3, kgroups=4)) if c not in out]
        return out
    if variants == "chunk-wide":   # x resident: one or two chunks per program (K ranges of 8 or 16
        # records at most), 64- or 128-row programs, so x is copied once per K range and shared by more rows
        for bn, w in ((64, 4), (128, 4), (128, 8)):
            for tps in (8, 16):
                for depth in (2, 3):
                    for xc in (4, 8):
                        cfg = MmaConfig(bn, -(-kt // tps), w, depth, False, True, x_chunk=xc)
                        if cfg not in out:
                            out.append(cfg)
        return out
    if variants == "chunk":
        for bn, w, split in tile_splits(m, kt, n, sms, tiles, block_m_for):
            for depth in (2, 3):
                out += [MmaConfig(bn, split, w, depth, False, True, x_chunk=xc) for xc in (2, 4)]
        return out
    for bn, w in tiles:
        for per_sm in (1, 2, 4):
            for depth in (2, 4):
                for cap in ((None, 128) if bn // w <= 16 and m > 8 else (None,)):
                    out.append(MmaConfig(bn, 1, w, depth, True, stream=per_sm, maxnreg=cap))
    if variants == "stream":
        return out
    for bn, w, split in tile_splits(m, kt, n, sms, tiles, block_m_for):
        for depth, wsmem, unroll in ((2, False, False), (3, False, False), (2, True, False), (4, True, False),
                                     (2, False, True), (3, False, True)):
            cfg = MmaConfig(bn, split, w, depth, wsmem, unroll)
            if cfg not in out:
                out.append(cfg)
    return out


def tile_splits(m: int, kt: int, n: int, sms: int, tiles, block_m_for):
    """(block_n, warps, split) for each tile shape and split-K giving about 1, 2, 4 and 8 programs
    per SM (distinct splits only): the tensor-core sweeps' grid."""
    mb = (m + block_m_for(m) - 1) // block_m_for(m)
    for bn, w in tiles:
        nb = (n + bn - 1) // bn * mb
        seen = set()
        for per_sm in (1, 2, 4, 8):
            split = max(1, min(kt, round(per_sm * sms / nb)))
            if split not in seen:
                seen.add(split)
                yield bn, w, split


def wgmma_configs(m: int, kt: int, n: int, sms: int):
    """Hopper wgmma variants for one (shape, m): one warpgroup on 64 weight rows or two on 128, the
    weights 2 or 3 records ahead, the x ring indexed or unrolled by three, split-K for about 1, 2, 4
    and 8 programs per SM."""
    from lab.w12.variants.mma import block_m_for
    from lab.w12.variants.wgmma import WgmmaConfig, default_config

    out = [default_config(m, n, kt * 64, sms)]
    for bn, w, split in tile_splits(m, kt, n, sms, ((64, 4), (128, 8)), block_m_for):
        for depth, unroll in ((2, False), (2, True), (3, False)):
            cfg = WgmmaConfig(bn, split, w, depth, unroll)
            if cfg not in out:
                out.append(cfg)
    return out


def _committed_on_rows(base, kt: int, splits_caps):
    """The one-row committed choice ``base`` on 8 and 16 rows with each ``(split_k, maxnreg)``; the
    escape chain stays spread only unsplit (``check_config``), and staged x must fit."""
    from lab.w12.variants.gemv_gluon import XS_MAX_BYTES

    out = []
    for rows in (8, 16):
        for split, cap in splits_caps:
            c = replace(base, rows=rows, split_k=split, maxnreg=cap, epi_spread=base.epi_spread and split == 1)
            if (not c.xs or c.xs_bytes(kt) <= XS_MAX_BYTES) and c not in out:
                out.append(c)
    return out


def gluon_gemv_configs(m: int, kt: int, n: int, sms: int, variants: str = "all"):
    """One-row Gluon GEMV variants: 8, 16 or 32 rows per program, 4, 8 (or 16) warps each streaming
    its own records, 1-3 records ahead in a rotated ring or 2-3 register sets unrolled, split-K for
    about 1, 2 and 4 programs per SM; then staged x (``xs``) with 2-4 unrolled sets, depth 4 also
    capped at 96 registers, each with the epilogue's loads first or after the first records'.
    ``variants="xs"``: the committed choice and the staged-x variants only; ``"xf32"``: it and the
    four-set staged-x configs with and without x converted to fp32 once per program; ``"split"``: it
    on 8 or 16 rows, with its register cap and without, its K range split 1-8 ways across programs."""
    from lab.w12.variants.gemv_gluon import XS_MAX_BYTES, GluonGemvConfig

    out = [committed.gluon_gemv_config(n, kt * 64, sms)]
    if variants == "tma":   # records through a TMA ring (gemv_tma): rows, records per stage, stages
        from lab.w12.variants import gemv_tma

        grid = [(8, 4, 1, s) for s in (4, 8, 12)] + [(8, 4, 2, s) for s in (3, 6)]
        grid += [(16, 4, r, s) for r, ss in ((1, (4, 8)), (2, (2, 4, 6)), (4, (2, 3))) for s in ss]
        grid += [(16, 8, 1, 4), (32, 4, 1, 3), (32, 4, 1, 6)]
        # also with the records' own 64-byte box rows, and with the epilogue's loader warp
        ab = {(8, 4, 1, 4), (16, 4, 2, 2), (16, 4, 1, 4), (8, 4, 2, 3)}
        for rows, warps, rps, stages in grid:
            if gemv_tma.smem_bytes(kt, rows, warps, stages, rps) <= gemv_tma.SMEM_LIMIT:
                for box, ew in ((256, False), (64, False), (256, True)) if (rows, warps, rps, stages) in ab \
                        else ((256, False),):
                    out.append(GluonGemvConfig(rows, warps, stages, tma=True, tma_rps=rps, tma_box=box,
                                               tma_epi_warp=ew))
        return out
    if variants == "spread":   # staged-x configs with the escape chain spread over step 0, and late
        for rows in (8, 16):
            for depth, cap in ((3, None), (4, None), (4, 96)):
                for late, spread in ((True, False), (False, True)):
                    c = GluonGemvConfig(rows, 4, depth, 1, True, xs=True, maxnreg=cap, late_epilogue=late,
                                        epi_spread=spread)
                    if c not in out and c.xs_bytes(kt) <= XS_MAX_BYTES:
                        out.append(c)
        base = out[0]
        if base.xs and base.unroll and base.split_k == 1:   # the committed choice itself, spread
            c = replace(base, late_epilogue=False, epi_spread=True)
            if c not in out:
                out.append(c)
        return out
    if variants == "split":   # the committed choice on 8 or 16 rows, its K range split 1-8 ways
        caps = sorted({out[0].maxnreg or 0, 0})
        return out + [c for c in _committed_on_rows(out[0], kt, [(s, cap or None) for cap in caps
                                                                  for s in (1, 2, 3, 4, 6, 8)]) if c not in out]
    if variants == "regs":   # more programs per SM: the committed choice on 8 or 16 rows, split 1-3,
        # its register cap lowered to 64-88 (8-5 four-warp programs per SM) or lifted
        return out + [c for c in _committed_on_rows(out[0], kt, [(s, cap) for s in (1, 2, 3)
                                                                  for cap in (64, 72, 80, 88, 96, None)])
                      if c not in out]
    if variants == "xf32":   # the staged-x configs with x converted to fp32 once, and without
        for rows in (8, 16):
            nb = (n + rows - 1) // rows
            for split in sorted({max(1, min(max(1, kt // 4), round(per_sm * sms / nb))) for per_sm in (1, 2)}):
                for cap in (None, 96):
                    cands = [GluonGemvConfig(rows, 4, 4, split, True, xs=True, maxnreg=cap, late_epilogue=True,
                                             xf32=xf) for xf in (False, True)]
                    out += [c for c in cands if c not in out and c.xs_bytes(kt) <= XS_MAX_BYTES]
        return out
    for rows in (8, 16, 32):
        for warps in ((4, 8, 16) if rows < 32 else (4, 8)):
            nb = (n + rows - 1) // rows
            seen = set()
            for per_sm in (1, 2, 4):
                split = max(1, min(max(1, kt // warps), round(per_sm * sms / nb)))
                if split in seen:
                    continue
                seen.add(split)
                cands = []
                if variants != "xs":
                    cands += [GluonGemvConfig(rows, warps, depth, split) for depth in ((1, 2, 3) if warps < 16 else (1, 2))]
                    if rows >= 16 and warps <= 8:   # unrolled rings
                        cands += [GluonGemvConfig(rows, warps, depth, split, True) for depth in (2, 3)]
                if rows <= 16 and warps <= 8:       # staged x, pinned reloads, escapes before or after
                    cands += [GluonGemvConfig(rows, warps, d, split, True, xs=True, maxnreg=r, late_epilogue=el)
                              for d, r in ((2, None), (3, None), (4, None), (4, 96)) for el in (False, True)]
                out += [c for c in cands if c not in out]
    return out


def warpk_configs(m: int, kt: int, n: int, sms: int, variants: str = "all"):
    """Tensor-core few-row variants (K split across warps): 16 or 32 rows per program, 4 or 8
    warps, 2-4 unrolled register sets, split-K for about 1, 2 and 4 programs per SM; x in the
    register sets or loaded right before each record's MMAs (``x_late``; only that above 16 rows,
    where x would take 32 registers per set). ``variants="split"``: the committed choice with its K
    range split 1-8 ways across programs (shorter programs: a shorter tail); ``"esc"``: it with 16
    or 32 escapes per epilogue pass instead of 64, with and without a 128-register cap; ``"spread"``:
    unsplit configs without and with the escape chain spread over the first step; ``"tail"``: unsplit
    16- and 32-row programs (x late above 16 rows) with the epilogue's loads before or after the loop."""
    from lab.w12.variants.warpk import WarpKConfig

    out = [committed.warpk_config(m, n, kt * 64, sms)]
    if variants == "split":   # the committed choice, its K range split 1-8 ways
        out += [c for c in (replace(out[0], split_k=s) for s in (1, 2, 3, 4, 6, 8)) if c not in out]
        return out
    if variants == "spread":   # the escape chain spread over step 0: the committed choice and unsplit
        # 16-row configs of 2-4 sets, each without and with it
        base = [out[0]] + [WarpKConfig(16, w, d, 1, x_late=m > 16, esc_ch=32 if m > 16 else 0)
                           for w in (4, 8) for d in (2, 4)]
        for c in base:
            c = replace(c, split_k=1)
            out += [v for v in (replace(c, epi_spread=False), replace(c, epi_spread=True)) if v not in out]
        return out
    if variants == "tail":   # unsplit 16- and 32-row programs with the epilogue's loads before the loop
        # (held in registers through it) or after it
        for rows in (16, 32):
            for warps in (4, 8):
                for depth in ((2, 3, 4) if rows == 16 else (2,)):
                    for esc in ((32,) if rows == 16 else (16, 32)):
                        out += [c for c in (WarpKConfig(rows, warps, depth, 1, x_late=m > 16, esc_ch=esc,
                                                        tail_epilogue=t) for t in (False, True)) if c not in out]
        return out
    if variants == "esc":   # fewer preloaded escapes per pass (registers), with and without a 128 cap
        out += [c for c in (replace(out[0], esc_ch=e, maxnreg=r) for e in (0, 16, 32) for r in (None, 128))
                if c not in out]
        return out
    for rows in (16, 32):
        nb = (n + rows - 1) // rows
        for warps in (4, 8):
            splits = sorted({max(1, min(max(1, kt // (2 * warps)), round(p * sms / nb))) for p in (1, 2, 4)})
            for x_late in ((False, True) if m <= 16 else (True,)):
                depths = (2, 3, 4) if m <= 8 or x_late else (2, 3)
                out += [c for c in (WarpKConfig(rows, warps, d, s, x_late=x_late) for s in splits for d in depths)
                        if c not in out]
    return out


def warpk_sweep(args) -> int:
    """M = 1..32 (``--rows``): every tensor-core few-row variant (K split across warps), what
    ``w12_linear`` does today and cuBLAS, side by side in one run."""
    from lab.w12.variants.warpk import WarpKConfig, w12_warpk

    def configs(m, kt, n, sms):
        return warpk_configs(m, kt, n, sms, variants=args.variants)

    return variant_sweep(args, "warpk", configs, w12_warpk, WarpKConfig, "1,8,16", "w12_warpk")


def gluon_gemv_sweep(args) -> int:
    """M = 1: every one-row Gluon GEMV variant against ``w12_linear`` as called today and cuBLAS."""
    from lab.w12.variants.gemv_gluon import GluonGemvConfig, w12_gemv_gluon

    def configs(m, kt, n, sms):   # a comma list of variant sets: their union, the committed choice first
        out = []
        for v in args.variants.split(","):
            out += [c for c in gluon_gemv_configs(m, kt, n, sms, variants=v) if c not in out]
        return out

    return variant_sweep(args, "gemv-gluon", configs, w12_gemv_gluon, GluonGemvConfig, "1", "w12_gemv_gluon")


def gemv_sweep(args) -> int:
    """M = 1, 2, 4 (``--rows``): every streaming-GEMV variant, the general kernel's tuned variant and
    cuBLAS, side by side in one run (correctness and determinism checked before timing)."""
    from lab.w12.variants.gemv import GemvConfig, w12_gemv

    return variant_sweep(args, "gemv", gemv_configs, w12_gemv, GemvConfig, "1,2,4", "w12_gemv")


def mma_sweep(args) -> int:
    """M = 2..64 (``--rows``): every tensor-core (Gluon) variant, what ``w12_linear`` does today
    and cuBLAS, side by side in one run."""
    from lab.w12.variants.mma import MmaConfig, w12_mma

    def configs(m, kt, n, sms):
        return mma_configs(m, kt, n, sms, args.tiles or ((64, 4), (128, 4)), variants=args.variants)

    return variant_sweep(args, "mma", configs, w12_mma, MmaConfig, "2,4,8,16,32,64", "w12_mma")


def wgmma_sweep(args) -> int:
    """M = 2..64 (``--rows``): every Hopper wgmma variant, what ``w12_linear`` does today and cuBLAS,
    side by side in one run."""
    from lab.w12.variants.wgmma import WgmmaConfig, w12_wgmma

    return variant_sweep(args, "wgmma", wgmma_configs, w12_wgmma, WgmmaConfig, "8,16,32,64", "w12_wgmma")


def variant_sweep(args, label, configs_fn, run, cfg_cls, default_rows, default_name) -> int:
    """Every variant of one kernel per (shape, rows), checked against the fp32 reference and run to
    run; the fastest correct one re-timed 3x interleaved with ``w12_linear`` as users call it (the
    old path), cuBLAS and the Q pass (median)."""
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.w12.routing import w12_linear

    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = L2Flusher()
    rows, sweep_rows = [], []
    shapes = args.shape_list
    ms = [int(v) for v in (args.rows or default_rows).split(",")]
    t0 = time.time()
    for name, k, n in shapes:
        w, _, kp, w12_bytes = random_layer(name, k, n, dev)
        for m in ms:
            x, ref, tol = row_inputs(w, m)
            best = None
            for cfg in configs_fn(m, kp.k_tiles, n, sms):
                out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                try:
                    y = run(x, kp, config=cfg, out=out)
                    torch.cuda.synchronize()
                except Exception as e:
                    sweep_rows.append({"shape": name, "m": m, "config": cfg.key(), "error": str(e).splitlines()[0][:200]})
                    continue
                ok = bool(((y.float() - ref).abs() <= tol).all())
                det = bool(torch.equal(y.view(torch.int16), run(x, kp, config=cfg).view(torch.int16)))
                us = time_cuda_graph(lambda: run(x, kp, config=cfg), reps=args.reps, flush=flush)
                r = {"shape": name, "m": m, "config": cfg.key(), "cfg": cfg.__dict__, "us": round(us, 2),
                     "correct": ok, "deterministic": det}
                sweep_rows.append(r)
                if ok and det and (best is None or us < best["us"]):
                    best = r
            if best is None:
                print(f"{name:16s} m={m} no correct variant", flush=True)
                continue
            cfg = cfg_cls(**best["cfg"])
            old_path = routed_path(x, kp)
            # re-time the chosen variant, the old path, cuBLAS and the Q pass, interleaved
            g_us, o_us, c_us, q_us = time_interleaved(
                [lambda: run(x, kp, config=cfg), lambda: w12_linear(x, kp), lambda: F.linear(x, w),
                 lambda: run(x, kp, qpass=True, config=cfg)], reps=args.reps, flush=flush)
            row = {"shape": name, "k": k, "n": n, "m": m, "config": cfg.key(), "cfg": cfg.__dict__,
                   "w12_us": round(g_us, 2), "cublas_us": round(c_us, 2), "speedup": round(c_us / g_us, 3),
                   "old_kernel_us": round(o_us, 2), "old_config": old_path,
                   "old_speedup": round(c_us / o_us, 3), "qpass_us": round(q_us, 2),
                   "qpass_speedup": round(c_us / q_us, 3),
                   "w12_TBps": round(w12_bytes / g_us / 1e6, 3), "cublas_TBps": round(w.numel() * 2 / c_us / 1e6, 3),
                   "selected_from": sum(1 for r in sweep_rows if r.get("shape") == name and r.get("m") == m)}
            rows.append(row)
            print(f"{name:16s} m={m} {label} {g_us:7.2f} old {o_us:7.2f} cublas {c_us:7.2f} us  x{row['speedup']:.3f} "
                  f"(old x{row['old_speedup']:.3f}, q x{row['qpass_speedup']:.3f}) {cfg.key()} ({time.time() - t0:.0f}s)",
                  flush=True)
        w = kp = None  # free the layer before the next one
        torch.cuda.empty_cache()
        write_results(args.name or default_name, rows, {"partial": True, "sweep": sweep_rows})
    summary = speedup_summary(rows, ms, ("speedup", "old_speedup", "qpass_speedup"))
    write_results(args.name or default_name, rows, {"mode": label, "summary": summary, "reps": args.reps,
                                                    "weights": "randn*0.02 bf16", "sweep": sweep_rows})
    print_table(rows, ["shape", "m", "w12_us", "old_kernel_us", "cublas_us", "speedup", "w12_TBps", "config"])
    print(json.dumps(summary))
    return 0


def parse_tiles(text: str) -> tuple:
    """``--tiles``: ``64x4,128x8`` -> ((64, 4), (128, 8))."""
    try:
        tiles = tuple(tuple(int(v) for v in t.split("x")) for t in text.split(","))
    except ValueError:
        tiles = ()
    if not tiles or any(len(t) != 2 for t in tiles):
        raise argparse.ArgumentTypeError(f"expected ROWSxWARPS[,ROWSxWARPS...], got {text!r}")
    return tiles


VARIANTS = ("all", "xs", "xf32", "stream", "chunk", "chunk-wide", "tma", "tma-pair", "tma-wgmma", "tma-kgroups",
            "tma-kstream", "tma-narrow", "split", "regs", "early", "esc", "spread", "tail")


def _variants(text: str) -> str:
    """``--variants``: one set, or in gemv-gluon mode a comma list of sets (their union)."""
    bad = [v for v in text.split(",") if v not in VARIANTS]
    if bad or not text:
        raise argparse.ArgumentTypeError(f"unknown variant set {','.join(bad) or text!r}; choose from "
                                         f"{', '.join(VARIANTS)}")
    return text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sweep", "final", "gemv", "gemv-gluon", "mma", "wgmma", "warpk"], default="final",
                    help="sweep/final: the general kernel's configs; gemv: streaming-GEMV configs; "
                         "gemv-gluon: one-row Gluon GEMV configs; mma: tensor-core (Gluon) configs; wgmma: Hopper wgmma (Gluon) configs; "
                         "warpk: few-row tensor-core configs (K split across warps)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tuned", default=None, help="JSON of best configs from a sweep")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: the seven layers; "
                    "also llama8b.kv and llama8b.up, transformers' unfused projections)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--rows", default=None, help="gemv / default modes: comma list of M (default 1,2,4 / 1,2,4,8,16,32,64)")
    ap.add_argument("--tiles", default=None, type=parse_tiles,
                    help="mma mode: comma list of ROWSxWARPS program tiles (default 64x4,128x4)")
    ap.add_argument("--variants", type=_variants, default="all",
                    help="only the committed choice and: the staged-x variants (xs, gemv-gluon mode; xf32: "
                         "with and without x converted to fp32 once), the "
                         "stream-K ones (stream, mma mode), the x-chunk ones (chunk, mma mode; chunk-wide: x copied once "
                         "per K range of 8 or 16 records, 64- or 128-row programs) or the "
                         "TMA/mbarrier ones (tma, mma mode; tma-pair: the consumer group taking one or two "
                         "records per step; tma-wgmma: the consumer group on wgmma; tma-kgroups: it as 2 or 4 warpgroups "
                         "taking every 2nd or 4th record; tma-kstream: four of them on a stream-K run; tma-narrow: 32-row programs of "
                         "two consumer warps; in gemv-gluon mode tma: the records through a TMA ring; spread "
                         "(gemv-gluon and warpk modes): the escape chain spread over the first step; in gemv-gluon "
                         "mode a comma list runs several sets; split: the committed choice with K split 1-8 ways, gemv-gluon "
                         "and warpk modes; regs: it on 8 or 16 rows, split 1-3, register caps 64-96 or none, "
                         "gemv-gluon mode; early: the epilogue's loads early vs in the tail, mma mode; "
                         "esc: fewer preloaded escapes per pass, warpk mode; tail: unsplit programs with the "
                         "epilogue's loads before or after the loop, warpk mode)")
    args = ap.parse_args()
    args.shape_list = select_shapes(args.shapes)   # an unknown name: exit 2 before any GPU work
    if "," in args.variants and args.mode != "gemv-gluon":
        ap.error("--variants takes a comma list of sets in gemv-gluon mode only")
    if args.mode == "gemv":
        return gemv_sweep(args)
    if args.mode == "mma":
        return mma_sweep(args)
    if args.mode == "wgmma":
        return wgmma_sweep(args)
    if args.mode == "warpk":
        return warpk_sweep(args)
    if args.mode == "gemv-gluon":
        return gluon_gemv_sweep(args)

    import torch
    import torch.nn.functional as F

    from lab.w12.variants.gemm import Config, w12_linear

    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = L2Flusher()
    tuned = {}
    if args.tuned:
        for key, c in json.loads(Path(args.tuned).read_text()).items():
            tuned[key] = Config(**c)
    rows, sweep_rows = [], []
    check = None
    if args.mode == "final":
        try:
            check = model_check()
        except Exception as e:  # reported, not fatal
            check = {"error": str(e).splitlines()[0][:300]}
        print("model check:", check, flush=True)
    shapes = args.shape_list
    t_start = time.time()
    for name, k, n in shapes:
        w, _, kp, w12_bytes = random_layer(name, k, n, dev)
        for m in MS:
            x, ref, tol = row_inputs(w, m)
            cublas_us = time_cuda_graph(lambda: F.linear(x, w), reps=args.reps, flush=flush)
            key = f"{n}x{k}@{m}"
            cfgs = [tuned[key]] if key in tuned else sweep_configs(m, kp.k_tiles, n, sms)
            best = None
            for cfg in cfgs:
                out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                try:
                    y = w12_linear(x, kp, config=cfg, out=out)
                    torch.cuda.synchronize()
                except Exception as e:  # a config that does not compile is reported, not fatal
                    sweep_rows.append({"shape": name, "m": m, "config": cfg.key() if cfg else "default",
                                       "error": str(e).splitlines()[0][:200]})
                    continue
                err = (y.float() - ref).abs()
                ok = bool((err <= tol).all())
                y2 = w12_linear(x, kp, config=cfg)
                y3 = w12_linear(x, kp, config=cfg)
                det = bool(torch.equal(y.view(torch.int16), y2.view(torch.int16))
                           and torch.equal(y.view(torch.int16), y3.view(torch.int16)))
                us = time_cuda_graph(lambda: w12_linear(x, kp, config=cfg), reps=args.reps, flush=flush)
                r = {"shape": name, "k": k, "n": n, "m": m, "config": cfg.key() if cfg else "default",
                     "cfg": cfg.__dict__ if cfg else None,
                     "w12_us": round(us, 2), "cublas_us": round(cublas_us, 2),
                     "speedup": round(cublas_us / us, 3), "w12_TBps": round(w12_bytes / us / 1e6, 3),
                     "cublas_TBps": round(w.numel() * 2 / cublas_us / 1e6, 3),
                     "max_rel_err": float((err / (ref.abs() + 1e-6)).max()), "correct": ok,
                     "deterministic": det}
                sweep_rows.append(r)
                if ok and det and (best is None or us < best["w12_us"]):
                    best = r
            if best is not None and args.mode == "final":
                # re-time the chosen variant and cuBLAS afresh, interleaved, so that picking the
                # fastest of many noisy timings does not flatter W12
                cfg = Config(**best["cfg"])
                w_us, c_us = time_interleaved([lambda: w12_linear(x, kp, config=cfg), lambda: F.linear(x, w)],
                                              reps=args.reps, flush=flush)
                q_us = None
                if m == 1:  # the Q pass (8-bit view only) with the same variant
                    yq = w12_linear(x, kp, qpass=True, config=cfg)
                    assert bool(torch.isfinite(yq.float()).all())
                    q_us = round(time_cuda_graph(lambda: w12_linear(x, kp, qpass=True, config=cfg),
                                                 reps=args.reps, flush=flush), 2)
                best = dict(best, w12_us=round(w_us, 2), cublas_us=round(c_us, 2), qpass_us=q_us,
                            speedup=round(c_us / w_us, 3), w12_TBps=round(w12_bytes / w_us / 1e6, 3),
                            cublas_TBps=round(w.numel() * 2 / c_us / 1e6, 3), selected_from=len(cfgs))
            if best is not None:
                rows.append(best)
                print(f"{name:16s} m={m:2d} w12 {best['w12_us']:8.2f} us  cublas {cublas_us:8.2f} us  "
                      f"x{best['speedup']:.3f}  {best['config']}  ({time.time() - t_start:.0f}s)", flush=True)
        w = kp = None  # free the layer before the next one
        torch.cuda.empty_cache()
        # keep what was measured if the call runs out of time
        write_results(args.name or ("w12_gemm_sweep" if args.mode == "sweep" else "w12_gemm"), rows,
                      {"partial": True, "sweep": sweep_rows})

    summary = speedup_summary(rows, MS)
    extra = {"mode": args.mode, "summary": summary, "reps": args.reps, "weights": "randn*0.02 bf16",
             "model_check": check}
    extra["sweep"] = sweep_rows
    name = args.name or ("w12_gemm_sweep" if args.mode == "sweep" else "w12_gemm")
    write_results(name, rows, extra)
    best_cfgs = {f"{r['n']}x{r['k']}@{r['m']}": r["cfg"] for r in rows if r.get("cfg")}
    import os
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}_best_configs.json").write_text(json.dumps(best_cfgs, indent=1))
    print_table(rows, ["shape", "m", "w12_us", "cublas_us", "speedup", "w12_TBps", "config"])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
