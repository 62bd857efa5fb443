"""How many programs the split-KV attention should aim for (``kernels/attention/decode.py``
``SplitConfig.target_programs``, the entries of ``kernels/attention/tuned/<arch>.json``): one request (AR and verify rows) and batched steps of B requests x N rows,
Llama-3.1-8B attention shapes (32 heads, 8 KV heads, head_dim 128), bf16, context 1024 per request.

    python lab/decode/attn_programs.py [--targets 128,256,512,1024,2048] [--batches 1,4,16,32]

Each launch is timed from a CUDA graph with L2 flushed (the attention of one layer); GB/s counts the
live K/V bytes read. Writes lab/results/attn_programs.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import L2Flusher, bootstrap, parse_int_list, print_table, time_cuda_graph, write_results  # noqa: E402

bootstrap()


def main():
    import torch

    from specpilot.kernels.attention import decode

    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="128,256,512,1024,2048")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--rows", default="1,4,33")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    targets = parse_int_list(args.targets, 1, 1 << 16, "attn_programs: --targets")
    batches = parse_int_list(args.batches, 1, 256, "attn_programs: --batches")
    rows_list = parse_int_list(args.rows, 1, 64, "attn_programs: --rows")
    nh, nkv, hd, ctx = 32, 8, 128, args.context
    S = ctx + 128
    dev = "cuda"
    flush = L2Flusher()
    out = []
    for B in batches:
        k = torch.randn(B, nkv, S, hd, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for N in rows_list:
            T = B * N
            q = torch.randn(T, nh, hd, device=dev, dtype=torch.bfloat16)
            mask = torch.zeros(T, S, dtype=torch.bool, device=dev)
            mask[:, :ctx] = True
            for b in range(B):
                mask[b * N:(b + 1) * N, ctx:ctx + N] = torch.tril(torch.ones(N, N, dtype=torch.bool, device=dev))
            segs = torch.tensor([[b * N, N, b] for b in range(B)], dtype=torch.int32, device=dev)
            live = B * nkv * (ctx + N) * hd * 2 * 2
            for tp in targets:
                cfg = decode.SplitConfig(tp)
                if B == 1:
                    fn = lambda: decode.masked_gqa_attention(q, k[0], v[0], mask, hd ** -0.5, cfg=cfg)  # noqa: E731
                else:
                    fn = lambda: decode.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs, N, cfg=cfg)  # noqa: E731
                us = time_cuda_graph(fn, flush=flush)
                _, _, rb, splits = decode.plan(N if B > 1 else T, nh, nkv, S, B if B > 1 else 1, cfg)
                out.append({"batch": B, "rows": N, "target_programs": tp, "splits": splits,
                            "programs": nkv * splits * rb * (B if B > 1 else 1), "us": us, "gbps": live / us / 1e3})
                print(out[-1], flush=True)
    write_results("attn_programs", out, {"context": ctx, "shapes": {"heads": nh, "kv_heads": nkv, "head_dim": hd}})
    print_table(out, ["batch", "rows", "target_programs", "splits", "programs", "us", "gbps"])


if __name__ == "__main__":
    main()
