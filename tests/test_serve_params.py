"""``specpilot serve``'s request parsing, without a server: ``max_new_tokens`` 0 and its OpenAI names.

SGLang takes ``max_new_tokens`` 0 on ``/generate`` (``SamplingParams.verify`` refuses only a
negative value) and ``max_tokens`` 0 on ``/v1/chat/completions`` (no validator), and refuses
``max_tokens`` 0 on ``/v1/completions`` (``CompletionRequest``'s "max_tokens must be positive").
A request for no token is checked like any other: its prompt within the context.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specpilot.engine import openai_api as oa
from specpilot.engine.http_api import BadRequest, parse_generate, parse_sampling
from specpilot.engine.server import check_context, check_prompt
from specpilot.errors import InputError


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def test_generate_takes_max_new_tokens_0():
    call = parse_generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}, vocab_size=256)
    assert call.sampling[0].max_new_tokens == 0 and call.prompts == [[1, 2, 3]]
    call = parse_generate({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 0}}, _bytes, 256)
    assert call.stream and call.sampling[0].max_new_tokens == 0 and call.prompts == [[104, 105]]
    # one per prompt in a list: 0 beside others
    call = parse_generate({"input_ids": [[1], [2, 3]], "sampling_params": [{"max_new_tokens": 0},
                                                                        {"max_new_tokens": 5}]}, vocab_size=256)
    assert [s.max_new_tokens for s in call.sampling] == [0, 5]
    # absent: SGLang's 128
    assert parse_sampling({}).max_new_tokens == 128


@pytest.mark.parametrize("value", [-1, 1.5, True, "0", 1 << 21])
def test_generate_refuses_other_max_new_tokens_by_name(value):
    with pytest.raises(BadRequest, match=r"sampling_params\.max_new_tokens must be an integer in \[0, "):
        parse_generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": value}}, vocab_size=256)


def test_the_prompt_of_a_0_token_request_is_still_checked():
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        parse_generate({"input_ids": [1, 999], "sampling_params": {"max_new_tokens": 0}}, vocab_size=256)
    with pytest.raises(BadRequest, match="non-empty list"):
        parse_generate({"input_ids": [], "sampling_params": {"max_new_tokens": 0}}, vocab_size=256)
    with pytest.raises(BadRequest, match="non-empty string"):
        parse_generate({"text": "", "sampling_params": {"max_new_tokens": 0}}, _bytes, 256)


def test_generate_clips_a_max_new_tokens_it_is_not_given_to_the_room():
    """SGLang 0.5.23: an absent ``max_new_tokens`` is ``SamplingParams``' 128 and ``null`` is no bound;
    neither is checked against the context (``TokenizerManager._validate_one_request`` checks a given
    one only); the scheduler clips both to what fits (``Scheduler.init_req_max_new_tokens``). A given
    one is kept as given, for the context check to refuse."""
    room = lambda n: 200 - n   # noqa: E731  the most new tokens after an n-token prompt

    def got(prompts, sp):
        return [s.max_new_tokens for s in parse_generate({"input_ids": prompts, "sampling_params": sp}, None, 256,
                                                         room).sampling]
    assert got([[1] * 10], {}) == [128] and got([[1] * 10], None) == [128]
    assert got([[1] * 150], {}) == [50] and got([[1] * 150], {"max_new_tokens": None}) == [50]
    assert got([[1] * 10], {"max_new_tokens": None}) == [190]            # null: no bound but the room
    assert got([[1] * 10], {"max_new_tokens": 300}) == [300]             # given: kept, for check_context
    assert got([[1] * 10, [1] * 190], {"ignore_eos": True}) == [128, 10]   # per prompt of a list
    assert got([[1] * 10, [1] * 190], [{}, {"max_new_tokens": 7}]) == [128, 7]
    assert got([[1] * 200], {}) == [1]   # no room: the prompt is refused for its length (check_context)
    with pytest.raises(InputError, match=r"The input \(200 tokens\) is longer"):
        check_context(200, 1, 200)
    # without a room: SGLang's 128 whatever the prompt
    assert parse_generate({"input_ids": [1] * 150}, None, 256).sampling[0].max_new_tokens == 128


def test_check_prompt_is_the_decoders_check_with_no_new_token():
    # capacity_needed(prompt, new) = prompt + new + 5 draft rows: 15 prompt tokens fit 20 slots, 16 do not
    dec = SimpleNamespace(model=SimpleNamespace(spec=SimpleNamespace(vocab_size=10)), mode="chain",
                          capacity_needed=lambda n, m: n + m + 5, cache=SimpleNamespace(max_seq=20))
    check_prompt(dec, [1] * 15)
    with pytest.raises(InputError, match=r"prompt \(16 tokens\) \+ 0 new tokens \+ 5 slots for draft rows need 21 "
                                         r"cache slots; the engine has 20"):
        check_prompt(dec, [1] * 16)
    with pytest.raises(InputError, match="token id 10 is outside the vocabulary"):
        check_prompt(dec, [1, 10])
    with pytest.raises(InputError, match="empty prompt"):
        check_prompt(dec, [])


def test_completions_refuse_0_as_sglang_does():
    with pytest.raises(BadRequest, match=r"^max_tokens must be an integer in \[1, "):
        oa.parse_completion({"prompt": [1, 2], "max_tokens": 0}, None, 256, "tiny")
    assert oa.parse_completion({"prompt": [1, 2], "max_tokens": 1}, None, 256, "tiny").sampling[0].max_new_tokens == 1
    assert oa.parse_completion({"prompt": [1, 2]}, None, 256, "tiny").sampling[0].max_new_tokens == 16


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 3}])
@pytest.mark.parametrize("value", [0, 3, None])
def test_completions_refuse_max_completion_tokens_by_name(value, extra):
    """SGLang's CompletionRequest has max_tokens only; max_completion_tokens is the chat request's."""
    with pytest.raises(BadRequest, match=r"^unknown request fields: max_completion_tokens \(/v1/completions takes "
                                         r"max_tokens"):
        oa.parse_completion({"prompt": [1, 2], "max_completion_tokens": value, **extra}, None, 256, "tiny")


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_chat_takes_0_as_sglang_does(key):
    msgs = [{"role": "user", "content": "hi"}]
    encode = lambda m: [3, 4, 5]   # noqa: E731
    call = oa.parse_chat({"messages": msgs, key: 0}, encode, 256, "tiny", lambda n: 100)
    assert call.sampling[0].max_new_tokens == 0 and call.prompts == [[3, 4, 5]]
    call = oa.parse_chat({"messages": msgs, key: 0, "stream": True, "stream_options": {"include_usage": True}},
                         encode, 256, "tiny", lambda n: 100)
    assert call.stream and call.include_usage and call.sampling[0].max_new_tokens == 0
    with pytest.raises(BadRequest, match=rf"^{key} must be an integer in \[0, "):
        oa.parse_chat({"messages": msgs, key: -1}, encode, 256, "tiny", lambda n: 100)
    # absent: what fits (and at least 1 when nothing does: the decoder's check then says why not)
    assert oa.parse_chat({"messages": msgs}, encode, 256, "tiny", lambda n: 100).sampling[0].max_new_tokens == 100
    assert oa.parse_chat({"messages": msgs}, encode, 256, "tiny", lambda n: -4).sampling[0].max_new_tokens == 1


def test_an_empty_chat_answer_and_its_stream_chunk():
    call = oa.parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "stream": True},
                         lambda m: [3, 4], 256, "tiny", lambda n: 100)
    answer = {"text": "", "meta_info": {"prompt_tokens": 2, "completion_tokens": 0,
                                        "finish_reason": {"type": "length", "length": 0}}}
    body = oa.response(call, [answer])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    # a chat stream: the role alone first (OpenAI's, SGLang's), then deltas without it
    role = oa.role_chunk(call)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["choices"][0]["finish_reason"] is None and role["object"] == "chat.completion.chunk"
    assert "usage" not in role and oa.role_chunk(call, (2, 0))["usage"]["completion_tokens"] == 0
    chunk = oa.chunk(call, "", "length")
    assert chunk["choices"][0]["delta"] == {} and chunk["choices"][0]["finish_reason"] == "length"
    assert oa.chunk(call, "hi", None)["choices"][0]["delta"] == {"content": "hi"}


def _chat_app():
    """The tiny model's server in process, given a chat template (its messages' text as bytes)."""
    from specpilot.engine.api import load_engine
    from specpilot.engine.server import ServeOptions, ServeState, make_app

    eng = load_engine("engine:model=tiny,mode=ar,threads=1,batch=2")
    eng.__class__ = type("ChatTiny", (type(eng),), {
        "has_chat_template": True,
        "encode_messages": lambda self, msgs: list("".join(m["content"] for m in msgs).encode())})
    state = ServeState(eng, eng.batch_decoder(), ServeOptions())
    return eng, state, make_app(state)


def test_a_chat_stream_sends_the_role_alone_first():
    """OpenAI's and SGLang's chat stream: a first event ``delta: {"role": "assistant", "content": ""}``,
    then content deltas without the role that add up to the answer and carry no finish reason, then
    SGLang's own finish event (``serving_chat.py``: an empty delta, the finish reason, no usage)."""
    import asyncio
    import json

    import httpx

    eng, state, app = _chat_app()
    want = eng.decode(eng.generate(list(b"hello"), 6).output_ids)
    state.start_engine()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as c:
            out = []
            for body in ({"max_tokens": 6}, {"max_tokens": 0, "stream_options": {"include_usage": True}},
                         {"max_tokens": 6, "stream_options": {"continuous_usage_stats": True}}):
                r = await c.post("/v1/chat/completions", timeout=60, json={
                    "messages": [{"role": "user", "content": "hello"}], "stream": True, **body})
                assert r.status_code == 200, r.text
                lines = [ln for ln in r.text.split("\n\n") if ln]
                assert lines[-1] == "data: [DONE]"
                out.append([json.loads(ln[6:]) for ln in lines[:-1]])
            return out

    try:
        full, empty, usage = asyncio.run(main())
    finally:
        state.join_engine()
    for ev in (full, empty, usage):
        assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert ev[0]["choices"][0]["finish_reason"] is None
        assert all("role" not in e["choices"][0]["delta"] for e in ev[1:] if e["choices"])
    assert len(full) >= 3 and "".join(e["choices"][0]["delta"].get("content", "") for e in full) == want
    assert all(e["choices"][0]["finish_reason"] is None for e in full[:-1])
    assert all(e["choices"][0]["delta"].get("content") for e in full[1:-1])   # each content event has text
    assert full[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert "usage" not in full[-1]
    # max_tokens 0: the role, the finish reason with an empty delta, the usage
    assert [e["choices"][0]["delta"] for e in empty[:2]] == [{"role": "assistant", "content": ""}, {}]
    assert empty[1]["choices"][0]["finish_reason"] == "length" and empty[2]["choices"] == []
    assert empty[2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    # continuous usage: the role's event says 0 tokens so far
    assert usage[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    # the last content event has the whole count; SGLang's finish event carries no usage
    assert usage[-2]["usage"]["completion_tokens"] == 6 and usage[-2]["choices"][0]["finish_reason"] is None
    assert usage[-1]["choices"][0]["delta"] == {} and usage[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in usage[-1]


def test_a_slow_prompt_to_tokenize_does_not_hold_up_other_clients():
    """Parsing and tokenizing run off the event loop: while one request's long text tokenizes
    (here an encode that takes 1.5 s), /health answers at once."""
    import asyncio
    import time

    import httpx

    from specpilot.engine.api import load_engine
    from specpilot.engine.server import ServeOptions, ServeState, make_app

    eng = load_engine("engine:model=tiny,mode=ar,threads=1,batch=2")
    real = eng.encode

    def slow(text, chat=False):
        if text == "slow":
            time.sleep(1.5)
        return real(text, chat=chat)

    eng.encode = slow
    app = make_app(ServeState(eng, eng.batch_decoder(), ServeOptions()))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as c:
            t0 = time.perf_counter()
            gen = asyncio.create_task(c.post("/generate", json={"text": "slow", "sampling_params": {"max_new_tokens": 0}}))
            await asyncio.sleep(0.3)   # the slow request is tokenizing by now
            health = await c.get("/health")
            answered = time.perf_counter() - t0   # on a blocked loop: after the 1.5 s encode
            return health.status_code, answered, (await gen).json()

    status, answered, answer = asyncio.run(main())
    assert status == 200 and answered < 1.2, answered
    assert answer["text"] == "" and answer["meta_info"]["prompt_tokens"] == 4


def test_a_0_token_request_counts_but_stays_out_of_the_latencies():
    """A request for no token is answered at once: a finished request (outcome, prompt tokens), but
    its ~0 s end-to-end latency would pull the percentiles of generating requests down."""
    from specpilot.engine.metrics import ServeMetrics

    m = ServeMetrics()
    zero = SimpleNamespace(prompt_ids=[1, 2, 3], output=[], max_new_tokens=0, t_arrival=10.0, t_admitted=None,
                           t_first=None, token_times=[], t_done=10.0001)
    real = SimpleNamespace(prompt_ids=[1, 2], output=[5, 6], max_new_tokens=2, t_arrival=10.0, t_admitted=10.1,
                           t_first=10.5, token_times=[(10.5, 1), (11.0, 1)], t_done=11.0)
    m.request_done(zero, "length")
    m.request_done(real, "length")
    assert m.finished["length"] == 2 and m.prompt_tokens == 5 and m.completion_tokens == 2
    assert m.e2e.count == 1 and m.samples["e2e"] == [1.0]
    assert m.ttft.count == 1 and m.queue.count == 1 and m.itl.count == 1


def test_aborted_requests_stay_out_of_the_latencies_and_the_summarys_percentiles():
    """Aborted requests (a client gone, the drain) and failed ones have their own counters; their
    latencies end where they were stopped, so the histograms and the exit summary's percentiles
    count completed requests only (none completed: no percentile). Their prompt tokens count only
    when the prompt was prefilled."""
    from specpilot.engine.metrics import ServeMetrics
    from specpilot.engine.server import ServeOptions, ServeState

    m = ServeMetrics()
    queued = SimpleNamespace(prompt_ids=[1, 2, 3, 4], output=[], max_new_tokens=8, prefilled=0, t_arrival=10.0,
                             t_admitted=None, t_first=None, token_times=[], t_done=12.0)
    running = SimpleNamespace(prompt_ids=[1, 2, 3], output=[5, 6], max_new_tokens=8, prefilled=3, t_arrival=10.0,
                              t_admitted=10.1, t_first=10.5, token_times=[(10.5, 1), (11.0, 1)], t_done=11.2)
    half = SimpleNamespace(prompt_ids=[1] * 600, output=[], max_new_tokens=8, prefilled=512, t_arrival=10.0,
                           t_admitted=10.1, t_first=None, token_times=[], t_done=11.0)
    m.request_done(queued, "abort")
    m.request_done(running, "abort")
    m.request_done(half, "error")
    assert m.finished["abort"] == 2 and m.finished["error"] == 1
    assert m.prompt_tokens == 3 and m.completion_tokens == 2
    assert (m.queue.count, m.ttft.count, m.itl.count, m.e2e.count) == (0, 0, 0, 0)
    stats = SimpleNamespace(verify_steps=0, request_steps=0, tau=lambda: None, step_seconds=0.0)
    state = ServeState(SimpleNamespace(), SimpleNamespace(stats=stats), ServeOptions(), metrics=m)
    summary = state.summary()
    assert (summary["requests"], summary["aborted"], summary["errors"]) == (0, 2, 1)
    assert all(summary[f"{k}_p{q}"] is None for k in ("ttft", "itl", "e2e") for q in (50, 90, 99)), summary
    done = SimpleNamespace(prompt_ids=[1, 2], output=[5, 6], max_new_tokens=2, prefilled=2, t_arrival=10.0,
                           t_admitted=10.1, t_first=10.5, token_times=[(10.5, 1), (11.0, 1)], t_done=11.0)
    m.request_done(done, "eos")
    assert m.prompt_tokens == 5 and (m.queue.count, m.ttft.count, m.itl.count, m.e2e.count) == (1, 1, 1, 1)
    assert state.summary()["e2e_p50"] == 1.0 and state.summary()["requests"] == 1


def test_context_checks_are_sglangs():
    """SGLang 0.5.23's ``_validate_one_request``: a prompt of the context length or more is refused,
    whatever the new tokens (0 too); a prompt and its new tokens may fill the context, not pass it."""
    check_context(99, 0, 100)
    check_context(99, 1, 100)
    check_context(60, 40, 100)
    for n in (0, 1, 5):
        with pytest.raises(InputError, match=r"^The input \(100 tokens\) is longer than the model's context length "
                                             r"\(100 tokens\)\. \(.*raise --ctx\)$"):
            check_context(100, n, 100)
    with pytest.raises(InputError, match=r"^The input \(101 tokens\) is longer"):
        check_context(101, 0, 100)
    with pytest.raises(InputError, match=r"^Requested token count exceeds the model's maximum context length of 100 "
                                         r"tokens\. You requested a total of 101 tokens: 60 tokens from the input "
                                         r"messages and 41 tokens for the completion\. "):
        check_context(60, 41, 100)


def test_the_summary_percentiles_cover_the_whole_run_past_the_sample_cap(monkeypatch):
    """Past MAX_SAMPLES the kept latencies are a uniform sample of the whole run: a run whose
    later three quarters are slower has its median there (the first samples alone said the fast one)."""
    from specpilot.engine import metrics

    monkeypatch.setattr(metrics, "MAX_SAMPLES", 1000)
    sm = metrics.ServeMetrics()
    for x in [0.008] * 1000 + [0.024] * 3000:
        sm._sample("itl", x)
    kept = sm.samples["itl"]
    assert len(kept) == 1000 and sm.seen["itl"] == 4000
    assert sorted(kept)[500] == 0.024 and 0.7 < kept.count(0.024) / 1000 < 0.8
