"""Overlapped AR steps of the batch decoder (``engine/batch/overlap.py``): each step after the first
of a streak is fed on the device from the previous step's argmax while the host takes that step's
tokens. On the CPU the bucket "graphs" run eagerly on the same static buffers, so the whole path
(device-side advance, the streak's start and end, requests finishing, arriving and cancelled
mid-streak) runs here; the GPU file checks it under CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.engine.batch.requests import Request
from specpilot.engine.batch.scheduler import BatchDecoder
from specpilot.engine.spec import EngineSpec
from test_engine_batch import PROMPTS


@pytest.fixture(scope="module")
def model():
    return load_engine(EngineSpec.parse("engine:model=tiny,mode=ar")).model


def _requests(lengths, arrivals, **kw):
    return [Request(p, n, id=i, arrival_step=a, **kw) for i, (p, n, a) in enumerate(zip(PROMPTS, lengths, arrivals))]


def _in_a_streak(model, batch, n):
    """A decoder of ``batch`` slots with ``n`` 20-token requests, one overlapped step past the
    streak's start (a step in flight)."""
    dec = BatchDecoder(model, "ar", batch=batch, graphs=True)
    reqs = _requests((20,) * n, (0,) * n)
    for r in reqs:
        dec.submit(r)
    while dec.streak is None:
        dec.step()
    dec.step()
    return dec, reqs


def _outputs(model, batch, lengths, arrivals, overlap, graphs=True, **kw):
    dec = BatchDecoder(model, "ar", batch=batch, graphs=graphs, overlap=overlap)
    reqs = _requests(lengths, arrivals, **kw)
    res = dec.generate_many(reqs)
    assert dec.idle() and dec.streak is None
    return dec, [r.output_ids for r in res], reqs


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_overlapped_steps_give_the_same_tokens(model, batch):
    lengths, arrivals = (20, 7, 13, 1, 20, 9), (0, 0, 2, 3, 7, 12)
    dec, got, _ = _outputs(model, batch, lengths, arrivals, overlap=True)
    _, plain, _ = _outputs(model, batch, lengths, arrivals, overlap=False, graphs=False)
    _, padded, _ = _outputs(model, batch, lengths, arrivals, overlap=False)
    assert got == plain == padded
    assert [len(o) for o in got] == list(lengths)
    assert dec.stats.overlapped_steps > 0
    assert dec.stats.tokens == sum(lengths)
    # every AR step counts once, overlapped or not: tokens after each request's first (prefill) token
    assert dec.stats.request_steps == sum(n - 1 for n in lengths)


def test_a_stop_token_ends_the_streak_and_drops_the_row_in_flight(model):
    _, ref, _ = _outputs(model, 2, (20, 20), (0, 0), overlap=False, graphs=False)
    stop = ref[0][6]
    dec, got, reqs = _outputs(model, 2, (20, 20), (0, 0), overlap=True, stop_ids=frozenset({stop}))
    for out, want in zip(got, ref):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert out == want[:cut]
    assert reqs[0].stop_reason == "stop"
    # the finished request's row of the step in flight was not delivered nor counted
    assert reqs[0].steps == len(got[0]) - 1 and len(reqs[0].full) == len(got[0])


def test_cancel_and_abort_mid_streak(model):
    _, ref, _ = _outputs(model, 2, (20, 20, 20), (0, 0, 0), overlap=False, graphs=False)
    dec, reqs = _in_a_streak(model, 2, 3)
    dec.cancel(reqs[0])
    dec.step()                          # the streak ends: the request in flight is taken, then freed
    assert dec.streak is None
    while not dec.idle():
        dec.step()
    assert reqs[0].stop_reason == "abort" and reqs[0].output == ref[0][:len(reqs[0].output)]
    assert [r.output for r in reqs[1:]] == ref[1:]

    late = _requests((20, 20), (0, 0))
    for r in late:
        dec.submit(r)
    while dec.streak is None:
        dec.step()
    dec.abort_all("server shutting down")
    assert dec.streak is None and dec.idle()
    assert all(r.stop_reason == "abort" for r in late)
    again = _requests((20,), (0,))
    dec.generate_many(again)            # the slots freed by the abort serve a new request correctly
    assert again[0].output == ref[0]


def test_drain_without_a_streak_is_a_no_op(model):
    dec = BatchDecoder(model, "ar", batch=2, graphs=True)
    dec.drain()
    assert dec.streak is None and dec.stats.verify_steps == 0


