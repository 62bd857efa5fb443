"""TLV mode (engine/tlv.py): lossless against AR for every drafter, a Q pass that leaves the
target's state untouched, prefix-closed truncation, the run report and its refusals."""

import json

import pytest
import torch

from conftest import one_error
from specpilot.auditors.policies import tree_is_prefix_closed
from specpilot.engine.api import load_engine
from specpilot.engine.spec import EngineSpec
from specpilot.errors import InputError
from specpilot.kernels import tree as T

CTX = 256
PROMPT = list(b"abcabcabc the cat the cat abc")
DRAFTERS = {"ngram": "drafter=ngram", "self": "drafter=self,draft_layers=2",
            "model": "drafter=model,draft_model=tiny"}


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_tlv_outputs_equal_ar_for_every_drafter(model):
    ref = load_engine(f"engine:model={model},mode=ar,ctx={CTX}").generate(PROMPT, 24)
    for name, d in DRAFTERS.items():
        for nodes in (6, 1):   # 1: C often fills the budget and the subtree is empty
            r = load_engine(f"engine:model={model},mode=tlv,{d},nodes={nodes},depth=4,topk=3,ctx={CTX}"
                            ).generate(PROMPT, 24)
            assert r.output_ids == ref.output_ids, (name, nodes)
            assert r.tlv["cycles"] == r.steps and r.steps <= ref.steps
            assert r.tlv["q_compared"] == r.tlv["chain_tokens"] >= r.steps


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_tlv_with_the_fp8_view_equals_ar(model):
    """qview=fp8 on the CPU: the e4m3 copies dequantized as the Q pass's weights; only the exact
    pass accepts, so the output is AR's."""
    ref = load_engine(f"engine:model={model},mode=ar,ctx={CTX}").generate(PROMPT, 24)
    e = load_engine(f"engine:model={model},mode=tlv,drafter=self,draft_layers=1,nodes=6,depth=4,topk=3,ctx={CTX},"
                    "qview=fp8")
    assert e.decoder.qview.kind == "fp8" and e.decoder.qview.pairs
    r = e.generate(PROMPT, 24)
    assert r.output_ids == ref.output_ids and r.tlv["cycles"] == r.steps
    if model == "tiny":   # float16 weights: the W12 view (of bf16 numbers) refuses them, the fp8 view takes them
        with pytest.raises(InputError, match="not float16; use dtype=bfloat16 or float32, or qview=fp8"):
            EngineSpec.parse(f"engine:model=tiny,mode=tlv,dtype=float16,ctx={CTX}")
        ref16 = load_engine(f"engine:model=tiny,mode=ar,dtype=float16,ctx={CTX}").generate(PROMPT, 24)
        r16 = load_engine(f"engine:model=tiny,mode=tlv,dtype=float16,nodes=6,depth=4,topk=3,ctx={CTX},qview=fp8"
                          ).generate(PROMPT, 24)
        assert r16.output_ids == ref16.output_ids


def after_cycles(dec, nodes: int = 12):
    """A few TLV cycles of ``dec`` (committed KV and GDN state that are not zero), then the next
    draft tree: (context, committed length, tree)."""
    r = dec.generate(PROMPT, 6)
    ctx = PROMPT + r.output_ids
    n_cache = len(ctx) - 1
    lat = dec.drafter.propose(ctx, n_cache, 4, 3)
    tree = T.build_best_first(lat.tokens, lat.logprobs, lat.transitions, nodes)
    assert len(tree) > 1
    return ctx, n_cache, tree


def _state(model):
    out = []
    for blk in model.layers:
        m = blk.mixer
        out += [m.k_cache.clone(), m.v_cache.clone()] if hasattr(m, "k_cache") else [m.state.clone(),
                                                                                      m.conv_state.clone()]
    return out


