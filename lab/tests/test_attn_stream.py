"""The lab attention walks of ``lab/decode/attn_stream.py`` give the product kernel's output (K/V
by pointer or TMA descriptor, mask loaded or taken from the live end, segment table read or not)."""

from __future__ import annotations

import pytest
import torch

from specpilot.kernels.attention import decode


@pytest.mark.parametrize("tma,use_mask,const", [(0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1)])
def test_lab_walks_equal_the_product(tma, use_mask, const):
    from lab.decode import attn_stream as lab

    B, nh, nkv, hd, ctx = 2, 8, 2, 32, 100
    S = ctx + 28
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(B, nkv, S, hd, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, nkv, S, hd, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, nh, hd, generator=gen).to(torch.bfloat16)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, :ctx + 1] = True
    segs = torch.tensor([[i, 1, i] for i in range(B)], dtype=torch.int32)
    slots = torch.full((B,), ctx, dtype=torch.int32)
    ref = decode.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs, 1, slots=slots)
    kd, vd = ((lab.TensorDescriptor.from_tensor(k.view(-1, hd), [32, hd]),
               lab.TensorDescriptor.from_tensor(v.view(-1, hd), [32, hd])) if tma else (k, v))
    out = torch.empty(B, nh * hd, dtype=torch.bfloat16)
    lab.lab_launch(q, k, v, kd, vd, mask.view(torch.uint8), hd ** -0.5, segs, slots, out, 32, 2, 4, use_mask, tma,
                   0, 1, const, ctx + 1)
    assert torch.equal(out, ref)
