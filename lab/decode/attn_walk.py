"""The split-KV attention's walk over its cache slice (``kernels/attention/decode.py``
``_attn_split``) with knobs the product kernel does not have, timed against it:

* ``v_early``: V's tile is loaded together with K's, before the score product (the product kernel
  loads V after the softmax update: one tile load in flight per program, not two);
* ``block_n``: cache slots per tile (64 in the product);
* ``warps``.

One layer's attention (Llama-3.1-8B shapes: 32 heads, 8 KV heads, head_dim 128, bf16, context
1024 per request) for one request (1 and 33 rows) and batched steps of 4/16/32 requests x 1 and
4 rows, from CUDA graphs with L2 flushed; outputs checked against the product kernel's. Writes
lab/results/attn_walk.json.

Measured (H200, best of 16 configs per case): batched steps gain nothing (16 requests x 1 row
33.3 vs 33.9 us, about 2.0 TB/s of live K/V; 32 x 1: 52.3 vs 52.2 us; 33 rows per request: equal);
one request gains 6-11% with V beside K and 128-slot tiles (1 row 10.7 vs 11.8 us), about 0.03 ms
of a 4 ms step. Not routed.

    python lab/decode/attn_walk.py [--batches 1,16,32] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import L2Flusher, bootstrap, parse_int_list, print_table, time_cuda_graph, write_results  # noqa: E402

bootstrap()

import torch  # noqa: E402

from specpilot.kernels.attention import decode  # noqa: E402
from specpilot.kernels.triton_env import tl, triton  # noqa: E402

NEG = decode.NEG


@triton.jit
def _split_var(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr, seg_ptr, T, S, R, chunk, scale, row_blocks,
               stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_mt,
               GRP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SEGS: tl.constexpr, V_EARLY: tl.constexpr):
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    nsplit = tl.num_programs(1)
    rb, t0, nt, slot = decode._segment(seg_ptr, T, row_blocks, SEGS)
    k_ptr += slot * stride_kb
    v_ptr += slot * stride_vb
    row_ok, g, t = decode._rows(rb, t0, nt, GRP, BLOCK_M)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + t[:, None] * stride_qt + (kvh * GRP + g)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, S)
    for s0 in range(lo, hi, BLOCK_N):
        n = s0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        allowed = tl.load(mask_ptr + t[:, None] * stride_mt + n[None, :],
                          mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
        if tl.max(allowed.to(tl.int32)) > 0:
            k = tl.load(k_ptr + kvh * stride_kh + n[:, None] * stride_ks + d[None, :], mask=n_ok[:, None], other=0.0)
            if V_EARLY:
                v = tl.load(v_ptr + kvh * stride_vh + n[:, None] * stride_vs + d[None, :], mask=n_ok[:, None],
                            other=0.0)
            s = tl.dot(q, tl.trans(k))
            s = tl.where(allowed, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if not V_EARLY:
                v = tl.load(v_ptr + kvh * stride_vh + n[:, None] * stride_vs + d[None, :], mask=n_ok[:, None],
                            other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    base = (kvh * nsplit + sp) * R + g * T + t
    tl.store(acc_ptr + base[:, None] * HD + d[None, :], acc, mask=row_ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok)


def variant(q, k, v, mask, scale, segs, seg_rows, v_early, block_n, warps, cfg):
    """``decode._launch`` with the variant's walk (and its tile) in place of ``_attn_split``."""
    T, nh, hd = q.shape
    _, nkv, S, _ = k.shape
    mask = mask.view(torch.uint8)
    nseg = 1 if segs is None else segs.shape[0]
    R = (nh // nkv) * T
    rows = T if segs is None else seg_rows
    _, block_m, row_blocks, splits = decode.plan(rows, nh, nkv, S, nseg, cfg)
    chunk = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
    splits = triton.cdiv(S, chunk)
    acc = torch.empty(nkv, splits, R, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(nkv, splits, R, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(T, nh * hd, dtype=v.dtype, device=q.device)
    _split_var[(nkv, splits, row_blocks * nseg)](
        q, k, v, mask, acc, ml, mask if segs is None else segs, T, S, R, chunk, float(scale), row_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), GRP=nh // nkv, HD=hd, BLOCK_M=block_m, BLOCK_N=block_n, SEGS=segs is not None,
        V_EARLY=v_early, num_warps=warps)
    decode._attn_merge[(nkv, R)](acc, ml, out, T, R, splits, out.stride(0), GRP=nh // nkv, HD=hd,
                                 SPLITS=decode.MERGE_SPLITS, PDL=False, num_warps=4)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--rows", default="1,4,33")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    batches = parse_int_list(args.batches, 1, 256, "attn_walk: --batches")
    rows_list = parse_int_list(args.rows, 1, 64, "attn_walk: --rows")
    nh, nkv, hd, ctx = 32, 8, 128, args.context
    S = ctx + 128
    flush = L2Flusher()
    out = []
    for B in batches:
        k = torch.randn(B, nkv, S, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for N in rows_list:
            T = B * N
            q = torch.randn(T, nh, hd, device="cuda", dtype=torch.bfloat16)
            mask = torch.zeros(T, S, dtype=torch.bool, device="cuda")
            mask[:, :ctx] = True
            for b in range(B):
                mask[b * N:(b + 1) * N, ctx:ctx + N] = torch.tril(torch.ones(N, N, dtype=torch.bool, device="cuda"))
            segs = torch.tensor([[b * N, N, b] for b in range(B)], dtype=torch.int32, device="cuda") if B > 1 else None
            live = B * nkv * (ctx + N) * hd * 2 * 2
            cfg = decode.split_config(q.device, B > 1, N if B > 1 else T, hd, B)
            if B == 1:
                prod = lambda: decode.masked_gqa_attention(q, k[0], v[0], mask, hd ** -0.5)  # noqa: E731
            else:
                prod = lambda: decode.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs, N)  # noqa: E731
            want = prod().float()
            base_us = time_cuda_graph(prod, flush=flush)
            for v_early, bn, warps, tp in itertools.product((False, True), (64, 128), (4, 8),
                                                            (cfg.target_programs, 2 * cfg.target_programs)):
                c = decode.SplitConfig(tp)
                fn = lambda: variant(q, k, v, mask, hd ** -0.5, segs, N, v_early, bn, warps, c)  # noqa: E731
                try:
                    err = float((fn().float() - want).abs().max())
                    us = time_cuda_graph(fn, flush=flush)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                    print("skip", B, N, v_early, bn, warps, tp, type(e).__name__, str(e)[:100], flush=True)
                    continue
                out.append({"batch": B, "rows": N, "v_early": v_early, "block_n": bn, "warps": warps,
                            "target_programs": tp, "us": us, "product_us": base_us, "speedup": base_us / us,
                            "gbps": live / us / 1e3, "product_gbps": live / base_us / 1e3, "max_err": err})
                print({a: (round(b, 3) if isinstance(b, float) else b) for a, b in out[-1].items()}, flush=True)
    write_results("attn_walk", out, {"context": ctx, "shapes": {"heads": nh, "kv_heads": nkv, "head_dim": hd}})
    best = {}
    for r in out:
        key = (r["batch"], r["rows"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print_table(list(best.values()), ["batch", "rows", "v_early", "block_n", "warps", "target_programs", "us",
                                      "product_us", "speedup", "gbps", "max_err"])


if __name__ == "__main__":
    main()
