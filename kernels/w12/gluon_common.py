"""Gluon pieces shared by the W12 Gluon kernels (:mod:`.gemv_gluon`, :mod:`.warpk`, :mod:`.mma`,
:mod:`.mma_tma`) and the fused decode kernels of :mod:`specpilot.kernels.decode.gemv_w12_gluon`.

* Gluon itself (``gluon``, ``gl``, ``async_copy``, ``mma_v2``; None without Gluon) and the names
  that moved between Triton versions (:func:`cta_barrier`, :func:`cp_async`, :func:`view_as`);
* the decode: :func:`decode_pairs` turns view and nibble words into bf16 pairs with ``prmt`` byte
  permutes and ``lop3`` bit selects, in the register layout the words were loaded in;
* record access: :func:`record_offsets` (2-D, rows over warps), :func:`record_offsets_3d` and
  :func:`load_clamped` (3-D, a record per warp), :func:`load_rec`; :func:`stage_x` copies a
  program's x into shared memory once; :func:`pin` keeps loads ahead of what follows;
* host side: the launch geometry of the tensor-core kernels (:func:`mma_block_m`,
  :func:`split_grid`, :func:`aligned_x`, :func:`esc_chunk`) and the checks every launcher makes.

Gluon kernels do not run under Triton's interpreter; on a machine without CUDA they still compile
for sm_90 (tests do).
"""

from __future__ import annotations

import math

import torch

from .common import split_workspace
from .format import TILE_K
from .pack import KernelPack
from ..triton_env import triton

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
cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
cp_async = getattr(async_copy, "async_load", None) or getattr(async_copy, "async_copy_global_to_shared", None)

XS_CHUNK = 8            # staged x: groups of ``warps`` records per cp.async chunk

