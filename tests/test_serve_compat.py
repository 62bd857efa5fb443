"""``specpilot serve`` against SGLang 0.5.23's contract: routes, nulls, sampling defaults, spec fields.

- Sampling parameters without ``temperature``: SGLang's absent temperature is 1.0, so ``top_p`` <
  1, a ``top_k`` that keeps more than one token or ``min_p`` > 0 sample there; here they are a 400
  naming them (send temperature 0 for greedy), where no sampling parameter at all stays greedy.
- ``GET /ready``, ``/server_info`` (``internal_states[0].avg_spec_accept_length``, what
  ``bench_serving`` reads), ``/model_info``, ``PUT /generate``.
- ``stop_regex``, ``beam_width``, ``watermark`` at their SGLang defaults (null) are taken, other
  values refused by name.
- ``meta_info.spec_accept_length`` is SGLang's ``completion_tokens / spec_verify_ct``, with its
  draft counts (``spec_num_correct_drafts``, ``spec_num_proposed_drafts``, ``spec_accept_rate``);
  the spec fields are left out without verify passes, and in ``--mode ar``.
- A 400 for unknown fields names a few and counts the rest.
- A stream whose client leaves while it is queued is dropped without running, whatever the ASGI
  server does about disconnects; aborted requests stay out of the latency histograms.
- The native stream's text holds back a character whose bytes have not all come, as SGLang's
  incremental detokenizer does.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from specpilot.engine import openai_api as oa
from specpilot.engine.http_api import BadRequest, parse_generate, parse_sampling
from test_serve_http import ServeProcess


@pytest.fixture(scope="module")
def tree_server():
    s = ServeProcess("--model", "tiny", "--mode", "tree", "--nodes", "6", "--depth", "4", "--batch", "4",
                     "--threads", "1")
    yield s
    s.kill()


def _gen(ids, max_new, **sp):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, **sp}}


# ------------------------------------------------------------------ sampling without temperature
@pytest.mark.parametrize("params, named", [({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"),
                                           ({"min_p": 0.1}, "min_p"), ({"top_p": 0.9, "min_p": 0.2}, "top_p, min_p"),
                                           ({"top_p": 0.5, "temperature": None}, "top_p")])
def test_sampling_parameters_without_temperature_are_refused_by_name(params, named):
    with pytest.raises(BadRequest) as e:
        parse_sampling(params)
    msg = str(e.value)
    assert f"sampling_params {named}" in msg and "send temperature 0" in msg, msg
    assert "temperature is absent" in msg
    # the OpenAI routes share the rule, the field named as sent
    body = {"prompt": [1, 2], **{k: v for k, v in params.items()}}
    with pytest.raises(BadRequest, match=rf"^{re.escape(named)} without temperature"):
        oa.parse_completion(body, None, 256, "tiny")
    with pytest.raises(BadRequest, match=rf"^{re.escape(named)} without temperature"):
        oa.parse_chat({"messages": [{"role": "user", "content": "hi"}], **params}, lambda m: [3], 256, "tiny",
                      lambda n: 10)


@pytest.mark.parametrize("params", [{}, None, {"max_new_tokens": 3}, {"top_p": 1.0}, {"top_k": -1},
                                    {"top_k": 1 << 30}, {"top_k": None}, {"min_p": 0}, {"min_p": 0.0},
                                    {"top_k": 1}, {"top_k": 1, "top_p": 0.5, "min_p": 0.3},
                                    {"temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.1},
                                    {"temperature": 0.0, "top_p": 0.5}])
def test_greedy_requests_stay_accepted(params):
    """No sampling parameter (greedy, as documented), neutral values, temperature 0, or top_k 1
    (greedy in SGLang too)."""
    parse_sampling(params)


def test_the_server_refuses_top_p_without_temperature(tree_server):
    url = tree_server.url()
    r = httpx.post(url + "/generate", json=_gen([1, 2, 3], 4, top_p=0.5), timeout=30)
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "top_p": 0.5, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("top_p without temperature"), r.text
    r = httpx.post(url + "/generate", json=_gen([1, 2, 3], 4, top_p=0.5, temperature=0), timeout=30)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ SGLang's nulls
@pytest.mark.parametrize("field", ["stop_regex", "beam_width", "watermark"])
def test_sglang_sampling_fields_are_taken_at_their_defaults(field):
    assert parse_sampling({field: None}).max_new_tokens == 128
    assert parse_generate({"input_ids": [1], "sampling_params": {field: None}}, vocab_size=256).prompts == [[1]]


@pytest.mark.parametrize("params, named", [({"stop_regex": "a+"}, "stop_regex"), ({"stop_regex": ["x"]}, "stop_regex"),
                                           ({"beam_width": 4}, "beam_width"),
                                           ({"watermark": {"enabled": True}}, "watermark"),
                                           ({"watermark": {"key": "k"}}, "watermark")])
def test_sglang_sampling_fields_that_change_the_answer_are_refused_by_name(params, named):
    with pytest.raises(BadRequest, match=rf"cannot honour sampling_params {named} "):
        parse_sampling(params)


@pytest.mark.parametrize("params", [{"stop_regex": []}, {"beam_width": 1}, {"watermark": {"enabled": False}},
                                    {"json_schema": ""}, {"regex": ""}])
def test_other_neutral_forms_sglang_takes(params):
    """SGLang: an empty stop_regex list matches nothing; beam_width 1 is no beam search
    (``BeamCoordinator.request_beam_width``); a watermark with enabled false is off; an empty
    grammar is unset (``SamplingParams.__post_init__``)."""
    parse_sampling(params)


def test_the_openai_routes_take_stop_regex_and_watermark_at_null():
    call = oa.parse_completion({"prompt": [1, 2], "stop_regex": None, "watermark": None}, None, 256, "tiny")
    assert call.prompts == [[1, 2]]
    with pytest.raises(BadRequest, match="cannot honour stop_regex"):
        oa.parse_completion({"prompt": [1, 2], "stop_regex": "x"}, None, 256, "tiny")


# ------------------------------------------------------------------------ unknown fields, bounded
def test_a_400_for_unknown_fields_names_a_few_and_counts_the_rest():
    params = {f"k{i:06d}": 1 for i in range(100_000)}
    with pytest.raises(BadRequest) as e:
        parse_sampling(params)
    msg = str(e.value)
    assert len(msg) < 300, len(msg)
    assert msg.startswith("unknown sampling_params: k000000, k000001, k000002, k000003, k000004 and 99995 more")
    with pytest.raises(BadRequest) as e:
        parse_generate({"input_ids": [1], **{f"f{i}": 1 for i in range(5000)}})
    assert len(str(e.value)) < 300 and str(e.value).endswith("and 4995 more")
    # a long name is cut, not echoed whole
    with pytest.raises(BadRequest) as e:
        parse_sampling({"x" * 1_000_000: 1})
    assert len(str(e.value)) < 300
    with pytest.raises(BadRequest) as e:
        oa.parse_chat({"messages": [{"role": "user", "content": "x", **{f"m{i}": 1 for i in range(1000)}}]},
                      lambda m: [3], 256, "tiny", lambda n: 10)
    assert len(str(e.value)) < 300 and "and 995 more" in str(e.value)


def test_the_server_answers_100k_unknown_keys_with_a_short_400(tree_server):
    body = {"input_ids": [1, 2], "sampling_params": {f"k{i}": 1 for i in range(100_000)}}
    r = httpx.post(tree_server.url() + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and len(r.content) < 1000, len(r.content)
    assert "and 99995 more" in r.json()["error"]["message"]


# -------------------------------------------------------------------------------- SGLang's routes
def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_sglang_routes_ready_server_info_model_info_and_put(tree_server):
    url = tree_server.url()
    r = httpx.get(url + "/ready", timeout=10)
    assert r.status_code == 200
    # PUT /generate is POST /generate (SGLang takes both)
    post = httpx.post(url + "/generate", json=_gen([5, 6, 7], 8), timeout=60)
    put = httpx.put(url + "/generate", json=_gen([5, 6, 7], 8), timeout=60)
    assert put.status_code == 200 and put.json()["output_ids"] == post.json()["output_ids"]
    info = httpx.get(url + "/server_info", timeout=10).json()
    old = httpx.get(url + "/get_server_info", timeout=10).json()
    assert set(info) == set(old) and info["model"] == "tiny" and info["max_running_requests"] == 4
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 4
    # SGLang's startup_time is a dict of phase durations; a field of that name must not be a timestamp
    assert not isinstance(info.get("startup_time", {}), (int, float))
    # bench_serving's accept length: tokens per request per verify pass, the server's tau
    tau = _metric(httpx.get(url + "/metrics", timeout=10).text, "specpilot_tau")
    assert state["avg_spec_accept_length"] == pytest.approx(info["tau"]) and tau == pytest.approx(info["tau"], 1e-5)
    assert state["avg_spec_accept_length"] >= 1.0
    model = httpx.get(url + "/model_info", timeout=10).json()
    assert model == httpx.get(url + "/get_model_info", timeout=10).json()
    assert model["model_path"] == "tiny" and model["served_model_name"] == "tiny" and model["is_generation"] is True
    assert model["model_type"] == "llama" and model["has_image_understanding"] is False
    assert model["preferred_sampling_params"] is None


def test_spec_accept_length_is_sglangs_completion_tokens_per_verify_pass(tree_server):
    url = tree_server.url()

    def counts():
        text = httpx.get(url + "/metrics", timeout=10).text
        return _metric(text, "specpilot_draft_tokens_total"), _metric(text, "specpilot_accepted_draft_tokens_total")

    before = counts()
    body = httpx.post(url + "/generate", json=_gen([3, 1, 4, 1, 5, 9, 2, 6] * 3, 24, ignore_eos=True), timeout=60).json()
    after = counts()
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 24 and meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
    # SGLang's draft counts: each pass checks its tree's 6 nodes; the accepted ones and the bonus
    # token of each pass, with the prefill's token, make the completion (the last pass may overrun it)
    ct, correct, proposed = meta["spec_verify_ct"], meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"]
    assert 0 < proposed <= 6 * ct and 0 <= correct <= proposed
    assert meta["spec_accept_rate"] == correct / proposed
    assert 1 + correct + ct >= 24 and 1 + correct + ct - 24 <= 6
    # the server's counters moved by this request's counts (it ran alone)
    assert (after[0] - before[0], after[1] - before[1]) == (proposed, correct)
    # one token: the prefill's, no verify pass: SGLang leaves the spec fields out
    one = httpx.post(url + "/generate", json=_gen([3, 1, 4], 1), timeout=60).json()["meta_info"]
    assert one["completion_tokens"] == 1 and not [k for k in one if k.startswith("spec_")], one
    # streamed: the fields describe the whole request, on its last event (SGLang computes them at the finish)
    r = httpx.post(url + "/generate", json={**_gen([2, 7, 1, 8], 20, ignore_eos=True), "stream": True}, timeout=60)
    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    last = events[-1]["meta_info"]
    assert last["spec_accept_length"] == 20 / last["spec_verify_ct"]
    assert all("spec_accept_length" not in e["meta_info"] for e in events[:-1])


def test_draft_counts_are_the_requests_own():
    """``spec_num_correct_drafts`` is the sum of the request's accepted drafts over its passes,
    ``spec_num_proposed_drafts`` the drafts its passes checked; a request whose passes checked no
    draft (an empty drafter) has no rate, as SGLang computes none without proposed drafts."""
    from types import SimpleNamespace

    from specpilot.engine.batch.requests import Request
    from specpilot.engine.http_api import parse_sampling
    from specpilot.engine.server import ServeOptions, ServeState

    eng = SimpleNamespace(spec=SimpleNamespace(mode="tree"), decode=lambda ids, **k: "x" * len(ids))
    state = ServeState(eng, None, ServeOptions())
    r = Request([1, 2], 9)
    r.output, r.steps, r.accepts, r.proposed = list(range(9)), 3, [2, 0, 3], 18
    r.finish = {"type": "length", "length": 9}
    sp = parse_sampling({"max_new_tokens": 9})
    meta = state.answer(r, sp)["meta_info"]
    assert (meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"]) == (5, 18)
    assert meta["spec_accept_rate"] == 5 / 18 and meta["spec_accept_length"] == 3.0
    r.accepts, r.proposed = [0, 0, 0], 0
    meta = state.answer(r, sp)["meta_info"]
    assert meta["spec_verify_ct"] == 3 and "spec_accept_rate" not in meta and "spec_num_proposed_drafts" not in meta


def test_model_info_names_the_folder_the_tokenizer_loads_from(tmp_path):
    """``tokenizer_path``: where ``bench_serving`` (given no ``--tokenizer``) loads the tokenizer;
    the model's folder when its tokenizer comes from one, else the model's name (random weights)."""
    from types import SimpleNamespace

    from specpilot.engine.server import ServeOptions, ServeState
    from specpilot.engine.spec import EngineSpec

    def info(weights, tokenizer):
        eng = SimpleNamespace(model_name="smollm2-135m-instruct", tokenizer=tokenizer,
                              spec=EngineSpec.parse("engine:model=smollm2,mode=tree"),
                              info={"weights": weights}, model=SimpleNamespace(spec=SimpleNamespace(raw={})))
        return ServeState(eng, None, ServeOptions()).model_info()

    got = info(str(tmp_path), object())
    assert got["tokenizer_path"] == str(tmp_path) and got["model_path"] == "smollm2-135m-instruct"
    assert got["engine"] == "engine:model=smollm2,mode=tree,batch=1"
    assert info("random", None)["tokenizer_path"] == "smollm2-135m-instruct"
    assert info(str(tmp_path), None)["tokenizer_path"] == "smollm2-135m-instruct"   # no tokenizer there


# ---------------------------------------------------------------------------- in process, mode ar
def _app(mode: str = "ar", batch: int = 2, max_queue: int = 8):
    from specpilot.engine.api import load_engine
    from specpilot.engine.server import ServeOptions, ServeState, make_app

    eng = load_engine(f"engine:model=tiny,mode={mode},threads=1,batch={batch}")
    lines: list[str] = []
    state = ServeState(eng, eng.batch_decoder(max_queue=max_queue), ServeOptions(log=lines.append))
    return state, make_app(state), lines


def test_mode_ar_answers_carry_no_spec_fields():
    state, app, lines = _app("ar")
    state.start_engine()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as c:
            empty = (await c.post("/generate", json=_gen([1, 2, 3], 0), timeout=60)).json()
            assert empty["output_ids"] == []
            gen = (await c.post("/generate", json=_gen([1, 2, 3], 6), timeout=60)).json()
            streamed = await c.post("/generate", json={**_gen([1, 2, 3], 6), "stream": True}, timeout=60)
            info = (await c.get("/server_info")).json()
            ready = (await c.get("/ready")).status_code
            state.draining = True
            not_ready = (await c.get("/ready")).status_code
            return gen, streamed.text, info, ready, not_ready

    try:
        gen, streamed, info, ready, not_ready = asyncio.run(main())
    finally:
        state.join_engine()
    assert gen["meta_info"]["completion_tokens"] == 6
    assert not [k for k in gen["meta_info"] if k.startswith("spec_")], gen["meta_info"]
    assert "spec_" not in streamed
    assert "avg_spec_accept_length" not in info["internal_states"][0]
    assert ready == 200 and not_ready == 503
    # the request log: a request of no tokens has no latency to give, and no unit after its dash
    assert re.search(r"0 generated, ttft -, itl -, e2e [\d.]+ s,", lines[0]), lines
    assert re.search(r"6 generated, ttft [\d.]+ s, itl [\d.]+ s, e2e [\d.]+ s,", lines[1]), lines


def test_openai_clients_get_openai_s_error_object_model_route_and_ids():
    """An OpenAI client reads error.type and error.param (they were absent), retrieves a model by
    its route (404 before), finds its completion's id in the request log (it had another), and may
    send a message's name and store/metadata/service_tier, which touch no greedy answer (400 before)."""
    state, app, lines = _app("ar")
    state.start_engine()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as c:
            bad = await c.post("/v1/completions", json={"prompt": [1, 2], "n": 2})
            native = await c.post("/generate", json=_gen([1, 2], 2, top_p=0.5))
            one = await c.get("/v1/models/tiny")
            other = await c.get("/v1/models/other/name")
            done = (await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "store": False,
                                                          "metadata": {"team": "a"}, "service_tier": "auto"})).json()
            many = (await c.post("/v1/completions", json={"prompt": [[1, 2], [3, 4]], "max_tokens": 2})).json()
            named = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi",
                                                                             "name": "bob"}]})
            nameless = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi",
                                                                                "name": 5}]})
            return bad, native, one, other, done, many, named, nameless

    try:
        bad, native, one, other, done, many, named, nameless = asyncio.run(main())
    finally:
        state.join_engine()
    err = bad.json()["error"]
    assert bad.status_code == 400 and err["type"] == "BadRequestError" and err["param"] is None and err["code"] == 400
    assert native.status_code == 400 and native.json()["error"]["type"] == "BadRequestError"
    assert one.status_code == 200 and one.json()["id"] == "tiny" and one.json()["object"] == "model"
    assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError"
    assert "model 'other/name' is not served here" in other.json()["error"]["message"]
    assert done["object"] == "text_completion" and f"request {done['id']}:" in lines[0], (done["id"], lines)
    assert f"request {many['id']}-0:" in lines[1] and f"request {many['id']}-1:" in lines[2], lines
    # the tiny model has no chat template: the message passes the checks and meets that refusal
    assert named.status_code == 400 and "no chat template" in named.json()["error"]["message"]
    assert nameless.status_code == 400 and "messages[0].name must be a non-empty string" in nameless.text