@pytest.mark.parametrize("bf16_pass", [False, True])
@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_q_pass_leaves_kv_cache_and_recurrent_state_bit_identical(model, bf16_pass):
    """Both Q passes a float32 model can run: in its own dtype, and in bf16 (CPUs with bf16 units);
    either way the output is AR's."""
    from specpilot.engine.tlv import QView

    e = load_engine(f"engine:model={model},mode=tlv,drafter=self,draft_layers=1,nodes=12,depth=4,topk=3,ctx={CTX}")
    dec = e.decoder
    dec.qview = QView.build(e.model, bf16_pass=bf16_pass)
    assert dec.qview.dtype == (torch.bfloat16 if bf16_pass else torch.float32)
    ref = load_engine(f"engine:model={model},mode=ar,ctx={CTX}").generate(PROMPT, 16).output_ids
    assert dec.generate(PROMPT, 16).output_ids == ref
    ctx, n_cache, tree = after_cycles(dec)
    for t in (tree, T.chain_tree([])):   # an empty tree runs one row: it must not advance GDN state either
        before = _state(e.model)
        q = dec.q_pass(ctx[-1], t, n_cache)
        assert len(q) == 1 + len(t)
        for a, b in zip(before, _state(e.model)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert all(g._stash is None for g in e.model.gdn_layers())
    # the view is the W12 8-bit one (a few mantissa bits): not the exact weights, but close to them
    lin, qw = dec.qview.pairs[0]
    assert not torch.equal(lin.weight, qw)
    assert bool(((lin.weight - qw).abs() <= lin.weight.abs() * 2 ** -3 + 1e-6).all())


def test_truncation_keeps_the_tree_prefix_closed_and_attach_hangs_it_under_the_chain():
    from specpilot.auditors.replay import synthetic_rows

    for row in synthetic_rows(requests=1, steps=4, m=5, k=4, transitions=True, seed=3):
        full = T.build_best_first(row["tokens"], row["logprobs"], row["transitions"], 40)
        for n in range(0, 41):
            sub = T.truncate(full, n)
            assert len(sub) == min(n, len(full)) and tree_is_prefix_closed(sub)
            # a best-first tree's prefix is the best-first tree of the smaller budget
            assert sub == T.build_best_first(row["tokens"], row["logprobs"], row["transitions"], n)
            tree = T.attach([7, 8, 9], sub)
            assert tree_is_prefix_closed(tree) and len(tree) == 3 + len(sub)
            assert tree.tokens[:3] == (7, 8, 9) and all(tree.parents[3 + i] == 2 for i, p in enumerate(sub.parents)
                                                        if p < 0)
    assert T.attach([], T.truncate(full, 3)) == T.truncate(full, 3)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_w12_target_takes_the_q_view_from_its_records(model):
    """A W12 target (a hybrid's GDN and gated layers too): the Q pass's view is its records' 8-bit
    part, and the output is W12 AR's."""
    from specpilot.kernels.w12 import decode, encode

    e = load_engine(f"engine:model={model},mode=tlv,w12=1,nodes=6,depth=3,topk=2,ctx={CTX}")
    lin, qw = e.decoder.qview.pairs[0]
    assert qw.dtype == torch.bfloat16
    assert torch.equal(qw, decode(encode(lin.weight.detach()), qpass=True))
    ref = load_engine(f"engine:model={model},mode=ar,w12=1,ctx={CTX}").generate(PROMPT, 8).output_ids
    assert e.generate(PROMPT, 8).output_ids == ref


def test_run_tlv_reports_tau_agreement_chain_and_time_split(run_cli):
    args = ("run", "--model", "tiny", "--prompt", "abcabcabc the cat the cat abc", "--max-new-tokens", "20")
    code, out, err = run_cli(*args, "--mode", "tlv", "--nodes", "32", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    t = d["tlv"]
    assert d["mode"] == "tlv" and d["nodes"] == 32 and t["nodes"] == 32 and t["cycles"] == d["steps"]
    assert t["tau_per_exact_pass"] == d["tau"] and 0 <= t["q_top1_agreement"] <= 1 and t["mean_commit_chain"] >= 1
    assert set(t["time_ms"]) == {"draft1", "qpass", "draft2", "exact", "append"}
    assert t["cycle_ms"] == pytest.approx(sum(t["time_ms"].values()))
    code, ar, _ = run_cli(*args, "--mode", "ar", "--format", "json")
    assert json.loads(ar)["output_ids"] == d["output_ids"]
    code, out, err = run_cli(*args, "--mode", "tlv", "--nodes", "32")
    assert code == 0, err
    assert "TLV: tau" in out and "Q-pass top-1 agreement" in out and "exact pass" in out


@pytest.mark.parametrize("args, msg", [
    (["--dtype", "float16"], "not float16"),
])
def test_tlv_refusals_are_one_error_line_exit_2(run_cli, args, msg):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tlv", "--prompt", "abc", *args)
    assert code == 2 and out == ""
    assert msg in one_error(err)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_batched_tlv_cycles_equal_one_request_cycles(model):
    """The batch decoder (serve, run --batch) runs every request's TLV cycle in the same step: one Q
    pass over all draft-1 trees, one exact pass. Requests arriving at different steps get AR's
    output and exactly the one-request decoder's cycles (|C|, accepts, Q-pass agreement)."""
    check_batched_cycles(f"model={model}")


def test_batched_tlv_with_the_fp8_view_equals_one_request_cycles():
    check_batched_cycles("model=tiny,qview=fp8")


def check_batched_cycles(base: str) -> None:
    """:func:`test_batched_tlv_cycles_equal_one_request_cycles` on the engine ``base`` describes."""
    from specpilot.engine.batch.requests import Request

    prompts = [PROMPT, PROMPT[3:] + [7, 8, 7, 8], [5, 6, 5, 6, 5, 6, 9], PROMPT[:9]]
    ar = load_engine(f"engine:{base},mode=ar,ctx={CTX}")
    refs = [ar.generate(p, 18).output_ids for p in prompts]
    for name, d in DRAFTERS.items():
        spec = f"engine:{base},mode=tlv,{d},nodes=6,depth=4,topk=3,ctx={CTX}"
        one = load_engine(spec)
        singles = [one.generate(p, 18) for p in prompts]
        dec = load_engine(spec + ",batch=3").batch_decoder()
        reqs = [Request(p, 18, id=i, arrival_step=a) for i, (p, a) in enumerate(zip(prompts, (0, 0, 2, 5)))]
        res = dec.generate_many(reqs)
        assert [r.output_ids for r in res] == refs, name
        keys = ("cycles", "chain_tokens", "accepted_tokens", "q_agree", "q_compared")
        for r, s1 in zip(res, singles):
            assert [r.tlv[k] for k in keys] == [s1.tlv[k] for k in keys], name
            assert r.steps == s1.steps == r.tlv["cycles"]
        tot = dec.stats.tlv
        assert tot.cycles == sum(r.tlv["cycles"] for r in res) and dec.stats.tlv_steps <= tot.cycles
        assert set(tot.seconds) == {"draft1", "qpass", "draft2", "exact", "append"}
        assert all(v > 0 for v in tot.seconds.values())
        assert not dec.running and all(lc.stash == {} for lc in dec.cache.layers)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_batched_q_pass_leaves_every_slot_bit_identical(model):
    check_batched_q_pass(f"model={model}")


def check_batched_q_pass(base: str) -> None:
    """:func:`test_batched_q_pass_leaves_every_slot_bit_identical` on the engine ``base`` describes."""
    from specpilot.engine.batch import tlv as btlv
    from specpilot.engine.batch.requests import Request

    e = load_engine(f"engine:{base},mode=tlv,drafter=self,draft_layers=1,nodes=10,depth=4,topk=3,ctx={CTX},batch=2")
    dec = e.batch_decoder()
    reqs = [Request(PROMPT, 4, id=0), Request(PROMPT[2:], 4, id=1)]
    dec.generate_many(reqs)     # committed KV and GDN state that are not zero, in slots 0 and 1
    for slot, r in enumerate(reqs):   # put them back in their slots as running requests
        r.slot, r.n_cache = slot, len(r.prompt_ids) + len(r.full) - 1
    lats = dec.drafting.propose([(r.slot, r.prompt_ids + r.full, r.n_cache) for r in reqs], 4, 3)
    trees = [T.build_best_first(lt.tokens, lt.logprobs, lt.transitions, 10) for lt in lats]
    trees[1] = T.chain_tree([])   # a lone row must not advance GDN state either
    before = [t.clone() for lc in dec.cache.layers for t in lc.tensors()]
    q = btlv.q_pass(e.model, dec.cache, dec.qview, [(r.slot, r.full[-1], r.n_cache, t) for r, t in zip(reqs, trees)])
    assert [len(x) for x in q] == [1 + len(t) for t in trees] and len(trees[0]) > 1
    after = [t for lc in dec.cache.layers for t in lc.tensors()]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))
    assert all(lc.stash == {} for lc in dec.cache.layers)


