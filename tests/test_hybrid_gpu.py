"""Hybrid (GDN) kernels and engine on the GPU: bf16 bit equality with the layer code where the
kernels promise it, agreement with the fp32 references, and chain/tree losslessness."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from specpilot.kernels.gdn import naive, path as gpath, rows as grows  # noqa: E402

DEV = "cuda"
NK, NV, DK, DV = 16, 32, 128, 128      # Qwen3.5-9B's GDN layers
C = 2 * NK * DK + NV * DV


def _inputs(R, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(R, C, generator=g, device=DEV).to(torch.bfloat16)
    ab = torch.randn(R, 2 * NV, generator=g, device=DEV).to(torch.bfloat16)
    A_log = torch.rand(NV, generator=g, device=DEV) * 2.7
    dt_bias = torch.ones(NV, device=DEV, dtype=torch.bfloat16)
    state = torch.randn(NV, DK, DV, generator=g, device=DEV) * 0.1
    return qkv, ab, A_log, dt_bias, state


@pytest.mark.parametrize("R", [33, 64])
def test_gdn_rows_against_fp32_reference(R):
    qkv, ab, A_log, dt_bias, state = _inputs(R, R)
    paths = gpath.row_paths(gpath.random_parents(R, R)).to(DEV)
    out = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK)
    q, k, v = qkv.float().split([NK * DK, NK * DK, NV * DV], -1)
    b, a = ab.float().chunk(2, -1)
    g = -A_log.exp() * F.softplus(a + dt_bias.float())
    prep = naive.prepare(q.view(R, NK, DK).repeat_interleave(NV // NK, 1), k.view(R, NK, DK).repeat_interleave(NV // NK, 1),
                         v.view(R, NV, DV), g, torch.sigmoid(b))
    ref = gpath.path_verify(*prep, state, paths)
    torch.testing.assert_close(out.view(R, NV, DV), ref, atol=2e-4, rtol=1e-3)


def test_commit_and_verify_rows_equal_ar_steps_bitwise():
    R = 17
    qkv, ab, A_log, dt_bias, state = _inputs(R, 5)
    parents = gpath.random_parents(R, 5)
    paths = gpath.row_paths(parents).to(DEV)
    verify = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK)
    leaf = R - 1
    accepted = [x for x in gpath.row_paths(parents)[leaf].tolist() if x >= 0]
    committed = state.clone()
    grows.gdn_rows(qkv, ab, A_log, dt_bias, committed, torch.tensor([accepted], device=DEV), NK, output=False,
                   new_state=committed)
    seq = state.clone()
    for r in accepted:
        o = grows.gdn_rows(qkv[r:r + 1], ab[r:r + 1], A_log, dt_bias, seq, None, NK, new_state=seq)
        assert torch.equal(o[0], verify[r])
    assert torch.equal(committed, seq)


def test_gated_norm_is_the_layers_rounding_bitwise():
    from specpilot.engine.norm import rms_norm

    R = 9
    o = torch.randn(R, NV, DV, device=DEV) * 0.05
    z = torch.randn(R, NV * DV, device=DEV).to(torch.bfloat16)
    w = torch.rand(DV, device=DEV).to(torch.bfloat16) + 0.5
    gated = grows.gated_norm_rows(o, z, w, 1e-6)
    ref = rms_norm(o.to(torch.bfloat16), w, 1e-6) * F.silu(z.view(R, NV, DV))
    assert (gated.view(R, NV, DV) == ref).float().mean() > 0.99   # 1/RMS sums in another order than torch's mean
    torch.testing.assert_close(gated.view(R, NV, DV).float(), ref.float(), rtol=2 ** -7, atol=2 ** -10)


def test_qk_norm_rope_store_and_gate_against_the_layers_rounding():
    """Per-row RMS sums run in another order than torch's mean, so q/k may differ by a bf16 ulp where
    1/RMS rounds differently; V and the gate are the layer's bits."""
    from specpilot.kernels.decode import gated_attention as ga, naive as dnaive

    nh, nkv, hd, rot, S, T = 16, 4, 256, 64, 64, 33
    dt = torch.bfloat16
    proj = torch.randn(T, 2 * nh * hd + 2 * nkv * hd, device=DEV).to(dt)
    qn, kn = (torch.rand(hd, device=DEV) + 0.5).to(dt), (torch.rand(hd, device=DEV) + 0.5).to(dt)
    ang = torch.rand(S, rot, device=DEV) * 6
    cos, sin = ang.cos(), ang.sin()
    pos = torch.randint(0, S, (T,), device=DEV)
    slot = torch.randperm(S, device=DEV)[:T]
    caches = [torch.zeros(nkv, S, hd, dtype=dt, device=DEV) for _ in range(4)]
    want = dnaive.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[0], caches[1], nh, nkv, True)
    got = ga.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[2], caches[3], nh, nkv, True)
    for a, b in ((got, want), (caches[2], caches[0])):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2 ** -7)
        assert (a == b).float().mean() > 0.9    # a row whose 1/RMS rounds differently differs throughout
    assert torch.equal(caches[3], caches[1])
    o = torch.randn(T, nh * hd, device=DEV).to(dt)
    assert torch.equal(ga.sigmoid_gate(o, proj, nh), dnaive.sigmoid_gate(o, proj, nh))


