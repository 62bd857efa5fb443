"""Tree masks/positions/commit against plain sequential AR; lossless chain/tree decoding; lattices."""

import pytest
import torch

from specpilot.engine import graphs as engine_graphs
from specpilot.engine.api import EngineSpec, load_engine
from specpilot.engine.step_input import StepInput
from specpilot.errors import InputError
from specpilot.kernels import tree as T
from specpilot.kernels.gdn.path import row_paths
from eager_runner import EagerRunner, check_commit_graph, eager_capture, model_state

CTX = 256


def _prefill(m, ids):
    m.reset()
    pos = torch.arange(len(ids))
    mask = torch.arange(CTX)[None, :] <= pos[:, None]
    return m(StepInput(torch.tensor(ids), pos, pos, mask, "seq"))


def _verify(m, n, pending, tree, mode):
    Tn = 1 + len(tree)
    slots = n + torch.arange(Tn)
    pos = torch.tensor([n] + [n + 1 + d for d in tree.depth])
    anc = torch.zeros(Tn, Tn, dtype=torch.bool)
    anc[:, 0] = True
    anc[1:, 1:] = torch.from_numpy(T.ancestor_mask(tree))
    mask = torch.zeros(Tn, CTX, dtype=torch.bool)
    mask[:, :n] = True
    mask[:, n:n + Tn] = anc
    paths = row_paths([-1] + [p + 1 for p in tree.parents])
    return m(StepInput(torch.tensor([pending] + list(tree.tokens)), pos, slots, mask, mode, paths))


