"""Continuous batching (``specpilot.engine.batch``): lossless against one-request greedy decoding,
and the batching rules doing what they say.

Every batched configuration decodes prompts arriving at different steps (so requests join and
leave mid-run, slots move) and each request's output must equal the one-request AR decoder's
output token for token (CPU fp32; tiny and tiny-hybrid, every mode, drafter, budget, block rule
and admission rule).
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.engine.batch import rules
from specpilot.engine.batch.requests import Request
from specpilot.engine.drafters import Lattice
from specpilot.engine.spec import EngineSpec
from specpilot.errors import InputError
from specpilot.kernels.tree import build_best_first, build_best_first_shared

MAX_NEW = 20


def _prompts(n=6, seed=3):
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rnd.randrange(256) for _ in range(rnd.randrange(3, 7))]
        out.append((base * 6)[:rnd.randrange(4, 26)])
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def reference():
    refs = {}
    for model in ("tiny", "tiny-hybrid"):
        eng = load_engine(EngineSpec.parse(f"engine:model={model},mode=ar"))
        refs[model] = [eng.generate(p, MAX_NEW).output_ids for p in PROMPTS]
    return refs


def _batched(model, extra, arrivals=(0, 0, 2, 3, 7, 12), runner=None, **kw):
    eng = load_engine(EngineSpec.parse(f"engine:model={model},batch=3,nodes=6,depth=4,topk=3,{extra}"))
    dec = eng.batch_decoder()
    if runner is not None:
        dec.runner = runner(dec)
    reqs = [Request(p, MAX_NEW, id=i, arrival_step=a, **kw) for i, (p, a) in enumerate(zip(PROMPTS, arrivals))]
    return dec, dec.generate_many(reqs), reqs


CONFIGS = [
    ("tiny", "mode=ar"),
    ("tiny", "mode=chain"),
    ("tiny", "mode=tree"),
    ("tiny", "mode=tree,budget=equal,block=fixed"),
    ("tiny", "mode=tree,admit=off"),
    ("tiny", "mode=tree,admit=all,admit_rows=8"),
    ("tiny", "mode=tree,drafter=self,draft_layers=2"),
    ("tiny", "mode=chain,drafter=model,draft_model=tiny"),
    ("tiny-hybrid", "mode=ar"),
    ("tiny-hybrid", "mode=chain,drafter=self,draft_layers=2"),
    ("tiny-hybrid", "mode=tree,drafter=self,draft_layers=2"),
    ("tiny-hybrid", "mode=tree,budget=equal,admit=off"),
]


@pytest.mark.parametrize("model,extra", CONFIGS)
def test_batched_outputs_equal_one_request_greedy(reference, model, extra):
    dec, res, _ = _batched(model, extra)
    assert [r.output_ids for r in res] == reference[model]
    assert dec.idle() and not dec.running
    if "mode=ar" not in extra:
        assert dec.stats.verify_steps > 0
    if "drafter=self" in extra:     # real multi-token accepts happened (KV moves, GDN commits)
        assert dec.stats.accepted > 0


def test_hybrid_verify_rows_of_all_requests_walk_in_one_launch(reference, monkeypatch):
    """tiny-hybrid through the GDN row kernels (Triton's interpreter): a verify step's chain/tree
    rows of every request go through one conv and one path-walk launch per GDN layer, and the
    outputs still equal one-request greedy decoding; the walk's outputs and stashes equal the
    per-request launches' bit for bit."""
    from specpilot.engine.gated_deltanet import GatedDeltaNet

    walks, compared = [], []
    real_walk, real_mix = GatedDeltaNet._walk, GatedDeltaNet.mix

    def walk(self, proj, table, segments, cache):
        out = real_walk(self, proj, table, segments, cache)
        segs = [segments[i] for i in table.segments]
        walks.append(len(segs))
        if not compared:    # the same segments, one request at a time (the fallback's launches)
            from specpilot.engine.step_input import StepInput

            own = self.state, self.conv_state
            try:
                for sg, got in zip(segs, out):
                    self.state, self.conv_state = cache.state[sg.slot], cache.conv[sg.slot]
                    r = slice(sg.start, sg.start + sg.rows)
                    z = torch.zeros(sg.rows, dtype=torch.long)
                    one = real_mix(self, proj[r], StepInput(z, z, z, torch.ones(sg.rows, 1, dtype=torch.bool),
                                                            sg.gdn_rows, sg.paths))
                    kind, mixed, (conv, ab) = self._stash
                    k2, m2, (c2, a2) = cache.stash[sg.slot]
                    assert torch.equal(one, got) and kind == k2 == "rows"
                    assert torch.equal(mixed, m2) and torch.equal(conv, c2) and torch.equal(ab, a2)
                    self._stash = None
                    compared.append(sg.slot)
            finally:
                self.state, self.conv_state = own
        return out

    monkeypatch.setattr(GatedDeltaNet, "_walk", walk)
    eng = load_engine(EngineSpec.parse("engine:model=tiny-hybrid,batch=2,nodes=3,depth=4,topk=3,mode=tree,"
                                       "drafter=self,draft_layers=1"))
    for layer in eng.model.gdn_layers():
        layer.impl = "triton"
        layer.verify = "path"
    dec = eng.batch_decoder()
    # the interpreter is slow: two short prompts, 3-node trees, 6 tokens (a prefix of the reference):
    # two steps walking both requests' rows, the second from the states the first committed (the
    # trees near the limit are cut to what the requests can take)
    n, pick = 6, (2, 3)
    reqs = [Request(PROMPTS[i], n, id=i) for i in pick]
    assert [r.output_ids for r in dec.generate_many(reqs)] == [reference["tiny-hybrid"][i][:n] for i in pick]
    assert walks and max(walks) >= 2 and compared and dec.stats.accepted > 0
    assert walks.count(2) >= 2 * len(eng.model.gdn_layers())   # two steps walked both requests


# trees of 3 nodes (buckets of 4 rows): two steps of both requests' branching trees, the second from
# the states the first committed
@pytest.mark.parametrize("extra,n,verify", [("mode=tree,nodes=3,depth=4,topk=3,drafter=self,draft_layers=1", 6, "wy"),
                                            ("mode=chain,nodes=6,depth=4,topk=3", 8, "path")])
def test_hybrid_verify_buckets_walk_every_row(reference, extra, n, verify, monkeypatch):
    """tiny-hybrid on the GDN row kernels (Triton's interpreter) through the bucket runner: verify
    buckets of more than one row per request walk every row's GDN path from the static path table
    (a one-row request's row too, committed afterwards like the others) with the path kernel or
    TreeWY over every request at once, and the outputs equal one-request greedy decoding; both
    requests' GDN states commit in one launch per layer, from the projection and conv rows the
    bucket wrote into the buffers every bucket shares."""
    from specpilot.kernels.gdn import wy

    from specpilot.engine.batch.graphs import BatchGraphRunner

    eng = load_engine(EngineSpec.parse(f"engine:model=tiny-hybrid,batch=2,{extra}"))
    for layer in eng.model.gdn_layers():
        layer.impl = "triton"
        layer.verify = verify
    dec = eng.batch_decoder()
    dec.runner = BatchGraphRunner(dec.model, dec.cache)
    dec.runner.prepare([(1, 2)])   # a walking bucket the steps do not use: its kept rows are the step's
    walked, branched, run = [], [], dec._run

    def spy(blocks, pblocks):
        out = run(blocks, pblocks)
        if not pblocks and max(len(b) for b in blocks) > 1:
            walked.append(sorted(len(b) for b in blocks))
            branched.append(all(len(set(b.pos)) < len(b) for b in blocks))   # rows at the same depth
        return out

    dec._run = spy
    from specpilot.engine.gated_deltanet import GatedDeltaNet

    together, one_launch, kept = [], GatedDeltaNet.commit_walked, []

    def commit_walked(self, cache, plan):
        kproj, kconv = dec.runner.keeps[eng.model.gdn_layers().index(self)]
        mixed, conv, ab, _ = cache.walked
        kept.append(mixed.data_ptr() == kproj.data_ptr() and conv.data_ptr() == kconv.data_ptr()
                    and ab.untyped_storage().data_ptr() == kproj.data_ptr())
        left = one_launch(self, cache, plan)
        together.append(len(plan.slots) - len(left))
        return left

    monkeypatch.setattr(GatedDeltaNet, "commit_walked", commit_walked)
    launches, segments_wy = [], wy.wy_verify_segments

    def spy_wy(*a, **kw):
        launches.append(a[7].shape[0])
        return segments_wy(*a, **kw)

    monkeypatch.setattr(wy, "wy_verify_segments", spy_wy)
    pick = (2, 3)
    reqs = [Request(PROMPTS[i], n, id=i) for i in pick]
    assert [r.output_ids for r in dec.generate_many(reqs)] == [reference["tiny-hybrid"][i][:n] for i in pick]
    assert walked and any(N > 1 for _, N in dec.runner.graphs) and dec.stats.eager_steps == 0
    assert max(together) == 2   # both requests' GDN commits in one launch per layer
    assert kept and all(kept)
    walking = [B * N for B, N in dec.runner.graphs if N > 1]   # (1, 2), then the steps' larger bucket
    assert len(walking) == 2 and all(kp[0].shape[0] == max(walking) for kp in dec.runner.keeps)
    assert (max(launches, default=0) == 2) == (verify == "wy")   # TreeWY over both requests at once
    if "drafter=self" in extra:
        assert dec.stats.accepted > 0 and branched[:2] == [True, True]
    else:   # the n-gram drafter finds nothing for some steps: one-row requests in walking buckets
        assert any(sizes[0] == 1 for sizes in walked)


@pytest.mark.parametrize("extra", ["mode=tree,drafter=self,draft_layers=2", "mode=chain,admit=off"])
def test_graph_bucket_layout_is_lossless(reference, extra):
    """The bucket runner's padded (requests, rows) layout over the whole static cache (on the CPU
    its steps run eagerly on the same buffers) gives the one-request outputs."""
    from specpilot.engine.batch.graphs import BatchGraphRunner

    dec, res, _ = _batched("tiny", extra, runner=lambda d: BatchGraphRunner(d.model, d.cache))
    assert [r.output_ids for r in res] == reference["tiny"]
    shapes = set(dec.runner.graphs)
    assert shapes and all(B in (1, 2, 3) and N >= 1 for B, N in shapes)
    assert any(N > 1 for _, N in shapes)


def test_cancel_frees_slot_and_others_stay_lossless(reference):
    eng = load_engine(EngineSpec.parse("engine:model=tiny,mode=tree,batch=2,nodes=6,depth=4,topk=3,drafter=self,"
                                       "draft_layers=2"))
    dec = eng.batch_decoder()
    reqs = [Request(p, MAX_NEW, id=i) for i, p in enumerate(PROMPTS[:4])]
    for r in reqs:
        dec.submit(r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dec.step()
        dec.step()
        victim = reqs[0]
        assert victim.slot == 0 and len(dec.running) == 2
        dec.cancel(victim)
        while not dec.idle():
            dec.step()
    finally:
        torch.set_num_threads(threads)
    assert victim.finish == {"type": "abort", "message": "cancelled"}
    assert [r.output for r in reqs[1:]] == reference["tiny"][1:4]


def test_stop_conditions():
    r = Request([1], 10, stop_ids=frozenset({7}), eos_ids=frozenset({7}))
    assert r.offer([5, 7, 9], 0.0) == [5, 7] and r.finish == {"type": "stop", "matched": 7}
    assert r.stop_reason == "eos"
    r = Request([1], 10, stop_strings=("ab",), decode=lambda ids: "".join(chr(97 + i) for i in ids))
    assert r.offer([2, 0, 1, 3], 0.0) == [2, 0, 1] and r.finish == {"type": "stop", "matched": "ab"}
    assert r.stop_reason == "stop"
    r = Request([1], 3)
    assert r.offer([4, 4, 4, 4], 0.0) == [4, 4, 4] and r.finish == {"type": "length", "length": 3}
    # two stop strings in one token's text: the earliest is matched whatever the list's order
    # (" Paris" with stop ["is", "Par"] was cut at "is", sending "Par")
    words = {0: " Paris"}
    for stops in (("is", "Par"), ("Par", "is")):
        r = Request([1], 10, stop_strings=stops, decode=lambda ids: "".join(words[i] for i in ids))
        r.offer([0], 0.0)
        assert r.finish == {"type": "stop", "matched": "Par"}, stops


def test_stop_token_ids_and_ignore_eos_in_the_decoder(reference):
    want = reference["tiny"][0]
    stop = want[5]
    first = want.index(stop)
    eng = load_engine(EngineSpec.parse("engine:model=tiny,mode=tree,batch=2,nodes=6,depth=4,topk=3"))
    dec = eng.batch_decoder()
    a = Request(PROMPTS[0], MAX_NEW, stop_ids=frozenset({stop}), eos_ids=frozenset({stop}))
    b = Request(PROMPTS[0], MAX_NEW)   # ignore_eos: the server leaves EOS out of stop_ids
    dec.generate_many([a, b])
    assert a.output == want[:first + 1] and a.stop_reason == "eos"
    assert b.output == want and b.stop_reason == "length"


@pytest.mark.parametrize("spec, batched, n, max_new", [
    # equal trees and fixed blocks: a batched run drafts exactly what one-request runs draft
    ("engine:model=tiny,mode=tree,nodes=6,depth=4,topk=3", ",batch=3,budget=equal,block=fixed", 4, 12),
    # an AR step records a row of no draft (replay's tau 1 needs every step)
    ("engine:model=tiny,mode=ar", ",batch=2", 3, 6),
])
def test_batched_lattice_rows_equal_one_request_rows(spec, batched, n, max_new):
    one = load_engine(EngineSpec.parse(spec))
    rows = []
    for i, p in enumerate(PROMPTS[:n]):
        rows += one.generate(p, max_new, record_lattice=True, request=i).lattice_steps
    eng = load_engine(EngineSpec.parse(spec + batched))
    reqs = [Request(p, max_new, id=i, record_lattice=True, arrival_step=i) for i, p in enumerate(PROMPTS[:n])]
    res = eng.batch_decoder().generate_many(reqs)
    got = [x for r in res for x in r.lattice_steps]
    steps = [x.pop("batch_step") for x in got]   # the batch decoder's step, which one-request rows lack
    assert got == rows and rows
    assert all(isinstance(s, int) and s >= 0 for s in steps) and len(set(steps)) > 1
    if "mode=ar" in spec:
        assert len(rows) == n * (max_new - 1) and all(x["tokens"] == [] for x in rows)


@pytest.mark.parametrize("extra", ["mode=tree,drafter=self,draft_layers=2", "mode=tree,budget=equal,block=fixed",
                                   "mode=chain", "mode=tree,admit=off", "mode=chain,admit=all,admit_rows=8"])
def test_batched_row_counts_add_up_per_request(extra, monkeypatch):
    """rows = prompt rows + verify rows, and verify rows = request steps + proposed, each request's
    verify rows in a step being its root row and its own draft nodes (batched steps once credited
    every request with the step's last request's nodes: proposed 444 against 401 rows)."""
    from specpilot.engine.batch import scheduler

    built = []   # the verify blocks of the step running now, in request order
    real = scheduler.verify_rows
    monkeypatch.setattr(scheduler, "verify_rows", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    eng = load_engine(EngineSpec.parse(f"engine:model=tiny,batch=4,nodes=6,depth=4,topk=3,{extra}"))
    dec = eng.batch_decoder()
    step = dec._verify_step
    seen = []

    def checked(decoding, prefilling):
        built.clear()
        before = [(r.steps, r.proposed) for r in decoding]
        out = step(decoding, prefilling)
        assert len(built) == len(decoding)
        for r, blk, (steps, proposed) in zip(decoding, built, before):
            assert (r.steps - steps, r.proposed - proposed) == (1, len(blk) - 1)   # its own root and nodes
        seen.append(len(decoding))
        return out

    dec._verify_step = checked
    reqs = [Request(p, MAX_NEW, id=i, arrival_step=a) for i, (p, a) in enumerate(zip(PROMPTS, (0, 0, 0, 1, 5, 9)))]
    dec.generate_many(reqs)
    st = dec.stats
    assert max(seen) > 1 and st.proposed > 0
    assert st.prompt_rows == sum(len(p) for p in PROMPTS)
    assert st.rows == st.prompt_rows + st.verify_rows
    assert st.verify_rows == st.request_steps + st.proposed
    assert st.request_steps == sum(r.steps for r in reqs) and st.proposed == sum(r.proposed for r in reqs)
    assert (st.admitted_prompt_rows > 0) == ("admit=off" not in extra)


# ------------------------------------------------------------------------------------- rules
def test_block_sizes():
    assert rules.block_sizes(16) == [16, 12, 8]
    assert rules.block_sizes(8) == [8, 6, 4]
    assert rules.block_sizes(1) == [1]


def test_choose_blocks_from_recent_acceptance_and_confidence():
    nan = float("nan")
    recent = torch.tensor([[nan] * 4, [10.0, 12.0, nan, nan], [1.0, 0.0, 2.0, 1.0], [1.0, 0.0, 2.0, 1.0],
                           [7.0, 7.0, 7.0, 7.0]])
    conf = torch.tensor([0.0, 0.0, 0.0, 9.5, 0.0])
    got = rules.choose_blocks(recent, conf, [16, 12, 8]).tolist()
    # no record: largest; mean 11 > 0.75 * 12; mean 1: smallest; confident draft: largest; 7 > 0.75 * 8 only
    assert got == [16, 16, 8, 16, 12]


def test_draft_confidence():
    lp = torch.log(torch.tensor([[[0.5, 0.1], [0.5, 0.1], [1.0, 0.0]], [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]]))
    assert torch.allclose(rules.draft_confidence(lp), torch.tensor([0.5 + 0.25 + 0.25, 1.0]))


def test_cut_blocks_cuts_positions_past_each_block():
    lp = torch.zeros(2, 4, 2)
    tr = torch.zeros(2, 3, 2, 2)
    lp2, tr2 = rules.cut_blocks(lp, tr, torch.tensor([2, 4]))
    assert torch.isinf(lp2[0, 2:]).all() and torch.isfinite(lp2[0, :2]).all() and torch.isfinite(lp2[1]).all()
    assert torch.isinf(tr2[0, 1:]).all() and torch.isfinite(tr2[0, 0]).all() and torch.isfinite(tr2[1]).all()


def test_pack_lattices_even_ragged_and_cut_rows():
    """Each candidate at its place, -inf where there is none, rows wider than ``k`` cut, a lattice
    without transitions given its marginal scores in them; even and ragged rows alike."""
    even = Lattice([[1, 2], [3, 4]], [[-0.1, -0.2], [-0.3, -0.4]], [[[-1.0, -2.0], [-3.0, -4.0]]])
    ragged = Lattice([[5, 6, 7], [8]], [[-0.5, -0.6, -0.7], [-0.8]], [[[-5.0], [-6.0, -6.5], [-7.0]]])
    plain = Lattice([[9], [10, 11]], [[-0.9], [-1.0, -1.1]], None)
    tok, lp, tr = rules.pack_lattices([even, ragged, plain], 3, 2, "cpu")
    inf = float("-inf")
    assert tok.tolist() == [[[1, 2], [3, 4], [0, 0]], [[5, 6], [8, 0], [0, 0]], [[9, 0], [10, 11], [0, 0]]]
    assert torch.equal(lp, torch.tensor([[[-0.1, -0.2], [-0.3, -0.4], [inf, inf]],
                                         [[-0.5, -0.6], [-0.8, inf], [inf, inf]],
                                         [[-0.9, inf], [-1.0, -1.1], [inf, inf]]]))
    assert torch.equal(tr, torch.tensor([[[[-1.0, -2.0], [-3.0, -4.0]], [[inf, inf], [inf, inf]]],
                                         [[[-5.0, inf], [-6.0, -6.5]], [[inf, inf], [inf, inf]]],
                                         [[[-1.0, -1.1], [inf, inf]], [[inf, inf], [inf, inf]]]]))
    assert rules.pack_lattices([plain], 2, 2, "cpu")[2] is None


def _lattice(rnd, m, k, transitions=True):
    toks = [[rnd.randrange(50) for _ in range(rnd.randrange(1, k + 1))] for _ in range(m)]
    lps = [sorted((np.log(rnd.random()) for _ in row), reverse=True) for row in toks]
    tr = [[[float(np.log(rnd.random())) for _ in toks[i + 1]] for _ in toks[i]] for i in range(m - 1)] \
        if transitions else None
    return Lattice(toks, [[float(x) for x in r] for r in lps], tr)


def test_trees_from_packed_lattices_match_the_host_builder():
    rnd = random.Random(5)
    lats = [_lattice(rnd, rnd.randrange(1, 5), 3, transitions=b % 2 == 0) for b in range(4)]
    m = max(lt.m for lt in lats)
    tok, lp, tr = rules.pack_lattices(lats, m, 3, "cpu")
    equal = rules.build_trees(tok, lp, tr, 5, "equal")
    for b, lt in enumerate(lats):
        want = build_best_first(lt.tokens, lt.logprobs, lt.transitions, 5)
        got = equal.request(b)
        assert got.tokens == want.tokens and got.parents == want.parents
    shared = rules.build_trees(tok, lp, tr, 2, "shared")      # 8 nodes over 4 requests, at most 4 each
    want = build_best_first_shared([(lt.tokens, lt.logprobs, lt.transitions) for lt in lats], 8)
    got = [shared.request(b) for b in range(4)]
    assert sum(len(t) for t in got) == sum(len(t) for t in want) <= 8
    if all(len(t) <= rules.SHARED_CAP * 2 for t in want):
        assert [t.tokens for t in got] == [t.tokens for t in want]


@pytest.mark.parametrize("budget", ["equal", "shared"])
def test_padding_lattices_and_requests_keeps_the_trees(budget):
    """The decoder pads a step's lattices to its depth and top-k and the requests to their bucket
    (one kernel shape per bucket): the requests' trees and the shared budget stay as they were."""
    rnd = random.Random(11)
    lats = [_lattice(rnd, rnd.randrange(1, 4), 3, transitions=b != 1) for b in range(3)]
    m = max(lt.m for lt in lats)
    plain = rules.build_trees(*rules.pack_lattices(lats, m, 3, "cpu"), 3, budget)
    padded = rules.build_trees(*rules.pack_lattices(lats + [Lattice.empty()], m + 3, 5, "cpu"), 3, budget,
                               requests=3)
    assert padded.count[3] == 0
    for b in range(3):
        assert padded.request(b).tokens == plain.request(b).tokens
        assert padded.request(b).parents == plain.request(b).parents


def test_plan_admission():
    assert rules.plan_admission("off", [5, 9], 10, 128, 512) == ([0, 0], True)
    # a pass runs for the 200-row prompt and takes the other two as well: none waits, none joins
    assert rules.plan_admission("waiting", [100, 20, 200], 10, 128, 512) == ([0, 0, 0], True)
    # the pass's 512 rows go to the first prompt: the second would wait, and it fits
    assert rules.plan_admission("waiting", [600, 20], 10, 128, 512) == ([0, 20], True)
    assert rules.plan_admission("waiting", [600, 20, 100, 10], 10, 128, 512) == ([0, 20, 0, 10], True)
    assert rules.plan_admission("waiting", [100, 20], 10, 128, 512) == ([0, 0], True)
    assert rules.plan_admission("waiting", [10, 20], 10, 128, 512) == ([10, 20], False)
    assert rules.plan_admission("all", [700, 20], 500, 128, 512) == ([512, 20], False)
    assert rules.plan_admission("waiting", [10], 0, 128, 512) == ([0], True)


# ------------------------------------------------------------------------------- the CLI
def test_run_batch_equals_run_one_at_a_time(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "prompt_ids": p}) + "\n"
                               for i, p in enumerate(PROMPTS[:4])))
    outs = {}
    for b in (1, 3):
        code, out, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--nodes", "6", "--depth", "4",
                                 "--prompts", prompts, "--max-new-tokens", MAX_NEW, "--batch", b, "--format", "json")
        assert code == 0, err
        outs[b] = json.loads(out)
    assert [r["output_ids"] for r in outs[3]["results"]] == [r["output_ids"] for r in outs[1]["results"]]
    assert outs[3]["batch"]["batch"] == 3 and outs[3]["batch"]["verify_steps"] > 0 and "batch" not in outs[1]
    # each result has the same fields either way; a batched one has no step time of its own
    assert [set(r) for r in outs[3]["results"]] == [set(r) for r in outs[1]["results"]]
    assert all(r["step_timing"] is None for r in outs[3]["results"])
    assert all(r["step_timing"]["steps"] > 0 for r in outs[1]["results"])
    # the drafts the passes checked: at most 6 tree nodes per request per pass, the accepted among them
    js = outs[3]["batch"]
    assert 0 < js["proposed"] <= 6 * js["request_steps"] and js["accepted"] <= js["proposed"]