def test_only_ar_with_bucket_steps_overlaps(model):
    assert BatchDecoder(model, "ar", batch=2, graphs=True).overlap
    assert not BatchDecoder(model, "ar", batch=2, graphs=False).overlap
    assert not BatchDecoder(model, "ar", batch=2, graphs=True, overlap=False).overlap
    assert not BatchDecoder(model, "chain", "ngram", batch=2, graphs=True).overlap


def test_device_side_advance_matches_the_host_layout(model):
    """Two steps fed on the device leave the bucket's inputs as the host would lay out the third."""
    from specpilot.engine.batch.step import assemble, verify_rows
    from specpilot.kernels import tree as treelib

    dec, reqs = _in_a_streak(model, 4, 3)
    dec.drain()
    B = 4   # bucket(3 requests)
    _, sinp, out, ids, *_ = dec.runner.graphs[(B, 1)]
    # after the drain the buffers hold the last launched step's inputs: each request's previous token
    blocks = [verify_rows(r.slot, r.full[-2], treelib.chain_tree([]), r.n_cache - 1, "seq") for r in reqs]
    want, _, _ = assemble(blocks, dec.cache.max_seq, torch.device("cpu"), pad=(B, 1), dump=dec.cache.dump,
                          held=dec._held())
    assert want.slots[3] == 0   # the free slot's padding row writes at its first position
    assert torch.equal(ids[0], want.tokens) and torch.equal(ids[1], want.pos) and torch.equal(ids[2], want.slots)
    assert torch.equal(sinp.mask, want.mask)


def test_warm_up_captures_every_one_row_bucket_and_leaves_no_trace(model):
    """The load-time warm-up runs a synthetic workload through the decoder: every one-row bucket up
    to the slots is captured, prompts go through prefill passes and verify steps; afterwards the
    totals start at zero and real requests give the one-request outputs."""
    _, ref, _ = _outputs(model, 4, (20,) * 6, (0, 0, 2, 3, 7, 12), overlap=False, graphs=False)
    dec = BatchDecoder(model, "ar", batch=4, graphs=True, admit="waiting")
    seconds = dec.warm_up()
    assert seconds > 0 and {(1, 1), (2, 1), (4, 1)} <= set(dec.runner.graphs)
    assert dec.idle() and dec.streak is None and dec.stats.tokens == 0 and dec.stats.verify_steps == 0
    res = dec.generate_many(_requests((20,) * 6, (0, 0, 2, 3, 7, 12)))
    assert [r.output_ids for r in res] == ref and dec.stats.tokens == 120


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_warm_up_leaves_nothing_for_a_request_to_compile(model, mode, monkeypatch):
    """After warm-up a verify-mode decoder captures no new bucket and hands the tree builder no new
    shape: every (requests, rows) bucket a step can pad to is captured, and the builder sees the
    lattices padded to the decoder's depth and top-k and the requests to their bucket."""
    from specpilot.engine.api import batch_stats
    from specpilot.engine.batch import rules
    from specpilot.engine.batch.graphs import sizes

    seen, real = [], rules.build_trees

    def spy(tok, lp, tr, *a, **k):
        seen.append((tuple(tok.shape), tr is None))
        return real(tok, lp, tr, *a, **k)

    monkeypatch.setattr(rules, "build_trees", spy)
    kw = dict(nodes=4, depth=3, topk=3) if mode == "tree" else dict(depth=3)
    _, ref, _ = _outputs(model, 4, (16,) * 6, (0, 0, 2, 3, 7, 12), overlap=False, graphs=False)
    dec = BatchDecoder(model, mode, "ngram", batch=4, graphs=True, **kw)
    dec.warm_up()
    captured, warm = set(dec.runner.graphs), set(seen)
    assert captured == {(B, N) for B in sizes(4) for N in sizes(dec.rows_per_request)}
    seen.clear()
    res = dec.generate_many(_requests((16,) * 6, (0, 0, 2, 3, 7, 12)))
    assert [r.output_ids for r in res] == ref
    assert seen and set(seen) <= warm and set(dec.runner.graphs) == captured
    assert batch_stats(dec)["bucket_graphs"] == len(captured)