def test_run_batch_tlv_reports_the_cycles(run_cli):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tlv", "--nodes", "8", "--batch", "2",
                             "--prompt", "abcabcabc the cat the cat abc", "--max-new-tokens", "16", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    t = d["batch"]["tlv"]
    assert t["cycles"] >= 1 and 0 <= t["q_top1_agreement"] <= 1 and t["accepted_per_exact_pass"] >= 1
    assert set(t["time_ms"]) == {"draft1", "qpass", "draft2", "exact", "append"}
    assert d["results"][0]["tlv"]["cycles"] == d["results"][0]["steps"]
    assert d["tlv"]["q_agree"] == t["q_agree"] and d["tlv"]["tau_per_exact_pass"] == d["tau"]
    assert d["batch"]["budget"] is None and d["batch"]["block"] is None   # rules of chain and tree steps
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tlv", "--nodes", "8", "--batch", "2",
                             "--prompt", "abcabcabc the cat the cat abc", "--max-new-tokens", "16")
    assert code == 0, err
    assert "TLV: tau" in out and "batched step" in out


def test_the_run_summary_counts_the_cycles_whichever_request_comes_first():
    """A batched request the prefill ended (EOS) has no ``tlv``: the run's summary is there when
    any request, or the batch, ran a cycle, whatever the prompts' order (it keyed on the first)."""
    from specpilot.commands.run import _tlv_summary
    from specpilot.engine.tlv import TLVStats

    st = TLVStats(8)
    st.count(2, 3, 2)
    ran = {"tokens": 3, "tlv": st.to_json()}
    for results in ([{"tokens": 1}, ran], [ran, {"tokens": 1}]):
        got = _tlv_summary(results, 3.0, None)
        assert got["cycles"] == 1 and got["chain_tokens"] == 2 and got["tau_per_exact_pass"] == 3.0
        assert _tlv_summary(results, 3.0, None, {"tlv": {**st.to_json(), "steps": 1}})["steps"] == 1
    assert _tlv_summary([{"tokens": 1}], 1.0, None) is None
    assert _tlv_summary([{"tokens": 1}], 1.0, None, {"tlv": st.to_json()})["cycles"] == 1