def test_run_batch_takes_no_more_slots_than_prompts(run_cli, tmp_path, monkeypatch):
    """--batch above the prompts' count: the decoder has one slot per prompt, which is what the
    memory check counts, and the report gives the batch used beside the one asked for."""
    import specpilot.machine

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "prompt_ids": p}) + "\n"
                               for i, p in enumerate(PROMPTS[:2])))
    # a tiny cache of 100000 slots is about 0.1 GB: the model's own and two fit, fifty would not
    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: 400 * 10**6)
    args = ("run", "--model", "tiny", "--ctx", "100000", "--prompts", prompts, "--max-new-tokens", "4")
    code, out, err = run_cli(*args, "--batch", "50", "--format", "json")
    assert code == 0, err
    b = json.loads(out)["batch"]
    assert b["batch"] == 2 and b["batch_asked"] == 50
    code, out, err = run_cli(*args, "--batch", "50")
    assert code == 0 and "batch 2 of --batch 50: 2 prompts)" in out and "\nbatch 2: " in out, out + err
    code, out, err = run_cli(*args, "--batch", "2", "--format", "json")   # as many slots as asked: no batch_asked
    assert code == 0 and json.loads(out)["batch"]["batch"] == 2 and "batch_asked" not in json.loads(out)["batch"]


