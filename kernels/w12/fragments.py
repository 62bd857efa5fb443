"""The tensor cores' operands for the W12 decode: register layouts in which the decoded record
words are the MMA's A operand without moving data between threads.

``mma.sync.m16n8k16`` (:func:`mma_layouts`, :func:`a_operand`, :func:`b_operand`): an A fragment
holds, per thread (lane ``4g + t``), rows ``g`` and ``g + 8`` and, per 16-wide k block, k ``{2t,
2t+1, 2t+8, 2t+9}``. The k order inside the MMA is free as long as x uses the same one, so MMA k
``16j + 8s + 2t + c`` is mapped to the physical k ``16t + 4j + 2s + c`` of the record
(:func:`mma_k_to_physical`): thread ``t`` then holds four *consecutive* 4-byte words of each of its
rows (one 16-byte load; 8 lanes x 64 bytes = one whole 128 x 64 record row per load instruction),
and each word decodes to the pairs ``s = 0, 1`` it needs. The matching B fragment (x) is 16
consecutive bf16 of one x row per thread. The ``convert_layout`` calls into the operand layouts are
asserted trivial at compile time: they only rename registers.

``wgmma`` (Hopper, :func:`wgmma_layouts`): for a 64-row warpgroup tile the ``mma.sync`` A layout the
decode produces is exactly ``wgmma``'s register A layout, so :func:`a_operand` feeds it as it is;
x is the B operand in shared memory and must be stored there in MMA k order (:func:`x_store`), a
4-byte-granular permutation no shared layout expresses, so x tiles are loaded in physical k order
(:func:`x_phys_bases`), permuted in registers and stored.
"""

from __future__ import annotations

from functools import lru_cache

from .format import TILE_K, TILE_N
from .gluon_common import bf16_halves, decode_pairs, gl, gluon, log2

try:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - Triton without Gluon's Hopper module
    warpgroup_mma = warpgroup_mma_wait = fence_async_shared = None

WGMMA_AVAILABLE = gluon is not None and warpgroup_mma is not None

RECORD_WORDS = TILE_N * TILE_K * 3 // 2 // 4   # 3072 int32 words per 12 KB record

VIEW_WORDS = TILE_K // 4                        # 16 words of 8-bit views per record row

NIB_WORDS = TILE_K // 8                         # 8 words of nibbles per record row