def test_steps_with_prompt_rows_are_counted_as_eager(model):
    """With bucket graphs, a verify step that carries an admitted prompt's rows runs eagerly: the
    totals count it and its wall time (``run``'s JSON, ``/metrics``); without prompt rows in verify
    steps (``admit=off``) no step is eager, and a decoder without graphs counts none."""
    from specpilot.engine.api import batch_stats

    lengths, arrivals = (12, 12, 12, 12), (0, 0, 3, 5)
    counts = {}
    for admit in ("all", "off"):
        dec = BatchDecoder(model, "ar", batch=4, graphs=True, admit=admit, admit_rows=8)
        dec.generate_many(_requests(lengths, arrivals))
        counts[admit] = (dec.stats.eager_steps, dec.stats.eager_seconds, dec.stats.admitted_prompt_rows)
        js = batch_stats(dec)
        assert js["eager_steps"] == dec.stats.eager_steps and js["eager_seconds"] == dec.stats.eager_seconds
    steps, secs, rows = counts["all"]
    assert rows > 0 and steps > 0 and secs > 0
    assert counts["off"][:1] == (0,) and counts["off"][2] == 0
    dec = BatchDecoder(model, "ar", batch=4, admit="all", admit_rows=8)
    dec.generate_many(_requests(lengths, arrivals))
    assert dec.stats.admitted_prompt_rows > 0 and dec.stats.eager_steps == 0


def test_waiting_admits_only_prompts_that_would_otherwise_wait(model):
    """``admit=waiting`` with two prompts arriving together while two requests decode, one too long
    for the step: the prefill pass that runs for it takes the short prompt as well (no prompt row in
    a verify step, no eager step); with a pass of 32 rows, which the long prompt fills, the short
    prompt would wait, so it joins the step (then the long prompt's last 8 rows, which fit). The
    outputs are ``admit=off``'s either way."""
    prompts = [PROMPTS[1], PROMPTS[4], [(7 * i) % 256 for i in range(40)], PROMPTS[2]]   # 10, 8, 40, 4 rows

    def run(admit, chunk):
        dec = BatchDecoder(model, "ar", batch=4, graphs=True, admit=admit, admit_rows=16, prefill_chunk=chunk)
        res = dec.generate_many([Request(p, n, id=i, arrival_step=a)
                                 for i, (p, n, a) in enumerate(zip(prompts, (12, 12, 6, 6), (0, 0, 3, 3)))])
        return [r.output_ids for r in res], dec.stats.admitted_prompt_rows, dec.stats.eager_steps

    off, whole, small = run("off", 512), run("waiting", 512), run("waiting", 32)
    assert whole[0] == small[0] == off[0]
    assert whole[1:] == (0, 0)
    assert small[1:] == (4 + 8, 2)


def test_warm_up_refuses_a_cache_no_request_fits(model):
    """A tree decoder whose largest bucket outgrows the cache can run no request: warm-up says so
    (the one-line input error a request would get) instead of capturing a bucket it cannot hold."""
    from specpilot.engine.batch.cache import BatchCache
    from specpilot.errors import InputError

    dec = BatchDecoder(model, "tree", "ngram", nodes=64, depth=8, topk=4, batch=4, graphs=True)
    dec.cache = BatchCache(model, 4, max_seq=100)
    dec.runner.cache = dec.cache
    with pytest.raises(InputError, match="raise ctx="):
        dec.warm_up()
    assert not dec.runner.graphs


def test_warm_up_fits_a_small_cache(model):
    """Warm-up requests never ask for more cache than the slots hold (a short context, many slots)."""
    from specpilot.engine.batch.cache import BatchCache

    dec = BatchDecoder(model, "ar", batch=16, graphs=True)
    dec.cache = BatchCache(model, 16, max_seq=40)
    dec.runner.cache = dec.cache
    assert dec.warm_up() > 0 and dec.idle()


@pytest.mark.parametrize("batch", [1, 3])
def test_ar_runs_in_a_cache_of_its_tokens_and_three_slots(model, batch):
    """AR reserves three cache slots past a request's tokens (``EngineSpec.cache_room``; the step
    still in flight when a request ends writes one past them), not a draft's: requests that fill
    such a cache give the tokens of a roomy one, overlapped and batched or alone."""
    lengths, arrivals = (20, 7, 13, 20), (0, 0, 2, 3)
    ctx = max(len(p) + n for p, n in zip(PROMPTS, lengths)) + 3
    spec = EngineSpec.parse(f"engine:model=tiny,mode=ar,ctx={ctx}")
    assert spec.cache_room() == 3 and spec.with_(depth=12).cache_room() == 3
    tight = load_engine(spec)
    _, want, _ = _outputs(model, batch, lengths, arrivals, overlap=False, graphs=False)
    dec, got, _ = _outputs(tight.model, batch, lengths, arrivals, overlap=True)
    assert got == want and dec.stats.overlapped_steps > 0
    longest = max(range(len(lengths)), key=lambda i: len(PROMPTS[i]) + lengths[i])
    assert tight.generate(PROMPTS[longest], lengths[longest]).output_ids == want[longest]