def test_run_batch_note_gives_the_steps_and_the_rules(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "prompt_ids": p}) + "\n"
                               for i, p in enumerate(PROMPTS[:3])))
    for mode, step, rules in (("tree", "verify", "budget shared, block adaptive, admit waiting"),
                              ("ar", "decode", "; admit waiting"), ("tlv", "verify", "; admit waiting")):
        code, out, err = run_cli("run", "--model", "tiny", "--mode", mode, "--prompts", prompts, "--max-new-tokens",
                                 MAX_NEW, "--batch", "2")
        assert code == 0, err
        (line,) = [ln for ln in out.splitlines() if ln.startswith("batch 2: ")]
        assert re.search(rf"batch 2: \d+ {step} steps of [12]\.\d requests on average, \d+\.\d{{3}} ms each "
                         rf"\(wall clock\); \d+ prefill pass(es)?, \d+ prompt rows? in {step} steps", line), line
        assert line.endswith(rules) and (mode == "tree" or "budget" not in line)
    # one new token: the prompts' passes give it, no step runs
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "chain", "--prompts", prompts, "--max-new-tokens",
                             "1", "--batch", "2")
    (line,) = [ln for ln in out.splitlines() if ln.startswith("batch 2: ")]
    assert code == 0 and line.startswith("batch 2: 0 verify steps; ") and "ms each" not in line
    # in Markdown each note line is a paragraph of its own (one newline would join them)
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "ar", "--prompts", prompts, "--max-new-tokens", "2",
                             "--batch", "2", "--format", "markdown")
    assert code == 0 and re.search(r"\(before the requests\)\n\nbatch 2: ", out), out


