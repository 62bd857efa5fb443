"""Row-invariant masked GQA attention: each row's output has the bits it has when the row attends
alone, over the same keys in the same order, wherever those keys sit in the cache (deterministic
steps, ``EngineSpec.deterministic``).

:mod:`.decode` tiles the cache by slot and packs a step's rows into one query tile, so a tree
node's keys (the committed prefix, then its ancestors at scattered slots past it) fall into other
tiles and splits than the same token's keys in an AR step, where they sit at consecutive slots:
the online softmax rounds differently. Here a row's keys are its *visible* slots in slot order -
the committed prefix, then its root path, which is exactly the AR step's context in position
order - renumbered 0..n-1 (:func:`key_table`), and everything is tiled on that logical index:

1. ``_inv_split``: program (row, KV head, split) takes the logical keys
   ``[s * SPLIT, (s + 1) * SPLIT)`` of its row in ``BLOCK_N`` tiles, gathering K and V by slot,
   with the row's query heads of that KV head as the tile's rows (an online softmax in float32,
   as :mod:`.decode`); splits past the row's keys do nothing.
2. ``_inv_merge``: per (row, head), the row's splits in split order.

So one row's arithmetic depends only on its query and its ordered keys: an AR step (one row, the
keys at consecutive slots) and a chain or tree row with the same context give the same bits. Slower
than :mod:`.decode` (each row reads its keys on its own, mostly from L2). The plain reference is
:func:`.naive.masked_gqa_attention`.
"""

from __future__ import annotations

import torch

from ..triton_env import pdl_args, tl, triton

BLOCK_N = 64    # logical keys per tile
SPLIT = 128     # logical keys per split (a multiple of BLOCK_N): fixed, so a row's splits are too

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from .decode import NEG, accumulate, merge_rows, softmax_tile

    @triton.jit
    def _inv_split(q_ptr, k_ptr, v_ptr, keys_ptr, nkeys_ptr, acc_ptr, ml_ptr, NS, scale,
                   stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_keys,
                   GRP: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        n = tl.load(nkeys_ptr + t)
        lo = sp * SPLIT
        if lo < n:
            hi = tl.minimum(lo + SPLIT, n)
            g = tl.arange(0, GP)
            g_ok = g < GRP
            d = tl.arange(0, HD)
            head = kvh * GRP + g
            q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
            m_i = tl.full([GP], NEG, tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, HD], tl.float32)
            for j0 in range(lo, hi, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                ok = j < hi
                slot = tl.load(keys_ptr + t * stride_keys + j, mask=ok, other=0).to(tl.int64)
                k = tl.load(k_ptr + kvh * stride_kh + slot[:, None] * stride_ks + d[None, :], mask=ok[:, None], other=0.0)
                p, alpha, m_i, l_i = softmax_tile(q, k, ok[None, :], m_i, l_i, scale, IEEE)
                v = tl.load(v_ptr + kvh * stride_vh + slot[:, None] * stride_vs + d[None, :], mask=ok[:, None], other=0.0)
                acc = accumulate(acc, alpha, p, v, IEEE)
            base = (t * (tl.num_programs(1) * GRP) + head) * NS + sp   # partials [T, nh, NS]
            tl.store(acc_ptr + base[:, None] * HD + d[None, :], acc, mask=g_ok[:, None])
            tl.store(ml_ptr + base * 2, m_i, mask=g_ok)
            tl.store(ml_ptr + base * 2 + 1, l_i, mask=g_ok)

    @triton.jit
    def _inv_merge(acc_ptr, ml_ptr, nkeys_ptr, out_ptr, NS, stride_ot,
                   HD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
        """Row ``t``, head ``h``: the largest max of its splits, then their weighted sums one split
        after another (:func:`.decode.merge_rows` on one row: the split order, whatever the count)."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        t = tl.program_id(0)
        h = tl.program_id(1)
        used = tl.cdiv(tl.load(nkeys_ptr + t), SPLIT)
        first = (t * tl.num_programs(1) + h) * NS + tl.arange(0, 1)   # one row; its splits follow it
        o = merge_rows(acc_ptr, ml_ptr, first, first >= 0, 1, used, 1, HD)
        d = tl.arange(0, HD)
        tl.store(out_ptr + t * stride_ot + h * HD + d[None, :], o.to(out_ptr.dtype.element_ty))


def key_table(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's visible slots in slot order, ``keys`` int32 [T, S] (entries past the row's count
    undefined), and their count ``nkeys`` int32 [T], from ``mask`` bool [T, S]. Fixed shapes and
    device ops only: a CUDA graph recomputes it from its static mask at each replay."""
    T, S = mask.shape
    cum = mask.to(torch.int32).cumsum(1, dtype=torch.int32)
    nkeys = cum[:, -1].contiguous() if S else torch.zeros(T, dtype=torch.int32, device=mask.device)
    dest = torch.where(mask, cum - 1, S).long()           # hidden slots go to a column that is cut off
    keys = torch.zeros(T, S + 1, dtype=torch.int32, device=mask.device)
    keys.scatter_(1, dest, torch.arange(S, dtype=torch.int32, device=mask.device).expand(T, S).contiguous())
    return keys[:, :S], nkeys


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         pdl: bool = False, keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Row-invariant masked GQA attention, output [T, nh * hd] in ``v``'s dtype: ``q`` [T, nh, hd],
    ``k``/``v`` [nkv, S, hd], ``mask`` bool [T, S] (every row must see at least one slot);
    ``keys``: :func:`key_table` of ``mask`` when the caller has it (one per step serves every
    layer); ``pdl`` as :mod:`.decode`."""
    from .decode import check_shapes

    if triton is None:  # pragma: no cover
        raise RuntimeError("the row-invariant attention needs triton")
    T, nh, hd = q.shape
    nkv, S, _ = k.shape
    check_shapes(nh, nkv, hd, k, v)
    if mask.shape != (T, S):
        raise ValueError(f"mask must be [T, S] = [{T}, {S}], got {tuple(mask.shape)}")
    table, nkeys = key_table(mask) if keys is None else keys
    q = q.contiguous()
    grp = nh // nkv
    ns = max(1, triton.cdiv(S, SPLIT))
    acc = torch.empty(T, nh, ns, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(T, nh, ns, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(T, nh * hd, dtype=v.dtype, device=q.device)
    ieee = v.dtype == torch.float32
    _inv_split[(T, nkv, ns)](q, k, v, table, nkeys, acc, ml, ns, float(scale),
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             table.stride(0), GRP=grp, GP=max(16, triton.next_power_of_2(grp)), HD=hd,
                             BLOCK_N=BLOCK_N, SPLIT=SPLIT, IEEE=ieee, num_warps=4, **pdl_args(pdl, q))
    _inv_merge[(T, nh)](acc, ml, nkeys, out, ns, out.stride(0), HD=hd, SPLIT=SPLIT, num_warps=4,
                        **pdl_args(pdl, q))
    return out