# --------------------------------------------------------------- a client leaving while queued
async def _asgi(app, path: str, body: dict, gone: asyncio.Event, spec: str):
    """One request through the ASGI app as a server reporting ASGI ``spec`` sends it: the body, then
    ``http.disconnect`` once ``gone`` is set; after that, sends are dropped (uvicorn's way)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"serve"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    read = False
    sent: list[dict] = []

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if not gone.is_set():
            sent.append(message)

    await app(scope, receive, send)
    return sent


_STREAM = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 50}}


@pytest.mark.parametrize("path, body, spec", [
    ("/generate", _STREAM, "2.4"),
    ("/v1/completions", {"prompt": [5, 6, 7], "stream": True, "max_tokens": 50}, "2.4"),
    ("/generate", _STREAM, "2.3"),   # uvicorn's: Starlette's listener and the stream's own both wait
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 50}}, "2.3"),
], ids=["generate-stream-2.4", "openai-stream-2.4", "generate-stream-2.3", "generate-2.3"])
def test_a_request_whose_client_leaves_while_queued_never_runs(path, body, spec):
    """One slot, held by a long request; a second waits in the queue and its client leaves: it is
    dropped then (0 tokens, finish abort) while the first still runs, not admitted and run later.
    At ASGI spec 2.4 Starlette's StreamingResponse does not listen for the disconnect itself (and
    uvicorn drops what is sent after it), so the stream has to watch for it."""
    state, app, lines = _app("ar", batch=1)
    dec = state.decoder
    state.start_engine()

    async def until(cond, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, (dec.load(), lines)
            await asyncio.sleep(0.01)

    async def main():
        a_gone, b_gone = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(_asgi(app, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 1900, "ignore_eos": True}}, a_gone, "2.3"))
        await until(lambda: dec.load() == (1, 0))
        b = asyncio.ensure_future(_asgi(app, path, body, b_gone, spec))
        await until(lambda: dec.load() == (1, 1))
        b_gone.set()
        await asyncio.wait_for(b, 5)   # before the fix: it stayed queued until the long request ended
        await until(lambda: len(lines) == 1)
        running = not a.done() and dec.load()[0] == 1
        a_gone.set()
        await asyncio.wait_for(a, 30)
        await until(lambda: len(lines) == 2)   # the long one, cancelled at its next step
        return running

    try:
        still_running = asyncio.run(main())
    finally:
        state.join_engine()
    assert still_running
    assert re.search(r"prompt 3 tokens, 0 generated, .* finish abort$", lines[0]), lines
    assert re.search(r"prompt 3 tokens, [1-9]\d* generated, .* finish abort$", lines[1]), lines
    m = state.metrics
    assert m.finished["abort"] == 2 and m.finished["length"] == 0
    # aborted requests stay out of the latencies; only the prompt that was prefilled counts
    assert (m.queue.count, m.ttft.count, m.itl.count, m.e2e.count) == (0, 0, 0, 0)
    assert m.prompt_tokens == 3


# ------------------------------------------------- a stream's text and half-decoded characters
def _byte_state():
    """A server state whose engine decodes ids as UTF-8 bytes (the tiny model's tokenizer)."""
    from types import SimpleNamespace

    from specpilot.engine.server import ServeOptions, ServeState

    eng = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: bytes(ids).decode("utf-8", errors="replace"),
                          spec=SimpleNamespace(mode="ar"))
    return ServeState(eng, SimpleNamespace(cancel=lambda r: None), ServeOptions())