def test_run_batch_refuses_too_long_prompt(run_cli):
    code, _, err = run_cli("run", "--model", "tiny", "--prompt-ids", ",".join(["5"] * 40), "--ctx", "48",
                           "--batch", "2", "--max-new-tokens", "4")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("specpilot: error:") and "cache slots" in last


def test_probe_rows_batch_and_ceiling(run_cli, tmp_path):
    out = tmp_path / "rows.json"
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1,4", "--context", "16",
                           "--batch", "3", "--reps", "1", "--warmup", "0", "--threads", "1", "--format", "json",
                           "--out", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["batch"] == 3 and [p["rows"] for p in doc["points"]] == [1, 4] and doc["ar_ms"] > 0
    # A CPU probe: the measured figures alone (floors for a GPU would mix devices, which is refused).
    code, _, err = run_cli("ceiling", "--rows", "4", "--batch", "2", "--rows-probe", out, "--tau", "2")
    assert code == 2 and "--batch 3" in err
    code, res, err = run_cli("ceiling", "--rows", "4", "--batch", "3", "--rows-probe", out, "--tau", "2",
                             "--format", "json")
    assert code == 0, err
    cost = json.loads(res)["cost_model"]
    assert cost["sources"]["step_ms"].startswith("rows probe")


def test_probe_rows_batch_warns_when_a_faster_ar_step_exists(monkeypatch):
    """The batched probe's T_AR is its own path's step too: where the fused kernels would take a
    model probed with the layer modules, the same warning as one request's probe."""
    from specpilot.engine import rows
    from specpilot.engine.api import load_target
    from specpilot.engine.batch.probe import measure_rows_batched
    from specpilot.engine.spec import EngineSpec

    m = load_target(EngineSpec.parse("engine:model=tiny,random=1,decode=layers"), max_seq=64).model
    res = measure_rows_batched(m, 2, [1, 2], 8, reps=1, warmup=0)
    assert not any("faster AR step" in w for w in res.warnings)      # the CPU has no faster step
    monkeypatch.setattr(rows, "slower_ar_warning", lambda model: "a faster AR step: " + type(model).__name__)
    res = measure_rows_batched(m, 2, [1, 2], 8, reps=1, warmup=0)
    assert "a faster AR step: Transformer" in res.warnings