def xs_group_count(records: int, warps: int, unit: int = 1) -> int:
    """Groups of ``warps`` records of staged x covering ``records``: a multiple of the cp.async chunk
    (:data:`XS_CHUNK`) and of ``unit`` (the records a warp takes per loop step)."""
    m = math.lcm(XS_CHUNK, unit)
    return -(-(-(-records // warps)) // m) * m
XS_MAX_BYTES = 100 * 1024   # staged x: the shared memory a program may take


def log2(v: int) -> int:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{v} is not a power of two")
    return v.bit_length() - 1

def mma_block_m(m: int) -> int:
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64

def esc_chunk(block_m: int) -> int:
    """Escapes per pass of the tensor-core kernels' epilogue (``[ESC_CH, BLOCK_M]`` fp32 in registers)."""
    return max(8, min(64, 2048 // block_m))

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
    bm = mma_block_m(m)
    tps = (kt + split_k - 1) // split_k
    split = (kt + tps - 1) // tps
    nb = (n + block_n - 1) // block_n
    mb = (m + bm - 1) // bm
    ws, locks = split_workspace(device, nb * mb * split * block_n * bm if split > 1 else 1, nb * mb)
    return bm, tps, split, nb, mb, ws, locks

def check_call(x: torch.Tensor, packed: KernelPack) -> None:
    """The checks every Gluon W12 launcher makes first: Gluon present, x ``[M, K]`` matching the weight."""
    if gluon is None or triton is None:
        raise RuntimeError("Gluon (triton >= 3.4) is not available")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")

if gluon is not None:
    from triton.language.extra.cuda import gdc_wait

    def warp_batched_mma(warps: int):
        """``mma.sync.m16n8k16`` layouts for a product batched over a program's warps (``[warps,
        rows, k] x [warps, k, cols]``, each warp its own batch entry): the accumulator's layout and
        the A and B operand layouts."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8])
        return (mma, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2))

    @gluon.jit
    def x_operand(x, WARPS: gl.constexpr, BM: gl.constexpr, B_OP: gl.constexpr):
        """x ``[WARPS, BM, 64]`` loaded 16 consecutive k per lane as the warp-batched MMA's B operand
        ``[WARPS, 64, BM]`` in MMA k order (``16j + 8s + 2t + c`` <- column ``16t + 4j + 2s + c``; the
        A operand must use the same order); the conversion moves no data (asserted)."""
        b = gl.permute(gl.reshape(x, [WARPS, BM, 4, 4, 2, 2]), [0, 3, 4, 2, 5, 1])  # [w, j, s, t, c, m]
        return gl.convert_layout(gl.reshape(b, [WARPS, 64, BM]), B_OP, assert_trivial=True)

    @gluon.jit
    def bf16_halves(p):
        lo = (p & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        hi = (p >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi)

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
    def decode_pairs(v, nb, L_VIEW: gl.constexpr, QPASS: gl.constexpr):
        """View words ``v`` ``[..., 16]`` (and nibble words ``nb`` ``[..., 8]``, same leading shape;
        ``[N, 16]`` or ``[W, R, 16]``) -> the bf16 pairs as uint32 in ``v``'s layout ``L_VIEW``:
        ``p0`` holds weights 4c, 4c+1 of view word c, ``p1`` weights 4c+2, 4c+3. The integer recipe
        of :func:`.common.decode_pairs` (the same bits for every input) in fewer instructions:
        ``prmt`` byte permutes put each sign next to its nibble (p0) and each view byte above its
        nibble so one shift aligns both (p1), and each bit select and the exponent OR are one
        ``lop3`` (the compiler splits the plain masks into two or three). Bit-exactness is tested
        exhaustively per weight on a torch mirror (tests/test_w12_decode_prmt.py)."""
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
    def pdl_wait(PDL: gl.constexpr):
        """A tensor-core kernel's wait for the previous kernel under programmatic dependent launch
        (its programs were placed while that one drained). The ``mma`` kernels wait as their first
        statement; the warp-K kernel loads its register sets' first records (constant) before it
        (whole W12 steps of 16 rows 0.04 ms faster, H200; the ``mma`` kernels doing the same made
        64-row steps 0.03-0.05 ms slower). x, the escapes' x and the split-K workspace are read
        after it. Dependents are not triggered early: on Llama-3.1-8B shapes that made W12 verify
        steps 1.2-1.4 ms slower, their programs taking the SMs these kernels still fill."""
        if PDL:
            gdc_wait()

    @gluon.jit
    def pin(v, PIN: gl.constexpr):
        """``bar.warp.sync`` (no data moved): ptxas does not move memory operations across it, so the
        loads just issued stay ahead of what follows. Without it ptxas sinks the reloads of an
        unrolled ring to the end of the loop body, where they issue together."""
        if PIN:
            v = gl.inline_asm_elementwise("bar.warp.sync -1;\n mov.b32 $0, $1;", "=r,r", [v], dtype=gl.int32,
                                          is_pure=False, pack=1)
        return v

    @gluon.jit
    def record_offsets(n0, KT, BLOCK_N: gl.constexpr, L_VIEW: gl.constexpr, L_NIB: gl.constexpr):
        """For the program's rows ``n0 .. n0 + BLOCK_N`` (inside one 128-row record tile): the index of
        the tile's first record, and the word offsets inside a record of the rows' view words
        (``[BLOCK_N, 16]``, at ``row * 16``) and nibble words (``[BLOCK_N, 8]``, at ``2048 + row * 8``)."""
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
    def load_rec(rec_ptr, tile_row, t, ok, off_v, off_n, QPASS: gl.constexpr):
        """Record ``t`` of the program's row tile: its view words and nibble words (if ``ok``)."""
        base = (tile_row + t) * 3072
        v = gl.load(rec_ptr + base + off_v, mask=ok, other=0)
        if QPASS:
            q = v
        else:
            q = gl.load(rec_ptr + base + off_n, mask=ok, other=0)
        return v, q

    @gluon.jit
    def f32_lo(p):
        return (p << 16).to(gl.float32, bitcast=True)

    @gluon.jit
    def f32_hi(p):
        return (p & 0xFFFF0000).to(gl.float32, bitcast=True)

    @gluon.jit
    def per_warp(v, L: gl.constexpr):
        """A ``[WARPS]`` vector as ``[WARPS, 1, 1]`` in the 3-D layout ``L``."""
        return gl.expand_dims(gl.expand_dims(gl.convert_layout(v, gl.SliceLayout(1, gl.SliceLayout(2, L))), 1), 2)

    @gluon.jit
    def record_offsets_3d(n0, KT, ROWS: gl.constexpr, L_V: gl.constexpr, L_Q: gl.constexpr):
        """:func:`record_offsets` for ``[WARPS, ROWS, ...]`` tiles (every warp the same rows): the
        index of the row tile's first record and the word offsets inside a record of the rows' view
        words (``row * 16``) and nibble words (``2048 + row * 8``)."""
        tile_row = (n0 // 128).to(gl.int64) * KT
        r_in = n0 % 128
        rv = r_in + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_V)))
        cv = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_V)))
        off_v = gl.expand_dims(gl.expand_dims(rv, 0), 2) * 16 + gl.expand_dims(gl.expand_dims(cv, 0), 1)
        rq = r_in + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_Q)))
        cq = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_Q)))
        off_q = 2048 + gl.expand_dims(gl.expand_dims(rq, 0), 2) * 8 + gl.expand_dims(gl.expand_dims(cq, 0), 1)
        return tile_row, off_v, off_q

    @gluon.jit
    def load_clamped(pv, pq, t, t_end, L_V: gl.constexpr, L_Q: gl.constexpr, QPASS: gl.constexpr):
        """Each warp's record ``t[w]``, clamped to the range (past it the last record is re-read),
        through the loop-invariant view and nibble pointers ``pv``/``pq``: view words, nibble words
        (the view again in the Q pass)."""
        d = gl.minimum(t, t_end - 1) * 3072
        v = gl.load(pv + per_warp(d, L_V))
        if QPASS:
            q = v
        else:
            q = gl.load(pq + per_warp(d, L_Q))
        return v, q

    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def view_as(buf, dtype: gl.constexpr, shape: gl.constexpr, order: gl.constexpr):
        """``buf``'s bytes as ``dtype`` ``shape``, unswizzled with dimension order ``order``."""
        if _PUBLIC_REINTERPRET:
            out = buf.reinterpret(dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, order=order))
        else:
            out = buf._reinterpret(dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, order=order))
        return out

    @gluon.jit
    def stage_x(x32_ptr, t_begin, t_end, KH, WARPS: gl.constexpr, XS_IT: gl.constexpr, XS_CH: gl.constexpr):
        """Shared memory ``[XS_IT, WARPS, 32]`` (group ``i``, warp ``w``: the x words of record
        ``t_begin + i * WARPS + w``, zero past ``t_end`` and ``KH``), filled by cp.async in chunks of
        ``XS_CH`` groups, 16 bytes per copy; one commit group."""
        CW: gl.constexpr = XS_CH * WARPS * 32
        xc = gl.allocate_shared_memory(gl.int32, [XS_IT // XS_CH, CW], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        off = gl.arange(0, CW, layout=gl.BlockedLayout([CW // (32 * WARPS)], [32], [WARPS], [0]))
        lim = gl.minimum(t_end * 32, KH)
        for c in range(0, XS_IT // XS_CH):
            g = t_begin * 32 + c * CW + off
            cp_async(xc.index(c), x32_ptr + g, mask=g < lim)
        async_copy.commit_group()
        return view_as(xc, gl.int32, [XS_IT, WARPS, 32], [1, 0])