async def _stream_events(state, steps: list[bytes], sp, finish: dict) -> list[dict]:
    """The /generate stream's events for a request delivered ``steps`` (one update each; the last
    finishes it with ``finish``)."""
    from specpilot.engine.batch.requests import Request
    from specpilot.engine.responses import stream_sglang as _stream

    class Client:   # never leaves
        async def receive(self):
            await asyncio.Event().wait()

    r = Request([1], 1000)
    updates: asyncio.Queue = asyncio.Queue()
    gen = _stream(state, Client(), r, sp, updates)
    out = []
    for i, toks in enumerate(steps):
        r.output.extend(toks)
        last = i == len(steps) - 1
        if last:
            r.finish, r.t_done = finish, time.perf_counter()
        updates.put_nowait((r, last))
        out.append(json.loads((await gen.__anext__())[6:]))
    assert await gen.__anext__() == b"data: [DONE]\n\n"
    await gen.aclose()
    return out


def test_the_native_stream_holds_back_a_character_whose_bytes_have_not_all_come():
    """SGLang's incremental detokenizer: an event's text stops short of a character whose bytes have
    not all come, so each extends the one before (they ended in U+FFFD: "ab\ufffd", then "ab🍎 ");
    the last carries the whole text, the non-streamed answer's (a character the length limit cut
    stays U+FFFD there). With a stop string the last is cut before the match, shorter."""
    from specpilot.engine.http_api import Sampling

    state = _byte_state()
    apple, banana = "🍎".encode(), "🍌".encode()
    steps = [b"a", b"b" + apple[:1], apple[1:2], apple[2:3], apple[3:] + b" ", banana[:2], banana[2:], banana[:2]]
    ev = asyncio.run(_stream_events(state, steps, Sampling(), {"type": "length", "length": 16}))
    texts = [e["text"] for e in ev]
    assert texts == ["a", "ab", "ab", "ab", "ab🍎 ", "ab🍎 ", "ab🍎 🍌", "ab🍎 🍌\ufffd"]
    assert [e["output_ids"] for e in ev] == [list(b"".join(steps[:i + 1])) for i in range(len(steps))]
    assert all(e["meta_info"]["completion_tokens"] == len(e["output_ids"]) for e in ev)

    ev = asyncio.run(_stream_events(state, [b"ab ", banana[:2], banana[2:], b"!"], Sampling(stop=("🍌!",)),
                                    {"type": "stop", "matched": "🍌!"}))
    assert [e["text"] for e in ev] == ["ab ", "ab ", "ab 🍌", "ab "]
    # the OpenAI streams' deltas: never past the end of the text, whatever the hold
    from specpilot.engine.responses import sendable as _sendable

    assert _sendable("abc", "", (), 5) == "" and _sendable("ab\ufffd", "a") == "b"
    assert _sendable("abcd", "ab", ("cd",)) == "" and _sendable("xy", "ab") == ""


def test_server_without_a_socket_binds_its_own():
    """``Server`` given no socket listens on the options' host and port itself (``serve`` binds
    before importing torch and hands its socket over; a library caller need not)."""
    from types import SimpleNamespace

    from specpilot.engine.server import Server, ServeOptions

    dec = SimpleNamespace(capacity_needed=lambda p, n: 4, cache=SimpleNamespace(max_seq=64))
    srv = Server(SimpleNamespace(batch_decoder=lambda max_queue: dec), ServeOptions(host="127.0.0.1", port=0))
    try:
        assert srv.port > 0 and srv.sock.getsockname()[0] == "127.0.0.1"
    finally:
        srv.sock.close()


def test_the_greedy_temperature_bound_is_sglangs():
    """SGLang decodes greedily for 0 <= temperature < 1e-6; at 1e-6 it samples, so it is refused here."""
    from specpilot.engine.http_api import BadRequest, parse_sampling

    assert parse_sampling({"temperature": 9.9e-7}).max_new_tokens == 128
    with pytest.raises(BadRequest, match="decodes greedily only"):
        parse_sampling({"temperature": 1e-6})
    assert parse_sampling({"temperature": 1e-6, "top_k": 1}).max_new_tokens == 128