def test_the_queue_bound_counts_the_free_slots_and_takes_a_list_whole():
    from specpilot.engine.batch.scheduler import QueueFull

    eng = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar,device=cpu"))
    req = lambda: Request([1, 2, 3], 4)  # noqa: E731
    dec = eng.batch_decoder(batch=2, max_queue=1)
    for _ in range(3):   # two about to take the free slots, one waiting
        dec.submit(req())
    with pytest.raises(QueueFull, match="^1 request is waiting for a slot already$"):
        dec.submit(req())
    dec = eng.batch_decoder(batch=2, max_queue=1)
    dec.submit(req())
    with pytest.raises(QueueFull, match="3 requests with 0 waiting already would pass the queue's 1"):
        dec.submit_all([req(), req(), req()])
    assert len(dec.waiting) == 1   # none of the list was queued
    with pytest.raises(InputError, match="4 requests in one list: more than this server holds at once"):
        dec.submit_all([req() for _ in range(4)])   # 503 would be a promise no retry keeps
    dec.submit_all([req(), req()])
    dec = eng.batch_decoder(batch=2, max_queue=0)   # none may wait for a slot
    dec.submit_all([req(), req()])
    with pytest.raises(QueueFull, match=r"^all 2 slots are taken and no request may wait for one \(a queue of 0\)$"):
        dec.submit(req())
    dec = eng.batch_decoder(batch=2, max_queue=0)
    dec.submit(req())   # one slot taken, one free: a list of two needs both
    with pytest.raises(QueueFull, match=r"^a list of 2 requests needs 2 free slots, 1 of 2 is free, and a queue of 0 "
                                        "lets none wait for one$"):
        dec.submit_all([req(), req()])
    assert len(dec.waiting) == 1
    dec.submit(req())
    dec = eng.batch_decoder(batch=2)   # no bound (run --batch)
    dec.submit_all([req() for _ in range(50)])
    assert len(dec.waiting) == 50


