"""The multi-row step kernels (kernels/verify, the rows' argmax) against their plain references,
and the engine's steps of 2..64 rows through them (decode=fused).

On the CPU the Triton kernels run under the interpreter at tiny shapes; ``-m gpu`` runs them on
CUDA at Llama-3.1-8B shapes and checks that a captured verify step gives the same bits as eager,
with or without programmatic dependent launch, for bf16 and W12 weights."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from specpilot.kernels.decode.argmax import argmax_rows  # noqa: E402
from specpilot.kernels.verify import common  # noqa: E402
from specpilot.kernels.verify import naive as R  # noqa: E402
from specpilot.kernels.verify import rows as W  # noqa: E402
from kernel_checks import DEV, closeness, rope_tables as _rope_tables, row_inputs as _inputs, tree_mask  # noqa: E402
from eager_runner import EagerRunner

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
_close = closeness(TOL)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_small_row_kernels_round_like_the_layers(dt):
    """Each kernel against the layer arithmetic it replaces (to the last bits: the sum of squares'
    order, ``exp``, and the interpreter's bf16 casts differ), and only the rows' slots written."""
    T = 5
    g, rnd, x, gamma = _inputs(dt, T, K=96, seed=2)
    _close(W.rms_norm_rows(x, gamma, 1e-5), R.rms_norm(x, gamma, 1e-5), dt)
    d = rnd(T, 96)
    s, h = W.add_rms_norm_rows(x, d, gamma, 1e-5)
    s2, h2 = R.add_rms_norm(x, d, gamma, 1e-5)
    _close(s, s2, dt)
    _close(h, h2, dt)
    gu = rnd(T, 2 * 40)
    _close(W.silu_mul_rows(gu, 40), R.silu_mul(gu, 40), dt)

    nh, nkv, hd, S = 4, 2, 16, 24
    qkv = rnd(T, (nh + 2 * nkv) * hd)
    cos, sin = _rope_tables(hd, 32)
    pos = torch.tensor([3, 9, 9, 10, 31], device=DEV)
    slots = torch.tensor([5, 6, 7, 8, 9], device=DEV)
    kc, vc = rnd(nkv, S, hd), rnd(nkv, S, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    kc0 = kc.clone()
    q = W.rope_store_rows(qkv, cos, sin, pos, slots, kc, vc, nh, nkv)
    q2 = R.rope_store(qkv, cos, sin, pos, slots, kc2, vc2, nh, nkv)
    _close(q, q2, dt)
    _close(kc, kc2, dt)
    assert torch.equal(vc, vc2)                       # V is copied, not computed
    assert torch.equal(kc[:, 10:], kc0[:, 10:]) and torch.equal(kc[:, :5], kc0[:, :5])
    # the reference is the layer's own RoPE (engine/model.py apply_rope)
    from specpilot.engine.model import apply_rope

    assert torch.equal(q2.view(T, nh, hd), apply_rope(qkv[:, :nh * hd].reshape(T, nh, hd), cos[pos], sin[pos]))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_rope_store_rows_into_each_rows_request_slot(dt):
    """Continuous batching: row t's K/V go to request ``req[t]``'s cache at ``slots[t]``, nowhere else."""
    T, nh, nkv, hd, S, B = 5, 4, 2, 16, 24, 3
    _, rnd, _, _ = _inputs(dt, T, seed=4)
    qkv = rnd(T, (nh + 2 * nkv) * hd)
    cos, sin = _rope_tables(hd, 32)
    pos = torch.tensor([3, 4, 9, 0, 1], device=DEV)
    slots = torch.tensor([3, 4, 9, 0, 1], device=DEV)
    req = torch.tensor([2, 2, 0, 1, 1], device=DEV)
    kc, vc = rnd(B, nkv, S, hd), rnd(B, nkv, S, hd)
    kc0, vc0 = kc.clone(), vc.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    q = W.rope_store_rows(qkv, cos, sin, pos, slots, kc, vc, nh, nkv, req=req)
    q2 = R.rope_store(qkv, cos, sin, pos, slots, kc2, vc2, nh, nkv, req=req)
    _close(q, q2, dt)
    _close(kc, kc2, dt)
    assert torch.equal(vc, vc2)
    written = torch.zeros(B, S, dtype=torch.bool, device=DEV)
    written[req, slots] = True
    assert torch.equal(kc.transpose(1, 2)[~written], kc0.transpose(1, 2)[~written])
    assert torch.equal(vc.transpose(1, 2)[~written], vc0.transpose(1, 2)[~written])
    with pytest.raises(ValueError, match="requests"):
        W.rope_store_rows(qkv, cos, sin, pos, slots, kc[0], vc[0], nh, nkv, req=req)


def test_argmax_rows_is_torch_argmax():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2500, generator=g)
    x[1, 2000] = x[1, 7] = 50.0          # a tie: the lowest index
    x[2, 1500] = float("nan")            # the first NaN wins
    x[3] = float("-inf")
    x = x.to(DEV)
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist()
    assert argmax_rows(x.to(torch.bfloat16)).tolist() == x.to(torch.bfloat16).argmax(-1).tolist()


def test_shape_errors():
    with pytest.raises(ValueError, match="2 \\* inter"):
        W.silu_mul_rows(torch.zeros(3, 30, device=DEV), 16)
    with pytest.raises(ValueError, match="does not match"):
        W.add_rms_norm_rows(torch.zeros(3, 16, device=DEV), torch.zeros(2, 16, device=DEV), torch.ones(16, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="columns"):
        W.rope_store_rows(torch.zeros(3, 100, device=DEV), *_rope_tables(16, 8), torch.zeros(3, dtype=torch.long),
                          torch.zeros(3, dtype=torch.long), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), 4, 2)


# ---------------------------------------------------------------------------------------------
# the engine's steps of 2..64 rows (decode=fused)
# ---------------------------------------------------------------------------------------------

def _tree_step(m, n, ctx, T, dev):
    """A tree step of T rows after a committed prefix of n tokens: rows 1.. form two branches."""
    parents = [-1] + [0] + [(i - 1) if i % 2 else max(0, i - 2) for i in range(2, T)]
    depth = [0] * T
    for i in range(1, T):
        depth[i] = depth[parents[i]] + 1
    mask = tree_mask(parents, n, ctx)
    from specpilot.engine.step_input import StepInput

    return StepInput(torch.arange(40, 40 + T, device=dev), torch.tensor([n + d for d in depth], device=dev),
                     n + torch.arange(T, device=dev), mask.to(dev), "seq")


def test_engine_verify_step_matches_the_layers():
    """A tree step of 9 rows through the fused kernels against the layer modules: logits and the
    K/V written agree (fp32, tiny model; CPU: Triton's interpreter)."""
    from specpilot.engine import fused_verify
    from specpilot.engine.api import load_engine
    from specpilot.engine.step_input import StepInput

    ctx = 64
    m = load_engine(f"engine:model=tiny,mode=ar,ctx={ctx},device={DEV},dtype=float32,graphs=0,decode=layers").model
    m.layers = m.layers[:2]   # a layer into the next one, and the last into the head: half the interpreter's work
    n = 11
    pos = torch.arange(n, device=DEV)
    m.forward(StepInput(torch.arange(60, 60 + n, device=DEV), pos, pos,
                        torch.arange(ctx, device=DEV)[None, :] <= pos[:, None], "seq"), kv_len=ctx)
    step = _tree_step(m, n, ctx, 9, DEV)
    ref = m.forward(step, kv_len=ctx)
    kv_ref = [(blk.mixer.k_cache[0, :, n:n + 9].clone(), blk.mixer.v_cache[0, :, n:n + 9].clone()) for blk in m.layers]
    for blk in m.layers:
        blk.mixer.k_cache[0, :, n:] = 0
        blk.mixer.v_cache[0, :, n:] = 0
    assert m.set_decode("fused") == "fused" and fused_verify.takes(m, 9)
    got = m.forward(step, kv_len=ctx)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    for blk, (k, v) in zip(m.layers, kv_ref):
        torch.testing.assert_close(blk.mixer.k_cache[0, :, n:n + 9], k, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(blk.mixer.v_cache[0, :, n:n + 9], v, atol=2e-5, rtol=2e-5)
    assert torch.equal(m.greedy(step, kv_len=ctx), ref.argmax(-1))


def test_engine_prompt_longer_than_a_verify_step_takes_the_fused_rows():
    """A prompt of more rows than a verify step (70 > 64) through the fused kernels against the
    layer modules: every row's logits and K/V agree (fp32, tiny model, two layers;
    CPU: Triton's interpreter)."""
    from specpilot.engine import fused_verify
    from specpilot.engine.api import load_engine
    from specpilot.engine.spec import MAX_STEP_ROWS
    from specpilot.engine.step_input import StepInput

    ctx, n = 96, MAX_STEP_ROWS + 6
    m = load_engine(f"engine:model=tiny,mode=ar,ctx={ctx},device={DEV},dtype=float32,graphs=0,decode=layers").model
    m.layers = m.layers[:2]
    pos = torch.arange(n, device=DEV)
    prompt = StepInput((7 * pos + 3) % m.spec.vocab_size, pos, pos,
                       torch.arange(ctx, device=DEV)[None, :] <= pos[:, None], "seq")
    ref = m.forward(prompt, kv_len=ctx)
    kv_ref = [(blk.mixer.k_cache[0, :, :n].clone(), blk.mixer.v_cache[0, :, :n].clone()) for blk in m.layers]
    for blk in m.layers:
        blk.mixer.k_cache.zero_()
        blk.mixer.v_cache.zero_()
    assert m.set_decode("fused") == "fused" and fused_verify.takes(m, n)
    assert not fused_verify.takes_invariant(m, n)
    got = m.forward(prompt, kv_len=ctx)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    for blk, (k, v) in zip(m.layers, kv_ref):
        torch.testing.assert_close(blk.mixer.k_cache[0, :, :n], k, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(blk.mixer.v_cache[0, :, :n], v, atol=2e-5, rtol=2e-5)


def _batched_fused_vs_layers(model: str, ctx: int, seed: int, scale: float, blocks, tol: float, prepare=None,
                             layers=None):
    """One batched step of ``blocks`` through the layer modules, then (every cache slot put back)
    through the fused kernels (``prepare(m)`` first): logits, every slot's K/V and GDN states agree
    within ``tol``; ``layers``: the model's first layers only. Returns (model, the step's input and
    kv_len, the layers' logits)."""
    from specpilot.engine import fused_verify
    from specpilot.engine.api import load_engine
    from specpilot.engine.batch.cache import BatchCache
    from specpilot.engine.batch.step import assemble

    m = load_engine(f"engine:model={model},mode=ar,ctx={ctx},device={DEV},dtype=float32,graphs=0,"
                    "decode=layers").model
    m.layers = m.layers[:layers]
    cache = BatchCache(m, 3)
    g = torch.Generator().manual_seed(seed)
    tensors = [t for lc in cache.layers for t in lc.tensors()]
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g) * scale)
    kept = [t.clone() for t in tensors]
    inp, kv, _ = assemble(blocks, cache.max_seq, m.device)
    ref = m.logits_batch(inp, cache, kv)
    want = [t.clone() for t in tensors]
    for t, k0 in zip(tensors, kept):
        t.copy_(k0)
    assert m.set_decode("fused") == "fused" and fused_verify.takes_batch(m)
    if prepare is not None:
        prepare(m)
    inp, kv, _ = assemble(blocks, cache.max_seq, m.device)
    got = m.logits_batch(inp, cache, kv)
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    for t, w in zip(tensors, want):
        torch.testing.assert_close(t, w, atol=tol, rtol=tol)
    return m, cache, inp, kv, ref


@pytest.mark.parametrize("one_row", [False, True])
def test_engine_batched_step_matches_the_layers(one_row):
    """A batched step (three requests: prompt chunks of 9, 1 and 7 rows in slots 2, 0, 1; or one
    request's one row in slot 1: the one-row decode chain on that slot) through the fused kernels
    against the layer modules: logits and every request's K/V agree (fp32, tiny)."""
    from specpilot.engine.batch.step import prefill_rows

    blocks = [prefill_rows(2, list(range(5, 17)), 3, 12, True), prefill_rows(0, list(range(30, 40)), 0, 1, True),
              prefill_rows(1, list(range(50, 80)), 20, 27, True)]
    if one_row:
        blocks = [prefill_rows(1, list(range(50, 80)), 20, 21, True)]
    # two layers: a layer into the next one, and the last into the head: half the interpreter's work
    m, cache, inp, kv, ref = _batched_fused_vs_layers("tiny", 128, 0, 1.0, blocks, 2e-5, layers=2)
    assert torch.equal(m.greedy_batch(inp, cache, kv), ref.argmax(-1))


@pytest.mark.parametrize("rope", [False, True])
def test_engine_batched_ar_step_with_rope_in_the_attention(rope, monkeypatch):
    """A batched AR step (one row per request, slots 2, 0, 1) with RoPE and the K/V write in the
    attention's split pass (``SplitConfig.rope``) or in a kernel of their own: the layer modules'
    logits and K/V either way (fp32, tiny)."""
    from dataclasses import replace

    from specpilot.engine.batch.step import prefill_rows
    from specpilot.kernels.attention import decode

    table, real, calls = decode.split_config, decode.rope_batched_gqa_attention, []
    monkeypatch.setattr(decode, "split_config", lambda *a: replace(table(*a), rope=rope))
    monkeypatch.setattr(decode, "rope_batched_gqa_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    blocks = [prefill_rows(s, list(range(40, 60)), a, a + 1, True) for s, a in ((2, 9), (0, 4), (1, 13))]
    _batched_fused_vs_layers("tiny", 128, 0, 1.0, blocks, 2e-5, layers=2)
    assert len(calls) == (2 if rope else 0)   # each layer's attention


@pytest.mark.parametrize("ar_rows", [True, False])
def test_engine_batched_hybrid_step_matches_the_layers(ar_rows):
    """tiny-hybrid: a batched step through the fused kernels (GDN rows in the Triton kernels: one AR
    row per request in one launch over the requests' state slots, or prompt chunks per request)
    against the layer modules (torch GDN): logits, K/V and every slot's GDN states agree (fp32)."""
    from specpilot.engine.batch.step import prefill_rows
    from specpilot.engine.gated_deltanet import GatedDeltaNet

    def gdn_kernels(m):
        for blk in m.layers:
            if isinstance(blk.mixer, GatedDeltaNet):
                blk.mixer.impl = "triton"

    if ar_rows:
        blocks = [prefill_rows(s, list(range(40, 60)), a, a + 1, True) for s, a in ((2, 9), (0, 4), (1, 13))]
    else:
        blocks = [prefill_rows(2, list(range(5, 17)), 3, 8, True), prefill_rows(0, list(range(30, 40)), 0, 3, True)]
    _batched_fused_vs_layers("tiny-hybrid", 64, 1, 0.5, blocks, 1e-4, prepare=gdn_kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the W12 GEMM takes 30 s in the interpreter)")
def test_gpu_engine_w12_verify_step_matches_the_layers():
    """W12 projections: a 5-row tree step through the fused path against the W12 layer modules (bf16)."""
    from specpilot.engine import w12_loader as ew
    from specpilot.engine.api import build_model
    from specpilot.engine.step_input import StepInput

    ctx = 32
    m, _, _ = build_model("tiny", True, torch.bfloat16, DEV, ctx)
    ew.convert_engine_model(m, fused=True)
    n = 4
    pos = torch.arange(n, device=DEV)
    m.forward(StepInput(torch.arange(60, 60 + n, device=DEV), pos, pos,
                        torch.arange(ctx, device=DEV)[None, :] <= pos[:, None], "seq"), kv_len=ctx)
    step = _tree_step(m, n, ctx, 5, DEV)
    ref = m.forward(step, kv_len=ctx).float()
    assert m.set_decode("fused") == "fused"
    got = m.forward(step, kv_len=ctx).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_decoder_padded_fused_verify_steps_equal_ar(model):
    """Tree generation with every step of the fused kernels (verify steps padded to a bucket as the
    CUDA graphs pad them) gives AR's tokens (fp32, tiny models; chain steps are chain-shaped trees;
    the hybrid's GDN layers on the row kernels, its attention layers gated and q/k-normed)."""
    from specpilot.engine.api import load_engine

    # the hybrid accepts nothing here, so each token is an interpreted step: a shorter prompt, drafted
    # for at its third step, then one step from that step's commit
    prompt, n = (list(b"abcabcabc abcabc"), 10) if model == "tiny" else (list(b"abc abcabc"), 5)
    spec = f"engine:model={model},ctx=96,device={DEV},dtype=float32,graphs=0,decode=layers"

    def engine(extra):
        e = load_engine(spec + extra)
        if model == "tiny":   # a layer into the next one, and the last into the head: half the interpreter's work
            e.model.layers = e.model.layers[:2]
        return e

    ar = engine(",mode=ar").generate(prompt, n).output_ids
    e = engine(",mode=tree,nodes=6,depth=3,topk=2")
    for g in e.model.gdn_layers():
        g.impl = "triton"
    e.model.set_decode("fused")
    runner = e.decoder.runner = EagerRunner(e.model)
    r = e.generate(prompt, n)
    assert r.output_ids == ar and max(runner.calls) > 1
    if model == "tiny":     # the random hybrid accepts nothing of this drafter's; the tiny model does
        assert r.steps < 9


# ---------------------------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [2, 33, 64])
def test_gpu_row_kernels_at_llama_shapes(T):
    """The small kernels at Llama-3.1-8B shapes (bf16) against the references, and the rows' argmax."""
    g = torch.Generator().manual_seed(T)
    dt = torch.bfloat16

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt).cuda()

    x, d, gamma = rnd(T, 4096), rnd(T, 4096), (torch.rand(4096, generator=g) + 0.5).to(dt).cuda()
    s, h = W.add_rms_norm_rows(x, d, gamma, 1e-5)
    s2, h2 = R.add_rms_norm(x, d, gamma, 1e-5)
    assert torch.equal(s, s2)
    _close(h, h2, dt)
    _close(W.rms_norm_rows(x, gamma, 1e-5), R.rms_norm(x, gamma, 1e-5), dt)
    gu = rnd(T, 2 * 14336)
    _close(W.silu_mul_rows(gu, 14336), R.silu_mul(gu, 14336), dt)
    nh, nkv, hd, S = 32, 8, 128, 256
    cos, sin = _rope_tables(hd, 2048)
    pos = torch.randint(0, 2048, (T,), generator=g).cuda()
    slots = torch.randperm(S, generator=g)[:T].cuda()
    kc, vc = rnd(nkv, S, hd), rnd(nkv, S, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    qkv = rnd(T, (nh + 2 * nkv) * hd)
    _close(W.rope_store_rows(qkv, cos, sin, pos, slots, kc, vc, nh, nkv),
           R.rope_store(qkv, cos, sin, pos, slots, kc2, vc2, nh, nkv), dt)
    _close(kc, kc2, dt)
    assert torch.equal(vc, vc2)
    logits = rnd(T, 128256)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weights", ["dtype=bfloat16", "w12=1"])
def test_gpu_verify_step_graph_equals_eager_with_and_without_pdl(weights, monkeypatch):
    """A 9-row tree step through the fused kernels (bf16 and W12 weights): the captured graph gives
    the eager step's bits, with programmatic dependent launch and without, replay after replay."""
    from specpilot.engine.api import load_engine
    from specpilot.engine.step_input import StepInput

    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(common, "USE_PDL", pdl)
        m = load_engine(f"engine:model=tiny,mode=ar,ctx=64,device=cuda,{weights},graphs=0").model
        assert m.fused_decode
        n = 11
        pos = torch.arange(n, device="cuda")
        m.forward(StepInput(torch.arange(60, 60 + n, device="cuda"), pos, pos,
                            torch.arange(64, device="cuda")[None, :] <= pos[:, None], "seq"), kv_len=64)
        step = _tree_step(m, n, 64, 9, "cuda")
        eager = m.hidden(step, 64).clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            m.hidden(step, 64)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h = m.hidden(step, 64)
        got = []
        for _ in range(3):
            graph.replay()
            got.append(h.clone())
        assert all(torch.equal(x, eager) for x in got)
        outs[pdl] = eager
    assert torch.equal(outs[True], outs[False])


def test_step_gemm_library_comes_from_the_table():
    """Steps of 32-64 rows take cuBLASLt (the table's entry), others torch's default; fp32 weights
    and the CPU always take plain ``F.linear``."""
    from specpilot.kernels.verify import blas

    cpu = torch.device("cpu")
    assert blas.gemm_config(cpu, 32).library == "cublaslt" and blas.gemm_config(cpu, 64).library == "cublaslt"
    assert blas.gemm_config(cpu, 16) == blas.gemm_config(cpu, 65) == blas.GemmConfig()
    x, w = torch.randn(32, 48, device=DEV), torch.randn(24, 48, device=DEV)
    assert torch.equal(blas.linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_gemm_on_cublaslt_agrees_and_restores_the_preference():
    from specpilot.kernels.verify import blas

    before = torch.backends.cuda.preferred_blas_library()
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    got = blas.linear(x, w)
    assert torch.backends.cuda.preferred_blas_library() == before
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=3e-2, rtol=2e-2)