def test_fla_prefill_matches_the_reference():
    from specpilot.kernels.gdn import prefill

    if not prefill.available(DEV):
        pytest.skip("fla-core is not installed")
    T, nk, nv, d = 300, 2, 4, 128
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k = (torch.randn(T, nk, d, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(T, nv, d, generator=g, device=DEV).to(torch.bfloat16)
    gate = -torch.rand(T, nv, generator=g, device=DEV)
    beta = torch.rand(T, nv, generator=g, device=DEV)
    s0 = torch.randn(nv, d, d, generator=g, device=DEV) * 0.1
    state = s0.clone()
    o = prefill.chunk_prefill(q, k, v, gate, beta, state)
    prep = naive.prepare(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, gate, beta)
    ref, last = naive.recurrent(*prep, s0, keep_states=False)
    torch.testing.assert_close(o, ref, atol=3e-2, rtol=3e-2)      # fla normalises q/k in bf16
    torch.testing.assert_close(state, last[0], atol=3e-2, rtol=3e-2)


def test_fla_prefill_of_several_chunks_in_one_call_matches_one_call_each():
    """``chunk_prefill_segments`` (one ``cu_seqlens`` call, states gathered from and scattered to
    their slots) against one ``chunk_prefill`` per chunk: fla chunks each sequence from its own
    start, so outputs and final states agree to fp32 rounding; a slot no chunk names stays."""
    from specpilot.kernels.gdn import prefill

    if not prefill.available(DEV):
        pytest.skip("fla-core is not installed")
    lengths, slots = [130, 7, 64, 201], [3, 0, 4, 1]
    T, nk, nv, d = sum(lengths), 2, 4, 128
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k = (torch.randn(T, nk, d, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(T, nv, d, generator=g, device=DEV).to(torch.bfloat16)
    gate = -torch.rand(T, nv, generator=g, device=DEV)
    beta = torch.rand(T, nv, generator=g, device=DEV)
    states = torch.randn(6, nv, d, d, generator=g, device=DEV) * 0.1
    want_st, want_o, at = states.clone(), [], 0
    for s, n in zip(slots, lengths):
        r = slice(at, at + n)
        want_o.append(prefill.chunk_prefill(q[r], k[r], v[r], gate[r], beta[r], want_st[s]))
        at += n
    st = states.clone()
    o = prefill.chunk_prefill_segments(q, k, v, gate, beta, st, slots, lengths)
    torch.testing.assert_close(o, torch.cat(want_o), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(st, want_st, atol=1e-3, rtol=1e-3)
    assert torch.equal(st[2], states[2]) and torch.equal(st[5], states[5])
    with pytest.raises(ValueError, match="lengths"):
        prefill.chunk_prefill_segments(q, k, v, gate, beta, st, slots, lengths[:3])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_tiny_hybrid_fp32_cuda_graphs_equal_ar(mode):
    from specpilot.engine.api import load_engine

    prompt = list(b"abcabcabc hello hello abcabc")
    base = "engine:model=tiny-hybrid,dtype=float32,device=cuda,ctx=512"
    ar_engine = load_engine(base + ",mode=ar")
    assert ar_engine.decoder.runner is not None and ar_engine.info["decode"] == "fused"
    ar = ar_engine.generate(prompt, 40).output_ids
    e = load_engine(base + f",mode={mode}")
    assert e.generate(prompt, 40).output_ids == ar


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_pipelined_ar_loop_equals_step_by_step(model):
    """The AR loop that queues graph replays ahead of the host (device-side input advance, EOS read
    a few steps late) gives the step-by-step loop's tokens, and stops at EOS the same way."""
    from specpilot.engine.api import load_engine

    e = load_engine(f"engine:model={model},dtype=float32,device=cuda,ctx=512,mode=ar")
    prompt = list(b"abcabcabc hello hello abcabc")
    fast = e.generate(prompt, 40)
    slow = e.generate(prompt, 40, record_lattice=True)      # lattice recording takes the step-by-step loop
    assert fast.output_ids == slow.output_ids and fast.steps == slow.steps == 39
    assert len(fast.step_times) == 39 and all(t[1] is not None for t in fast.step_times)
    eos = fast.output_ids[17]
    e.decoder.eos_ids = {eos}
    a, b = e.generate(prompt, 40), e.generate(prompt, 40, record_lattice=True)
    assert a.output_ids == b.output_ids and a.stop_reason == b.stop_reason == "eos"
    assert a.output_ids[-1] == eos and len(a.step_times) == a.steps == b.steps


@pytest.mark.parametrize("model,mode", [("tiny-hybrid", "chain"), ("tiny-hybrid", "tree"), ("tiny", "tree"),
                                        ("tiny-hybrid", "tlv")])
def test_commit_graphs_equal_eager_commits(model, mode):
    """Steps committed through the runner's commit graphs (captured at load) give the tokens, the
    steps and the final K/V and GDN states of the same decode committed eagerly."""
    from eager_runner import model_state
    from specpilot.engine.api import load_engine

    prompt = list(b"abcabcabc hello hello abcabc")
    e = load_engine(f"engine:model={model},dtype=float32,device=cuda,ctx=512,mode={mode},drafter=self,"
                    "draft_layers=1,depth=4,nodes=12,topk=3")
    runner = e.decoder.runner
    assert runner.commits, "warm-up captures the commit graphs"
    served = []
    graph_commit = runner.commit
    runner.commit = lambda *a: served.append(graph_commit(*a)) or served[-1]
    got = e.generate(prompt, 40)
    state = model_state(e.model)
    runner.commit = lambda *a: False
    want = e.generate(prompt, 40)
    assert any(served) and got.output_ids == want.output_ids and got.steps == want.steps
    assert all(torch.equal(a, b) for a, b in zip(state, model_state(e.model)))