def test_recording_lattices_keeps_the_rows_and_counts_of_the_run(run_cli, tmp_path):
    """A finished request that decodes on only to learn its last draft's targets adds rows and steps
    of its own: they are counted apart (lattice_rows, lattice_steps), so the run's verify rows and
    request steps are the same with a lattice recorded as without."""
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": str(i), "prompt_ids": ids}) + "\n"
                         for i, ids in enumerate([[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]])))
    got = []
    for extra in ([], ["--lattice-out", tmp_path / "x.lat"]):
        code, out, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--nodes", "8", "--batch", "3",
                                 "--prompts", p, "--max-new-tokens", "40", "--format", "json", *extra)
        assert code == 0, err
        got.append(json.loads(out)["batch"])
    plain, recorded = got
    for key in ("rows", "verify_rows", "request_steps", "accepted"):
        assert plain[key] == recorded[key], key
    assert plain["lattice_rows"] == plain["lattice_steps"] == 0 and recorded["lattice_rows"] > 0


@pytest.mark.parametrize("extra", ["mode=tree", "mode=chain", "mode=tlv"])
def test_a_pass_cut_by_the_limit_counts_the_drafts_it_delivered(extra):
    """Drafts accepted past max_new_tokens are not delivered, so neither tau nor the drafts accepted
    count them: each request's tokens are its prefill token and, per pass, its accepted drafts and
    the bonus token, as SGLang's completion tokens relate to its verify count."""
    eng = load_engine(EngineSpec.parse(f"engine:model=tiny,batch=3,nodes=6,depth=4,topk=3,{extra}"))
    dec = eng.batch_decoder()
    limits = [5, 7, 9, 11, 12, 13]   # several cut inside a pass's accepted tokens
    reqs = [Request(p, n, id=i) for i, (p, n) in enumerate(zip(PROMPTS, limits))]
    res = dec.generate_many(reqs)
    for r, n in zip(res, limits):
        assert len(r.output_ids) == n == 1 + r.steps + sum(r.accept_lengths), (n, r.steps, r.accept_lengths)
    st = dec.stats
    assert st.tau() == pytest.approx((sum(limits) - len(limits)) / st.request_steps)
