"""The batched AR step's RoPE + K/V write folded into the attention's split pass
(``rope_batched_gqa_attention``) against the two kernels it replaces (``rope_store_rows``, then
``batched_gqa_attention``): the same output bits and the same caches. CPU: Triton's interpreter at
tiny shapes; ``-m gpu``: Llama-3.1-8B attention shapes in bf16, under PDL, and a whole batched step."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from specpilot.kernels.attention import decode as fused  # noqa: E402
from specpilot.kernels.verify import rows as W  # noqa: E402
from kernel_checks import rope_tables  # noqa: E402


def _step(B, nh, nkv, hd, S, held, dtype, device, seed=0, spare=None):
    """A batched AR step: request b's one row at position ``held[b]`` (its cache holds the positions
    before it), attending its context and itself; with ``spare`` the last request's row writes the
    spare cache slot instead (a hybrid's padding row) and attends position 0 only."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (nh + 2 * nkv) * hd, generator=g).to(dtype).to(device)
    slots_n = B + (spare is not None)
    kc = torch.randn(slots_n, nkv, S, hd, generator=g).to(dtype).to(device)
    vc = torch.randn(slots_n, nkv, S, hd, generator=g).to(dtype).to(device)
    pos = torch.tensor(held, device=device)
    slots = pos.clone()
    req = torch.arange(B, device=device)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, p in enumerate(held):
        mask[b, :p + 1] = True
    if spare is not None:
        req[-1] = B
        mask[-1] = False
        mask[-1, 0] = True
    segs = torch.tensor([[b, 1, b] for b in range(B)], dtype=torch.int32, device=device)
    cos, sin = rope_tables(hd, S)
    return qkv, kc, vc, pos, slots, req, mask.to(device), segs, cos.to(device), sin.to(device)


def _both(case, nh, cfg, pdl=False):
    qkv, kc, vc, pos, slots, req, mask, segs, cos, sin = case
    hd = kc.shape[-1]
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = W.rope_store_rows(qkv, cos, sin, pos, slots, k1, v1, nh, kc.shape[1], req=req)
    want = fused.batched_gqa_attention(q.view(q.shape[0], nh, hd), k1, v1, mask, hd ** -0.5, segs, 1, pdl=pdl,
                                       cfg=cfg, slots=slots)
    got = fused.rope_batched_gqa_attention(qkv, cos, sin, pos, slots, req, k2, v2, mask, hd ** -0.5, segs, nh,
                                           pdl=pdl, cfg=cfg)
    return got, want, (k1, v1), (k2, v2)


@pytest.mark.parametrize("cfg", [
    fused.SplitConfig(4, live=True, stages=2, block_n=16),                  # one split a program
    fused.SplitConfig(64, live=True, stages=2, merge="last", block_n=16),   # splits, merged by the last
    fused.SplitConfig(64, block_n=32),                                      # checked walk, merge kernel
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_the_split_pass_gives_the_two_kernels_bits(cfg, dtype):
    case = _step(3, 8, 2, 16, 96, held=[40, 7, 63], dtype=dtype, device="cpu")
    got, want, c1, c2 = _both(case, 8, cfg)
    assert torch.equal(got, want)
    assert torch.equal(c1[0], c2[0]) and torch.equal(c1[1], c2[1])   # K (RoPE) and V written at each row's slot


def test_a_row_writing_a_spare_slot_attends_its_own_cache():
    """A padding row whose K/V go to a spare slot (``req`` != its segment's slot) reads its own
    segment's cache as the two kernels do; the spare slot gets the write."""
    case = _step(3, 8, 2, 16, 64, held=[20, 33, 9], dtype=torch.float32, device="cpu", spare=True)
    got, want, c1, c2 = _both(case, 8, fused.SplitConfig(8, live=True, block_n=16))
    assert torch.equal(got, want)
    assert torch.equal(c1[0], c2[0]) and torch.equal(c1[1], c2[1])
    assert not torch.equal(c2[0][3], case[1][3])   # the spare slot was written


def test_rope_attention_refuses_what_it_cannot_fuse():
    qkv, kc, vc, pos, slots, req, mask, segs, cos, sin = _step(2, 8, 2, 16, 64, [5, 9], torch.float32, "cpu")
    two_rows = torch.tensor([[0, 2, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="one-row segments"):
        fused.rope_batched_gqa_attention(qkv, cos, sin, pos, slots, req, kc, vc, mask, 0.25, two_rows, 8)
    with pytest.raises(ValueError, match="qkv must be"):
        fused.rope_batched_gqa_attention(qkv[:, :-16], cos, sin, pos, slots, req, kc, vc, mask, 0.25, segs, 8)
    with pytest.raises(ValueError, match="req must be"):
        fused.rope_batched_gqa_attention(qkv, cos, sin, pos, slots, req[:1], kc, vc, mask, 0.25, segs, 8)
    with pytest.raises(ValueError, match="caches"):
        fused.rope_batched_gqa_attention(qkv, cos, sin, pos, slots, req, kc[0], vc[0], mask, 0.25, segs, 8)


def test_rope_in_the_split_pass_compiles_for_sm90():
    """The fused variant at the table's 16-request config compiles for sm_90 (ptxas accepts it)."""
    from gluon_ptx import ptxas_report

    r = ptxas_report("""
from triton.compiler import ASTSource as GluonASTSource   # a Triton kernel: the plain AST source
from specpilot.kernels.attention import decode
k = decode._attn_split
ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
ptrs.update({"mask_ptr": "*u8", "acc_ptr": "*bf16", "ml_ptr": "*bf16", "seg_ptr": "*i32", "slots_ptr": "*i64",
             "cnt_ptr": "*u8", "scale": "fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64",
             "req_ptr": "*i64"})
const = {"GRP": 4, "HD": 128, "BLOCK_M": 16, "BLOCK_N": 128, "IEEE": False, "SEGS": True, "PDL": True, "LIVE": True,
         "STAGES": 3, "DIRECT": True, "MERGE_LAST": False, "PREFETCH": 0, "ROPE": True}
div = []
warps = 4
""")
    assert r["rc"] == 0, r["log"][-2000:]
    assert r["ptx"].count("st.global") >= 2   # the row's K and V


def test_the_table_fuses_only_where_measured():
    """Batched steps at head_dim 128 (Llama's) RoPE in the split pass and read nothing past the
    rows' highest slot; one request's steps (the decode chain's RoPE) and Qwen3.5's gated attention
    (head_dim 256, its own RoPE kernel) keep both as they were."""
    cpu = torch.device("cpu")
    for requests in (4, 16, 32):
        cfg = fused.split_config(cpu, True, 1, 128, requests)
        assert cfg.rope and not cfg.tail
    for cfg in (fused.split_config(cpu, False, 1, 128), fused.split_config(cpu, False, 64, 128),
                fused.split_config(cpu, True, 1, 256, 16)):
        assert not cfg.rope and cfg.tail


@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 16, 32])
def test_rope_in_the_split_pass_on_cuda(B):
    """Llama-3.1-8B attention shapes in bf16 at the table's configs, with and without PDL: the two
    kernels' bits and caches."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    held = [1000 - 13 * b for b in range(B)]
    case = _step(B, 32, 8, 128, 2048, held, torch.bfloat16, "cuda", seed=B)
    for pdl in (False, True):
        got, want, c1, c2 = _both(case, 32, None, pdl)
        assert torch.equal(got, want)
        assert torch.equal(c1[0], c2[0]) and torch.equal(c1[1], c2[1])


@pytest.mark.gpu
def test_batched_decoding_with_rope_in_the_attention_equals_one_request_ar(monkeypatch):
    """The batch decoder (bucket graphs, overlapped AR steps, free slots' padding rows) with RoPE
    and the K/V write in the split pass and the live walk without its tail: each request's greedy
    tokens equal one-request AR's (fp32, tiny)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from dataclasses import replace

    from specpilot.engine.api import load_engine
    from specpilot.engine.batch.requests import Request
    from specpilot.engine.spec import EngineSpec

    table, real, calls = fused.split_config, fused.rope_batched_gqa_attention, []
    monkeypatch.setattr(fused, "split_config", lambda *a: replace(table(*a), rope=True, tail=False))
    monkeypatch.setattr(fused, "rope_batched_gqa_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [[(7 * i + 3 * k) % 250 + 1 for k in range(5 + 3 * i)] for i in range(3)]
    base = "engine:model=tiny,dtype=float32,device=cuda,ctx=512"
    ar = load_engine(EngineSpec.parse(base + ",mode=ar,graphs=0"))
    want = [ar.generate(p, 24).output_ids for p in prompts]
    dec = load_engine(EngineSpec.parse(base + ",mode=ar,batch=4")).batch_decoder()
    got = [r.output_ids for r in dec.generate_many([Request(p, 24, id=i, arrival_step=2 * i)
                                                    for i, p in enumerate(prompts)])]
    assert got == want and calls and dec.stats.overlapped_steps > 0
