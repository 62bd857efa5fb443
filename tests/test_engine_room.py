"""A request near its token limit verifies no draft node it could not take: the trees are cut to its
room (``kernels.tree.within_depth``) in every mode, one request and batched, with the same output
and the same steps as the whole trees and fewer rows."""

import pytest

from specpilot.auditors.policies import tree_is_prefix_closed
from specpilot.engine.api import load_engine
from specpilot.engine.batch.requests import Request
from specpilot.kernels import tree as T

PROMPT = list(b"abcabcabc the cat the cat abc abc")
CTX = 256


def test_within_depth_keeps_the_shallow_nodes_prefix_closed():
    from specpilot.auditors.replay import synthetic_rows

    for row in synthetic_rows(requests=1, steps=3, m=5, k=3, transitions=True, seed=5):
        full = T.build_best_first(row["tokens"], row["logprobs"], row["transitions"], 30)
        assert T.within_depth(full, max(full.depth) + 1) is full
        for d in range(-1, max(full.depth) + 1):
            cut = T.within_depth(full, d)
            kept = [i for i, x in enumerate(full.depth) if x < d]
            assert tree_is_prefix_closed(cut) and len(cut) == len(kept)
            assert cut.tokens == tuple(full.tokens[i] for i in kept) and all(x < d for x in cut.depth)
            # each kept node hangs under the same token path as before
            for j, i in enumerate(kept):
                p, q = cut.parents[j], full.parents[i]
                assert (p < 0) == (q < 0) and (p < 0 or cut.tokens[p] == full.tokens[q])


def _whole_trees(monkeypatch):
    monkeypatch.setattr(T, "within_depth", lambda tree, d: tree)


def _rows(dec, monkeypatch):
    """Record (rows, deepest node's depth) of every verify pass of a one-request decoder."""
    rows, real = [], dec.verify_predictions

    def spy(pending, tree, n_cache, mode):
        rows.append((1 + len(tree), max(tree.depth, default=-1)))
        return real(pending, tree, n_cache, mode)

    monkeypatch.setattr(dec, "verify_predictions", spy)
    return rows


@pytest.mark.parametrize("extra", ["mode=tree,nodes=8", "mode=chain", "mode=tlv,nodes=8",
                                   "mode=tree,nodes=8,drafter=model,draft_model=tiny"])
def test_one_request_near_its_limit_verifies_fewer_rows_for_the_same_tokens(extra, monkeypatch):
    drafter = "" if "drafter" in extra else "drafter=self,draft_layers=1,"
    spec = f"engine:model=tiny,{drafter}{extra},depth=6,topk=3,ctx={CTX}"
    ref = load_engine(f"engine:model=tiny,mode=ar,ctx={CTX}").generate(PROMPT, 9)
    got = {}
    for cut in (True, False):
        with monkeypatch.context() as mp:
            if not cut:
                _whole_trees(mp)
            eng = load_engine(spec)
            rows = _rows(eng.decoder, mp)
            r = eng.generate(PROMPT, 9)
            got[cut] = (r, rows)
    (a, rows_a), (b, rows_b) = got[True], got[False]
    assert a.output_ids == b.output_ids == ref.output_ids
    assert a.steps == b.steps and a.accept_lengths == b.accept_lengths
    assert sum(n for n, _ in rows_a) < sum(n for n, _ in rows_b)
    # no node deeper than the tokens left could use (TLV: C is verified whole, its subtree is cut)
    done = 1
    for (_, deepest), acc in zip(rows_a, a.accept_lengths):
        assert "tlv" in extra or deepest < 9 - done - 1
        done += acc + 1
    if "tlv" in extra:
        assert a.tlv["q_compared"] == a.tlv["chain_tokens"] == b.tlv["chain_tokens"]


@pytest.mark.parametrize("extra", ["mode=tree,nodes=8,depth=6,topk=3", "mode=tlv,nodes=8,depth=6,topk=3",
                                   "mode=chain,depth=6,budget=equal"])
def test_batched_requests_near_their_limits_verify_fewer_rows(extra, monkeypatch):
    prompts = [PROMPT, list(b"the cat the cat the cat the"), list(b"xyzxyzxyz abc")]
    limits = [7, 11, 5]
    ref = [load_engine(f"engine:model=tiny,mode=ar,ctx={CTX}").generate(p, n).output_ids
           for p, n in zip(prompts, limits)]
    got = {}
    for cut in (True, False):
        with monkeypatch.context() as mp:
            if not cut:
                _whole_trees(mp)
            dec = load_engine(f"engine:model=tiny,batch=3,drafter=self,draft_layers=1,{extra},ctx={CTX}"
                              ).batch_decoder()
            reqs = [Request(p, n, id=i) for i, (p, n) in enumerate(zip(prompts, limits))]
            done = dec.generate_many(reqs)
            got[cut] = ([r.output_ids for r in done], dec.stats.verify_rows, dec.stats.verify_steps)
    assert got[True][0] == got[False][0] == ref
    assert got[True][2] == got[False][2] and got[True][1] < got[False][1]
