"""CUDA: the self and model drafters' rollouts as one captured graph (engine/draft_graph.py)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT = list(b"draft graphs: the rollout in one replay, draft graphs")


def _engine(extra: str, graphs: int = 1):
    from specpilot.engine.api import load_engine

    return load_engine(f"engine:model=tiny,dtype=float32,device=cuda,ctx=512,graphs={graphs},{extra}")


def _state(model):
    caches = [t.clone() for blk in model.layers for t in (getattr(blk.mixer, "k_cache", None),
                                                          getattr(blk.mixer, "v_cache", None)) if t is not None]
    return caches, [t.clone() for g in model.gdn_layers() for t in (g.state, g.conv_state)]


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_graph_rollout_proposes_the_eager_lattice_and_restores_states(model):
    """After a prefill, the captured rollout's top-k equal the eager rollout's (logprobs to fp32
    rounding); GDN states come back as they were, and no committed K/V slot is written."""
    from specpilot.engine.api import load_engine

    spec = f"engine:model={model},dtype=float32,device=cuda,ctx=512,mode=tree,drafter=self,draft_layers=2"
    e = load_engine(spec + ",graphs=1")
    d = e.decoder
    assert d.drafter.graphs is not None
    n = len(PROMPT)
    pending = d.prefill(PROMPT)
    ctx = PROMPT + [pending]
    caches, states = _state(e.model)
    got = d.drafter.propose(ctx, n, 6, 4)
    caches2, states2 = _state(e.model)
    for a, b in zip(states, states2):
        assert torch.equal(a, b)
    for a, b in zip(caches, caches2):
        assert torch.equal(a[:, :, :n], b[:, :, :n])
    graphs, d.drafter.graphs = d.drafter.graphs, None
    want = d.drafter.propose(ctx, n, 6, 4)
    assert got.tokens == want.tokens
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4)
    assert (6, 4) in graphs.graphs   # captured by the call (the load-time warm-up captured the spec's own)


@pytest.mark.parametrize("extra", ["mode=tree,drafter=self,draft_layers=2",
                                   "mode=chain,drafter=model,draft_model=tiny",
                                   "mode=tlv,drafter=self,draft_layers=2,nodes=12,depth=4,topk=3"])
def test_decoding_with_graph_drafts_equals_ar(extra):
    ar = _engine("mode=ar").generate(PROMPT, 40).output_ids
    e = _engine(extra)
    assert e.decoder.drafter.graphs is not None
    assert e.generate(PROMPT, 40).output_ids == ar
    assert e.decoder.drafter.graphs.graphs   # the rollout replayed from its graph


def test_no_draft_graphs_without_step_graphs():
    assert _engine("mode=tree,drafter=self,draft_layers=2", graphs=0).decoder.drafter.graphs is None
