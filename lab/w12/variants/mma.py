"""W12 GEMM on the tensor cores for 2-64 rows, written in Gluon so the decode lands in the MMA
fragment layout (the decoded weights never go through shared memory).

Why Gluon: in plain Triton the decoded weight tile keeps the layout it was loaded in, and ``tl.dot``
moves it into the operand layout through shared memory (2-byte stores); that, not HBM, bounded the
general kernel (:mod:`.gemm`) at 0.3-0.6x of cuBLAS with 8-64 rows. Gluon lets the kernel choose
the register layout of every tensor, so here the record words are *loaded* in a layout whose
decoded bf16 pairs are exactly the ``mma.sync.m16n8k16`` A-operand registers:

* an A fragment holds, per thread (lane ``4g + t``), rows ``g`` and ``g + 8`` and, per 16-wide k
  block, k ``{2t, 2t+1, 2t+8, 2t+9}``. The k order inside the MMA is free as long as x uses the
  same one, so MMA k ``16j + 8s + 2t + c`` is mapped to the physical k ``16t + 4j + 2s + c`` of the
  record: thread ``t`` then holds four *consecutive* 4-byte words of each of its rows (one 16-byte
  load; 8 lanes x 64 bytes = one whole 128x64 record row per load instruction), and each word
  decodes to the pairs ``s = 0, 1`` it needs;
* the matching B fragment (x) is 16 consecutive bf16 of one x row per thread (two 16-byte loads);
* the record words arrive either straight into those registers, ``depth`` records ahead, or
  (``wsmem``) through a ``cp.async`` shared-memory ring shared with x, which holds no registers for
  bytes in flight (the register ring capped occupancy at 25 % with 2-3 records ahead); the raw
  words are then read from shared memory in the same layout, 16-byte loads, conflict-free;
* the ``convert_layout`` calls into the MMA operand layouts are asserted trivial at compile time
  (``assert_trivial=True``): they only rename registers.

The record is ``[128 rows, 64 k]``: 8 KB of 8-bit views (64 bytes per row, words ``(w0, w2, w1,
w3)``), then 4 KB of low nibbles (32 bytes per row, a word per 8 weights); see docs/w12.md. The
epilogue (row scale ``2**(L_n - 112)``, exact escape corrections ``x[:, k] * (w - slot)``, fixed-
order split-K reduction through a workspace and a per-block counter) makes results bitwise
identical run to run, like the other W12 kernels. The plain reference is
:func:`.naive.w12_linear_ref`.

Gluon kernels do not run under Triton's interpreter; on a machine without CUDA the layouts are
still built and the kernel still compiles for sm_90 (tests do both), and ``w12_linear`` uses the
other kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specpilot.kernels.w12.format import TILE_K, TILE_N
from .gemm import KernelPack, _workspace, triton

try:  # Gluon ships with Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except Exception:  # pragma: no cover - older Triton or none
    gluon = None
    gl = None
    mma_v2 = None
    async_copy = None
# Gluon names that moved: the CTA-wide barrier is ``thread_barrier`` in Triton 3.6 and ``barrier``
# later; the cp.async copy is ``async_copy_global_to_shared`` in 3.6 and ``async_load`` later
_cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
_cp_async = getattr(async_copy, "async_load", None) or getattr(async_copy, "async_copy_global_to_shared", None)

RECORD_WORDS = TILE_N * TILE_K * 3 // 2 // 4   # 3072 int32 words per 12 KB record
VIEW_WORDS = TILE_K // 4                        # 16 words of 8-bit views per record row
NIB_WORDS = TILE_K // 8                         # 8 words of nibbles per record row


def _log2(v: int) -> int:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{v} is not a power of two")
    return v.bit_length() - 1


def layout_bases(block_n: int, block_m: int, num_warps: int) -> dict[str, tuple]:
    """The register/lane/warp bases of the kernel's load layouts (pure Python, tested on CPU).

    ``view``: the ``[block_n, 16]`` tile of 8-bit-view words; ``nib``: the ``[block_n, 8]`` tile
    of nibble words; ``x``: the ``[block_m, 64]`` x tile (physical k). Warps split the rows in
    16-row slices like the MMA layout; every warp reads the whole x tile.
    """
    w = num_warps
    if block_n % (16 * w) or block_n > TILE_N:
        raise ValueError(f"block_n {block_n} must be a multiple of 16 x {w} warps and at most {TILE_N}")
    if block_m < 8 or block_m > 64 or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} must be 8, 16, 32 or 64")
    row_reps = [[16 * w * (1 << i), 0] for i in range(_log2(block_n // (16 * w)))]
    warps = [[16 * (1 << i), 0] for i in range(_log2(w))]
    rows_lane = [[1, 0], [2, 0], [4, 0]]
    view = ([[0, 1], [0, 2], [8, 0]] + row_reps, [[0, 4], [0, 8]] + rows_lane, warps, [block_n, VIEW_WORDS])
    nib = ([[0, 1], [8, 0]] + row_reps, [[0, 2], [0, 4]] + rows_lane, warps, [block_n, NIB_WORDS])
    m_reps = [[8 * (1 << i), 0] for i in range(_log2(block_m // 8))]
    x = ([[0, 1], [0, 2], [0, 4], [0, 8]] + m_reps, [[0, 16], [0, 32]] + rows_lane,
         [[0, 0]] * _log2(w), [block_m, TILE_K])
    return {"view": view, "nib": nib, "x": x}


def mma_k_to_physical(kl: int) -> int:
    """Physical k (inside a 64-wide record) of MMA k ``kl = 16j + 8s + 2t + c``: ``16t + 4j + 2s + c``."""
    j, s, t, c = kl >> 4, (kl >> 3) & 1, (kl >> 1) & 3, kl & 1
    return 16 * t + 4 * j + 2 * s + c


if gluon is not None:

    def epilogue_layout(block_m: int, num_warps: int):
        """The epilogue's ``[BLOCK_N, BLOCK_M]`` (and the escapes' ``[ESC_CH, BLOCK_M]``): rows over
        lanes and warps (:func:`_finalize`; shared with :mod:`.warpk`)."""
        tm = min(block_m, 4)
        return gl.BlockedLayout([1, min(block_m // tm, 4)], [32 // tm, tm], [num_warps, 1], [1, 0])

    @lru_cache(maxsize=None)
    def layouts(block_n: int, block_m: int, num_warps: int):
        """Gluon layout objects for one (block_n, block_m, warps) variant."""
        b = layout_bases(block_n, block_m, num_warps)
        lin = {k: gl.DistributedLinearLayout(v[0], v[1], v[2], [], v[3]) for k, v in b.items()}
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
        a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        l_ep = epilogue_layout(block_m, num_warps)
        # x copies: 8 (or, for few rows, 4) bf16 per thread, a 128-byte x row per 8 (16) threads
        spt = max(2, min(8, block_m * 64 // (32 * num_warps)))
        tk = 64 // spt
        xc = gl.BlockedLayout([1, spt], [32 // tk, tk], [num_warps, 1], [1, 0])
        # x stages: 16-byte chunks XOR-swizzled by row, so the B-fragment reads are conflict-free
        xs = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        return lin["view"], lin["nib"], lin["x"], mma, a_op, b_op, l_ep, xc, xs

    @lru_cache(maxsize=None)
    def wsmem_layouts(num_warps: int):
        """For ``wsmem``: 16-byte cp.async copies of the view words (``[BLOCK_N, 16]``) and nibble
        words (``[BLOCK_N, 8]``), and their unswizzled shared layout (the fragment reads of 8 rows x
        64 or 32 contiguous bytes per instruction are conflict-free as they are)."""
        wc = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
        qc = gl.BlockedLayout([1, 4], [16, 2], [num_warps, 1], [1, 0])
        return wc, qc, gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

    @gluon.jit
    def _bf16_halves(p):
        lo = (p & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        hi = (p >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _decode_pairs(v, nb, L_VIEW: gl.constexpr, QPASS: gl.constexpr):
        """View words ``v`` ``[..., 16]`` (and nibble words ``nb`` ``[..., 8]``, same leading shape)
        -> the bf16 pairs as uint32 in ``v``'s layout ``L_VIEW``: ``p0`` holds weights 4c, 4c+1 of view
        word c, ``p1`` weights 4c+2, 4c+3. Shared by this kernel and the one-row GEMV
        (:mod:`.gemv_gluon`); the nibble regrouping is asserted to move no data."""
        SGN: gl.constexpr = 0x80008000
        MAG: gl.constexpr = 0x07F007F0
        NIB: gl.constexpr = 0x000F000F
        EXP: gl.constexpr = 0x38003800
        be = v.to(gl.uint32)
        if QPASS:
            ln0 = 0x00080008
            ln1 = 0x00080008
        else:
            nn = nb.to(gl.uint32)
            # view word 2j takes nibble word j's bytes 0 and 2, word 2j+1 its bytes 1 and 3
            nw = gl.convert_layout(gl.reshape(gl.join(nn, nn >> 8), v.shape), L_VIEW, assert_trivial=True)
            ln0 = nw & NIB
            ln1 = (nw >> 4) & NIB
        p0 = ((be << 8) & SGN) | ((be << 4) & MAG) | ln0 | EXP     # weights 4c, 4c+1 (s = 0)
        p1 = (be & SGN) | ((be >> 4) & MAG) | ln1 | EXP            # weights 4c+2, 4c+3 (s = 1)
        return p0, p1

    @gluon.jit
    def _prmt(a, b, ASM: gl.constexpr):
        """PTX ``prmt.b32 d, a, b, SEL`` (selector in ``ASM``): byte i of d = byte SEL[i] of {b:a}."""
        return gl.inline_asm_elementwise(ASM, "=r,r,r", [a, b], dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def _sel_mag(a, b):
        """``(a & 0x07F007F0) | (b & 0xF80FF80F)`` as one LOP3 (a bit select)."""
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x07F007F0, $2, 0xE2;", "=r,r,r", [a, b],
                                         dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def _sel_sgn(a, b):
        """``(a & 0x80008000) | (b & 0x7FFF7FFF)`` as one LOP3."""
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x80008000, $2, 0xE2;", "=r,r,r", [a, b],
                                         dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def _or_masked(t, e, ASM: gl.constexpr):
        """``(t & MASK) | e`` as one LOP3, ``e`` (the exponent bits) in a register."""
        return gl.inline_asm_elementwise(ASM, "=r,r,r", [t, e], dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def _pairs_of_half(be, nn, e, SX: gl.constexpr, SY: gl.constexpr):
        """View words ``be`` (all even or all odd) and their nibble words ``nn`` -> (p0, p1)."""
        xs = _prmt(be, nn, SX)          # sign of w1 @31, its nibble @19..16; sign of w0 @15, nibble @3..0
        t0 = _sel_mag(be << 4, xs)      # + the 7 view bits of w0 @10..4 and w1 @26..20
        ys = _prmt(be, nn, SY)          # (w3, w2 view bytes and their nibbles) << 4
        t1 = _sel_sgn(be, ys >> 4)      # signs of w2, w3 straight from the view word
        p0 = _or_masked(t0, e, "lop3.b32 $0, $1, 0x87FF87FF, $2, 0xEA;")
        p1 = _or_masked(t1, e, "lop3.b32 $0, $1, 0x87FF87FF, $2, 0xEA;")
        return p0, p1

    @gluon.jit
    def _decode_pairs_fast(v, nb, L_VIEW: gl.constexpr, QPASS: gl.constexpr):
        """:func:`_decode_pairs` (the plain form; same result bits for every input) in fewer
        instructions, for ``[N, 16]`` or ``[W, R, 16]`` view words: ``prmt`` byte permutes put each
        sign next to its nibble (p0) and each view byte above its nibble so one shift aligns both
        (p1), and each bit select and the exponent OR are one ``lop3`` (the compiler splits the
        plain masks into two or three). One-row GEMV main loop at 16 rows x 4 warps, two unrolled
        sets: 398 instead of 468 instructions per two records (static SASS, sm_90); on the H200
        1.182x vs 1.141x cuBLAS (geomean, 7 layers, one run). Bit-exactness: exhaustive per weight
        and GF(2)-affine on all inputs, tests/test_w12_decode_prmt.py (torch mirror), and bitwise
        A/B against the plain decode on the GPU; study in docs/plans/w12-decode-isa.md."""
        be = v.to(gl.uint32)
        if QPASS:   # nibble 0b1000 everywhere
            e = gl.full(be.shape, 0x38083808, gl.uint32, L_VIEW)
            t0 = _sel_sgn(be << 8, be << 4)
            t1 = _sel_sgn(be, be >> 4)
            p0 = _or_masked(t0, e, "lop3.b32 $0, $1, 0x87F087F0, $2, 0xEA;")
            p1 = _or_masked(t1, e, "lop3.b32 $0, $1, 0x87F087F0, $2, 0xEA;")
        else:
            # view words 2j and 2j+1 use nibble word j (bytes 0, 2 and 1, 3): split, decode, rejoin
            # (the split, the join and both conversions move no data: asserted)
            if len(v.shape) == 3:
                ve, vo = gl.split(gl.reshape(be, [v.shape[0], v.shape[1], 8, 2]))
            else:
                ve, vo = gl.split(gl.reshape(be, [v.shape[0], 8, 2]))
            nn = gl.convert_layout(nb.to(gl.uint32), ve.type.layout, assert_trivial=True)
            e = gl.full(ve.shape, 0x38003800, gl.uint32, ve.type.layout)
            p0e, p1e = _pairs_of_half(ve, nn, e, "prmt.b32 $0, $1, $2, 0x2604;", "prmt.b32 $0, $1, $2, 0x3614;")
            p0o, p1o = _pairs_of_half(vo, nn, e, "prmt.b32 $0, $1, $2, 0x2705;", "prmt.b32 $0, $1, $2, 0x3715;")
            p0 = gl.convert_layout(gl.reshape(gl.join(p0e, p0o), v.shape), L_VIEW, assert_trivial=True)
            p1 = gl.convert_layout(gl.reshape(gl.join(p1e, p1o), v.shape), L_VIEW, assert_trivial=True)
        return p0, p1

    @gluon.jit
    def _a_operand(v, nb, L_VIEW: gl.constexpr, A_OP: gl.constexpr, BLOCK_N: gl.constexpr,
                   QPASS: gl.constexpr, PLAIN: gl.constexpr):
        """Decode one record's ``[BLOCK_N, 16]`` view words (+ ``[BLOCK_N, 8]`` nibble words) into the
        ``[BLOCK_N, 64]`` bf16 A operand, MMA k order, without moving data between threads."""
        if PLAIN:
            p0, p1 = _decode_pairs(v, nb, L_VIEW, QPASS)
        else:
            p0, p1 = _decode_pairs_fast(v, nb, L_VIEW, QPASS)
        w5 = gl.join(_bf16_halves(p0), _bf16_halves(p1))         # [n, word, c, s]
        w5 = gl.reshape(w5, [BLOCK_N, 4, 4, 2, 2])                 # [n, t, j, c, s]
        w5 = gl.permute(w5, [0, 2, 4, 1, 3])                       # [n, j, s, t, c]
        return gl.convert_layout(gl.reshape(w5, [BLOCK_N, 64]), A_OP, assert_trivial=True)

    @gluon.jit
    def _record_offsets(n0, KT, BLOCK_N: gl.constexpr, L_VIEW: gl.constexpr, L_NIB: gl.constexpr):
        """For the program's rows ``n0 .. n0 + BLOCK_N`` (inside one 128-row record tile): the index of
        the tile's first record, and the word offsets inside a record of the rows' view words
        (``[BLOCK_N, 16]``, at ``row * 16``) and nibble words (``[BLOCK_N, 8]``, at ``2048 + row * 8``).
        Shared by this kernel and the ``wgmma`` one."""
        tile_row = (n0 // 128).to(gl.int64) * KT
        r_in = n0 % 128
        rv = r_in + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_VIEW))
        wv = gl.arange(0, 16, layout=gl.SliceLayout(0, L_VIEW))
        off_v = rv[:, None] * 16 + wv[None, :]
        rn = r_in + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_NIB))
        wn = gl.arange(0, 8, layout=gl.SliceLayout(0, L_NIB))
        off_n = 2048 + rn[:, None] * 8 + wn[None, :]
        return tile_row, off_v, off_n

    @gluon.jit
    def _pin(v, PIN: gl.constexpr):
        """``bar.warp.sync`` (no data moved): ptxas does not move memory operations across it, so the
        loads just issued stay ahead of what follows. Without it ptxas sinks the reloads of an
        unrolled ring to the end of the loop body, where they issue together."""
        if PIN:
            v = gl.inline_asm_elementwise("bar.warp.sync -1;\n mov.b32 $0, $1;", "=r,r", [v], dtype=gl.int32,
                                          is_pure=False, pack=1)
        return v

    @gluon.jit
    def _load_rec(rec_ptr, tile_row, t, ok, off_v, off_n, QPASS: gl.constexpr):
        """Record ``t`` of the program's row tile: its view words and nibble words (if ``ok``)."""
        base = (tile_row + t) * 3072
        v = gl.load(rec_ptr + base + off_v, mask=ok, other=0)
        if QPASS:
            q = v
        else:
            q = gl.load(rec_ptr + base + off_n, mask=ok, other=0)
        return v, q

    @gluon.jit
    def _x_copy(xs, x_ptr, rows_c, kc, t, ok, M, K, stride_xm):
        """Start copying x[rows, 64t : 64t+64] into the shared-memory stage ``xs`` (cp.async, 8-16
        bytes per thread, zero-filled outside x or when not ``ok``) and commit it as one group."""
        kk = t * 64 + kc
        _cp_async(
            xs, x_ptr + rows_c[:, None] * stride_xm + kk[None, :],
            mask=((rows_c < M)[:, None] & (kk < K)[None, :]) & ok)
        async_copy.commit_group()

    @gluon.jit
    def _w_copy(wv_s, wq_s, rec_ptr, tile_row, t, ok, offc_v, offc_q, QPASS: gl.constexpr):
        """Start copying record ``t``'s view (and nibble) words of the program's rows into a stage
        of the weight ring (cp.async, 16 bytes per thread; committed with the x copy that follows)."""
        base = (tile_row + t) * 3072
        _cp_async(wv_s, rec_ptr + base + offc_v, mask=ok)
        if not QPASS:
            _cp_async(wq_s, rec_ptr + base + offc_q, mask=ok)

    @gluon.jit
    def _copy_offsets(r_in, BLOCK_N: gl.constexpr, L_WC: gl.constexpr, L_QC: gl.constexpr):
        """Word offsets inside a record of rows ``r_in .. r_in + BLOCK_N``' view and nibble words, in
        the ``wsmem`` copy layouts (for :func:`_w_copy`)."""
        rcv = r_in + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_WC))
        offc_v = rcv[:, None] * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, L_WC))[None, :]
        rcq = r_in + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_QC))
        offc_q = 2048 + rcq[:, None] * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, L_QC))[None, :]
        return offc_v, offc_q

    @gluon.jit
    def _wsmem_mma(acc, xs, wv_s, wq_s, stage, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr,
                   L_VIEW: gl.constexpr, L_NIB: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr,
                   B_OP: gl.constexpr, PLAIN: gl.constexpr):
        """One record of the ``wsmem`` ring: its x (B operand) and weight words from ring stage
        ``stage``, decoded into the A operand, and the MMA. Shared with :mod:`.mma_stream`."""
        b = _b_operand(xs.index(stage), L_X, B_OP, BLOCK_M)
        w = wv_s.index(stage).load(L_VIEW)
        if QPASS:
            q = w
        else:
            q = wq_s.index(stage).load(L_NIB)
        return mma_v2(_a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS, PLAIN), b, acc)

    @gluon.jit
    def _b_operand(xs, L_X: gl.constexpr, B_OP: gl.constexpr, BLOCK_M: gl.constexpr):
        """A ``[BLOCK_M, 64]`` x stage as the ``[64, BLOCK_M]`` B operand in MMA k order: each thread
        reads 16 consecutive bf16 of one x row (two 16-byte shared loads)."""
        xv = xs.load(L_X)
        xv = gl.reshape(xv, [BLOCK_M, 4, 4, 2, 2])                 # [m, t, j, s, c]
        xv = gl.permute(xv, [2, 3, 1, 4, 0])                       # [j, s, t, c, m]
        return gl.convert_layout(gl.reshape(xv, [64, BLOCK_M]), B_OP, assert_trivial=True)

    @gluon.jit
    def _ring_step(acc, w, q, xs, x_ptr, t, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
                   L_VIEW: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                   PLAIN: gl.constexpr):
        """Record ``t`` of the register-ring loop: its x stage (landed), the copy of x for ``t + DEPTH``
        into the stage freed by ``t - 1``, and the MMA of the record's weights ``w``/``q``."""
        XD: gl.constexpr = DEPTH + 1
        it = t - t_begin
        async_copy.wait_group(DEPTH - 1)        # this thread's copies of record t have landed
        _cta_barrier()                          # ... everyone's, and stage (it - 1) is free again
        _x_copy(xs.index((it + DEPTH) % XD), x_ptr, rows_c, kc, t + DEPTH, t + DEPTH < t_end, M, K, stride_xm)
        b = _b_operand(xs.index(it % XD), L_X, B_OP, BLOCK_M)
        return mma_v2(_a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS, PLAIN), b, acc)

    @gluon.jit
    def _register_ring(acc, xs, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n, rows_c, kc, M, K, stride_xm,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
                       UNROLL: gl.constexpr, L_VIEW: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr,
                       B_OP: gl.constexpr, PLAIN: gl.constexpr, epi, ESC_CH: gl.constexpr, L_EP: gl.constexpr,
                       PRE: gl.constexpr):
        """The main loop with the weights DEPTH records ahead in registers and x DEPTH records ahead
        in a shared-memory ring filled by cp.async (one copy per program, not per warp). Loads past
        the range are predicated off.

        Rolled, the ring rotates (``w0 <- w1 <- next``): the move of the record just loaded waits
        for that load, so one record is in flight whatever DEPTH. ``UNROLL``: DEPTH register sets,
        the loop unrolled by DEPTH, each set reloaded in place after its MMA (DEPTH - 1 in flight);
        the last ``(t_end - t_begin) % DEPTH`` records (already loaded) run after the loop.

        ``PRE``: the epilogue's loads (``epi``: low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, N)
        are issued after the first records' and returned with the accumulator (else 0)."""
        w0, q0 = _load_rec(rec_ptr, tile_row, t_begin, t_begin < t_end, off_v, off_n, QPASS)
        if DEPTH >= 2:
            w1, q1 = _load_rec(rec_ptr, tile_row, t_begin + 1, t_begin + 1 < t_end, off_v, off_n, QPASS)
        if DEPTH >= 3:
            w2, q2 = _load_rec(rec_ptr, tile_row, t_begin + 2, t_begin + 2 < t_end, off_v, off_n, QPASS)
        for i in gl.static_range(DEPTH):
            _x_copy(xs.index(i), x_ptr, rows_c, kc, t_begin + i, t_begin + i < t_end, M, K, stride_xm)
        low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, N = epi
        pre = _early_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                           BLOCK_N, BLOCK_M, ESC_CH, L_EP, PRE)
        if UNROLL:
            t_main = t_begin + (t_end - t_begin) // DEPTH * DEPTH
            for t in range(t_begin, t_main, DEPTH):
                acc = _ring_step(acc, w0, q0, xs, x_ptr, t, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                 BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
                w0, q0 = _load_rec(rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end, off_v, off_n, QPASS)
                if DEPTH >= 2:
                    acc = _ring_step(acc, w1, q1, xs, x_ptr, t + 1, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                     BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
                    w1, q1 = _load_rec(rec_ptr, tile_row, t + 1 + DEPTH, t + 1 + DEPTH < t_end, off_v, off_n, QPASS)
                if DEPTH >= 3:
                    acc = _ring_step(acc, w2, q2, xs, x_ptr, t + 2, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                     BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
                    w2, q2 = _load_rec(rec_ptr, tile_row, t + 2 + DEPTH, t + 2 + DEPTH < t_end, off_v, off_n, QPASS)
            if t_main < t_end:
                acc = _ring_step(acc, w0, q0, xs, x_ptr, t_main, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                 BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
            if DEPTH >= 3:
                if t_main + 1 < t_end:
                    acc = _ring_step(acc, w1, q1, xs, x_ptr, t_main + 1, t_begin, t_end, rows_c, kc, M, K,
                                     stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
        else:
            for t in range(t_begin, t_end):
                wx, qx = _load_rec(rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end, off_v, off_n, QPASS)
                acc = _ring_step(acc, w0, q0, xs, x_ptr, t, t_begin, t_end, rows_c, kc, M, K, stride_xm,
                                 BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
                if DEPTH == 1:
                    w0, q0 = wx, qx
                elif DEPTH == 2:
                    w0, q0 = w1, q1
                    w1, q1 = wx, qx
                else:
                    w0, q0 = w1, q1
                    w1, q1 = w2, q2
                    w2, q2 = wx, qx
        return acc, pre

    @gluon.jit
    def _chunk_copy(xb, c, x_ptr, t_begin, t_end, M, K, stride_xm, pid_m,
                    BLOCK_M: gl.constexpr, XC: gl.constexpr, L_XC: gl.constexpr):
        """Start copying x for the ``XC`` records of chunk ``c`` into the buffer ``xb`` (``[XC *
        BLOCK_M, 64]``, record after record) as one copy (cp.async, zero-filled outside x or past
        ``t_end``; one copy, so the barrier analysis sees one write and not ``XC`` writes to one
        buffer), one commit group."""
        r = gl.arange(0, XC * BLOCK_M, layout=gl.SliceLayout(1, L_XC))
        k = gl.arange(0, 64, layout=gl.SliceLayout(0, L_XC))
        t = t_begin + c * XC + r // BLOCK_M
        rows = pid_m * BLOCK_M + r % BLOCK_M
        kk = t[:, None] * 64 + k[None, :]
        _cp_async(xb, x_ptr + rows[:, None] * stride_xm + kk,
                  mask=(rows < M)[:, None] & (kk < K) & (t < t_end)[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _chunk_step(acc, w, q, xb, j: gl.constexpr, tok, rec_ptr, tile_row, t, t_end, off_v, off_n,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
                    L_VIEW: gl.constexpr, L_X: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
                    PLAIN: gl.constexpr):
        """Record ``t`` (``j``-th of its chunk): its MMA, then its register set reloaded in place with
        record ``t + DEPTH`` and pinned there."""
        b = _b_operand(xb.slice(j * BLOCK_M, BLOCK_M), L_X, B_OP, BLOCK_M)
        acc = mma_v2(_a_operand(w, q, L_VIEW, A_OP, BLOCK_N, QPASS, PLAIN), b, acc)
        w, q = _load_rec(rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end, off_v, off_n, QPASS)
        return acc, w, q, _pin(tok, True)

    @gluon.jit
    def _chunk(acc, w0, q0, w1, q1, w2, q2, tok, xcur, xnext2, c, KPOS: gl.constexpr, x_ptr, rec_ptr, tile_row,
               t_begin, t_end,
               off_v, off_n, pid_m, M, K, stride_xm,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
               XC: gl.constexpr, L_VIEW: gl.constexpr, L_X: gl.constexpr, L_XC: gl.constexpr, A_OP: gl.constexpr,
               B_OP: gl.constexpr, PLAIN: gl.constexpr):
        """Chunk ``c`` (``KPOS``-th of the loop body): wait for its x (buffer ``xcur``), one CTA barrier
        (everyone has it and is done with chunk ``c - 1``, whose buffer ``xnext2`` then takes chunk
        ``c + 2``), then its records, each with register set ``(KPOS * XC + j) % DEPTH``."""
        async_copy.wait_group(1)
        _cta_barrier()
        _chunk_copy(xnext2, c + 2, x_ptr, t_begin, t_end, M, K, stride_xm, pid_m, BLOCK_M, XC, L_XC)
        for j in gl.static_range(XC):
            t = t_begin + c * XC + j
            if t < t_end:
                if (KPOS * XC + j) % DEPTH == 0:
                    acc, w0, q0, tok = _chunk_step(acc, w0, q0, xcur, j, tok, rec_ptr, tile_row, t, t_end, off_v, off_n,
                                                   BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
                elif (KPOS * XC + j) % DEPTH == 1:
                    acc, w1, q1, tok = _chunk_step(acc, w1, q1, xcur, j, tok, rec_ptr, tile_row, t, t_end, off_v, off_n,
                                                   BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
                else:
                    acc, w2, q2, tok = _chunk_step(acc, w2, q2, xcur, j, tok, rec_ptr, tile_row, t, t_end, off_v, off_n,
                                                   BLOCK_M, BLOCK_N, QPASS, DEPTH, L_VIEW, L_X, A_OP, B_OP, PLAIN)
        return acc, w0, q0, w1, q1, w2, q2, tok

    @gluon.jit
    def _chunk_ring(acc, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n, pid_m, M, K, stride_xm,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr, DEPTH: gl.constexpr,
                    XC: gl.constexpr, L_VIEW: gl.constexpr, L_X: gl.constexpr, L_XC: gl.constexpr,
                    A_OP: gl.constexpr, B_OP: gl.constexpr, XS: gl.constexpr, PLAIN: gl.constexpr):
        """The main loop with x in chunks of ``XC`` records and the weights in ``DEPTH`` unrolled
        register sets, each reloaded in place after its MMA and pinned so the reload is not sunk to
        the end of the loop. x sits in three separate
        shared-memory buffers used in turn (the loop unrolled by three chunks): Triton's barrier
        analysis sees a copy into one buffer and the fragment reads of another as independent, so a
        chunk costs one CTA barrier; the one ring with indexed stages costs two per record (the
        explicit one and one the analysis adds between the copy and the reads). Records past the
        range are skipped."""
        xa = gl.allocate_shared_memory(gl.bfloat16, [XC * BLOCK_M, 64], XS)
        xb = gl.allocate_shared_memory(gl.bfloat16, [XC * BLOCK_M, 64], XS)
        xc = gl.allocate_shared_memory(gl.bfloat16, [XC * BLOCK_M, 64], XS)
        tok = gl.arange(0, 1, layout=gl.SliceLayout(1, L_XC))
        w0, q0 = _load_rec(rec_ptr, tile_row, t_begin, t_begin < t_end, off_v, off_n, QPASS)
        w1 = w0
        q1 = q0
        w2 = w0
        q2 = q0
        if DEPTH >= 2:
            w1, q1 = _load_rec(rec_ptr, tile_row, t_begin + 1, t_begin + 1 < t_end, off_v, off_n, QPASS)
        if DEPTH >= 3:
            w2, q2 = _load_rec(rec_ptr, tile_row, t_begin + 2, t_begin + 2 < t_end, off_v, off_n, QPASS)
        _chunk_copy(xa, 0, x_ptr, t_begin, t_end, M, K, stride_xm, pid_m, BLOCK_M, XC, L_XC)
        _chunk_copy(xb, 1, x_ptr, t_begin, t_end, M, K, stride_xm, pid_m, BLOCK_M, XC, L_XC)
        for c in range(0, (t_end - t_begin + XC - 1) // XC, 3):
            acc, w0, q0, w1, q1, w2, q2, tok = _chunk(
                acc, w0, q0, w1, q1, w2, q2, tok, xa, xc, c, 0, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n,
                pid_m, M, K, stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, XC, L_VIEW, L_X, L_XC, A_OP, B_OP, PLAIN)
            acc, w0, q0, w1, q1, w2, q2, tok = _chunk(
                acc, w0, q0, w1, q1, w2, q2, tok, xb, xa, c + 1, 1, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v,
                off_n, pid_m, M, K, stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, XC, L_VIEW, L_X, L_XC, A_OP, B_OP,
                PLAIN)
            acc, w0, q0, w1, q1, w2, q2, tok = _chunk(
                acc, w0, q0, w1, q1, w2, q2, tok, xc, xb, c + 2, 2, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v,
                off_n, pid_m, M, K, stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, XC, L_VIEW, L_X, L_XC, A_OP, B_OP,
                PLAIN)
        return acc

    @gluon.jit
    def _w12_mma_kernel(
        x_ptr, y_ptr, rec_ptr, low_ptr,
        eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr,
        ws_ptr, lock_ptr,
        M, N, K, KT, TILES_PER_SPLIT, NUM_N_BLOCKS, SPLIT_K,
        stride_xm, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, QPASS: gl.constexpr,
        ESC_CH: gl.constexpr, DEPTH: gl.constexpr, WSMEM: gl.constexpr, UNROLL: gl.constexpr, PLAIN: gl.constexpr,
        L_VIEW: gl.constexpr, L_NIB: gl.constexpr, L_X: gl.constexpr, MMA: gl.constexpr,
        A_OP: gl.constexpr, B_OP: gl.constexpr, L_EP: gl.constexpr, L_XC: gl.constexpr, XS: gl.constexpr,
        L_WC: gl.constexpr, L_QC: gl.constexpr, WSL: gl.constexpr, XC: gl.constexpr = 1, PRE: gl.constexpr = False,
    ):
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        pid_m = gl.program_id(2)
        n0 = pid_n * BLOCK_N
        tile_row, off_v, off_n = _record_offsets(n0, KT, BLOCK_N, L_VIEW, L_NIB)
        rows_c = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_XC))
        kc = gl.arange(0, 64, layout=gl.SliceLayout(0, L_XC))
        XD: gl.constexpr = DEPTH + 1
        if XC == 1:     # (x chunks: three buffers of their own, in _chunk_ring)
            xs = gl.allocate_shared_memory(gl.bfloat16, [XD, BLOCK_M, 64], XS)

        t_begin = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_begin + TILES_PER_SPLIT, KT)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)

        if WSMEM:
            # weights and x: DEPTH records ahead in one shared-memory ring of DEPTH + 1 stages, filled
            # by cp.async (no registers held for bytes in flight); the fragments are read from it
            wv_s = gl.allocate_shared_memory(gl.int32, [XD, BLOCK_N, 16], WSL)
            wq_s = gl.allocate_shared_memory(gl.int32, [XD, BLOCK_N, 8], WSL)
            offc_v, offc_q = _copy_offsets(n0 % 128, BLOCK_N, L_WC, L_QC)
            for i in gl.static_range(DEPTH):
                ok = t_begin + i < t_end
                _w_copy(wv_s.index(i), wq_s.index(i), rec_ptr, tile_row, t_begin + i, ok, offc_v, offc_q, QPASS)
                _x_copy(xs.index(i), x_ptr, rows_c, kc, t_begin + i, ok, M, K, stride_xm)
            pre = _early_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                               BLOCK_N, BLOCK_M, ESC_CH, L_EP, PRE)
            for t in range(t_begin, t_end):
                it = t - t_begin
                async_copy.wait_group(DEPTH - 1)        # this thread's copies of record t have landed
                _cta_barrier()                          # ... everyone's, and stage (it - 1) is free again
                nxt = (it + DEPTH) % XD
                _w_copy(wv_s.index(nxt), wq_s.index(nxt), rec_ptr, tile_row, t + DEPTH, t + DEPTH < t_end,
                        offc_v, offc_q, QPASS)
                _x_copy(xs.index(nxt), x_ptr, rows_c, kc, t + DEPTH, t + DEPTH < t_end, M, K, stride_xm)
                acc = _wsmem_mma(acc, xs, wv_s, wq_s, it % XD, BLOCK_M, BLOCK_N, QPASS, L_VIEW, L_NIB, L_X, A_OP, B_OP,
                                 PLAIN)
        elif XC > 1:
            acc = _chunk_ring(acc, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n, pid_m, M, K, stride_xm,
                              BLOCK_M, BLOCK_N, QPASS, DEPTH, XC, L_VIEW, L_X, L_XC, A_OP, B_OP, XS, PLAIN)
            pre = 0
        else:
            acc, pre = _register_ring(acc, xs, x_ptr, rec_ptr, tile_row, t_begin, t_end, off_v, off_n, rows_c, kc, M,
                                      K, stride_xm, BLOCK_M, BLOCK_N, QPASS, DEPTH, UNROLL, L_VIEW, L_X, A_OP, B_OP,
                                      PLAIN, (low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, N), ESC_CH, L_EP,
                                      PRE)
        async_copy.wait_group(0)
        _epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                  n0, pid_n, pid_k, pid_m, M, N, NUM_N_BLOCKS, SPLIT_K, SPLIT_K, stride_xm, stride_ym,
                  BLOCK_N, BLOCK_M, USE_SPLIT, ESC_CH, MMA, L_EP, pre, PRE)

    @gluon.jit
    def _epilogue(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, ws_ptr, lock_ptr,
                  n0, pid_n, pid_k, pid_m, M, N, NUM_N_BLOCKS, SPLIT_K, SLOTS, stride_xm, stride_ym,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, ESC_CH: gl.constexpr,
                  ACC: gl.constexpr, L_EP: gl.constexpr, pre=0, PRE: gl.constexpr = False):
        """The accumulator ``acc`` (layout ``ACC``) to y: directly, or through the fixed-order split-K
        reduction (partial ``pid_k`` of ``SPLIT_K`` to a workspace of ``SLOTS`` partials per block, a
        per-block counter, the last program sums them in order). ``PRE``: the epilogue's loads were
        issued before the main loop (``pre``, :func:`_finalize_loads`; with split-K by every program,
        as the last one is not known then), so the tail keeps the split-K sum, if any, but not the
        epilogue's three dependent round trips.
        Shared by this kernel, the ``wgmma`` one (:mod:`.wgmma`), the stream-K one
        (:mod:`.mma_stream`) and :mod:`.warpk`."""
        if not USE_SPLIT:
            _finalize_pre(acc, pre, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N,
                          stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP, PRE)
        else:
            blk = pid_m * NUM_N_BLOCKS + pid_n
            ws_base = ws_ptr + blk.to(gl.int64) * (SLOTS * BLOCK_N * BLOCK_M)
            tr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
            tc = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
            tile_offs = tr[:, None] * BLOCK_M + tc[None, :]
            zero_i = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, ACC)
            gl.store(ws_base + pid_k * (BLOCK_N * BLOCK_M) + tile_offs, acc)
            _cta_barrier()
            count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
                # fixed order (bitwise identical run to run), four partials loaded at a time
                TILE: gl.constexpr = BLOCK_N * BLOCK_M
                for s in range(0, SPLIT_K, 4):
                    p0 = gl.load(ws_base + s * TILE + tile_offs, cache_modifier=".cg")
                    p1 = gl.load(ws_base + (s + 1) * TILE + tile_offs, mask=zero_i + s + 1 < SPLIT_K, other=0.0,
                                 cache_modifier=".cg")
                    p2 = gl.load(ws_base + (s + 2) * TILE + tile_offs, mask=zero_i + s + 2 < SPLIT_K, other=0.0,
                                 cache_modifier=".cg")
                    p3 = gl.load(ws_base + (s + 3) * TILE + tile_offs, mask=zero_i + s + 3 < SPLIT_K, other=0.0,
                                 cache_modifier=".cg")
                    total += p0
                    total += p1
                    total += p2
                    total += p3
                gl.atomic_xchg(lock_ptr + blk, 0)
                _finalize_pre(total, pre, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m,
                              M, N, stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP, PRE)

    @gluon.jit
    def _early_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr, L_EP: gl.constexpr,
                     PRE: gl.constexpr):
        """With ``PRE``: the epilogue's loads (:func:`_finalize_loads`) behind a pin, so the weight
        loads issued before stay ahead of their dependent round trips (ptxas would otherwise put the
        chain first); else 0."""
        if PRE:
            n0 = _pin(n0, True)
            pre = _finalize_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                                  BLOCK_N, BLOCK_M, ESC_CH, L_EP)
        else:
            pre = 0
        return pre

    @gluon.jit
    def _finalize_pre(acc, pre, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N,
                      stride_xm, stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr,
                      L_EP: gl.constexpr, PRE: gl.constexpr):
        """:func:`_finalize_apply` on the loads issued earlier (``PRE``), else :func:`_finalize`."""
        if PRE:
            _finalize_apply(acc, pre, x_ptr, y_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                            stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)
        else:
            _finalize(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N,
                      stride_xm, stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)

    @gluon.jit
    def _finalize(acc, x_ptr, y_ptr, low_ptr, eptr_ptr, erow_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N,
                  stride_xm, stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr,
                  L_EP: gl.constexpr):
        """Row scale, exact escape corrections and the store.

        The escapes are CSR by row (``eptr``): the block's row ranges are loaded at once, then the
        columns and deltas of ``ESC_CH`` escapes and x at those columns (one pass for any real
        layer, so three dependent round trips in all, not two per handful of escapes), and each
        output adds its row's contributions in escape order through a register gather."""
        pre = _finalize_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                              BLOCK_N, BLOCK_M, ESC_CH, L_EP)
        _finalize_apply(acc, pre, x_ptr, y_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                        stride_ym, BLOCK_N, BLOCK_M, ESC_CH, L_EP)

    @gluon.jit
    def _esc_contrib(x_ptr, ecol_ptr, edelta_ptr, e0, e_hi, offs_m, M, stride_xm, ESC_CH: gl.constexpr,
                     L_EP: gl.constexpr):
        """``x[m, col] * delta`` of escapes ``e0 .. e0 + ESC_CH`` (below ``e_hi``): ``[ESC_CH, BLOCK_M]``."""
        ok, ec, ed = _esc_cols(ecol_ptr, edelta_ptr, e0, e_hi, ESC_CH, L_EP)
        return _esc_x(x_ptr, ok, ec, offs_m, M, stride_xm).to(gl.float32) * ed[:, None]

    @gluon.jit
    def _esc_cols(ecol_ptr, edelta_ptr, e0, e_hi, ESC_CH: gl.constexpr, L_EP: gl.constexpr):
        """Escapes ``e0 .. e0 + ESC_CH`` (below ``e_hi``: ``ok``): their columns and deltas."""
        idx = e0 + gl.arange(0, ESC_CH, layout=gl.SliceLayout(1, L_EP))
        ok = idx < e_hi
        ec = gl.load(ecol_ptr + idx, mask=ok, other=0)
        ed = gl.load(edelta_ptr + idx, mask=ok, other=0.0)
        return ok, ec, ed

    @gluon.jit
    def _esc_x(x_ptr, ok, ec, offs_m, M, stride_xm):
        """x at the escapes' columns ``[ESC_CH, BLOCK_M]`` (bf16; zero where not ``ok`` or past M)."""
        return gl.load(x_ptr + offs_m[None, :] * stride_xm + ec[:, None], mask=ok[:, None] & (offs_m < M)[None, :],
                       other=0.0)

    @gluon.jit
    def _finalize_loads(x_ptr, low_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr, L_EP: gl.constexpr):
        """The epilogue's loads (three dependent round trips): row scales, the rows' escape ranges
        and the first ``ESC_CH`` escapes' contributions. A kernel may issue them before its main
        loop so they are not paid in the tail."""
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, L_EP))
        scale, r_lo, r_hi, e_lo, e_hi = _finalize_range(low_ptr, eptr_ptr, n0, N, BLOCK_N, L_EP)
        contrib = _esc_contrib(x_ptr, ecol_ptr, edelta_ptr, e_lo, e_hi, offs_m, M, stride_xm, ESC_CH, L_EP)
        return scale, r_lo, r_hi, e_lo, e_hi, contrib

    @gluon.jit
    def _finalize_range(low_ptr, eptr_ptr, n0, N, BLOCK_N: gl.constexpr, L_EP: gl.constexpr):
        """The independent loads of :func:`_finalize_loads`: row scales, the rows' escape ranges."""
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_EP))
        n_mask = offs_n < N
        low = gl.load(low_ptr + offs_n, mask=n_mask, other=112).to(gl.int32)
        r_lo = gl.load(eptr_ptr + offs_n, mask=n_mask, other=0)
        r_hi = gl.load(eptr_ptr + offs_n + 1, mask=n_mask, other=0)
        e_lo = gl.load(eptr_ptr + n0)
        e_hi = gl.load(eptr_ptr + gl.minimum(n0 + BLOCK_N, N))
        scale = ((low + (127 - 112)) << 23).to(gl.float32, bitcast=True)
        return scale, r_lo, r_hi, e_lo, e_hi

    @gluon.jit
    def _finalize_apply(acc, pre, x_ptr, y_ptr, eptr_ptr, ecol_ptr, edelta_ptr, n0, pid_m, M, N, stride_xm,
                        stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, ESC_CH: gl.constexpr,
                        L_EP: gl.constexpr):
        """:func:`_finalize` after :func:`_finalize_loads` (``pre``): scale, escapes (later chunks,
        rare, loaded now), store."""
        scale, r_lo, r_hi, e_lo, e_hi, contrib = pre
        y = gl.convert_layout(acc, L_EP) * scale[:, None]
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_EP))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, L_EP))
        n_mask = offs_n < N
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, L_EP)
        for e0 in range(e_lo, e_hi, ESC_CH):
            if e0 > e_lo:
                contrib = _esc_contrib(x_ptr, ecol_ptr, edelta_ptr, e0, e_hi, offs_m, M, stride_xm, ESC_CH, L_EP)
            lo = gl.where(n_mask, gl.maximum(r_lo, e0) - e0, 0)          # this chunk's slots of each row
            hi = gl.where(n_mask, gl.minimum(r_hi, e0 + ESC_CH) - e0, 0)
            for i in range(0, gl.max(hi - lo, axis=0)):                   # the most escapes in one row
                slot = lo + i
                got = gl.gather(contrib, zero + gl.minimum(slot, ESC_CH - 1)[:, None], 0)
                y += gl.where((slot < hi)[:, None], got, 0.0)
        gl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(y_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (offs_m < M)[None, :])


