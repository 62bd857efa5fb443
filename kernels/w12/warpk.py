"""W12 product for 1-32 rows on the tensor cores with the K split across the warps of a program.

The one-row Gluon GEMV (:mod:`.gemv_gluon`) splits K across warps (each warp streams its own
records, the program sums its warps once) and multiplies on the FMA pipe: per 4 weights it decodes
two bf16 pairs (8 instructions), then needs 4 more to widen them to fp32, 2 to widen x and 4 FMAs:
about 6.2 instructions per weight in its main loop, and it is bound by them (Nsight: 2.5 issued per
SM and cycle). The tensor-core kernel (:mod:`.mma`) takes the decoded pairs as they are, but its
programs split the *rows* across warps, so all warps read one shared x ring (a CTA barrier per
record) and small layers need split-K across programs.

This kernel is the GEMV's schedule with the MMA kernel's arithmetic:

* warp ``w`` of a program streams the records ``t0 + i * WARPS + w`` of the program's ``ROWS``
  (16 or 32) weight rows, ``DEPTH`` register sets reloaded in place (the GEMV's unrolled ring:
  clamped record indices, loop-invariant pointers, each reload pinned with ``bar.warp.sync``);
* the record words are loaded in the layout whose decoded pairs are the ``mma.sync.m16n8k16`` A
  registers (:func:`.fragments.a_operand`, per warp: the MMA layout is 3-D, the warp being the
  batch), and x arrives with the record, straight from global memory (L1/L2), 16 consecutive bf16
  of one x row per lane: the B registers in the MMA k order (:func:`.fragments.mma_k_to_physical`).
  Rows of x past M
  are predicated off, so one row costs 4 lanes' loads;
* per record and warp: 4 MMAs per 16 weight rows and 8 x rows, no widening, no FMA, no shared
  memory and no barrier in the loop; with ``x_late`` x is loaded right before each record's MMAs
  instead of riding in the register sets (at 32 x rows those are 32 registers per set);
* the program sums its warps' accumulators (fixed order) and runs the tensor-core kernels' epilogue
  (row scale, exact escapes, fixed-order split-K): bitwise identical run to run.

The plain reference is :func:`.naive.w12_linear_ref`. Gluon does not run under Triton's
interpreter; tests compile the kernel for sm_90 on the CPU and run it on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import tuning
from ..triton_env import pdl_args
from .format import TILE_K
from .gluon_common import (aligned_x, bf16_halves, check_call, decode_pairs, esc_chunk, gl, gluon, load_clamped,
                           log2, mma_v2, pdl_wait, per_warp, pin, record_offsets_3d, split_grid,
                           warp_batched_mma, x_operand)
from .gluon_epilogue import epilogue, epilogue_layout, esc_cols, esc_x, finalize_apply, finalize_loads, finalize_range
from .pack import KernelPack

ROWS = 16       # weight rows per program: one 16-row MMA slice per warp
MAX_ROWS = 32   # x rows per launch: one to four 8-row MMA column blocks


@dataclass(frozen=True)
class WarpKConfig:
    """``warps`` (each streams its own records of the program's 16 weight rows), ``depth`` register
    sets reloaded in place (2-4), ``split_k`` K ranges across programs, ``x_late``: x is loaded right
    before its record's MMAs instead of riding in the register sets (16-32 x rows take 16-32
    registers per set there), ``esc_ch``: escapes per epilogue pass (the first pass's contributions
    are loaded before the main loop and held in registers: ``esc_ch * BLOCK_M`` values per
    program; 0 takes :func:`.gluon_common.esc_chunk`, sized for 64-row blocks), ``epi_spread``: the
    escape chain's dependent loads spread over a peeled first step."""

    warps: int = 4
    depth: int = 2
    split_k: int = 1
    x_late: bool = False   # x loaded right before its record's MMAs, not with the record (register sets)
    esc_ch: int = 0        # escapes per epilogue pass, preloaded before the loop (0: gluon_common.esc_chunk)
    epi_spread: bool = False   # no split: the escape chain's dependent loads spread over a peeled step 0

    def key(self) -> str:
        return (f"wk-r{ROWS}-w{self.warps}-d{self.depth}-s{self.split_k}{'-xl' if self.x_late else ''}"
                f"{f'-e{self.esc_ch}' if self.esc_ch else ''}{'-es' if self.epi_spread else ''}")