@pytest.mark.parametrize("model, drafter, batch", [("tiny", "ngram", 1), ("tiny-hybrid", "self", 1),
                                                   ("tiny-hybrid", "self", 2)])
def test_replay_tlv_reproduces_the_engines_tau(run_cli, tmp_path, model, drafter, batch):
    prompts, lat = tmp_path / "p.jsonl", tmp_path / "tlv.lattice.jsonl"
    prompts.write_text('{"schema": "specpilot.prompts/1", "id": "a", "text": "abcabcabc the cat the cat abc"}\n'
                       '{"schema": "specpilot.prompts/1", "id": "b", "text": "xyzxyz xyz hello hello"}\n')
    code, out, err = run_cli("run", "--model", model, "--mode", "tlv", "--drafter", drafter, "--nodes", "10",
                             "--depth", "4", "--topk", "3", "--prompts", prompts, "--max-new-tokens", "20",
                             "--lattice-out", lat, "--batch", batch, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    rows = [json.loads(x) for x in lat.read_text().splitlines()]
    assert len(rows) == d["steps"] and all(r["tlv"]["nodes"] == 10 for r in rows)
    assert all(len(r["tlv"]["q_argmax"]) >= 1 and len(r["target"]) >= len(r["tlv"]["commit"]) for r in rows)
    code, out, err = run_cli("replay", lat, "--policy", "tlv:10", "--policy", "best-first:10",
                             "--policy", "marginal:10", "--format", "json")
    assert code == 0, err
    pol = {p["policy"]: p for p in json.loads(out)["policies"]}
    # the run's own tau: replay caps each pass at what its request could still deliver ("remaining")
    assert all(r["remaining"] >= 1 for r in rows)
    assert pol["tlv:10"]["tau"] == pytest.approx(d["tau"], abs=1e-12)
    assert sum(pol["tlv:10"]["tau_hist"]) == d["steps"]
    for p in pol.values():
        assert p["tau_ci"][0] <= p["tau"] <= p["tau_ci"][1]


def test_replay_tlv_refusals_are_one_error_line_exit_2(run_cli, tmp_path):
    lat, tree_lat = tmp_path / "tlv.jsonl", tmp_path / "tree.jsonl"
    base = ("run", "--model", "tiny", "--prompt", "abcabcabc abc", "--max-new-tokens", "8", "--nodes", "8")
    assert run_cli(*base, "--mode", "tlv", "--lattice-out", lat)[0] == 0
    assert run_cli(*base, "--mode", "tree", "--lattice-out", tree_lat)[0] == 0
    for path, policy, msg in [(lat, "tlv:0", "between 1 and"), (lat, "tlv:16", "recorded with --nodes 8"),
                              (tree_lat, "tlv:8", "has no TLV cycle"), (lat, "tlv", "needs a parameter")]:
        code, out, err = run_cli("replay", path, "--policy", policy)
        assert code == 2 and out == "", (policy, err)
        assert msg in one_error(err), policy
    rows = [json.loads(x) for x in lat.read_text().splitlines()]
    rows[0]["tlv"]["commit"] = rows[0]["tlv"]["commit"] + [1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli("replay", bad, "--policy", "tlv:8")
    assert code == 2 and f"{bad}:1: policy tlv:8: request " in one_error(err) and "commit chain" in one_error(err)
    short = [dict(r, tlv=dict(r["tlv"], q_argmax=r["tlv"]["q_argmax"][:2])) if i == 2 else r
             for i, r in enumerate(json.loads(x) for x in lat.read_text().splitlines())]
    bad.write_text("".join(json.dumps(r) + "\n" for r in short))
    code, _, err = run_cli("replay", bad, "--policy", "tlv:8")
    assert code == 2 and f"{bad}:3: policy tlv:8: request " in one_error(err), err
    assert "records 2 Q-pass tokens for a tree of" in one_error(err)
    rows[0]["tlv"]["draft2"] = {"tokens": [[1, 1]], "logprobs": [[0.0, 0.0]], "transitions": None}
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli("replay", bad, "--policy", "tlv:8")
    assert code == 2 and f"{bad}:1 (tlv.draft2)" in one_error(err)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the real model on a shared 2-core CPU; the Q view is encoded at load
@pytest.mark.parametrize("qview", ["w12", "fp8"])
def test_smollm2_tlv_equals_ar_for_every_drafter(qview):
    ar = load_engine("engine:model=smollm2,mode=ar,ctx=512")
    prompt = ar.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):")
    ref = ar.generate(prompt, 32).output_ids
    for d in ("drafter=ngram", "drafter=self,draft_layers=8", "drafter=model,draft_model=smollm2"):
        r = load_engine(f"engine:model=smollm2,mode=tlv,nodes=16,{d},ctx=512,qview={qview}").generate(prompt, 32)
        assert r.output_ids == ref, d
        assert r.tlv["q_compared"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smollm2_batched_tlv_equals_ar():
    """Three SmolLM2 prompts decoded together in TLV mode (self-drafter): each output is its AR output."""
    from specpilot.engine.batch.requests import Request

    ar = load_engine("engine:model=smollm2,mode=ar,ctx=512")
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):", "Count from one to ten: one, two,",
             "The quick brown fox"]
    prompts = [ar.encode(t) for t in texts]
    refs = [ar.generate(p, 24).output_ids for p in prompts]
    dec = load_engine("engine:model=smollm2,mode=tlv,nodes=16,drafter=self,draft_layers=8,ctx=512,batch=3"
                      ).batch_decoder()
    res = dec.generate_many([Request(p, 24, id=i, arrival_step=i) for i, p in enumerate(prompts)])
    assert [r.output_ids for r in res] == refs
    assert dec.stats.tlv.q_compared > 0


