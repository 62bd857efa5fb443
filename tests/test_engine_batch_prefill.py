"""A batch's prompt chunks through the GDN layers in one pass (``GatedDeltaNet._prefill_segments``):
one conv launch, one variable-length chunked delta-rule call and one gated norm for every
request's chunk, instead of a launch sequence per request.

fla runs on CUDA only; here its entry point is replaced by the torch reference (``naive``) with
the same signature, ``cu_seqlens`` included, so the engine's side (rows, slots, windows, states)
runs under Triton's interpreter on the CPU. tests/test_engine_batch_gpu.py and
tests/test_hybrid_gpu.py run the real fla.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.engine.batch.requests import Request
from specpilot.engine.gated_deltanet import GatedDeltaNet
from specpilot.engine.spec import EngineSpec
from specpilot.engine.step_input import StepInput
from specpilot.kernels.gdn import naive, prefill

PROMPTS = [list(b"gated delta"), list(b"abcabcab"), list(b"one two o"), list(b"xy")]


def _reference_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla's ``chunk_gated_delta_rule`` as the sequential torch reference, one sequence per
    ``cu_seqlens`` span, each from its own initial state."""
    q, k, v, g, beta = q[0], k[0], v[0], g[0], beta[0]
    cu = [0, q.shape[0]] if cu_seqlens_cpu is None else cu_seqlens_cpu.tolist()
    rep = v.shape[1] // q.shape[1]
    outs, finals = [], []
    for i in range(len(cu) - 1):
        r = slice(cu[i], cu[i + 1])
        args = naive.prepare(q[r].repeat_interleave(rep, 1), k[r].repeat_interleave(rep, 1), v[r], g[r], beta[r])
        o, last = naive.recurrent(*args, initial_state[i].clone(), keep_states=False)
        outs.append(o)
        finals.append(last[0])
    return torch.cat(outs)[None], torch.stack(finals)


def count_prefill_segments(monkeypatch) -> list[int]:
    """Spy on ``GatedDeltaNet._prefill_segments``: the returned list gets each call's chunk count."""
    calls = []
    real = GatedDeltaNet._prefill_segments

    def spy(self, proj, segs, cache):
        calls.append(len(segs))
        return real(self, proj, segs, cache)

    monkeypatch.setattr(GatedDeltaNet, "_prefill_segments", spy)
    return calls


@pytest.fixture
def fla_on_cpu(monkeypatch):
    monkeypatch.setattr(prefill, "_chunk", lambda: _reference_fla)
    monkeypatch.setattr(prefill, "available", lambda device: True)


def _engine(extra="mode=ar", batch=4):
    eng = load_engine(EngineSpec.parse(f"engine:model=tiny-hybrid,batch={batch},{extra}"))
    for layer in eng.model.gdn_layers():
        layer.impl = "triton"
    return eng


def test_prompt_chunks_of_a_batch_equal_one_request_prefills(fla_on_cpu):
    """One layer, four requests' chunks (one of two rows, shorter than the conv window; one slot
    left out): outputs, states and conv windows equal each chunk through ``mix`` on its own slot,
    bit for bit; a slot no chunk names stays."""
    eng = _engine()
    dec = eng.batch_decoder()
    layer = eng.model.gdn_layers()[0]
    cache = dec.cache.layers[[b.mixer for b in eng.model.layers].index(layer)]
    gen = torch.Generator().manual_seed(5)
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen))
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    from specpilot.engine.step_input import Segment

    lengths, slots = [6, 2, 9], [2, 0, 3]
    segs, at = [], 0
    for s, n in zip(slots, lengths):
        segs.append(Segment(s, at, n))
        at += n
    proj = torch.randn(at, layer.in_proj.weight.shape[0], generator=gen)
    st0, cv0 = cache.state.clone(), cache.conv.clone()
    got = layer._prefill_segments(proj, segs, cache)
    own = layer.state, layer.conv_state
    try:
        for sg, out in zip(segs, got):
            st, cv = st0[sg.slot].clone(), cv0[sg.slot].clone()
            layer.state, layer.conv_state = st, cv
            z = torch.zeros(sg.rows, dtype=torch.long)
            want = layer.mix(proj[sg.start:sg.start + sg.rows],
                             StepInput(z, z, z, torch.ones(sg.rows, 1, dtype=torch.bool), "seq", None))
            assert torch.equal(out, want)
            assert torch.equal(cache.state[sg.slot], st) and torch.equal(cache.conv[sg.slot], cv)
    finally:
        layer.state, layer.conv_state = own
    assert torch.equal(cache.state[1], st0[1]) and torch.equal(cache.conv[1], cv0[1])


@pytest.mark.parametrize("extra", ["mode=ar"])
def test_batched_prefill_pass_equals_one_request_greedy(fla_on_cpu, monkeypatch, extra):
    """Prompts arriving together are prefilled in one pass through ``_prefill_segments`` (every GDN
    layer, all their chunks at once), and each request's output equals its one-request greedy
    output (the one-request decoder prefills through the same reference)."""
    calls = count_prefill_segments(monkeypatch)
    n = 3   # the prefill's token, then two steps from the states it left
    one = _engine(extra, batch=1)
    want = [one.generate(p, n).output_ids for p in PROMPTS[:3]]
    dec = _engine(extra).batch_decoder()
    got = [r.output_ids for r in dec.generate_many([Request(p, n, id=i) for i, p in enumerate(PROMPTS[:3])])]
    assert got == want
    assert calls and max(calls) == 3 and dec.stats.prefill_passes >= 1
