"""A small decode-like torch loop with NVTX step ranges, for trace-reader fixtures.

A Llama-shaped decoder (random bf16 weights, static KV cache) decodes one token per step:
``draft`` (a one-layer drafter proposing 3 tokens) then ``decode_step_N`` verification of
1 row, with the LM head inside an ``lm_head`` range. Run it under Nsight Systems (``--mode
eager`` or ``--mode graph``, the whole step captured in a CUDA graph) or with the PyTorch
profiler (``--kineto FILE``). Self-contained: torch only.

    nsys profile -t cuda,nvtx --sample=none --cpuctxsw=none -o run python3 capture_decode_trace.py --mode eager
    python3 capture_decode_trace.py --mode eager --kineto trace.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math

import torch
import torch.nn.functional as F

CONFIG = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
          "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2816, "vocab_size": 32000,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
DRAFTER = {**CONFIG, "num_hidden_layers": 1}
CONTEXT = 512


def rng(nvtx_on: bool, name: str):
    if not nvtx_on:
        return torch.profiler.record_function(name)
    return torch.cuda.nvtx.range(name)


class Decoder:
    def __init__(self, cfg, dev, max_len=CONTEXT + 64):
        torch.manual_seed(0)
        d, h, kv, hd, i = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                           cfg["head_dim"], cfg["intermediate_size"])
        w = lambda *s: (torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02)  # noqa: E731
        self.h, self.kv, self.hd = h, kv, hd
        self.layers = [dict(qkv=w((h + 2 * kv) * hd, d), o=w(d, h * hd), gu=w(2 * i, d), down=w(d, i),
                            n1=torch.ones(d, device=dev, dtype=torch.bfloat16),
                            n2=torch.ones(d, device=dev, dtype=torch.bfloat16),
                            k=torch.zeros(1, kv, max_len, hd, device=dev, dtype=torch.bfloat16),
                            v=torch.zeros(1, kv, max_len, hd, device=dev, dtype=torch.bfloat16))
                       for _ in range(cfg["num_hidden_layers"])]
        self.embed = w(cfg["vocab_size"], d)
        self.head = w(cfg["vocab_size"], d)
        self.norm = torch.ones(d, device=dev, dtype=torch.bfloat16)
        self.eps = cfg["rms_norm_eps"]
        for L in self.layers:
            L["k"][:, :, :CONTEXT].normal_()
            L["v"][:, :, :CONTEXT].normal_()

    def rms(self, x, wt):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * wt

    def forward(self, tok, pos, nv):
        x = F.embedding(tok, self.embed)  # [1, 1, d]
        for L in self.layers:
            hN = self.rms(x, L["n1"])
            qkv = F.linear(hN, L["qkv"])
            q, k, v = qkv.split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
            q = q.view(1, 1, self.h, self.hd).transpose(1, 2)
            L["k"].index_copy_(2, pos, k.view(1, 1, self.kv, self.hd).transpose(1, 2))
            L["v"].index_copy_(2, pos, v.view(1, 1, self.kv, self.hd).transpose(1, 2))
            kk = L["k"][:, :, :CONTEXT + 1].repeat_interleave(self.h // self.kv, dim=1)
            vv = L["v"][:, :, :CONTEXT + 1].repeat_interleave(self.h // self.kv, dim=1)
            a = F.scaled_dot_product_attention(q, kk, vv)
            x = x + F.linear(a.transpose(1, 2).reshape(1, 1, -1), L["o"])
            hN = self.rms(x, L["n2"])
            g, u = F.linear(hN, L["gu"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, L["down"])
        x = self.rms(x, self.norm)
        with rng(nv, "lm_head"):
            logits = F.linear(x, self.head)
        return logits.argmax(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["eager", "graph"], default="eager")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kineto", help="write a PyTorch profiler trace here instead of NVTX ranges")
    ap.add_argument("--config-out", help="write the target config.json here")
    args = ap.parse_args()
    if args.config_out:
        with open(args.config_out, "w") as fh:
            json.dump(CONFIG, fh, indent=2)
    dev = "cuda"
    target, drafter = Decoder(CONFIG, dev), Decoder(DRAFTER, dev)
    nv = args.kineto is None
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = torch.tensor([CONTEXT], device=dev)

    def step():
        with rng(nv, "draft"):
            t = tok
            for _ in range(3):
                t = drafter.forward(t, pos, nv)
        return target.forward(t, pos, nv)

    for _ in range(3):  # warm up: cuBLAS handles, SDPA kernel choice
        step()
    torch.cuda.synchronize()
    g = None
    if args.mode == "graph":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        torch.cuda.synchronize()
    prof = contextlib.nullcontext()
    if args.kineto:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
    with prof as p:
        for i in range(args.steps):
            with rng(nv, f"decode_step_{i}"):
                if g is not None:
                    g.replay()
                    res = out
                else:
                    res = step()
                res.item()  # the engine reads the accepted token every step
    if args.kineto:
        p.export_chrome_trace(args.kineto)
    print(f"done {args.steps} steps ({args.mode}); {torch.cuda.get_device_name(0)}; "
          f"{math.prod(res.shape)} token(s) per step")


if __name__ == "__main__":
    main()