def test_cuda_q_view_packs_swap_in_and_out_and_the_fused_rows_path_reads_them(monkeypatch):
    """The CUDA form of the view (built here on the CPU): one W12 pack per projection, a W12 target's
    own records reused, set on the projections only while active, and read by the fused rows path's
    ``_linear`` through the QPASS kernels (here a spy)."""
    from specpilot.engine import fused_verify
    from specpilot.engine.tlv import QView, cuda_refusal
    from specpilot.kernels.w12 import routing

    e = load_engine(f"engine:model=tiny,mode=tlv,nodes=6,depth=3,topk=2,ctx={CTX}")
    view = QView.build_packs(e.model)
    lins = [lin for lin, _ in view.packs]
    assert len(lins) == 4 * e.model.spec.num_layers and view.dtype == torch.bfloat16
    assert view.extra_bytes() == sum(kp.nbytes() for _, kp in view.packs) > 0
    seen = []
    monkeypatch.setattr(routing, "w12_linear", lambda x, kp, qpass=False, **kw: seen.append((x.dtype, kp, qpass,
                                                                                              kw)) or "q")
    h = torch.zeros(3, lins[0].in_features)
    with view.active():
        assert all(lin.qkp is kp for lin, kp in view.packs)
        assert fused_verify._project(h, lins[0]) == "q"
    assert seen == [(torch.bfloat16, view.packs[0][1], True, {"out_dtype": torch.float32})]
    assert all(lin.qkp is None for lin in lins)
    assert fused_verify._project(h, lins[0]).shape == (3, lins[0].out_features)   # the exact weights again
    # the refusals: the Q pass needs the fused rows path for all its rows
    assert "decode=fused" in cuda_refusal(e.model, view, 6)
    e.model.fused_decode = True
    assert cuda_refusal(e.model, view, 63) is None
    assert "nodes <= 63" in cuda_refusal(e.model, view, 64)
    assert "packs" in cuda_refusal(e.model, QView([], e.model), 6)