TREE = T.DraftTree((5, 9, 7, 11, 3, 9), (-1, 0, 0, -1, 3, 4), (0, 1, 1, 0, 1, 2), (0, 0, 1, 1, 0, 0), (0.0,) * 6)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_tree_rows_equal_sequential_ar_and_commit(model):
    e = load_engine(f"engine:model={model},ctx={CTX}")
    m = e.model
    prompt = list(b"the tree test ")
    pending = 42
    _prefill(m, prompt)
    got = _verify(m, len(prompt), pending, TREE, "tree")
    # every row must equal plain AR over prompt + pending + its root path
    for r in range(len(TREE) + 1):
        path = [] if r == 0 else [TREE.tokens[i] for i in TREE.path(r - 1)]
        ref = _prefill(m, prompt + [pending] + path)[-1]
        assert torch.allclose(got[r], ref, atol=1e-4, rtol=1e-4), r
    # commit a path, then the next step must equal AR on the committed sequence
    _prefill(m, prompt)
    _verify(m, len(prompt), pending, TREE, "tree")
    accepted = [0, 1 + 3, 1 + 4]  # root, node 3, node 4 (path 11 -> 3)
    m.commit(len(prompt), accepted, "tree")
    seq = prompt + [pending, 11, 3]
    n = len(seq)
    nxt = 77
    mask = torch.arange(CTX)[None, :] <= n
    step = m(StepInput(torch.tensor([nxt]), torch.tensor([n]), torch.tensor([n]), mask, "seq"))[-1]
    ref = _prefill(m, seq + [nxt])[-1]
    assert torch.allclose(step, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_modes_and_drafters_are_lossless(model):
    prompt = list(b"abcabcabc hello hello abc")
    ref = load_engine(f"engine:model={model},mode=ar,ctx={CTX}").generate(prompt, 24)
    assert ref.tau == 1.0 and ref.steps == 23
    variants = ["mode=chain,drafter=ngram", "mode=tree,drafter=ngram,nodes=12",
                "mode=tree,drafter=self,draft_layers=2,depth=3,topk=2,nodes=6",
                "mode=tree,drafter=model,draft_model=tiny,depth=3,topk=2,nodes=6"]
    for v in variants:
        r = load_engine(f"engine:model={model},{v},ctx={CTX}").generate(prompt, 24)
        assert r.output_ids == ref.output_ids, v
        assert r.tau >= 1.0 and r.steps <= ref.steps


def test_ngram_tree_accepts_more_than_one_token_per_pass_on_repetitive_text():
    prompt = list(b"abcabcabc hello hello abc")
    r = load_engine(f"engine:model=tiny,mode=tree,ctx={CTX}").generate(prompt, 40)
    assert r.tau > 1.5
    assert r.steps == len(r.accept_lengths)
    assert abs(r.tau - (len(r.output_ids) - 1) / r.steps) < 1e-12
    assert sum(r.accept_lengths) + r.steps >= len(r.output_ids) - 1


def test_lattice_targets_replay_to_the_engine_acceptance():
    e = load_engine(f"engine:model=tiny,mode=tree,nodes=10,depth=4,topk=3,ctx={CTX}")
    r = e.generate(list(b"xyzxyzxyz xy"), 30, record_lattice=True, request="p0")
    assert len(r.lattice_steps) == r.steps
    for row, acc in zip(r.lattice_steps, r.accept_lengths):
        assert row["schema"] == "specpilot.lattice/1" and row["request"] == "p0"
        m = len(row["tokens"])
        assert len(row["target"]) >= m + 1
        tree = T.build_best_first(row["tokens"], row["logprobs"], row["transitions"], 10)
        path, _ = T.accept_greedy(tree, row["target"])
        assert len(path) == acc


def test_engine_spec_parse_and_errors():
    s = EngineSpec.parse("engine:model=smollm2,mode=tree,nodes=32,drafter=ngram,dtype=float32,device=cpu")
    assert (s.model, s.mode, s.nodes, s.drafter, s.dtype) == ("smollm2", "tree", 32, "ngram", "float32")
    assert EngineSpec.parse(str(s)) == s
    for bad in ("engine:mode=beam", "engine:nodes=x", "engine:foo=1", "engine:nodes", "engine:device=tpu",
                "engine:nodes=-1"):
        with pytest.raises(InputError):
            EngineSpec.parse(bad)


def test_capacity_and_token_range_errors():
    e = load_engine("engine:model=tiny,mode=tree,ctx=64")
    with pytest.raises(InputError, match="cache slots"):
        e.generate([1] * 40, 30)
    with pytest.raises(InputError, match="vocabulary"):
        e.generate([1, 999], 4)
    with pytest.raises(InputError):
        e.generate([], 4)
    for ids, n in (("abc", 4), ([97, 98.0], 4), ([97, True], 4), ([97, 98], 4.5), ([97, 98], True)):
        with pytest.raises(InputError, match="must be"):   # a library caller's slip, named, not a TypeError
            e.generate(ids, n)
    import numpy as np

    assert e.generate(np.array([97, 98]), np.int64(3)).output_ids == e.generate([97, 98], 3).output_ids


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_chunked_prefill_equals_one_shot(model):
    prompt = list(b"a prompt longer than one chunk, with state")
    e = load_engine(f"engine:model={model},mode=tree,ctx={CTX}")
    ref = e.generate(prompt, 12).output_ids
    e.decoder.prefill_chunk = 5
    assert e.generate(prompt, 12).output_ids == ref


@pytest.mark.parametrize("model,variant", [("tiny", "mode=chain,depth=5"), ("tiny", "mode=tree,nodes=12,depth=4,topk=3"),
                                           ("tiny-hybrid", "mode=chain,depth=5"),
                                           ("tiny-hybrid", "mode=tree,nodes=12,depth=4,topk=3")])
def test_padded_graph_verify_steps_equal_ar(model, variant):
    """Verify steps padded to the runner's row buckets (padding rows attend slot 0, write KV past the
    tree, and are dropped; hybrids' GDN rows walk the root paths the runner is given, padding rows
    only themselves) give AR's tokens; every step used a bucket."""
    prompt = list(b"abcabcabc hello hello abc")
    ref = load_engine(f"engine:model={model},mode=ar,ctx={CTX}").generate(prompt, 24)
    e = load_engine(f"engine:model={model},{variant},ctx={CTX}")
    runner = e.decoder.runner = EagerRunner(e.model)
    got = e.generate(prompt, 24)
    assert got.output_ids == ref.output_ids
    assert set(runner.calls) <= set(e.decoder.verify_buckets) | {1} and max(runner.calls) > 1
    rows = 1 + (12 if "tree" in variant else 5)
    assert e.decoder.verify_buckets == sorted({b for b in (2, 4, 8) if b < rows} | {rows})


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
@pytest.mark.parametrize("extra", ["mode=tree,drafter=self,draft_layers=2,depth=3,topk=2,nodes=6",
                                   "mode=tree,drafter=model,draft_model=tiny-hybrid,depth=3,topk=2,nodes=6",
                                   "mode=tlv,drafter=model,draft_model=tiny-hybrid,depth=3,topk=2,nodes=6"])
def test_drafters_hand_the_last_context_token_to_the_captured_rollout(model, extra, monkeypatch):
    """With a rollout graph (its capture stood in by eager replays) a drafter feeds the context but
    its last token into its cache and starts the rollout from that token at its slot: the drafts,
    the steps and the outputs are the eager drafter's (a GDN draft model's state included)."""
    from specpilot.engine.draft_graph import RolloutGraphs

    monkeypatch.setattr(engine_graphs, "capture", eager_capture)
    prompt = list(b"abcabcabc hello hello abc")
    eager = load_engine(f"engine:model={model},{extra},ctx={CTX}")
    ref = eager.generate(prompt, 20, record_lattice=True)
    e = load_engine(f"engine:model={model},{extra},ctx={CTX}")
    dr = e.decoder.drafter
    dr.graphs = RolloutGraphs(getattr(dr, "target", None) or dr.draft, getattr(dr, "layers", None))
    got = e.generate(prompt, 20, record_lattice=True)
    assert dr.graphs.graphs and got.output_ids == ref.output_ids and got.steps == ref.steps
    assert len(got.lattice_steps) == len(ref.lattice_steps)
    for a, b in zip(got.lattice_steps, ref.lattice_steps):
        assert a["tokens"] == b["tokens"]


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_rollout_graph_code_proposes_the_eager_lattice_on_the_cpu(model, monkeypatch):
    """engine/draft_graph.RolloutGraphs with CUDA graph capture stood in by eager replays: after a
    prefill its rollout gives the eager drafter's top-k, the capture leaves the committed K/V and
    the GDN states as they were, and so does every rollout."""
    from specpilot.engine.draft_graph import RolloutGraphs

    monkeypatch.setattr(engine_graphs, "capture", eager_capture)
    e = load_engine(f"engine:model={model},mode=tree,drafter=self,draft_layers=2,ctx={CTX}")
    d, m = e.decoder, e.model
    prompt = list(b"abcabcabc hello hello abc")
    n = len(prompt)
    ctx = prompt + [d.prefill(prompt)]

    def snapshot():
        kv = [t[:, :, :n].clone() for blk in m.layers for t in (getattr(blk.mixer, "k_cache", None),
                                                                 getattr(blk.mixer, "v_cache", None)) if t is not None]
        return kv + [t.clone() for g in m.gdn_layers() for t in (g.state, g.conv_state)]

    before = snapshot()
    d.drafter.graphs = RolloutGraphs(m, 2)
    got = d.drafter.propose(ctx, n, 4, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    d.drafter.graphs = None
    want = d.drafter.propose(ctx, n, 4, 3)
    assert got.tokens == want.tokens
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)


COMMIT_TREE = T.DraftTree((5, 9, 7), (-1, -1, 1), (0, 0, 1), (0, 1, 0), (0.0,) * 3)


def test_commit_graph_moves_the_accepted_kv_as_the_eager_commit(monkeypatch):
    """GraphRunner.commit on a dense model (capture stood in by eager replays): accepting the
    second root child and its child moves their K/V as Transformer.commit does; one graph per
    accepted length, captured once."""
    e = load_engine(f"engine:model=tiny,mode=tree,drafter=self,draft_layers=2,ctx={CTX}")
    runner = check_commit_graph(e, list(b"abcabcabc hello"), COMMIT_TREE, [0, 2, 3], monkeypatch)
    assert set(runner.commits) == {(0, 3, True)}
    assert runner.commit(20, [0, 1, 2], "tree")    # nothing moved, no GDN layer: nothing to replay
    assert set(runner.commits) == {(0, 3, True)}


def test_commit_graphs_fall_back_where_no_graph_serves(monkeypatch):
    """A hybrid whose GDN layers run the torch recurrence leaves commit data no graph replays
    (the commit is eager), as does a commit that follows no replay of the runner."""
    e = load_engine(f"engine:model=tiny-hybrid,mode=tree,drafter=self,draft_layers=2,ctx={CTX}")
    m, d = e.model, e.decoder
    monkeypatch.setattr(engine_graphs, "capture", eager_capture)
    runner = engine_graphs.GraphRunner(m, warmup=0)
    prompt = list(b"abcabcabc hello")
    runner.run(*d.padded_rows(d.prefill(prompt), COMMIT_TREE, len(prompt), 4))
    assert not runner.commit(len(prompt), [0, 2, 3], "tree") and not runner.commits
    assert not runner.commit(len(prompt), [0, 1], "tree")   # no replay since the last commit
    assert runner.capture_commits([2, 4], 3, True) == 0


def test_capture_commits_captures_each_accepted_length_once_and_leaves_the_caches(monkeypatch):
    """The load-time capture: per bucket, every accepted length up to the most rows (dense: only
    moved ones, keyed without the bucket); warm-up and capture leave the K/V as they were."""
    monkeypatch.setattr(engine_graphs, "capture", eager_capture)
    e = load_engine(f"engine:model=tiny,mode=tree,drafter=self,draft_layers=2,ctx={CTX}")
    m = e.model
    e.decoder.prefill(list(b"abcabcabc hello"))
    before = model_state(m)
    runner = engine_graphs.GraphRunner(m, warmup=1)
    assert runner.capture_commits([2, 4, 8], 4, True) == 3
    assert set(runner.commits) == {(0, 2, True), (0, 3, True), (0, 4, True)}
    assert runner.capture_commits([2, 4, 8], 4, False) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model_state(m)))
