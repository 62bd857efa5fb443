"""Continuous batching on the GPU: CUDA graphs per (requests, rows) bucket, the fused row kernels
with one attention launch over every request's slot and the Triton tree builder, each request's
output equal to one-request greedy AR (fp32, tiny and tiny-hybrid: its buckets replay graphs,
padding rows in the spare slot; its GDN layers advance every request's state in one launch in AR
buckets and walk every row's path in verify buckets, the stashes the commit reads being the
graph's own buffers)."""

from __future__ import annotations

import pytest
import torch

from specpilot.engine import fused_verify
from specpilot.engine.api import load_engine
from specpilot.engine.batch.requests import Request
from specpilot.engine.spec import EngineSpec

pytestmark = pytest.mark.gpu

PROMPTS = [[(5 * i + j) % 256 for j in range(4 + i % 4)] * 3 for i in range(7)]


@pytest.mark.parametrize("model,extra", [
    ("tiny", "mode=ar"),
    ("tiny-hybrid", "mode=ar"),
    ("tiny", "mode=chain,drafter=self,draft_layers=2"),
    ("tiny", "mode=tree,drafter=self,draft_layers=2"),
    ("tiny", "mode=tree,budget=equal,block=fixed,admit=off"),
    ("tiny-hybrid", "mode=tree,drafter=self,draft_layers=2"),
    ("tiny-hybrid", "mode=chain"),
])
def test_batched_on_cuda_equals_one_request_ar(model, extra):
    base = f"engine:model={model},dtype=float32,device=cuda,ctx=512"
    ar = load_engine(EngineSpec.parse(base + ",mode=ar,graphs=0"))
    want = [ar.generate(p, 24).output_ids for p in PROMPTS]
    eng = load_engine(EngineSpec.parse(f"{base},{extra},batch=3,nodes=6,depth=4,topk=3"))
    dec = eng.batch_decoder()
    assert dec.runner is not None and fused_verify.takes_batch(eng.model)   # the fused row kernels
    warm = set(dec.runner.graphs)   # load-time warm-up: every bucket, one shared graph memory pool
    warm_mixed = set(dec.runner.mixed)
    reqs = [Request(p, 24, id=i, arrival_step=2 * i) for i, p in enumerate(PROMPTS)]
    got = [r.output_ids for r in dec.generate_many(reqs)]
    assert got == want
    assert dec.runner.graphs and set(dec.runner.graphs) == warm and set(dec.runner.mixed) == warm_mixed
    if "mode=ar" not in extra:   # verify steps replay buckets of more than one row per request
        assert any(N > 1 for _, N in dec.runner.graphs)
    if "mode=ar" in extra:   # AR steps overlap the host: fed on the device from the previous step
        assert dec.overlap and dec.stats.overlapped_steps > 0
    if "mode=ar" in extra and model == "tiny":   # arriving prompts' rows ride AR steps in mixed buckets,
        assert dec.runner.mixed and dec.stats.mixed_steps > 0   # and a lone prompt's pass replays one too
        assert dec.stats.prefill_replays > 0


@pytest.mark.parametrize("extra", ["mode=ar", "mode=tree,drafter=self,draft_layers=2"])
def test_prompts_arriving_together_prefill_in_one_gdn_pass(extra, monkeypatch):
    """tiny-hybrid (fp32, CUDA, real fla): prompts arriving at once are prefilled together, every
    GDN layer taking all their chunks in one variable-length call, and each output equals
    one-request AR."""
    from test_engine_batch_prefill import count_prefill_segments

    calls = count_prefill_segments(monkeypatch)
    base = "engine:model=tiny-hybrid,dtype=float32,device=cuda,ctx=512"
    ar = load_engine(EngineSpec.parse(base + ",mode=ar,graphs=0"))
    want = [ar.generate(p, 24).output_ids for p in PROMPTS[:4]]
    dec = load_engine(EngineSpec.parse(f"{base},{extra},batch=4,nodes=6,depth=4,topk=3")).batch_decoder()
    calls.clear()   # the warm-up's synthetic prompts
    got = [r.output_ids for r in dec.generate_many([Request(p, 24, id=i) for i, p in enumerate(PROMPTS[:4])])]
    assert got == want and calls and max(calls) == 4


