"""Masked grouped-query attention as one split-KV Triton pass plus a fixed-order merge.

The same contract as :func:`.naive.masked_gqa_attention` (``q`` [T, nh, hd], ``k``/``v``
[nkv, S, hd], ``mask`` bool [T, S]), for AR decode and for chain/tree verification rows. Where
the reference launches a dozen kernels per layer (two batched GEMMs, scaling, masking, softmax,
casts and permutes), this is two, or one:

1. ``_attn_split``: program (KV head, KV split, row block) holds the group's query rows of that
   head (row ``r = g * T + t``: group member ``g``, step row ``t``) and walks its slice of the
   cache in ``BLOCK_N`` tiles with an online softmax (float32 scores, max and sum). Two walks
   (``SplitConfig.live``, from the measured table): the *checked* walk loads a tile's mask first
   and skips a tile no row may attend (the unused tail of a static cache, which CUDA graphs read
   whole) without loading its K and V, so a step reads only the live context; the *live* walk
   takes the highest slot its rows write (read from the rows' slots) as the end of what they
   attend - in the engine's steps no row attends past its own slot - so below it the mask, K and V
   of a tile load together, software-pipelined, and above it the checked walk takes over: correct
   for any mask, at the same arithmetic.
2. the merge combines the splits' partial outputs in split order - deterministic, no atomics on
   the data - in one of two places (``SplitConfig.merge``): ``kernel``, a second kernel
   ``_attn_merge``, one program per (KV head, row), one compiled kernel for every split count; or
   ``last``, inside the split pass: each program counts itself done on its (KV head, row block)'s
   counter and the last of them merges that block's rows (no second launch and no dependency wait
   between the two, at the cost of one program reading every partial of its block). A plan of one
   split (enough programs without splitting: batched steps of many requests) has no merge; the
   split pass writes the output.

Under programmatic dependent launch a program starts while the previous kernel (the K/V write of
the step's rows) still runs; with ``SplitConfig.prefetch`` it asks L2 for its first live K and V
tiles (one bulk prefetch each) before it waits. The committed context below the rows' slots is
what those tiles hold, and L2 is where every write lands, so the hint changes no bits.

:func:`batched_gqa_attention` runs the rows of several requests (continuous batching) in the same
launches: each request is a segment of consecutive rows attending over its own cache slot
(``k``/``v`` [slots, nkv, S, hd]), its programs the row blocks of that segment;
:func:`rope_batched_gqa_attention` takes a batched AR step's q/k/v rows instead of q and does the
RoPE and the K/V write of ``kernels/verify/rows.py`` in the split pass (``SplitConfig.rope``).

Scores are accumulated in float32 from the cache dtype (``tl.dot``; IEEE float32 when the cache
is float32), probabilities enter the value product in the cache dtype as in the reference.
Runs on CUDA and under ``TRITON_INTERPRET=1`` (the CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import tuning, workspace
from ..triton_env import pdl_args, tl, triton  # sets TRITON_INTERPRET first on a machine without CUDA

BLOCK_N = 64        # cache slots per tile (SplitConfig's default)
MAX_BLOCK_M = 64    # query rows per program (group members x step rows); more rows: more programs
MERGE_SPLITS = 16   # partials the merge loads at once (a step's split count is up to a few dozen)
MERGES = ("kernel", "last")


@dataclass(frozen=True)
class SplitConfig:
    """``target_programs``: split the cache until about this many programs run (fills the SMs).
    ``live``: below the highest slot its rows write (in the engine's steps no row attends past its
    own slot) a program loads each tile's mask, K and V at once, software-pipelined ``stages``
    deep, instead of checking the mask before it loads K and V; above it the checked walk skips
    what no row attends. Same arithmetic either way; needs the rows' slots. ``merge``: where the
    splits are combined (``kernel`` or ``last``, the module doc). ``prefetch`` (with ``live`` under
    programmatic dependent launch): before it waits for the previous kernel, a program asks L2 for
    up to this many of its first live K and V tiles (one bulk prefetch each; the module doc).
    ``block_n``: cache slots per tile. ``tail`` (with ``live``): above the rows' highest slot the
    checked walk looks for tiles a row attends (one mask load and test a tile, in sequence); off,
    nothing above it is read (rows must attend nothing past the highest slot of their program's
    rows, which the engine's batched steps never do), which spares a program's serial mask loads
    over a cache longer than its context. ``rope`` (batched steps of one row per request): the
    split pass RoPEs q and k and writes K/V itself (:func:`rope_batched_gqa_attention`), one kernel
    fewer per layer."""

    target_programs: int = 256
    live: bool = False
    stages: int = 2
    merge: str = "kernel"
    prefetch: int = 0
    block_n: int = BLOCK_N
    tail: bool = True
    rope: bool = False

    def __post_init__(self):
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {self.merge!r}")
        if not 0 <= self.prefetch <= 16:
            raise ValueError(f"prefetch must be 0-16 tiles, got {self.prefetch}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"block_n must be 16, 32, 64 or 128, got {self.block_n}")


@lru_cache(maxsize=None)
def _split_config(arch: str | None, batched: bool, rows: int, head_dim: int, requests: int) -> SplitConfig:
    found = tuning.lookup("attention", "split-kv-batched" if batched else "split-kv", arch, rows=rows,
                          requests=requests if batched else None, head_dim=head_dim)
    return SplitConfig(**found[0]["config"]) if found else SplitConfig()


def split_config(device, batched: bool, rows: int, head_dim: int, requests: int = 1) -> SplitConfig:
    """The measured config (``kernels/attention/tuned/<arch>.json``) for one request's ``rows`` rows,
    or a batched step of ``requests`` requests whose segments have at most ``rows`` rows each, at
    ``head_dim`` on ``device``; the default where nothing was measured for that head_dim."""
    return _split_config(tuning.device_arch(device), batched, rows, head_dim, requests)


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from ..verify.rows import rope_round

    NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": a row with nothing to attend in a split stays finite

    @triton.jit
    def softmax_tile(q, k, allowed, m_i, l_i, scale, IEEE: tl.constexpr):
        """One tile of the online softmax: probabilities ``p``, the rescale ``alpha`` of what came
        before, the running max and sum (float32 scores)."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(allowed, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return acc * alpha[:, None] + pv

    @triton.jit
    def _segment(seg_ptr, T, row_blocks, SEGS: tl.constexpr):
        """This program's row block and its request: (row block, first row, rows, cache slot as int64).
        ``SEGS``: several requests, each a segment (first row, rows, cache slot) of ``row_blocks``
        programs; else one request of ``T`` rows in slot 0."""
        rb = tl.program_id(2)
        if SEGS:
            seg = rb // row_blocks
            rb = rb % row_blocks
            t0 = tl.load(seg_ptr + seg * 3)
            nt = tl.load(seg_ptr + seg * 3 + 1)
            slot = tl.load(seg_ptr + seg * 3 + 2).to(tl.int64)
        else:
            t0 = 0
            nt = T
            slot = 0
        return rb, t0, nt, slot

    @triton.jit
    def _rows(rb, t0, nt, GRP: tl.constexpr, BLOCK_M: tl.constexpr):
        """Row block ``rb``'s rows ``r = g * nt + t``: (in range, group member g, step row t)."""
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        return rows < GRP * nt, rows // nt, t0 + rows % nt

    @triton.jit
    def _live_end(slots_ptr, t, row_ok):
        """One past the highest cache slot the rows write: in the engine's steps no row attends past it."""
        return tl.max(tl.load(slots_ptr + t, mask=row_ok, other=-1).to(tl.int32), 0) + 1

    @triton.jit
    def _prefetch_l2(ptr, nbytes):
        """One bulk L2 prefetch of ``nbytes`` (a multiple of 16, 16-byte aligned) from ``ptr``, issued
        by the program's first thread; nothing when ``nbytes`` is 0."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p;\n\t"
            "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0; }",
            "=r,l,r", [ptr, nbytes.to(tl.uint32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_kv(k_ptr, v_ptr, seg_ptr, slots_ptr, T, S, chunk, row_blocks, stride_kb, stride_kh, stride_ks,
                     stride_vb, stride_vh, stride_vs, GRP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SEGS: tl.constexpr, TILES: tl.constexpr):
        """Before the PDL wait: ask L2 for up to ``TILES`` of this program's first live K and V tiles
        (K/V rows contiguous in the cache). A hint only: nothing read here is used past the wait, so
        the step's inputs it reads (segments, slots) need not be visible yet (an older value of the
        same buffer is a valid slot too: the prefetch stays inside the cache); and L2 is the GPU's
        point of coherence, so a line fetched early never hides a later write from the loads."""
        rb, t0, nt, slot = _segment(seg_ptr, T, row_blocks, SEGS)
        row_ok, g, t = _rows(rb, t0, nt, GRP, BLOCK_M)
        lo = tl.program_id(1) * chunk
        end = tl.minimum(tl.minimum(tl.minimum(lo + chunk, S), _live_end(slots_ptr, t, row_ok)), lo + TILES * BLOCK_N)
        n = tl.maximum(end - lo, 0)
        kvh = tl.program_id(0)
        size: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
        _prefetch_l2(k_ptr + slot * stride_kb + kvh * stride_kh + lo * stride_ks, n * stride_ks * size)
        _prefetch_l2(v_ptr + slot * stride_vb + kvh * stride_vh + lo * stride_vs, n * stride_vs * size)

    @triton.jit
    def _rotate(x_ptr, pos, cos_ptr, sin_ptr, stride_rot, d, ok, HD: tl.constexpr):
        """RoPE (rotate-half) of the head rows at ``x_ptr`` (offsets ``d`` in ``[0, HD)``, any leading
        shape; zero where ``ok`` is false) at position ``pos``, rounding as
        ``kernels/verify/rows.py``'s RoPE kernel (its ``rope_round``)."""
        HALF: tl.constexpr = HD // 2
        dt = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + d, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(x_ptr + (d + HALF) % HD, mask=ok, other=0.0).to(tl.float32)   # the pair's other half
        c = tl.load(cos_ptr + pos * stride_rot + d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_rot + d).to(dt).to(tl.float32)
        return rope_round(x, tl.where(d < HALF, -y, y), c, s, dt)

    @triton.jit(do_not_specialize=["T", "R", "row_blocks"])   # an eager step's rows vary: one compile for all
    def _attn_split(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr, seg_ptr, slots_ptr, out_ptr, cnt_ptr,
                    cos_ptr, sin_ptr, pos_ptr, req_ptr, T, S, R, chunk, scale, row_blocks,
                    stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                    stride_mt, stride_ot, stride_rot, NH,
                    GRP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr, SEGS: tl.constexpr, PDL: tl.constexpr, LIVE: tl.constexpr,
                    STAGES: tl.constexpr, DIRECT: tl.constexpr, MERGE_LAST: tl.constexpr,
                    PREFETCH: tl.constexpr, TAIL: tl.constexpr, ROPE: tl.constexpr):
        if PDL:   # the fused decode chain: let the next kernel launch, then wait for q and the cache write
            gdc_launch_dependents()
            if PREFETCH > 0:
                _prefetch_kv(k_ptr, v_ptr, seg_ptr, slots_ptr, T, S, chunk, row_blocks, stride_kb, stride_kh,
                             stride_ks, stride_vb, stride_vh, stride_vs, GRP, BLOCK_M, BLOCK_N, SEGS, PREFETCH)
            gdc_wait()
        kvh = tl.program_id(0)
        sp = tl.program_id(1)
        nsplit = tl.num_programs(1)
        rb, t0, nt, slot = _segment(seg_ptr, T, row_blocks, SEGS)
        row_ok, g, t = _rows(rb, t0, nt, GRP, BLOCK_M)
        d = tl.arange(0, HD)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, S)
        if ROPE:   # one-row segments: q_ptr holds the step's q/k/v rows; RoPE here, K/V written here
            q = _rotate(q_ptr + t0 * stride_qt + (kvh * GRP + g)[:, None] * HD, tl.load(pos_ptr + t0),
                        cos_ptr, sin_ptr, stride_rot, d[None, :], row_ok[:, None], HD)
            knew = _rotate(q_ptr + t0 * stride_qt + (NH + kvh) * HD, tl.load(pos_ptr + t0), cos_ptr, sin_ptr,
                           stride_rot, d, d < HD, HD)
            vnew = tl.load(q_ptr + t0 * stride_qt + (NH + tl.num_programs(0) + kvh) * HD + d)
            at = tl.load(slots_ptr + t0)
            r = tl.load(req_ptr + t0).to(tl.int64)   # the request whose cache the row writes
            if (lo <= at) & ((at < hi) | (sp == nsplit - 1)):   # the split holding the row's position
                tl.store(k_ptr + r * stride_kb + kvh * stride_kh + at * stride_ks + d, knew)
                tl.store(v_ptr + r * stride_vb + kvh * stride_vh + at * stride_vs + d, vnew)
            tl.debug_barrier()   # the program's own writes before any of its threads loads the tiles
        else:
            q = tl.load(q_ptr + t[:, None] * stride_qt + (kvh * GRP + g)[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
        k_ptr += slot * stride_kb
        v_ptr += slot * stride_vb
        m_i = tl.full([BLOCK_M], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        k_base = k_ptr + kvh * stride_kh + d[None, :]
        v_base = v_ptr + kvh * stride_vh + d[None, :]
        mid = lo
        if LIVE:   # tiles up to the rows' highest slot: no check, the three loads together, pipelined
            live = _live_end(slots_ptr, t, row_ok)
            mid = lo + tl.cdiv(tl.maximum(tl.minimum(hi, live) - lo, 0), BLOCK_N) * BLOCK_N
            for s0 in tl.range(lo, mid, BLOCK_N, num_stages=STAGES):
                n = s0 + tl.arange(0, BLOCK_N)
                n_ok = n < hi
                allowed = tl.load(mask_ptr + t[:, None] * stride_mt + n[None, :],
                                  mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
                k = tl.load(k_base + n[:, None] * stride_ks, mask=n_ok[:, None], other=0.0)
                v = tl.load(v_base + n[:, None] * stride_vs, mask=n_ok[:, None], other=0.0)
                p, alpha, m_i, l_i = softmax_tile(q, k, allowed, m_i, l_i, scale, IEEE)
                acc = accumulate(acc, alpha, p, v, IEEE)
        if TAIL or not LIVE:   # without the live walk's bound, or past it: only tiles some row attends
            for s0 in range(mid, hi, BLOCK_N):
                n = s0 + tl.arange(0, BLOCK_N)
                n_ok = n < hi
                allowed = tl.load(mask_ptr + t[:, None] * stride_mt + n[None, :],
                                  mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
                if tl.max(allowed.to(tl.int32)) > 0:  # skip tiles no row attends: K/V never loaded
                    k = tl.load(k_base + n[:, None] * stride_ks, mask=n_ok[:, None], other=0.0)
                    p, alpha, m_i, l_i = softmax_tile(q, k, allowed, m_i, l_i, scale, IEEE)
                    # V after the scores: one tile load in flight per program (faster here than beside K)
                    v = tl.load(v_base + n[:, None] * stride_vs, mask=n_ok[:, None], other=0.0)
                    acc = accumulate(acc, alpha, p, v, IEEE)
        if DIRECT:   # one split: the merge's result (its weights are exactly 1), no second kernel
            o = acc / tl.where(row_ok, l_i, 1.0)[:, None]   # padding rows: no 0/0
            tl.store(out_ptr + t[:, None] * stride_ot + ((kvh * GRP + g) * HD)[:, None] + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            base = (kvh * nsplit + sp) * R + g * T + t  # workspace [nkv, nsplit, R = GRP * T, ...]
            tl.store(acc_ptr + base[:, None] * HD + d[None, :], acc, mask=row_ok[:, None], cache_modifier=".cg")
            tl.store(ml_ptr + base * 2, m_i, mask=row_ok, cache_modifier=".cg")
            tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok, cache_modifier=".cg")
            if MERGE_LAST:
                block = kvh * tl.num_programs(2) + tl.program_id(2)
                tl.debug_barrier()   # every thread's partials stored before the program counts itself done
                if tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel") == nsplit - 1:
                    o = merge_rows(acc_ptr, ml_ptr, kvh * nsplit * R + g * T + t, row_ok, R, nsplit, BLOCK_M, HD)
                    tl.store(out_ptr + t[:, None] * stride_ot + ((kvh * GRP + g) * HD)[:, None] + d[None, :],
                             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
                    tl.store(cnt_ptr + block, 0)

    @triton.jit
    def merge_rows(acc_ptr, ml_ptr, first, row_ok, stride, nsplit, BLOCK_M: tl.constexpr, HD: tl.constexpr):
        """The merged output ``[BLOCK_M, HD]`` of rows whose partials (``acc`` ``[.., HD]`` and
        ``(max, sum)`` pairs in ``ml``) sit at index ``first`` in split 0 and ``stride`` further per
        split: the largest max first, then the weighted sums in split order (deterministic, one
        split after another whatever their count). Loads bypass L1 (``.cg``): the partials may have
        been written by other programs of the same kernel."""
        top = tl.load(ml_ptr + first * 2, mask=row_ok, other=NEG, cache_modifier=".cg")
        for sp in range(1, nsplit):
            top = tl.maximum(top, tl.load(ml_ptr + (first + sp * stride) * 2, mask=row_ok, other=NEG,
                                          cache_modifier=".cg"))
        d = tl.arange(0, HD)
        num = tl.zeros([BLOCK_M, HD], tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        for sp in range(0, nsplit):
            b = first + sp * stride
            w = tl.exp(tl.load(ml_ptr + b * 2, mask=row_ok, other=NEG, cache_modifier=".cg") - top)
            den += tl.load(ml_ptr + b * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg") * w
            num += tl.load(acc_ptr + b[:, None] * HD + d[None, :], mask=row_ok[:, None], other=0.0,
                           cache_modifier=".cg") * w[:, None]
        return num / tl.where(row_ok, den, 1.0)[:, None]   # padding rows: no 0/0

    @triton.jit(do_not_specialize=["T", "R", "nsplit"])
    def _attn_merge(acc_ptr, ml_ptr, out_ptr, T, R, nsplit, stride_ot,
                    GRP: tl.constexpr, HD: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        """Out row ``r`` of KV head ``kvh`` from the ``nsplit`` partials, ``SPLITS`` per load: the
        largest max first, then the weighted sums in split order. A loop, not a block of
        ``nsplit``: one compiled kernel serves every split count (an eager step's count follows
        its cache length)."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        kvh = tl.program_id(0)
        r = tl.program_id(1)
        sc = tl.arange(0, SPLITS)
        top = tl.full([SPLITS], NEG, tl.float32)
        for s0 in range(0, nsplit, SPLITS):
            sp = s0 + sc
            top = tl.maximum(top, tl.load(ml_ptr + ((kvh * nsplit + sp) * R + r) * 2, mask=sp < nsplit, other=NEG))
        mx = tl.max(top, 0)
        d = tl.arange(0, HD)
        num = tl.zeros([HD], tl.float32)
        den = tl.zeros([SPLITS], tl.float32)
        for s0 in range(0, nsplit, SPLITS):
            sp = s0 + sc
            ok = sp < nsplit
            base = (kvh * nsplit + sp) * R + r
            w = tl.exp(tl.load(ml_ptr + base * 2, mask=ok, other=NEG) - mx)
            den += tl.load(ml_ptr + base * 2 + 1, mask=ok, other=0.0) * w
            acc = tl.load(acc_ptr + base[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
            num += tl.sum(acc * w[:, None], 0)
        o = num / tl.sum(den, 0)
        g = r // T
        t = r % T
        tl.store(out_ptr + t * stride_ot + (kvh * GRP + g) * HD + d, o.to(out_ptr.dtype.element_ty))


if triton is not None:

    @triton.jit
    def _store_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_ch, stride_cs, stride_dh, stride_ds, HD: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + t)
        d = tl.arange(0, HD)
        tl.store(kc_ptr + h * stride_ch + slot * stride_cs + d, tl.load(k_ptr + t * stride_kt + h * stride_kh + d))
        tl.store(vc_ptr + h * stride_dh + slot * stride_ds + d, tl.load(v_ptr + t * stride_vt + h * stride_vh + d))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``k_cache[:, slots[t]] = k[t]`` (and V) for rows ``k``/``v`` [T, nkv, hd] into caches [nkv, S, hd]:
    one launch for both caches (torch's index_put is two launches of a generic kernel)."""
    T, nkv, hd = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv needs rows and caches contiguous in head_dim")
    _store_kv[(T, nkv)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), HD=hd,
                        num_warps=1)


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles these shapes (``tl.dot`` tiles need a power-of-two head_dim >= 16)."""
    return heads % kv_heads == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def plan(T: int, nh: int, nkv: int, S: int, segments: int = 1,
         cfg: SplitConfig = SplitConfig()) -> tuple[int, int, int, int]:
    """(rows R, row block, row blocks per segment, splits) for a step of ``T`` rows (``segments``
    requests of at most ``T`` rows each): about ``cfg.target_programs`` programs.

    Requests count as the next power of two, so a batched step of 9 requests splits its caches
    as the bucket graph of 16 does (whose free slots' programs walk one position): the table's
    targets were measured at power-of-two request counts, one program per SM for 4-16 requests,
    and rounding up 9 requests' 72 (KV head, request) pairs to 128 programs made 144, two waves
    (on the H200 a decoder of 9 slots stepped 0.16 ms slower than 16 requests, 9 in 16 slots 0.06
    ms faster)."""
    R = (nh // nkv) * T
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(R)))
    row_blocks = triton.cdiv(R, block_m)
    tiles = triton.cdiv(S, cfg.block_n)
    units = nkv * row_blocks * triton.next_power_of_2(segments)
    splits = max(1, min(tiles, triton.cdiv(cfg.target_programs, units)))
    return R, block_m, row_blocks, splits


def check_shapes(nh: int, nkv: int, hd: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if not supports(nh, nkv, hd):
        raise ValueError(f"fused attention needs heads divisible by KV heads and a power-of-two head_dim >= 16 "
                         f"(got {nh} heads, {nkv} KV heads, head_dim {hd})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("fused attention needs K/V caches contiguous in head_dim")


def _launch(q, k, v, mask, scale, pdl, segs=None, seg_rows: int = 0, cfg: SplitConfig | None = None,
            slots: torch.Tensor | None = None, rope=None):
    """The kernels for ``q`` [T, nh, hd] over ``k``/``v`` [slots, nkv, S, hd]: one request in slot 0
    (``segs`` None) or the requests ``segs`` [n, 3] int32 (first row, rows, slot) of at most
    ``seg_rows`` rows each; ``cfg`` (default: :func:`split_config`'s) sets the program target and
    the walk (``live`` takes the rows' cache ``slots`` [T]; without them the checked walk runs). A
    plan of one split writes the output from the split pass; more take the merge. ``rope`` (``cos``,
    ``sin``, ``pos``, ``req``, one-row segments): ``q`` is the step's q/k/v rows [T, nh, hd] view of
    their q heads, RoPE'd in the split pass, which writes K/V too (:func:`rope_batched_gqa_attention`)."""
    T, nh, hd = q.shape
    _, nkv, S, _ = k.shape
    if rope is None:
        q = q.contiguous()
    mask = mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8).contiguous()
    nseg = 1 if segs is None else segs.shape[0]
    R = (nh // nkv) * T
    rows = T if segs is None else seg_rows
    cfg = cfg or split_config(q.device, segs is not None, rows, hd, nseg)
    _, block_m, row_blocks, splits = plan(rows, nh, nkv, S, nseg, cfg)
    chunk = triton.cdiv(triton.cdiv(S, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(S, chunk)
    out = torch.empty(T, nh * hd, dtype=v.dtype, device=q.device)
    direct = splits == 1
    merge_last = not direct and cfg.merge == "last"
    if direct:
        acc = ml = out
    else:
        acc = torch.empty(nkv, splits, R, hd, dtype=torch.float32, device=q.device)
        ml = torch.empty(nkv, splits, R, 2, dtype=torch.float32, device=q.device)
    cnt = workspace.counters(q.device, "attention.blocks", nkv * row_blocks * nseg) if merge_last else out
    live = cfg.live and slots is not None
    if live:
        if slots.dim() != 1 or slots.shape[0] != T:
            raise ValueError(f"slots must be [T] = [{T}], got {tuple(slots.shape)}")
        slots = slots.contiguous()   # the kernel reads slots[t] at slots_ptr + t
    ieee = v.dtype == torch.float32
    cos, sin, pos, req = rope if rope is not None else (mask,) * 4
    _attn_split[(nkv, splits, row_blocks * nseg)](
        q, k, v, mask, acc, ml, mask if segs is None else segs, slots if live or rope else mask, out, cnt,
        cos, sin, pos, req, T, S, R, chunk, float(scale), row_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), out.stride(0), cos.stride(0), nh, GRP=nh // nkv, HD=hd, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, IEEE=ieee, SEGS=segs is not None, LIVE=live, STAGES=cfg.stages, DIRECT=direct,
        MERGE_LAST=merge_last, PREFETCH=cfg.prefetch if live and k.stride(2) == hd and v.stride(2) == hd else 0,
        TAIL=cfg.tail, ROPE=rope is not None, num_warps=4, **pdl_args(pdl, q))
    if not direct and not merge_last:
        _attn_merge[(nkv, R)](acc, ml, out, T, R, splits, out.stride(0), GRP=nh // nkv, HD=hd,
                              SPLITS=MERGE_SPLITS, num_warps=4, **pdl_args(pdl, q))
    return out


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float, pdl: bool = False, cfg: SplitConfig | None = None,
                         slots: torch.Tensor | None = None) -> torch.Tensor:
    """Fused masked GQA attention; output [T, nh * hd] in ``v``'s dtype (see the module doc).
    ``pdl``: launch both kernels with programmatic dependent launch (kernels/triton_env.pdl_args;
    the fused decode chain); ``cfg``: the program target and walk (default: the measured table's);
    ``slots`` [T]: the cache slots the rows wrote (the live walk's bound)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("the fused attention needs triton")
    check_shapes(q.shape[1], k.shape[0], q.shape[2], k, v)
    return _launch(q, k[None], v[None], mask, scale, pdl, cfg=cfg, slots=slots)


def segment_table(segments, device) -> tuple[torch.Tensor, int]:
    """The [n, 3] int32 table (first row, rows, cache slot) of a batched step's segments (objects with
    ``start``, ``rows``, ``slot``) and their most rows: what :func:`batched_gqa_attention` takes."""
    table = torch.tensor([[s.start, s.rows, s.slot] for s in segments], dtype=torch.int32)
    return table.to(device), max(s.rows for s in segments)


def batched_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          segs: torch.Tensor, seg_rows: int, pdl: bool = False,
                          cfg: SplitConfig | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`masked_gqa_attention` for the rows of several requests in one launch (continuous
    batching): rows ``segs[i, 0] ..`` (``segs[i, 1]`` of them, at most ``seg_rows``) attend over
    request ``segs[i, 2]``'s cache ``k[slot]``/``v[slot]`` ([slots, nkv, S, hd]) under their rows of
    ``mask`` [T, S]. Every row of ``q`` must belong to one segment; ``cfg`` as there."""
    _check_batched(q.shape[1], q.shape[2], k, v, segs)
    return _launch(q, k, v, mask, scale, pdl, segs, seg_rows, cfg, slots)


def _check_batched(nh: int, hd: int, k: torch.Tensor, v: torch.Tensor, segs: torch.Tensor) -> None:
    if triton is None:  # pragma: no cover
        raise RuntimeError("the fused attention needs triton")
    if k.dim() != 4 or segs.dim() != 2 or segs.shape[1] != 3 or segs.dtype != torch.int32:
        raise ValueError("batched attention takes caches [slots, nkv, S, hd] and a segment table [n, 3] int32")
    check_shapes(nh, k.shape[1], hd, k, v)


def rope_batched_gqa_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                               slots: torch.Tensor, req: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               mask: torch.Tensor, scale: float, segs: torch.Tensor, nh: int, pdl: bool = False,
                               cfg: SplitConfig | None = None) -> torch.Tensor:
    """``rope_store_rows`` (:mod:`specpilot.kernels.verify.rows`) and :func:`batched_gqa_attention`
    in one launch, for a step whose every segment is one row (a batched AR step): ``qkv`` [T,
    (nh + 2 nkv) hd] the q/k/v GEMM's rows; each program RoPEs its row's q heads of its KV head
    at ``pos``; the program whose split holds position ``slots[t]`` writes the row's K (RoPE) and V
    there in request ``req[t]``'s cache, then every program walks its tiles. The same bits as the
    two kernels (the same RoPE roundings, the same tiles) where no segment reads a position another
    segment's row writes in the same step, as in the engine (rows write their own request's cache,
    or a spare slot no row attends). Output [T, nh * hd]; the caches written as ``rope_store_rows``
    writes them."""
    _check_batched(nh, k.shape[-1], k, v, segs)
    _, nkv, S, hd = k.shape
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (nh + 2 * nkv) * hd or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, (nh + 2 nkv) * hd] = [T, {(nh + 2 * nkv) * hd}] rows, contiguous in "
                         f"each row (got {tuple(qkv.shape)})")
    if segs.shape[0] != T:
        raise ValueError(f"the fused RoPE takes one-row segments: {segs.shape[0]} segments for {T} rows")
    if req.shape != (T,):
        raise ValueError(f"req must be [{T}]")
    from specpilot.kernels.verify import common

    common.check_rope_store(T, hd, cos, sin, pos, slots, k, v)
    q = qkv.view(T, nh + 2 * nkv, hd)[:, :nh]
    return _launch(q, k, v, mask, scale, pdl, segs, 1, cfg, slots.contiguous(),
                   (cos, sin, pos.contiguous(), req.contiguous()))