def layout_bases(block_n: int, block_m: int, num_warps: int) -> dict[str, tuple]:
    """The register/lane/warp bases of the ``mma.sync`` kernels' load layouts (pure Python, tested on CPU).

    ``view``: the ``[block_n, 16]`` tile of 8-bit-view words; ``nib``: the ``[block_n, 8]`` tile
    of nibble words; ``x``: the ``[block_m, 64]`` x tile (physical k). Warps split the rows in
    16-row slices like the MMA layout; every warp reads the whole x tile.
    """
    w = num_warps
    if block_n % (16 * w) or block_n > TILE_N:
        raise ValueError(f"block_n {block_n} must be a multiple of 16 x {w} warps and at most {TILE_N}")
    if block_m < 8 or block_m > 64 or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} must be 8, 16, 32 or 64")
    row_reps = [[16 * w * (1 << i), 0] for i in range(log2(block_n // (16 * w)))]
    warps = [[16 * (1 << i), 0] for i in range(log2(w))]
    rows_lane = [[1, 0], [2, 0], [4, 0]]
    view = ([[0, 1], [0, 2], [8, 0]] + row_reps, [[0, 4], [0, 8]] + rows_lane, warps, [block_n, VIEW_WORDS])
    nib = ([[0, 1], [8, 0]] + row_reps, [[0, 2], [0, 4]] + rows_lane, warps, [block_n, NIB_WORDS])
    m_reps = [[8 * (1 << i), 0] for i in range(log2(block_m // 8))]
    x = ([[0, 1], [0, 2], [0, 4], [0, 8]] + m_reps, [[0, 16], [0, 32]] + rows_lane,
         [[0, 0]] * log2(w), [block_m, TILE_K])
    return {"view": view, "nib": nib, "x": x}


def mma_k_to_physical(kl: int) -> int:
    """Physical k (inside a 64-wide record) of MMA k ``kl = 16j + 8s + 2t + c``: ``16t + 4j + 2s + c``."""
    j, s, t, c = kl >> 4, (kl >> 3) & 1, (kl >> 1) & 3, kl & 1
    return 16 * t + 4 * j + 2 * s + c


def x_phys_bases(block_m: int, num_warps: int) -> tuple[list, list, list]:
    """Register/lane/warp bases of the ``[block_m, 64]`` x load (physical k ``16t + 4j + 2s + c``):
    a thread holds 4 consecutive k (8 bytes: ``s``, ``c``) of one row and, in registers, the ``t``
    the warps do not take; lanes take ``j`` and 8 rows; warps take further rows, then ``t``."""
    rows = [[1 << i, 0] for i in range(3, log2(block_m))]
    ts = [[0, 16], [0, 32]]
    warps = []
    for _ in range(log2(num_warps)):
        warps.append(rows.pop(0) if rows else ts.pop() if ts else [0, 0])
    return [[0, 1], [0, 2]] + ts + rows, [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warps


if gluon is not None:
    from .gluon_epilogue import epilogue_layout

    @lru_cache(maxsize=None)
    def mma_layouts(block_n: int, block_m: int, num_warps: int):
        """Gluon layout objects for one (block_n, block_m, warps) variant of the ``mma.sync`` kernels: the
        view, nibble and x loads, the MMA accumulator and its A and B operands, the epilogue, the x
        copies and the x stages."""
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

    @gluon.jit
    def a_operand(v, nb, L_VIEW: gl.constexpr, A_OP: gl.constexpr, BLOCK_N: gl.constexpr, QPASS: gl.constexpr):
        """Decode one record's ``[BLOCK_N, 16]`` view words (+ ``[BLOCK_N, 8]`` nibble words) into the
        ``[BLOCK_N, 64]`` bf16 A operand, MMA k order, without moving data between threads."""
        p0, p1 = decode_pairs(v, nb, L_VIEW, QPASS)
        w5 = gl.join(bf16_halves(p0), bf16_halves(p1))             # [n, word, c, s]
        w5 = gl.reshape(w5, [BLOCK_N, 4, 4, 2, 2])                 # [n, t, j, c, s]
        w5 = gl.permute(w5, [0, 2, 4, 1, 3])                       # [n, j, s, t, c]
        return gl.convert_layout(gl.reshape(w5, [BLOCK_N, 64]), A_OP, assert_trivial=True)

    @gluon.jit
    def b_operand(xs, L_X: gl.constexpr, B_OP: gl.constexpr, BLOCK_M: gl.constexpr):
        """A ``[BLOCK_M, 64]`` x stage as the ``[64, BLOCK_M]`` B operand in MMA k order: each thread
        reads 16 consecutive bf16 of one x row (two 16-byte shared loads)."""
        xv = xs.load(L_X)
        xv = gl.reshape(xv, [BLOCK_M, 4, 4, 2, 2])                 # [m, t, j, s, c]
        xv = gl.permute(xv, [2, 3, 1, 4, 0])                       # [j, s, t, c, m]
        return gl.convert_layout(gl.reshape(xv, [64, BLOCK_M]), B_OP, assert_trivial=True)


if WGMMA_AVAILABLE:

    @lru_cache(maxsize=None)
    def wgmma_layouts(block_n: int, block_m: int, num_warps: int):
        """Weight loads and the epilogue as in :func:`mma_layouts`; the wgmma accumulator and A
        operand; the x load (physical k) and the x stage (128-byte swizzled, k contiguous)."""
        l_view, l_nib, _, _, _, _, l_ep, _, _ = mma_layouts(block_n, block_m, num_warps)
        acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])
        a_op = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
        reg, lane, warp = x_phys_bases(block_m, num_warps)
        l_xp = gl.DistributedLinearLayout(reg, lane, warp, [], [block_m, TILE_K])
        xsl = gl.NVMMASharedLayout.get_default_for([block_m, TILE_K], gl.bfloat16)
        return l_view, l_nib, acc, a_op, l_ep, l_xp, xsl

    @gluon.jit
    def x_store(xs, xv, BLOCK_M: gl.constexpr):
        """Store an x tile into a stage in MMA k order: ``[m, t, j, s, c] -> [m, j, s, t, c]``."""
        xv = gl.permute(gl.reshape(xv, [BLOCK_M, 4, 4, 2, 2]), [0, 2, 3, 1, 4])
        xs.store(gl.reshape(xv, [BLOCK_M, 64]))