def test_padded_rows_put_padding_after_the_tree_attending_slot_zero():
    e = load_engine(f"engine:model=tiny-hybrid,mode=tree,nodes=6,depth=3,topk=2,ctx={CTX}")
    tree = T.chain_tree([7, 8])
    tokens, pos, slots, mask, paths = e.decoder.padded_rows(5, tree, 10, 4)
    assert tokens.tolist() == [5, 7, 8, 0] and pos.tolist() == [10, 11, 12, 10] and slots.tolist() == [10, 11, 12, 13]
    assert mask.shape == (4, CTX) and mask[3].nonzero().flatten().tolist() == [0]
    assert mask[2, :13].all() and not mask[2, 13:].any()
    assert paths[3].tolist()[0] == 3 and (paths[3, 1:] == -1).all()   # a padding row walks only itself


def test_a_bf16_q_pass_copies_the_lm_head_without_initialising_it_first(monkeypatch):
    """The bf16 Q pass's LM head is a bf16 copy of the model's: built with its weight as allocated
    (the copy writes all of it), the same values as the head it copies."""
    from torch import nn

    from specpilot.engine.tlv import QView

    e = load_engine(f"engine:model=tiny,mode=tlv,drafter=self,draft_layers=1,nodes=12,depth=4,topk=3,ctx={CTX}")

    def refused(*a, **k):
        raise AssertionError("default init ran")

    with monkeypatch.context() as m:
        m.setattr(nn.init, "kaiming_uniform_", refused)
        view = QView.build(e.model, bf16_pass=True)
    assert torch.equal(view.head.weight, e.model.lm_head.weight.to(torch.bfloat16))