@pytest.mark.parametrize("weights", ["dtype=bfloat16", "w12=1"])
@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_overlapped_ar_steps_equal_host_fed_steps(model, weights):
    """The same bucket graphs fed on the device (overlap) or from the host give the same tokens,
    with requests of different lengths finishing mid-streak and arriving later (bf16 weights, and
    W12 ones: a hybrid's GDN and gated layers on the W12 kernels too)."""
    eng = load_engine(EngineSpec.parse(f"engine:model={model},mode=ar,{weights},device=cuda,ctx=512,batch=4"))
    assert eng.model.fused_decode
    outs = []
    for overlap in (True, False):
        dec = eng.batch_decoder()
        dec.overlap = overlap
        reqs = [Request(p, 8 + 5 * i, id=i, arrival_step=3 * i) for i, p in enumerate(PROMPTS)]
        outs.append([r.output_ids for r in dec.generate_many(reqs)])
        assert (dec.stats.overlapped_steps > 0) == overlap and dec.streak is None
    assert outs[0] == outs[1]


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_ar_fills_a_cache_of_its_tokens_and_three_slots(model):
    """AR reserves three slots past a request's tokens (``EngineSpec.cache_room``): in a cache that
    tight the bucket graphs, the overlapped steps (one still in flight as a request ends), the mixed
    buckets of arriving prompts and the one-request graph step stay inside each request's slots,
    and every output equals one-request AR in a roomy cache."""
    new = 24
    ctx = max(len(p) for p in PROMPTS) + new + 3
    base = f"engine:model={model},dtype=float32,device=cuda"
    ar = load_engine(EngineSpec.parse(base + ",mode=ar,graphs=0,ctx=512"))
    want = [ar.generate(p, new).output_ids for p in PROMPTS]
    spec = EngineSpec.parse(f"{base},mode=ar,ctx={ctx},batch=3")
    assert spec.cache_room() == 3
    eng = load_engine(spec)
    dec = eng.batch_decoder()
    got = [r.output_ids for r in dec.generate_many([Request(p, new, id=i, arrival_step=2 * i)
                                                     for i, p in enumerate(PROMPTS)])]
    assert got == want and dec.stats.overlapped_steps > 0
    if model == "tiny":
        assert dec.stats.mixed_steps > 0
    one = load_engine(EngineSpec.parse(f"{base},mode=ar,ctx={ctx}"))
    assert [one.generate(p, new).output_ids for p in PROMPTS] == want


def test_batched_graph_step_equals_eager_step_bf16():
    """One bucket's graph replay gives the eager batched step's argmax (bf16, Llama-like shapes)."""
    from specpilot.engine.batch.graphs import BatchGraphRunner
    from specpilot.engine.batch.probe import chain_rows
    from specpilot.engine.batch.step import assemble

    m, cache, gen = _bf16_tiny_with_cache(1)
    blocks = chain_rows(3, 5, 40, m.spec.vocab_size, gen)
    inp, _, need = assemble(blocks, cache.max_seq, m.device, pad=(4, 8))
    eager = m.greedy_batch(inp, cache, cache.max_seq)
    graph = BatchGraphRunner(m, cache).run(inp, 4, 8)
    rows = [i for n in need for i in n]
    assert graph[rows].tolist() == eager[rows].tolist()


