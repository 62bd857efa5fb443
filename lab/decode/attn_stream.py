"""A batched AR step's attention (B requests x 1 row, one program per (request, KV head), the whole
live cache walked by one program) against lab walks of the same partition: K/V tiles by pointer
(cp.async, as the product) or through TMA descriptors, the mask loaded or taken from the live end,
and a stream kernel with the same tiles and no attention arithmetic (what the partition can read).

One launch per layer cache (32 caches of B requests, Llama-3.1-8B heads: 32 heads, 8 KV heads,
head_dim 128, bf16, context 1024, a cache of ``--ctx + 128`` slots per request) in one CUDA graph:
the caches together are far larger than L2, so each launch reads its K/V from HBM as in the step.
Prints microseconds per launch and the live K/V bandwidth; outputs of the attention walks are
checked against the product kernel's.

Measured (H200, 16 requests): the product 11.7 / 23.7 / 68.0 us at context 256 / 1024 / 4096, a
fixed ~8 us plus the bytes at 4.5 TB/s; at 1024 every walk (TMA or pointers, mask or not, segment
table or not, 2 or 4 programs per (request, KV head)) and the stream kernel took 21.5-23.5 us: the
fixed cost is the launch's, not the walk's.

    python lab/decode/attn_stream.py [--batch 16] [--ctx 1024] [--layers 32]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, parse_int_list, print_table, time_cuda_graph, write_results  # noqa: E402

bootstrap()

import torch  # noqa: E402

from specpilot.kernels.attention import decode  # noqa: E402
from specpilot.kernels.triton_env import tl, triton  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

NEG = decode.NEG
softmax_tile, accumulate = decode.softmax_tile, decode.accumulate   # the product's online softmax


@triton.jit
def _walk(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, seg_ptr, slots_ptr, k_desc, v_desc, S,
          scale, stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_mt, stride_ot,
          NKV: tl.constexpr, GRP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, STAGES: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr,
          STREAM: tl.constexpr, CONST: tl.constexpr, LIVE):
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    seg = tl.program_id(2)
    if CONST:   # no segment table: request i is row i in slot i (what the lab's steps hold)
        t0 = seg
        nt = 1
        slot = seg.to(tl.int64)
    else:
        t0 = tl.load(seg_ptr + seg * 3)
        nt = tl.load(seg_ptr + seg * 3 + 1)
        slot = tl.load(seg_ptr + seg * 3 + 2).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GRP * nt
    g = rows // nt
    t = t0 + rows % nt
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + t[:, None] * stride_qt + (kvh * GRP + g)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if CONST:   # no slots read: the live end comes as an argument
        live = LIVE
    else:
        live = tl.max(tl.load(slots_ptr + t, mask=row_ok, other=-1).to(tl.int32), 0) + 1
    hi = tl.minimum(live, S)
    chunk = tl.cdiv(tl.cdiv(hi, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    end = tl.minimum(lo + chunk, tl.cdiv(hi, BLOCK_N) * BLOCK_N)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    sink = tl.zeros([HD], tl.float32)
    base = (slot * NKV + kvh) * S   # this (request, KV head)'s first row in the [slots * nkv * S, HD] view
    k_base = k_ptr + slot * stride_kb + kvh * stride_kh + d[None, :]
    v_base = v_ptr + slot * stride_kb + kvh * stride_kh + d[None, :]
    for s0 in tl.range(lo, end, BLOCK_N, num_stages=STAGES):
        n = s0 + tl.arange(0, BLOCK_N)
        n_ok = n < S
        if TMA:
            k = k_desc.load([(base + s0).to(tl.int32), 0])
            v = v_desc.load([(base + s0).to(tl.int32), 0])
        else:
            k = tl.load(k_base + n[:, None] * stride_ks, mask=n_ok[:, None], other=0.0)
            v = tl.load(v_base + n[:, None] * stride_ks, mask=n_ok[:, None], other=0.0)
        if STREAM:
            sink += tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0)
        else:
            if MASK:
                allowed = tl.load(mask_ptr + t[:, None] * stride_mt + n[None, :],
                                  mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
            else:
                allowed = (n < hi)[None, :] & row_ok[:, None]
            p, alpha, m_i, l_i = softmax_tile(q, k, allowed, m_i, l_i, scale, False)
            acc = accumulate(acc, alpha, p, v, False)
    if STREAM:
        tl.store(out_ptr + ((seg * NKV + kvh) * tl.num_programs(1) + sp) * HD + d, sink)
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + ((kvh * GRP + g) * HD)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def lab_launch(q, k, v, kd, vd, mask, scale, segs, slots, out, block_n, stages, warps, use_mask, tma, stream,
               splits=1, const=0, live=0):
    T, nh, hd = q.shape
    B, nkv, S, _ = k.shape
    _walk[(nkv, splits, B)](q, k, v, mask, out, segs, slots, kd, vd, S, scale,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), mask.stride(0),
                       out.stride(0), NKV=nkv, GRP=nh // nkv, HD=hd, BLOCK_M=16, BLOCK_N=block_n,
                       STAGES=stages, MASK=use_mask, TMA=tma, STREAM=stream, CONST=const,
                       LIVE=live, num_warps=warps)


SHORT = [(0, 1, 0, 128, 3, 4, 0), (0, 1, 0, 128, 3, 4, 1), (1, 0, 0, 128, 3, 8, 0), (1, 0, 0, 128, 3, 8, 1),
         (1, 1, 1, 128, 3, 4, 0), (1, 1, 1, 128, 3, 4, 1)]   # (tma, mask, stream, block_n, stages, warps, const)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", default="1024", help="comma list of contexts")
    ap.add_argument("--splits", default="1", help="comma list: programs per (request, KV head) (no merge: "
                    "the walks' outputs are only checked with one)")
    ap.add_argument("--grid", choices=("full", "short"), default="full")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    rows = []
    for ctx in parse_int_list(args.ctx, 16, 1 << 16, "attn_stream: --ctx"):
        for splits in parse_int_list(args.splits, 1, 64, "attn_stream: --splits"):
            rows += case(args.batch, ctx, splits, args.layers, args.grid)
    print_table(rows, ["ctx", "splits", "variant", "block_n", "stages", "warps", "us", "tb_s", "max_err"])
    write_results("attn_stream", rows, {"batch": args.batch, "layers": args.layers})
    return 0


def case(B: int, ctx: int, splits: int, L: int, grid: str) -> list[dict]:
    torch.manual_seed(0)
    nh, nkv, hd = 32, 8, 128
    S = ctx + 128
    scale = hd ** -0.5
    ks = [torch.randn(B, nkv, S, hd, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    vs = [torch.randn(B, nkv, S, hd, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    q = torch.randn(B, nh, hd, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(B, S, dtype=torch.bool, device="cuda")
    mask[:, :ctx + 1] = True
    mask8 = mask.view(torch.uint8)
    segs = torch.tensor([[i, 1, i] for i in range(B)], dtype=torch.int32, device="cuda")
    slots = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    live_bytes = 2 * B * nkv * (ctx + 1) * hd * 2
    ref = decode.batched_gqa_attention(q, ks[0], vs[0], mask, scale, segs, 1, slots=slots)
    rows = []
    tag = {"ctx": ctx, "splits": splits}

    def product():
        for i in range(L):
            decode.batched_gqa_attention(q, ks[i], vs[i], mask, scale, segs, 1, slots=slots)

    if splits == 1:
        us = time_cuda_graph(product) / L
        rows.append({**tag, "variant": "product", "block_n": "table", "stages": "table", "warps": 4,
                     "us": round(us, 2), "tb_s": round(live_bytes / us / 1e6, 2), "max_err": 0.0})
        print(rows[-1], flush=True)
    out = torch.empty(B, nh * hd, device="cuda", dtype=torch.bfloat16)
    sink = torch.empty(B * nkv * splits * hd, device="cuda", dtype=torch.float32)
    configs = SHORT if grid == "short" else itertools.product((0, 1), (1, 0), (0, 1), (64, 128), (2, 3, 4), (4, 8),
                                                              (0,))
    for tma, use_mask, stream, block_n, stages, warps, const in configs:
        if stream and not use_mask:
            continue
        if tma and TensorDescriptor is None:
            continue
        descs = [(TensorDescriptor.from_tensor(ks[i].view(-1, hd), [block_n, hd]),
                  TensorDescriptor.from_tensor(vs[i].view(-1, hd), [block_n, hd])) if tma else (ks[i], vs[i])
                 for i in range(L)]
        dst = sink if stream else out
        name = (("stream" if stream else "walk") + ("-tma" if tma else "-ptr")
                + ("" if use_mask or stream else "-nomask") + ("-const" if const else ""))
        try:
            lab_launch(q, ks[0], vs[0], *descs[0], mask8, scale, segs, slots, dst, block_n, stages, warps,
                       use_mask, tma, stream, splits, const, ctx + 1)
            torch.cuda.synchronize()
        except Exception as exc:   # shared memory past the SM's: the config does not exist
            print(f"{name} {block_n}/{stages}/{warps}: {type(exc).__name__}", flush=True)
            continue
        err = None if stream or splits > 1 else round((out.float() - ref.float()).abs().max().item(), 4)

        def fn(descs=descs, dst=dst, block_n=block_n, stages=stages, warps=warps, use_mask=use_mask, tma=tma,
               stream=stream, const=const):
            for i in range(L):
                lab_launch(q, ks[i], vs[i], *descs[i], mask8, scale, segs, slots, dst, block_n, stages, warps,
                           use_mask, tma, stream, splits, const, ctx + 1)

        us = time_cuda_graph(fn) / L
        rows.append({**tag, "variant": name, "block_n": block_n, "stages": stages, "warps": warps,
                     "us": round(us, 2), "tb_s": round(live_bytes / us / 1e6, 2), "max_err": err})
        print(rows[-1], flush=True)
    del ks, vs
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sys.exit(main())