def check_config(cfg: WarpKConfig) -> None:
    if cfg.warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {cfg.warps}")
    if cfg.depth not in (2, 3, 4):
        raise ValueError(f"depth must be 2-4, got {cfg.depth}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")
    if cfg.esc_ch not in (0, 8, 16, 32, 64):
        raise ValueError(f"esc_ch must be 0 (default), 8, 16, 32 or 64, got {cfg.esc_ch}")
    if cfg.epi_spread and cfg.split_k != 1:
        raise ValueError("epi_spread (the escape chain spread over the first step) needs split_k=1")


def layout_bases(rows: int, block_m: int, warps: int) -> dict[str, tuple]:
    """Register/lane/warp bases of the ``[warps, rows, 16]`` view words, ``[warps, rows, 8]``
    nibble words and ``[warps, block_m, 64]`` x (physical k): :func:`.fragments.layout_bases` for one
    warp, the warp as a leading (batch) dimension."""
    reps = [[0, 16 * (1 << i), 0] for i in range(log2(rows // 16))]
    warp = [[1 << i, 0, 0] for i in range(log2(warps))]
    rows_lane = [[0, 1, 0], [0, 2, 0], [0, 4, 0]]
    view = ([[0, 0, 1], [0, 0, 2], [0, 8, 0]] + reps, [[0, 0, 4], [0, 0, 8]] + rows_lane, warp, [warps, rows, 16])
    nib = ([[0, 0, 1], [0, 8, 0]] + reps, [[0, 0, 2], [0, 0, 4]] + rows_lane, warp, [warps, rows, 8])
    m_reps = [[0, 8 * (1 << i), 0] for i in range(log2(block_m // 8))]
    x = ([[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]] + m_reps, [[0, 0, 16], [0, 0, 32]] + rows_lane, warp,
         [warps, block_m, TILE_K])
    return {"view": view, "nib": nib, "x": x}


if gluon is not None:
    _K = gl.constexpr(TILE_K)   # record width (k) inside the kernels

    @lru_cache(maxsize=None)
    def layouts(rows: int, block_m: int, warps: int):
        b = layout_bases(rows, block_m, warps)
        lin = {k: gl.DistributedLinearLayout(v[0], v[1], v[2], [], v[3]) for k, v in b.items()}
        mma, a_op, b_op = warp_batched_mma(warps)
        return lin["view"], lin["nib"], lin["x"], mma, a_op, b_op, epilogue_layout(block_m, warps)

    @gluon.jit
    def _load(pv, pq, px, t, t_end, tx, L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr,
              QPASS: gl.constexpr, X_LATE: gl.constexpr):
        """Each warp's record ``t[w]`` (clamped to the range: past it the last record is re-read and
        its x is zero, so it adds +-0): view words, nibble words, x (with ``X_LATE``: the record
        index instead, for :func:`_x_of`)."""
        v, q = load_clamped(pv, pq, t, t_end, L_V, L_Q, QPASS)
        return v, q, _x_set(px, t, t_end, tx, L_X, X_LATE)

    @gluon.jit
    def _x_set(px, t, t_end, tx, L_X: gl.constexpr, X_LATE: gl.constexpr):
        """A register set's x as :func:`_load` gives it: x of records ``t`` (with ``X_LATE``: ``t``)."""
        if X_LATE:
            x = t
        else:
            x = _x_of(px, t, t_end, tx, L_X)
        return x

    @gluon.jit
    def _x_of(px, t, t_end, tx, L_X: gl.constexpr):
        """x of each warp's record ``t[w]`` (zero past ``t_end`` and for rows past M)."""
        return gl.load(px + per_warp(t * _K, L_X), mask=tx & per_warp(t < t_end, L_X), other=0.0)

    @gluon.jit
    def _mma(acc, v, q, x, WARPS: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, L_V: gl.constexpr,
             A_OP: gl.constexpr, B_OP: gl.constexpr, QPASS: gl.constexpr):
        """acc ``[W, ROWS, BLOCK_M]`` += each warp's decoded record times its x (MMA k order)."""
        p0, p1 = decode_pairs(v, q, L_V, QPASS)
        a = gl.join(bf16_halves(p0), bf16_halves(p1))          # [w, n, word, c, s]
        a = gl.permute(gl.reshape(a, [WARPS, ROWS, 4, 4, 2, 2]), [0, 1, 3, 5, 2, 4])   # [w, n, j, s, t, c]
        a = gl.convert_layout(gl.reshape(a, [WARPS, ROWS, _K]), A_OP, assert_trivial=True)
        return mma_v2(a, x_operand(x, WARPS, BLOCK_M, B_OP), acc)

    @gluon.jit
    def _set(acc, v, q, x, t_next, wid, pv, pq, px, t_end, tx, WARPS: gl.constexpr, ROWS: gl.constexpr,
             BLOCK_M: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr,
             B_OP: gl.constexpr, QPASS: gl.constexpr, X_LATE: gl.constexpr):
        """One register set: its records' MMAs, then the set reloaded in place and pinned there
        (``X_LATE``: ``x`` holds the record indices and x is loaded here)."""
        if X_LATE:
            x = _x_of(px, x, t_end, tx, L_X)
        acc = _mma(acc, v, q, x, WARPS, ROWS, BLOCK_M, L_V, A_OP, B_OP, QPASS)
        v, q, x = _load(pv, pq, px, t_next + wid, t_end, tx, L_V, L_Q, L_X, QPASS, X_LATE)
        return acc, v, q, x, pin(wid, True)

    @gluon.jit
    def _w12_warpk_kernel(
        x_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K, stride_xm, stride_ym,
        ROWS: gl.constexpr, BLOCK_M: gl.constexpr, WARPS: gl.constexpr, DEPTH: gl.constexpr,
        USE_SPLIT: gl.constexpr, QPASS: gl.constexpr, ESC_CH: gl.constexpr,
        L_V: gl.constexpr, L_Q: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr,
        A_OP: gl.constexpr, B_OP: gl.constexpr, L_EP: gl.constexpr, X_LATE: gl.constexpr = False,
        EPI_SPREAD: gl.constexpr = False, PDL: gl.constexpr = False,
    ):
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        n0 = pid_n * ROWS
        # loop-invariant pointers: the rows' view and nibble words in the tile's first record, and
        # each lane's x row and 16 physical k
        tile_row, off_v, off_q = record_offsets_3d(n0, KT, ROWS, L_V, L_Q)
        pv = rec_ptr + tile_row * 3072 + off_v
        pq = rec_ptr + tile_row * 3072 + off_q
        mx = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_X)))
        mx = gl.expand_dims(gl.expand_dims(mx, 0), 2)
        kx = gl.expand_dims(gl.expand_dims(gl.arange(0, _K, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_X))), 0), 1)
        px = x_ptr + mx * stride_xm + kx
        tx = mx < M
        wid = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_V)))

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = gl.zeros([WARPS, ROWS, BLOCK_M], gl.float32, MMA)
        # the records are constant: the register sets' first records load before the wait for the
        # previous kernel (under PDL, while it drains), their x after it
        v0, q0 = load_clamped(pv, pq, t_begin + wid, t_end, L_V, L_Q, QPASS)
        v1, q1 = load_clamped(pv, pq, t_begin + WARPS + wid, t_end, L_V, L_Q, QPASS)
        if DEPTH >= 3:
            v2, q2 = load_clamped(pv, pq, t_begin + 2 * WARPS + wid, t_end, L_V, L_Q, QPASS)
        if DEPTH >= 4:
            v3, q3 = load_clamped(pv, pq, t_begin + 3 * WARPS + wid, t_end, L_V, L_Q, QPASS)
        pdl_wait(PDL)
        x0 = _x_set(px, t_begin + wid, t_end, tx, L_X, X_LATE)
        x1 = _x_set(px, t_begin + WARPS + wid, t_end, tx, L_X, X_LATE)
        if DEPTH >= 3:
            x2 = _x_set(px, t_begin + 2 * WARPS + wid, t_end, tx, L_X, X_LATE)
        if DEPTH >= 4:
            x3 = _x_set(px, t_begin + 3 * WARPS + wid, t_end, tx, L_X, X_LATE)
        if not USE_SPLIT and not EPI_SPREAD:   # the epilogue's three dependent round trips, behind the
            # weights (held in registers through the loop)
            wid = pin(wid, True)
            pre = finalize_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, 0, M, N, stride_xm,
                                  ROWS, BLOCK_M, ESC_CH, L_EP)
        t0 = t_begin
        if EPI_SPREAD:
            # only the independent loads now; step 0 peeled (the same sets in the same order) with the
            # chain's dependent loads between its sets, and x[col] * delta taken after the loop, so
            # no warp waits on the chain before its first MMA (as the one-row GEMV's epi_spread)
            wid = pin(wid, True)
            scale, r_lo, r_hi, e_lo, e_hi = finalize_range(low_ptr, eptr_ptr, n0, N, ROWS, L_EP)
            acc, v0, q0, x0, wid = _set(acc, v0, q0, x0, t_begin + DEPTH * WARPS, wid, pv, pq, px, t_end, tx, WARPS,
                                        ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            e_ok, e_col, e_delta = esc_cols(ecol_ptr, edelta_ptr, e_lo, e_hi, ESC_CH, L_EP)
            wid = pin(wid, True)
            acc, v1, q1, x1, wid = _set(acc, v1, q1, x1, t_begin + (DEPTH + 1) * WARPS, wid, pv, pq, px, t_end, tx,
                                        WARPS, ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            if DEPTH >= 3:
                acc, v2, q2, x2, wid = _set(acc, v2, q2, x2, t_begin + (DEPTH + 2) * WARPS, wid, pv, pq, px, t_end,
                                            tx, WARPS, ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            if DEPTH >= 4:
                acc, v3, q3, x3, wid = _set(acc, v3, q3, x3, t_begin + (DEPTH + 3) * WARPS, wid, pv, pq, px, t_end,
                                            tx, WARPS, ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, L_EP))
            e_x = esc_x(x_ptr, e_ok, e_col, offs_m, M, stride_xm)
            wid = pin(wid, True)
            t0 = t_begin + DEPTH * WARPS
        for t in range(t0, t_end, DEPTH * WARPS):
            acc, v0, q0, x0, wid = _set(acc, v0, q0, x0, t + DEPTH * WARPS, wid, pv, pq, px, t_end, tx, WARPS, ROWS,
                                        BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            acc, v1, q1, x1, wid = _set(acc, v1, q1, x1, t + (DEPTH + 1) * WARPS, wid, pv, pq, px, t_end, tx, WARPS,
                                        ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            if DEPTH >= 3:
                acc, v2, q2, x2, wid = _set(acc, v2, q2, x2, t + (DEPTH + 2) * WARPS, wid, pv, pq, px, t_end, tx,
                                            WARPS, ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
            if DEPTH >= 4:
                acc, v3, q3, x3, wid = _set(acc, v3, q3, x3, t + (DEPTH + 3) * WARPS, wid, pv, pq, px, t_end, tx,
                                            WARPS, ROWS, BLOCK_M, L_V, L_Q, L_X, A_OP, B_OP, QPASS, X_LATE)
        part = gl.sum(acc, axis=0)          # the warps, in a fixed order
        if EPI_SPREAD:   # the products of finalize_loads, now
            pre = (scale, r_lo, r_hi, e_lo, e_hi, e_x.to(gl.float32) * e_delta[:, None])
        if not USE_SPLIT:
            finalize_apply(part, pre, x_ptr, y_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, 0, M, N, stride_xm,
                            stride_ym, ROWS, BLOCK_M, ESC_CH, L_EP)
        else:
            epilogue(part, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                      n0, pid_n, pid_k, 0, M, N, NUM_N_BLOCKS, SPLIT_K, SPLIT_K, stride_xm, stride_ym,
                      ROWS, BLOCK_M, USE_SPLIT, ESC_CH, gl.SliceLayout(0, MMA), L_EP)


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Gluon present, 1-32 bf16 rows on a CUDA device with compute capability 8.0+ (mma.sync)."""
    return (gluon is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and packed.rec32.is_cuda
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def tuned_config(m: int, n: int, k: int, device=None) -> WarpKConfig | None:
    """The table's config for ``m`` rows of the ``n x k`` layer (:mod:`specpilot.kernels.tuning`)."""
    found = tuning.lookup("w12", "warpk", tuning.device_arch(device) if device is not None else None, rows=m, n=n, k=k)
    return WarpKConfig(**found[0]["config"]) if found else None


def default_config(m: int, n: int, k: int, sms: int = 132, *, device=None) -> WarpKConfig:
    """The table's config, else programs of 4 warps, four register sets up to 8 x rows (the sweeps'
    most frequent choice) and two above (x takes 16-32 registers per set; above 16 rows x is loaded
    late and the epilogue preloads 32 escapes, not 64: faster on 6 of 7 layers), split-K when there
    are fewer than two programs per SM."""
    tuned = tuned_config(m, n, k, device)
    if tuned is not None:
        return tuned
    kt = (k + TILE_K - 1) // TILE_K
    blocks = (n + ROWS - 1) // ROWS
    split = 1 if blocks >= 2 * sms else max(1, min(max(1, kt // 8), (2 * sms + blocks - 1) // blocks))
    return WarpKConfig(4, 4 if m <= 8 else 2, split, x_late=m > 16, esc_ch=32 if m > 16 else 0)


def w12_warpk(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: WarpKConfig | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` bf16, M = 1..32; fp32 accumulation, deterministic."""
    check_call(x, packed)
    if not supported(x, packed):
        raise ValueError(f"w12_warpk needs 1-{MAX_ROWS} bf16 rows on a CUDA GPU of compute capability 8.0+")
    m, n = x.shape[0], packed.shape[0]
    cfg = config or default_config(m, n, x.shape[1], device=x.device)
    check_config(cfg)
    kt = packed.k_tiles
    x, k = aligned_x(x, kt)
    bm, tps, split, nb, _, ws, locks = split_grid(m, n, kt, ROWS, cfg.split_k, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    l_v, l_q, l_x, mma, a_op, b_op, l_ep = layouts(ROWS, bm, cfg.warps)
    _w12_warpk_kernel[(nb, split)](
        x, out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split, x.stride(0), out.stride(0),
        ROWS=ROWS, BLOCK_M=bm, WARPS=cfg.warps, DEPTH=cfg.depth, USE_SPLIT=split > 1, QPASS=qpass,
        ESC_CH=cfg.esc_ch or esc_chunk(bm), L_V=l_v, L_Q=l_q, L_X=l_x, MMA=mma, A_OP=a_op, B_OP=b_op, L_EP=l_ep,
        X_LATE=cfg.x_late, EPI_SPREAD=cfg.epi_spread and split == 1,
        num_warps=cfg.warps, **pdl_args(True, x),
    )
    return out