def test_mixed_bucket_replay_equals_eager_step_bf16():
    """A mixed bucket (4 requests x 1 row, then 32 prompt rows) replayed for two different prompt
    chunks, in different slots, gives the eager step's argmax on the same layout (bf16): the
    segment table is refreshed at each replay."""
    from specpilot.engine.batch.graphs import BatchGraphRunner
    from specpilot.engine.batch.probe import chain_rows
    from specpilot.engine.batch.step import assemble, prefill_rows

    m, cache, gen = _bf16_tiny_with_cache(2)
    runner = BatchGraphRunner(m, cache)
    runner.prepare_mixed([(4, 1, 32)])
    prompt = torch.randint(0, m.spec.vocab_size, (40,), generator=gen).tolist()
    for slot, (a, b) in ((3, (0, 20)), (2, (8, 37))):
        blocks = [blk for blk in chain_rows(4, 1, 60, m.spec.vocab_size, gen) if blk.slot != slot]
        chunk = prefill_rows(slot, prompt, a, b, True)
        inp, _, need = assemble(blocks, cache.max_seq, torch.device("cpu"), pad=(4, 1), prompt=(chunk, 32))
        graph = runner.run_mixed(inp, 4, 1, 32).clone()
        dev = assemble(blocks, cache.max_seq, m.device, pad=(4, 1), prompt=(chunk, 32))[0]
        eager = m.greedy_batch(dev, cache, cache.max_seq)
        rows = [i for n in need for i in n]
        assert graph[rows].tolist() == eager[rows].tolist()


def _bf16_tiny_with_cache(seed: int):
    """A bf16 tiny model on CUDA, a 4-slot batch cache of random K/V, and the generator that made
    them (the tests draw their rows from it next)."""
    from specpilot.engine.batch.cache import BatchCache

    m = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar,dtype=bfloat16,device=cuda,ctx=256")).model
    cache = BatchCache(m, 4)
    gen = torch.Generator().manual_seed(seed)
    for lc in cache.layers:
        lc.k.copy_(torch.randn(lc.k.shape, generator=gen).to(lc.k.dtype))
        lc.v.copy_(torch.randn(lc.v.shape, generator=gen).to(lc.v.dtype))
    return m, cache, gen


def test_hybrid_verify_buckets_share_what_their_commits_read():
    """A hybrid's verify buckets write what their commits read (each GDN layer's projection and
    conv rows) into buffers every bucket shares, sized for the most rows: against runners whose
    buckets keep their own rows, the same captures hold less memory by the smaller buckets' rows
    (whatever else each capture holds, about 33 MB each here, is in both), and a replay's stashes
    are views of the shared buffers."""
    from specpilot.engine.batch.cache import BatchCache
    from specpilot.engine.batch.graphs import BatchGraphRunner

    m = load_engine(EngineSpec.parse("engine:model=tiny-hybrid,mode=ar,dtype=float32,device=cuda,ctx=256")).model
    cache = BatchCache(m, 8)
    shapes = [(B, N) for B in (1, 2, 4, 8) for N in (2, 4, 8, 16)]

    def held(own: bool) -> tuple[int, BatchGraphRunner]:
        runner = BatchGraphRunner(m, cache)
        if own:
            runner._keep = lambda T: [None] * len(m.gdn_layers())
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        runner.prepare(shapes)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, runner

    held(False)   # what the first captures allocate once (kernel workspaces)
    own, _ = held(True)
    shared, runner = held(False)
    assert [kp[0].shape[0] for kp in runner.keeps] == [128] * len(m.gdn_layers())
    per_row = sum(t.shape[1] * t.element_size() for kp in runner.keeps for t in kp)
    smaller = sum(B * N for B, N in shapes) - 128
    assert own - shared > 0.8 * per_row * smaller, (own, shared, per_row * smaller)
    runner.replay(2, 4)
    gdn = [lc for lc in cache.layers if lc.state is not None]
    assert all(lc.walked[0].data_ptr() == kp[0].data_ptr() and lc.walked[1].data_ptr() == kp[1].data_ptr()
               for lc, kp in zip(gdn, runner.keeps))