def esc_chunk(block_m: int) -> int:
    """Escapes per pass of the tensor-core kernels' epilogue (``[ESC_CH, BLOCK_M]`` fp32 in registers)."""
    return max(8, min(64, 2048 // block_m))


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MmaConfig:
    """One variant: ``block_n`` rows per program (16 per warp slice), ``split_k`` k ranges."""

    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    depth: int = 2     # records loaded ahead (1-3 in registers, 1-6 with wsmem)
    wsmem: bool = False  # weights through a cp.async shared-memory ring instead of registers
    unroll: bool = False  # register ring: depth sets reloaded in place (depth 2-3), not rotated
    plain_decode: bool = False  # _decode_pairs instead of _decode_pairs_fast (A/B)
    stream: int = 0     # > 0: stream-K schedule, this many programs per SM (wsmem, or tma=3 with four
                        # K groups and one program per SM; split_k unused)
    maxnreg: int | None = None  # register cap passed to ptxas (None: its own choice)
    x_chunk: int = 1    # > 1: x copied XC records at a time, one CTA barrier per chunk (unrolled ring)
    tma: int = 0        # weights and x by TMA into ``depth`` stages with mbarriers (mma_tma): 1 a consumer
                        # warp per 16 rows, 2 the program's warps as one consumer group (with ``unroll``:
                        # two records per consumer step), 3 the group on wgmma
    a_smem: bool = False  # tma=3: the decoded record through shared memory, the wgmma left in flight
    kgroups: int = 1    # tma=3: 2 or 4 warpgroups on the program's rows, each taking every kgroups-th record
    early_epilogue: bool = False  # the epilogue's loads after the first records', not in the tail
                                  # (register and wsmem rings; with split-K in every program)

    def key(self) -> str:
        return (f"mma-n{self.block_n}-s{self.split_k}-w{self.num_warps}-d{self.depth}{'-ws' if self.wsmem else ''}"
                f"{'-u' if self.unroll else ''}{f'-sk{self.stream}' if self.stream else ''}"
                f"{f'-r{self.maxnreg}' if self.maxnreg else ''}{f'-xc{self.x_chunk}' if self.x_chunk > 1 else ''}"
                f"{f'-tma{self.tma}' if self.tma else ''}{'-as' if self.a_smem else ''}"
                f"{f'-kg{self.kgroups}' if self.kgroups > 1 else ''}"
                f"{'-plain' if self.plain_decode else ''}{'-ee' if self.early_epilogue else ''}")


def block_m_for(m: int) -> int:
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def supported(x: torch.Tensor, packed: KernelPack) -> bool:
    """Gluon present, bf16 rows on a CUDA device with compute capability 8.0+ (mma.sync, cp.async)."""
    return (gluon is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
            and packed.rec32.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 8)


def default_config(m: int, n: int, k: int, sms: int = 132, tma: bool = True, wgmma: bool = True) -> MmaConfig:
    """64-row programs, the weights two records ahead in the shared-memory ring, and split-K for
    about four programs per SM (``tma`` and ``wgmma`` are accepted for the product's signature)."""
    kt = (k + TILE_K - 1) // TILE_K
    bn = 64
    blocks = (n + bn - 1) // bn * ((m + block_m_for(m) - 1) // block_m_for(m))
    split = max(1, min(kt, round(4 * sms / blocks)))
    return MmaConfig(block_n=bn, split_k=split, depth=2, wsmem=True)


def aligned_x(x: torch.Tensor, kt: int) -> tuple[torch.Tensor, int]:
    """x as the tensor-core kernels read it: rows 16-byte aligned and K a multiple of the record
    width, zero past K. cp.async copies 16-byte chunks (Triton proves the alignment from strides
    divisible by 16) and leaves masked chunks as they were. Real projections (K a multiple of 64,
    contiguous x) never take the copy."""
    m, k = x.shape
    if k % TILE_K or x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
        xp = torch.zeros(m, kt * TILE_K, dtype=x.dtype, device=x.device)
        xp[:, :k] = x
        return xp, kt * TILE_K
    return x, k


def split_grid(m: int, n: int, kt: int, block_n: int, split_k: int, device):
    """The tensor-core kernels' launch: the x row block, records per split, the split count, the
    grid ``(n blocks, splits, m blocks)`` and the split-K workspace and counters."""
    bm = block_m_for(m)
    tps = (kt + split_k - 1) // split_k
    split = (kt + tps - 1) // tps
    nb = (n + block_n - 1) // block_n
    mb = (m + bm - 1) // bm
    ws, locks = _workspace(device, nb * mb * split * block_n * bm if split > 1 else 1, nb * mb)
    return bm, tps, split, nb, mb, ws, locks


def check_call(x: torch.Tensor, packed: KernelPack) -> None:
    """The checks every Gluon W12 launcher makes first: Gluon present, x ``[M, K]`` matching the weight."""
    if gluon is None or triton is None:
        raise RuntimeError("Gluon (triton >= 3.4) is not available")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")


def w12_mma(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config: MmaConfig | None = None,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` bf16 (any M; 64 rows per program), fp32 accumulation, deterministic."""
    check_call(x, packed)
    if config is not None and config.tma:
        from . import mma_tma

        if not mma_tma.AVAILABLE:
            raise RuntimeError("the TMA variant needs Gluon's Hopper module (triton >= 3.5)")
        mma_tma.check(config)
    elif config is not None and config.depth not in ((1, 2, 3, 4, 5, 6) if config.wsmem else (1, 2, 3)):
        raise ValueError(f"depth must be 1-3 (1-6 with wsmem), got {config.depth}")
    if config is not None and config.unroll and (config.wsmem or config.depth < 2):
        raise ValueError("an unrolled ring is a register ring of depth 2-3 (not wsmem)")
    if config is not None and config.maxnreg is not None and not 32 <= config.maxnreg <= 255:
        raise ValueError(f"maxnreg must be 32-255, got {config.maxnreg}")
    if config is not None and config.x_chunk > 1 and (not config.unroll or config.x_chunk not in (2, 4, 8)):
        raise ValueError("x chunks are 2, 4 or 8 records and go with an unrolled register ring")
    if config is not None and config.stream and not config.tma and (config.stream < 0 or not config.wsmem):
        raise ValueError("the stream-K schedule takes a positive program count per SM and the wsmem ring")
    if config is not None and config.early_epilogue and (config.tma or config.stream or config.x_chunk > 1):
        raise ValueError("early_epilogue goes with the register and wsmem rings (not tma, stream or x chunks)")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    m, k = x.shape
    n = packed.shape[0]
    kt = packed.k_tiles
    if config is None:
        from . import mma_tma

        cfg = default_config(m, n, k, tma=mma_tma.supported(x.device), wgmma=mma_tma.wgmma_supported(x.device))
    else:
        cfg = config
    x, k = aligned_x(x, kt)
    bm, tps, split, nb, mb, ws, locks = split_grid(m, n, kt, cfg.block_n, cfg.split_k, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    esc_ch = esc_chunk(bm)
    if cfg.tma:
        from . import mma_tma

        mma_tma.launch(x, packed, out, qpass, cfg, (bm, tps, split, nb, mb, ws, locks), esc_ch)
        return out
    if cfg.stream:
        from . import mma_stream

        mma_stream.launch(x, packed, out, qpass, cfg, bm, mb, esc_ch, layouts(cfg.block_n, bm, cfg.num_warps),
                          wsmem_layouts(cfg.num_warps))
        return out
    l_view, l_nib, l_x, mma, a_op, b_op, l_ep, l_xc, xs = layouts(cfg.block_n, bm, cfg.num_warps)
    l_wc, l_qc, wsl = wsmem_layouts(cfg.num_warps)
    _w12_mma_kernel[(nb, split, mb)](
        x, out, packed.rec32, packed.low_exp,
        packed.esc_rowptr, packed.esc_row, packed.esc_col, packed.esc_delta_q if qpass else packed.esc_delta,
        ws, locks,
        m, n, k, kt, tps, nb, split,
        x.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=bm, USE_SPLIT=split > 1, QPASS=qpass, ESC_CH=esc_ch, DEPTH=cfg.depth,
        WSMEM=cfg.wsmem, UNROLL=cfg.unroll, PLAIN=cfg.plain_decode, XC=cfg.x_chunk, PRE=cfg.early_epilogue,
        L_VIEW=l_view, L_NIB=l_nib, L_X=l_x, MMA=mma, A_OP=a_op, B_OP=b_op, L_EP=l_ep, L_XC=l_xc,
        XS=xs, L_WC=l_wc, L_QC=l_qc, WSL=wsl,
        num_warps=cfg.num_warps, **launch_options(cfg),
    )
    return out


def launch_options(cfg) -> dict:
    """Compile options of a config that are not constexprs (the register cap)."""
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
