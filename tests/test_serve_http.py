"""``specpilot serve`` under concurrent load: a real server process on loopback, real httpx clients.

Server A (tiny model, 8 slots): hundreds of concurrent clients all answered, each output equal to
the model's own one-request greedy output; SGLang's streaming format; every kind of malformed
request a 400 with a JSON error; sampling parameters honoured or refused by name; max_new_tokens 0
answered empty among concurrent requests; a client that leaves frees its slot; /metrics in
Prometheus text; SIGTERM drains the requests in flight.
Server B (a tiny Llama folder whose EOS the greedy text reaches, 1 slot, queue of 1, 0.5 s grace):
EOS and ignore_eos, 503 + Retry-After when the queue is full, SIGTERM past the grace fails the
rest cleanly. Both exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import cli_imports

from specpilot.engine.api import load_engine
from specpilot.engine.spec import EngineSpec

PROMPTS = [[(7 * i + j) % 256 for j in range(3 + i % 5)] * 2 for i in range(10)]
REPO = Path(__file__).resolve().parents[1]


class ServeProcess:
    """``specpilot serve ARGS --port 0`` in a subprocess; :meth:`url` waits for it to listen."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", *map(str, args), "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.err: list[str] = []
        self._url = None
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.err.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m and self._url is None:
                self._url = m.group(1)
                self._found.set()

    def url(self, timeout=120.0) -> str:
        if not self._found.wait(timeout):
            self.kill()
            pytest.fail("specpilot serve did not start: " + "".join(self.err)[-1000:])
        return self._url

    def stop(self, timeout=60.0) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, rest = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("specpilot serve did not stop on SIGTERM")
        # communicate reads stderr too: the last lines go to whichever reader gets them first
        self._reader.join(timeout=10)
        self.err.extend(rest.splitlines(keepends=True))
        return self.proc.returncode, out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _info(url):
    return httpx.get(url + "/get_server_info", timeout=10).json()


def _wait_running(url, n, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _info(url)["running"] == n:
            return True
        time.sleep(0.05)
    return False


def _gen(ids, max_new, **sp):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **sp}}


@pytest.fixture(scope="module")
def server_a():
    s = ServeProcess("--model", "tiny", "--mode", "tree", "--nodes", "6", "--depth", "4", "--batch", "16",
                     "--max-queue", "1024", "--threads", "1", "--log-requests")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def greedy():
    eng = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar"))
    cache = {}

    def get(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = eng.generate(ids, n).output_ids
        return cache[key]

    return get


def test_hundreds_of_concurrent_clients_are_batched_and_lossless(server_a, greedy):
    url = server_a.url()
    before = _info(url)["spec_verify_ct"]

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            return await asyncio.gather(*[c.post(url + "/generate", json=_gen(PROMPTS[i % 10], 3 + i % 4))
                                          for i in range(200)])

    rs = asyncio.run(main())
    assert [r.status_code for r in rs] == [200] * 200
    steps = 0
    for i, r in enumerate(rs):
        body = r.json()
        assert body["output_ids"] == greedy(PROMPTS[i % 10], 3 + i % 4)
        assert body["meta_info"]["completion_tokens"] == 3 + i % 4
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 3 + i % 4}
        steps += body["meta_info"]["spec_verify_ct"]
    # one verify pass served several requests: the server ran fewer passes than the requests counted
    assert _info(url)["spec_verify_ct"] - before < steps


def test_streaming_in_sglangs_format(server_a, greedy):
    url = server_a.url()
    n = 60   # enough tokens that a loaded machine still sends them in several events
    events = []
    with httpx.stream("POST", url + "/generate", json={**_gen(PROMPTS[3], n), "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line[6:])
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == n
    assert all(c["output_ids"] == chunks[-1]["output_ids"][:len(c["output_ids"])] for c in chunks)
    assert chunks[-1]["output_ids"] == greedy(PROMPTS[3], n)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_text_prompts_and_stop_token_ids(server_a, greedy):
    url = server_a.url()
    r = httpx.post(url + "/generate", json={"text": ["abcabc", "xyz"], "sampling_params": {"max_new_tokens": 5}},
                   timeout=60)
    assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 2
    assert r.json()[0]["output_ids"] == greedy(list(b"abcabc"), 5)
    want = greedy(PROMPTS[1], 16)
    stop = want[6]
    r = httpx.post(url + "/generate", json=_gen(PROMPTS[1], 16, stop_token_ids=[stop]), timeout=60).json()
    assert r["output_ids"] == want[:want.index(stop) + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # the text leaves the matched stop token out, as SGLang's detokenizer does, unless no_stop_trim
    tok = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar"))
    assert r["text"] == tok.decode(want[:want.index(stop)])
    kept = httpx.post(url + "/generate", json=_gen(PROMPTS[1], 16, stop_token_ids=[stop], no_stop_trim=True),
                      timeout=60).json()
    assert kept["text"] == tok.decode(want[:want.index(stop) + 1]) and kept["output_ids"] == r["output_ids"]
    streamed = _events(httpx.post(url + "/generate", json={**_gen(PROMPTS[1], 16, stop_token_ids=[stop]),
                                                           "stream": True}, timeout=60))
    assert streamed[-1]["text"] == r["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(streamed, streamed[1:]))   # no event takes back text
    r = httpx.post(url + "/generate", json=_gen(PROMPTS[1], 16, stop_token_ids=[stop], min_new_tokens=4), timeout=60)
    assert r.status_code == 400 and "min_new_tokens" in r.json()["error"]["message"]
    r = httpx.post(url + "/generate", json=_gen(PROMPTS[1], 16, stop_token_ids=[stop], min_new_tokens=0), timeout=60)
    assert r.json()["output_ids"] == want[:want.index(stop) + 1]


RAW_BAD = [
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GARBAGE\r\n\r\n",
]

BAD_BODIES = [
    (b'{"text": "\\ud800"}', "lone surrogate"),
    (b'{"text": "ok", "sampling_params": {"stop": "\\udfff"}}', "lone surrogate"),
    (b"[" * 50000 + b"]" * 50000, "nests deeper"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nests deeper"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": NaN}}', "NaN"),
    (b"\xff\xfe\x00", "not UTF-8"),
    (b"", "JSON body"),
    (b"[1, 2, 3]", "JSON object"),
    (b'{"text": "hi"', "not valid JSON"),
    (b'{"input_ids": [1, 2], "text": "x"}', "exactly one"),
    (b'{"input_ids": []}', "input_ids"),
    (b'{"input_ids": [1, true]}', "input_ids"),
    (b'{"input_ids": [1, 999999]}', "outside the vocabulary"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1e400}}', "overflows"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1' + b"0" * 5000 + b'}}', "number"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100000000000000000000000}}', "max_new_tokens"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100000}}', "You requested a total of 100002 tokens"),
    (b'{"input_ids": [1, 2], "sampling_params": "fast"}', "sampling_params"),
    (b'{"input_ids": [1, 2], "sampling_params": {"stop": [1]}}', "stop"),
    (b'{"input_ids": [1, 2], "stream": "yes"}', "stream"),
    (b'{"input_ids": [[1], [2]], "stream": true}', "stream"),
    (b'{"input_ids": [1, 2], "bogus": 1}', "bogus"),
]


@pytest.mark.parametrize("raw", RAW_BAD, ids=range(len(RAW_BAD)))
def test_malformed_http_gets_a_json_400(server_a, raw):
    url = server_a.url()
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data[:200]
    assert "message" in json.loads(body)["error"]


def test_a_body_in_a_content_encoding_it_does_not_decode_is_refused(server_a, greedy):
    """A body said to be gzip (or any coding but identity) was read as JSON as it came; now 415."""
    import gzip

    url, body = server_a.url() + "/generate", json.dumps(_gen([3, 4, 5], 2)).encode()
    for sent, coding in ((body, "gzip"), (gzip.compress(body), "gzip"), (body, "br")):
        r = httpx.post(url, content=sent, headers={"content-encoding": coding}, timeout=30)
        assert r.status_code == 415 and f"Content-Encoding '{coding}' is not supported" in r.json()["error"]["message"]
    r = httpx.post(url, content=body, headers={"content-encoding": "identity"}, timeout=30)
    assert r.status_code == 200 and r.json()["output_ids"] == greedy([3, 4, 5], 2)


@pytest.mark.parametrize("body,words", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_malformed_requests_get_400_naming_the_problem(server_a, body, words):
    r = httpx.post(server_a.url() + "/generate", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("params,named", [({"repetition_penalty": 1.2}, "repetition_penalty"),
                                          ({"frequency_penalty": 0.5, "json_schema": "{}"}, "frequency_penalty, json_schema"),
                                          ({"temperature": 0.8}, "temperature"),
                                          ({"n": 2}, "n"),
                                          ({"top_q": 1}, "top_q")])
def test_sampling_params_that_change_the_answer_are_refused_by_name(server_a, params, named):
    r = httpx.post(server_a.url() + "/generate", json=_gen([1, 2, 3], 4, **params), timeout=30)
    assert r.status_code == 400 and named in r.json()["error"]["message"]


def test_neutral_parameters_are_accepted(server_a, greedy):
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "top_p": 0.9,
                                                       "top_k": 40, "min_p": 0.0, "repetition_penalty": 1.0,
                                                       "frequency_penalty": 0.0, "sampling_seed": 3},
            "return_logprob": False, "logprob_start_len": -1, "lora_path": None, "return_routed_experts": False,
            "rid": "my-id", "stream": False}
    r = httpx.post(server_a.url() + "/generate", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["output_ids"] == greedy([4, 5, 6], 4)
    assert r.json()["meta_info"]["id"] == "my-id"
    r = httpx.post(server_a.url() + "/generate", json={**body, "return_logprob": True}, timeout=30)
    assert r.status_code == 400 and "return_logprob" in r.json()["error"]["message"]


def test_client_disconnect_cancels_and_frees_the_slot(server_a):
    url = server_a.url()
    assert _wait_running(url, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json=_gen([9, 9, 9], 1500), timeout=httpx.Timeout(30, read=0.5))
    assert _wait_running(url, 0, timeout=10)
    with httpx.stream("POST", url + "/generate", json={**_gen([8, 8, 8], 1500), "stream": True}, timeout=30) as r:
        it = r.iter_lines()
        assert next(it).startswith("data: ")
    assert _wait_running(url, 0, timeout=10)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert re.search(r'^specpilot_requests_total\{outcome="abort"\} [2-9]', metrics, re.M)


def test_metrics_info_health_flush(server_a):
    url = server_a.url()
    text = httpx.get(url + "/metrics", timeout=10).text
    names = set()
    for line in text.splitlines():
        if line.startswith("# "):
            assert re.match(r"# (HELP|TYPE) specpilot_\w+ ", line)
            continue
        m = re.match(r'^(specpilot_\w+?)(\{[a-z_]+="[^"]*"\})? (-?[0-9.e+]+|\+Inf)$', line)
        assert m, line
        names.add(m.group(1))
    for n in ("specpilot_requests_total", "specpilot_generation_tokens_total", "specpilot_tau",
              "specpilot_queue_depth", "specpilot_overlapped_steps_total", "specpilot_eager_steps_total",
              "specpilot_eager_step_seconds_total",
              "specpilot_step_seconds_bucket", "specpilot_time_to_first_token_seconds_sum",
              "specpilot_inter_token_latency_seconds_count", "specpilot_e2e_request_latency_seconds_bucket"):
        assert n in names
    assert re.search(r'^specpilot_requests_total\{outcome="length"\} [1-9]', text, re.M)
    info = _info(url)
    assert info["max_running_requests"] == 16 and info["budget"] == "shared" and info["model"] == "tiny"
    assert info["qview"] is None
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.head(url + "/health", timeout=10).status_code == 200
    assert httpx.head(url + "/health_generate", timeout=10).status_code == 200
    assert httpx.get(url + "/get_model_info", timeout=10).json()["is_generation"] is True
    assert _wait_running(url, 0)
    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 200
    r = httpx.get(url + "/no_such_thing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_a_request_id_in_use_is_refused(server_a):
    url = server_a.url()
    r = httpx.post(url + "/generate", json={**_gen([[1, 2], [3, 4]], 2), "rid": ["x", "x"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "rid 'x' is given twice in this request's list"
    results = {}

    def long():
        results["long"] = httpx.post(url + "/generate", json={**_gen([5, 6], 400, ignore_eos=True), "rid": "dup"},
                                     timeout=120)

    t = threading.Thread(target=long)
    t.start()
    assert _wait_running(url, 1)
    r = httpx.post(url + "/generate", json={**_gen([7, 8], 2), "rid": "dup"}, timeout=30)
    assert r.status_code == 400 and "'dup' is already in use" in r.json()["error"]["message"]
    t.join(120)
    assert results["long"].status_code == 200 and results["long"].json()["meta_info"]["id"] == "dup"
    # once it is done, the id is free again
    assert httpx.post(url + "/generate", json={**_gen([7, 8], 2), "rid": "dup"}, timeout=30).status_code == 200
    # an empty rid is no rid: never in use (it stayed "in use" after its request finished)
    for _ in range(2):
        r = httpx.post(url + "/generate", json={**_gen([7, 8], 2), "rid": ""}, timeout=30)
        assert r.status_code == 200 and r.json()["meta_info"]["id"]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def _counts(url) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = [f'specpilot_requests_total{{outcome="{o}"}}' for o in ("length", "eos", "stop", "abort", "error")]
    names += ['specpilot_rejected_requests_total{reason="bad_request"}', "specpilot_generation_tokens_total",
              "specpilot_prompt_tokens_total", "specpilot_prefill_passes_total", "specpilot_verify_steps_total",
              "specpilot_time_to_first_token_seconds_count", "specpilot_e2e_request_latency_seconds_count"]
    return {n: _metric(text, n) for n in names}


def _empty_answer(body, prompt_len):
    assert body["text"] == "" and body["output_ids"] == []
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == prompt_len and meta["completion_tokens"] == 0
    assert not [k for k in meta if k.startswith("spec_")]   # no verify pass: SGLang leaves the spec fields out
    assert meta["finish_reason"] == {"type": "length", "length": 0}


def test_max_new_tokens_0_answers_empty_among_concurrent_requests(server_a, greedy):
    """SGLang's ``max_new_tokens`` 0 (a client scoring or caching a prompt): the prompt checked, an
    empty answer with finish_reason length 0, streamed as one event and [DONE]; concurrent requests
    around it decode as before; the engine runs nothing for it; /metrics counts it as a request, and
    leaves it out of the latency histograms."""
    url = server_a.url()
    assert _wait_running(url, 0)
    before = _counts(url)
    plan = [(PROMPTS[i % 10], 0 if i % 3 == 0 else 3 + i % 4, i % 5 == 0) for i in range(60)]

    async def one(c, ids, n, stream):
        r = await c.post(url + "/generate", json={**_gen(ids, n), "stream": stream})
        return r.status_code, ([json.loads(e[6:]) if e != "data: [DONE]" else e
                                for e in r.text.split("\n\n") if e] if stream else r.json())

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*[one(c, *p) for p in plan])

    rs = asyncio.run(main())
    assert [code for code, _ in rs] == [200] * len(plan)
    for (ids, n, stream), (_, got) in zip(plan, rs):
        if stream:   # events, then [DONE]; a 0-token request has one event, the final one
            assert got[-1] == "data: [DONE]" and (len(got) == 2 if n == 0 else len(got) >= 2)
            got = got[-2]
        if n == 0:
            _empty_answer(got, len(ids))
        else:
            assert got["output_ids"] == greedy(ids, n) and got["meta_info"]["finish_reason"]["length"] == n
    after = _counts(url)
    done = sum(after[k] - before[k] for k in after if "requests_total{outcome" in k)
    assert done == len(plan) and after['specpilot_requests_total{outcome="length"}'] - \
        before['specpilot_requests_total{outcome="length"}'] == len(plan)
    assert after["specpilot_generation_tokens_total"] - before["specpilot_generation_tokens_total"] == \
        sum(n for _, n, _ in plan)
    assert after["specpilot_prompt_tokens_total"] - before["specpilot_prompt_tokens_total"] == \
        sum(len(ids) for ids, _, _ in plan)
    zeros = sum(1 for _, n, _ in plan if n == 0)
    # only requests that asked for tokens have latencies: a 0-token answer's ~0 s stays out of them
    assert after["specpilot_e2e_request_latency_seconds_count"] - \
        before["specpilot_e2e_request_latency_seconds_count"] == len(plan) - zeros
    assert after["specpilot_time_to_first_token_seconds_count"] - \
        before["specpilot_time_to_first_token_seconds_count"] == len(plan) - zeros

    # only 0-token requests (a list, a text prompt, a stream): the engine runs no pass for them
    before = _counts(url)
    r = httpx.post(url + "/generate", json={"input_ids": [PROMPTS[0], PROMPTS[1]],
                                            "sampling_params": {"max_new_tokens": 0}}, timeout=30)
    assert r.status_code == 200 and len(r.json()) == 2
    for body, p in zip(r.json(), PROMPTS[:2]):
        _empty_answer(body, len(p))
    _empty_answer(httpx.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 0}},
                             timeout=30).json(), len(b"hello"))
    after = _counts(url)
    for k in ("specpilot_prefill_passes_total", "specpilot_verify_steps_total", "specpilot_generation_tokens_total"):
        assert after[k] == before[k], k
    # a list with 0 beside a real request: each answered as asked, in order
    r = httpx.post(url + "/generate", json={"input_ids": [PROMPTS[2], PROMPTS[3]],
                                            "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 5}]},
                   timeout=60).json()
    _empty_answer(r[0], len(PROMPTS[2]))
    assert r[1]["output_ids"] == greedy(PROMPTS[3], 5)
    # its rid is free again once answered
    for _ in range(2):
        r = httpx.post(url + "/generate", json={**_gen([7, 8], 0), "rid": "score-me"}, timeout=30)
        assert r.status_code == 200 and r.json()["meta_info"]["id"] == "score-me"

    # the prompt is checked as for any request: the context (SGLang's rules and messages: a prompt of
    # the context length or more is refused, 0 new tokens or not), the vocabulary; a negative count too
    room = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    assert httpx.post(url + "/generate", json=_gen([1] * (room - 1), 0), timeout=30).status_code == 200
    refused = _counts(url)['specpilot_rejected_requests_total{reason="bad_request"}']
    too_long = f"The input ({room} tokens) is longer than the model's context length ({room} tokens)"
    cases = ((_gen([1] * room, 0), too_long),
             ({**_gen([1] * room, 0), "stream": True}, too_long),
             ({"input_ids": [[1, 2], [1] * room], "sampling_params": {"max_new_tokens": 0}}, too_long),
             (_gen([1] * (room + 1), 0), f"The input ({room + 1} tokens) is longer"),
             (_gen([1] * (room - 1), 2), f"maximum context length of {room} tokens. You requested a total of "
                                         f"{room + 1} tokens: {room - 1} tokens from the input messages and 2 tokens"),
             (_gen([1, 999], 0), "token id 999 is outside the vocabulary"),
             ({"input_ids": [[1, 2], [3, 999]], "sampling_params": {"max_new_tokens": 0}}, "999"),
             (_gen([1, 2], -1), "sampling_params.max_new_tokens must be an integer in [0, "))
    for body, words in cases:
        r = httpx.post(url + "/generate", json=body, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert _counts(url)['specpilot_rejected_requests_total{reason="bad_request"}'] - refused == len(cases)


def test_generate_without_max_new_tokens_takes_what_fits(server_a, greedy):
    """SGLang 0.5.23: a /generate that gives no max_new_tokens is not refused for the default's 128
    (its tokenizer manager checks the context only against a given one); the scheduler clips the
    default (128 absent, no bound when null) to what fits. A given one is still checked."""
    url = server_a.url()
    room = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    for sp, prompt_len, n in (({}, room - 5, 5), ({"max_new_tokens": None}, room - 40, 40),
                              ({}, room - 1, 1), ({}, 20, 128)):
        ids = [3] * prompt_len
        r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {**sp, "ignore_eos": True}},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert body["output_ids"] == greedy(ids, n)
    chunks = _events(httpx.post(url + "/generate", json={"input_ids": [3] * (room - 3), "stream": True,
                                                         "sampling_params": {"ignore_eos": True}}, timeout=60))
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    r = httpx.post(url + "/generate", json=_gen([3] * (room - 5), 128), timeout=30)
    assert r.status_code == 400 and f"{room - 5} tokens from the input messages and 128 tokens for the completion" \
        in r.json()["error"]["message"]


def _completion(url, **body):
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _events(r) -> list[dict]:
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines), r.text
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_openai_completions_are_the_greedy_text(server_a, greedy):
    url = server_a.url()
    tok = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar"))
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    assert model["id"] == "tiny" and 2000 < model["max_model_len"] < 2048   # the draft rows' share left out
    r = _completion(url, model="any-name", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["model"] == "any-name"
    assert body["choices"] == [{"index": 0, "text": tok.decode(greedy(PROMPTS[0], 12)), "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": len(PROMPTS[0]), "completion_tokens": 12,
                             "total_tokens": len(PROMPTS[0]) + 12}
    # a list of prompts: one choice each, in order; no max_tokens: OpenAI's 16
    r = _completion(url, prompt=PROMPTS[1:4]).json()
    assert [c["text"] for c in r["choices"]] == [tok.decode(greedy(p, 16)) for p in PROMPTS[1:4]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 48
    # text prompts go through the tokenizer (bytes for the tiny model)
    r = _completion(url, prompt="hello", max_tokens=5).json()
    assert r["choices"][0]["text"] == tok.decode(greedy(list(b"hello"), 5))


def test_openai_streaming_sends_deltas_and_holds_back_a_stop_string(server_a, greedy):
    url = server_a.url()
    tok = load_engine(EngineSpec.parse("engine:model=tiny,mode=ar"))
    p = PROMPTS[0]
    text = tok.decode(greedy(p, 24))
    r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 24, "stream": True,
                                                  "stream_options": {"include_usage": True}}, timeout=60)
    ev = _events(r)
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == text and len(ev) > 3
    assert ev[-2]["choices"][0]["finish_reason"] == "length" and ev[-1]["choices"] == []
    assert ev[-1]["usage"]["completion_tokens"] == 24 and all(e["object"] == "text_completion" for e in ev)
    # vLLM's continuous usage: every event says the tokens so far (how a load generator counts them)
    ev = _events(httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 24, "stream": True,
                                                          "stream_options": {"continuous_usage_stats": True}},
                            timeout=60))
    seen = [e["usage"]["completion_tokens"] for e in ev]
    assert seen == sorted(seen) and seen[-1] == 24 and all(e["usage"]["prompt_tokens"] == len(p) for e in ev)
    assert "".join(e["choices"][0]["text"] for e in ev) == text
    # a stop string from the middle of the text: no delta ever shows it, the pieces add up to the cut text
    stop = text[10:13]
    want = text[:text.find(stop)]
    ev = _events(httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 24, "stream": True,
                                                          "stop": stop}, timeout=60))
    sent = "".join(e["choices"][0]["text"] for e in ev)
    assert sent == want and ev[-1]["choices"][0]["finish_reason"] == "stop"
    assert _completion(url, prompt=p, max_tokens=24, stop=stop).json()["choices"][0]["text"] == want


@pytest.mark.parametrize("body, words", [
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be an integer in [1,"),
    ({"prompt": [1, 2], "max_completion_tokens": 3}, "unknown request fields: max_completion_tokens"),
    ({"prompt": [1, 2], "max_tokens": 2, "max_completion_tokens": 2}, "unknown request fields: max_completion_tokens"),
    ({"prompt": [1, 2], "temperature": 0.7}, "temperature: the embedded engine decodes greedily"),
    ({"prompt": [1, 2], "logprobs": 1}, "does not support logprobs"),
    ({"prompt": [1, 2], "echo": True}, "does not support echo"),
    ({"prompt": [1, 2], "best_of": 3}, "does not support best_of"),
    ({"prompt": [1, 2], "n": 2}, "n must be an integer in [1, 1]"),
    ({"prompt": [1, 2], "presence_penalty": 1.0}, "cannot honour presence_penalty"),
    ({"prompt": [1, 2], "min_tokens": 3}, "cannot honour min_tokens"),
    ({"prompt": [1, 2], "seed": "x"}, "seed must be an integer"),
    ({"prompt": [1, 2], "presence_penalty": "0"}, "presence_penalty must be a number"),
    ({"prompt": [1, 2], "user": 5}, "user must be a string"),
    ({"prompt": [1, 2], "metadata": {"a": 1}}, "metadata must be an object of string values"),
    ({"prompt": [1, 2], "store": "yes"}, "store must be true or false"),
    ({"prompt": [1, 2], "messages": []}, "unknown request fields: messages"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options needs stream: true"),
    ({"prompt": [1, 2], "stream": "yes"}, "stream must be true or false"),
    ({"prompt": [1, 2], "model": 3}, "model must be a non-empty string"),
    ({"prompt": []}, "prompt must be a non-empty string"),
    ({"prompt": [1, "a"]}, "prompt must be a non-empty string"),
    ({"prompt": [[1], []]}, "prompt must be a non-empty list of integers"),
    ({"prompt": [1, 999]}, "prompt: token id 999 is outside the vocabulary"),
    ({"prompt": [[1], [2]], "stream": True}, "stream with several prompts"),
    ({"prompt": [1, 2], "stop_token_ids": [999]}, "stop_token_ids: 999 is outside"),
    ({}, "prompt must be a non-empty string"),
])
def test_openai_bad_requests_get_400_naming_the_field(server_a, body, words):
    r = _completion(server_a.url(), **body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_the_load_generator_counts_every_token_on_either_api(server_a, api):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from loadgen import run_load
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    for stream in (True, False):
        res = run_load(server_a.url(), PROMPTS[:4], max_new_tokens=12, concurrency=4, num_prompts=8, stream=stream,
                       api=api, model="tiny")
        assert res["completed"] == 8 and res["output_tokens"] == 8 * 12 and res["api"] == api, res
        assert res["input_tokens"] == 2 * sum(len(p) for p in PROMPTS[:4])
        if stream:
            assert res["ttft_ms"]["p50"] is not None and res["itl_ms"]["p50"] is not None


def test_openai_chat_needs_a_chat_template(server_a):
    r = httpx.post(server_a.url() + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    assert r.status_code == 400 and "no chat template; use /v1/completions" in r.json()["error"]["message"]


def test_sigterm_drains_requests_in_flight(server_a, greedy):
    url = server_a.url()
    results = {}

    # long enough that all three are still running when the signal comes, even on a loaded machine
    n_new = 400

    def client(i):
        results[i] = httpx.post(url + "/generate", json=_gen(PROMPTS[i], n_new), timeout=120)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert _wait_running(url, 3)
    server_a.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        late = httpx.post(url + "/generate", json=_gen([1, 2], 2), timeout=10).status_code
    except httpx.TransportError:
        late = None
    assert late in (503, None)
    for t in threads:
        t.join(120)
    assert [results[i].status_code for i in range(3)] == [200] * 3
    assert [results[i].json()["output_ids"] for i in range(3)] == [greedy(PROMPTS[i], n_new) for i in range(3)]
    out, _ = server_a.proc.communicate(timeout=60)
    assert server_a.proc.returncode == 0
    assert "served" in out and "latency (ms)" in out
    assert "request" in "".join(server_a.err)   # --log-requests lines
    # batched steps count once, each request's share of them separately: tau's denominator
    header, _, row = out.split("served\n", 1)[1].splitlines()[:3]
    cols = dict(zip(re.split(r"\s{2,}", header.strip()), row.split()))
    assert 0 < int(cols["steps"]) < int(cols["request passes"]), out


# ---------------------------------------------------------------------------------- server B
@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A tiny Llama folder whose config names as EOS a token its greedy text reaches."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("serve_eos") / "model"
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                      initializer_range=0.5, bos_token_id=1, eos_token_id=95, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(folder))
    eng = load_engine(EngineSpec.parse(f"engine:model={folder},mode=ar"))
    want = eng.generate([5, 6, 7, 8], 24).output_ids
    eos = next(t for t in want[3:] if t not in want[:3])
    conf = json.loads((folder / "config.json").read_text())
    conf["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(conf))
    gen = folder / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = eos
        gen.write_text(json.dumps(g))
    return str(folder), want, eos


@pytest.fixture(scope="module")
def server_b(eos_model):
    s = ServeProcess("--model", eos_model[0], "--mode", "chain", "--depth", "3", "--batch", "1", "--max-queue", "1",
                     "--grace", "0.5", "--threads", "1")
    yield s
    s.kill()


def test_eos_and_ignore_eos(server_b, eos_model):
    _, want, eos = eos_model
    url = server_b.url()
    # the spec it reports starts this server again: batch=1 is kept (serve's own default is 8)
    spec = httpx.get(url + "/get_server_info", timeout=30).json()["engine"]
    assert ",batch=1" in spec and spec in "".join(server_b.err)
    from specpilot.engine.spec import EngineSpec

    assert EngineSpec.parse(spec).batch == 1
    r = httpx.post(url + "/generate", json=_gen([5, 6, 7, 8], 24), timeout=60).json()
    assert r["output_ids"] == want[:want.index(eos) + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    r = httpx.post(url + "/generate", json=_gen([5, 6, 7, 8], 24, ignore_eos=True), timeout=60).json()
    assert r["output_ids"] == want and r["meta_info"]["finish_reason"]["type"] == "length"
    # as SGLang: ignore_eos turns off stop_token_ids too (a fixed-length load run sends both)
    body = _gen([5, 6, 7, 8], 24, ignore_eos=True)
    body["sampling_params"]["stop_token_ids"] = [want[1]]
    r = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert r["output_ids"] == want and r["meta_info"]["finish_reason"]["type"] == "length"


def test_full_queue_answers_503_with_retry_after(server_b):
    url = server_b.url()

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            post = lambda: c.post(url + "/generate", json=_gen([3, 4, 5], 120, ignore_eos=True))  # noqa: E731
            # the burst follows once the first request holds the slot: sent all at once on a loaded
            # machine, the first can still be in the queue when the others arrive, and all but it get 503
            first = asyncio.create_task(post())
            while not first.done() and (await c.get(url + "/get_server_info")).json()["running"] != 1:
                await asyncio.sleep(0.02)
            rest = await asyncio.gather(*[post() for _ in range(5)])
            return [await first, *rest]

    rs = asyncio.run(main())
    codes = sorted(r.status_code for r in rs)
    # one slot and a queue of one: the burst finds them full and some of it is turned away
    assert codes.count(200) >= 2 and 503 in codes
    busy = next(r for r in rs if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "busy" in busy.json()["error"]["message"]


def test_sigterm_past_the_grace_fails_the_rest_cleanly(server_b):
    url = server_b.url()
    results = {}

    def plain():
        results["plain"] = httpx.post(url + "/generate", json=_gen([3, 4, 5], 1500, ignore_eos=True), timeout=120)

    def streamed():
        lines = []
        with httpx.stream("POST", url + "/generate", json={**_gen([3, 4], 1500, ignore_eos=True), "stream": True},
                          timeout=120) as r:
            lines = [x for x in r.iter_lines() if x]
        results["stream"] = lines

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    threads[0].start()
    assert _wait_running(url, 1)
    threads[1].start()
    time.sleep(0.5)
    code, out = server_b.stop()
    for t in threads:
        t.join(60)
    assert code == 0 and "served" in out
    statuses = {"plain": results["plain"].status_code}
    last = json.loads(results["stream"][-2][6:]) if len(results["stream"]) >= 2 else None
    assert statuses["plain"] == 503 and "shutting down" in results["plain"].json()["error"]["message"]
    assert results["stream"][-1] == "data: [DONE]"
    assert last["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_second_signal_ends_the_grace_and_every_stream_still_gets_its_end():
    """SIGTERM, then SIGINT while the long grace runs: the requests in flight are failed at once,
    each stream with its abort event and [DONE] (not cut mid-stream), the OpenAI one too;
    the summary counts them; no traceback; exit 0 long before the grace would end."""
    # SmolLM2's steps take tens of ms on the CPU: the second signal lands inside one
    s = ServeProcess("--model", "smollm2", "--mode", "tree", "--nodes", "16", "--batch", "8", "--grace", "120",
                     "--threads", "1")
    try:
        url = s.url()
        results = {}

        def streamed(i, path, body):
            with httpx.stream("POST", url + path, json=body, timeout=120) as r:
                results[i] = [x for x in r.iter_lines() if x]

        bodies = [("/generate", {**_gen([3, 4, i], 1000, ignore_eos=True), "stream": True}) for i in range(5)]
        bodies.append(("/v1/completions", {"prompt": [5, 6], "max_tokens": 1000, "ignore_eos": True, "stream": True}))
        threads = [threading.Thread(target=streamed, args=(i, p, b)) for i, (p, b) in enumerate(bodies)]
        for t in threads:
            t.start()
        assert _wait_running(url, 6)
        time.sleep(1.0)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGINT)
        out, err = s.proc.communicate(timeout=60)
        for t in threads:
            t.join(60)
        assert s.proc.returncode == 0 and time.monotonic() - t0 < 30
        assert "Traceback" not in "".join(s.err) + err, "".join(s.err) + err
        for i in range(5):
            assert results[i][-1] == "data: [DONE]", results[i][-3:]
            assert json.loads(results[i][-2][6:])["meta_info"]["finish_reason"]["type"] == "abort"
        assert results[5][-1] == "data: [DONE]"
        assert json.loads(results[5][-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert re.search(r"\n\S+\s+\S+\s+\S+\s+\S+\s+6\s", out.split("served", 1)[1]), out   # aborted 6
        # none completed: the summary has no latency percentile (the aborted streams' times are no latencies)
        assert re.search(r"^end to end\s+-\s+-\s+-$", out, re.M), out
    finally:
        s.kill()


def test_signals_that_keep_coming_during_the_shutdown_still_exit_0():
    """A signal landing after the drain (uvicorn has handed the signals back) made the exit 143;
    signals every 30 ms from the first on: every one is part of the same shutdown, exit 0. The exit
    summary counts as /metrics does: bad requests are its bad_requests (rejected_requests_total
    {reason="bad_request"}), errors the requests the engine failed (none here)."""
    s = ServeProcess("--model", "tiny", "--threads", "1", "--grace", "0.3", "--format", "json")
    try:
        url = s.url()
        for body in (b"not json", b'{"text": 5}', b'{"input_ids": [1], "sampling_params": {"top_k": 3}}'):
            assert httpx.post(url + "/generate", content=body, timeout=30).status_code == 400
        assert httpx.post(url + "/generate", json=_gen([1, 2], 2), timeout=30).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'specpilot_rejected_requests_total{reason="bad_request"} 3' in metrics, metrics
        assert 'specpilot_requests_total{outcome="error"} 0' in metrics, metrics
        assert httpx.get(url + "/health", timeout=30).status_code == 200   # serving, its handlers in place
        deadline = time.monotonic() + 30
        while s.proc.poll() is None and time.monotonic() < deadline:
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.03)
        out, err = s.proc.communicate(timeout=30)
        assert s.proc.returncode == 0, "".join(s.err) + err
        doc = json.loads(out)
        assert (doc["requests"], doc["bad_requests"], doc["errors"], doc["rejected"]) == (1, 3, 0, 0), doc
    finally:
        s.kill()


def test_tlv_server_batches_concurrent_cycles_losslessly(greedy):
    """serve --mode tlv: concurrent clients' TLV cycles share Q passes and exact passes; every output
    is the one-request greedy output."""
    s = ServeProcess("--model", "tiny", "--mode", "tlv", "--nodes", "6", "--depth", "4", "--batch", "8",
                     "--threads", "1")
    try:
        url = s.url()

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*[c.post(url + "/generate", json=_gen(PROMPTS[i], 8)) for i in range(10)])

        rs = asyncio.run(main())
        assert [r.status_code for r in rs] == [200] * 10
        assert [r.json()["output_ids"] for r in rs] == [greedy(PROMPTS[i], 8) for i in range(10)]
        steps = sum(r.json()["meta_info"]["spec_verify_ct"] for r in rs)
        info = _info(url)
        assert info["spec_verify_ct"] < steps   # exact passes served several requests each
        # the Q pass's view is said; the batching rules TLV does not take are none
        assert info["qview"] == "w12" and info["budget"] is None and info["block"] is None
        assert any("tiny tlv on http://" in line and "Q pass w12, batch 8;" in line for line in s.err), s.err
        code, _ = s.stop()
        assert code == 0
    finally:
        s.kill()


@pytest.mark.slow
def test_smollm2_concurrent_clients_equal_greedy():
    eng = load_engine(EngineSpec.parse("engine:model=smollm2,mode=ar"))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
             "The quick brown fox", "Water boils at"]
    want = [eng.generate(eng.encode(t), 16).output_ids for t in texts]
    s = ServeProcess("--model", "smollm2", "--mode", "tree", "--nodes", "16", "--batch", "4")
    try:
        url = s.url(timeout=600)

        async def main():
            async with httpx.AsyncClient(timeout=600) as c:
                return await asyncio.gather(*[c.post(url + "/generate", json={
                    "text": t, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}) for t in texts])

        rs = asyncio.run(main())
        assert [r.json()["output_ids"] for r in rs] == want
        code, _ = s.stop()
        assert code == 0
    finally:
        s.kill()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama folder with SmolLM2's tokenizer and chat template (fast, real text)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpilot.engine.weights import smollm2_dir

    src = smollm2_dir()
    folder = tmp_path_factory.mktemp("serve_chat") / "model"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(folder))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)
    return str(folder)


def test_openai_chat_completions_use_the_chat_template(chat_model):
    eng = load_engine(EngineSpec.parse(f"engine:model={chat_model},mode=ar"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = eng.encode_messages(msgs)
    s = ServeProcess("--model", chat_model, "--mode", "chain", "--depth", "3", "--batch", "2", "--ctx", "96",
                     "--threads", "1")
    try:
        url = s.url()
        want = eng.decode(eng.generate(ids, 10).output_ids)
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 10},
                       timeout=60).json()
        assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant",
                                                                                  "content": want}
        assert r["usage"]["prompt_tokens"] == len(ids) and r["choices"][0]["finish_reason"] == "length"
        # content as text parts is the same conversation
        parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in msgs]
        r2 = httpx.post(url + "/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 10},
                        timeout=60).json()
        assert r2["choices"][0]["message"]["content"] == want
        # streamed: the role alone first (OpenAI's, SGLang's), then content deltas that add up to the answer
        ev = _events(httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 10,
                                                                     "stream": True}, timeout=60))
        assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert ev[0]["choices"][0]["finish_reason"] is None
        assert all("role" not in e["choices"][0]["delta"] for e in ev[1:])
        assert all(e["object"] == "chat.completion.chunk" for e in ev)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev) == want
        # SGLang's end of a chat stream: the content events carry no finish reason, an event of its
        # own does, with an empty delta
        assert all(e["choices"][0]["finish_reason"] is None for e in ev[:-1])
        assert ev[-1]["choices"][0]["delta"] == {} and ev[-1]["choices"][0]["finish_reason"] == "length"
        # no max_tokens: the answer may fill the context (--ctx 96)
        r3 = httpx.post(url + "/v1/chat/completions", json={"messages": msgs}, timeout=120).json()
        n = r3["usage"]["completion_tokens"]
        assert r3["choices"][0]["finish_reason"] in ("length", "stop") and n > 10
        assert len(ids) + n + 3 + 2 <= 96 + 3   # within the context, draft rows included
        # max_tokens 0, as SGLang's chat route takes it (max_completion_tokens 0 too): an empty answer
        for key in ("max_tokens", "max_completion_tokens"):
            r4 = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, key: 0}, timeout=30).json()
            assert r4["choices"][0]["message"] == {"role": "assistant", "content": ""}
            assert r4["choices"][0]["finish_reason"] == "length"
            assert r4["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        ev = _events(httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 0, "stream": True,
                                                                     "stream_options": {"include_usage": True}},
                                timeout=30))
        assert len(ev) == 3 and ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert ev[0]["choices"][0]["finish_reason"] is None
        assert ev[1]["choices"][0]["delta"] == {} and ev[1]["choices"][0]["finish_reason"] == "length"
        assert ev[2]["choices"] == []
        assert ev[2]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        for bad, words in [({"messages": [{"role": "robot", "content": "x"}]}, "role among"),
                           ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
                           ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "unsupported fields"),
                           ({"messages": [{"role": "user", "content": "x", "name": ""}]},
                            "messages[0].name must be a non-empty string"),
                           ({"messages": [{"role": "user", "content": []}]}, "non-empty list of text parts"),
                           ({"messages": "hi"}, "messages must be a non-empty list"),
                           ({"messages": msgs, "tools": [{"type": "function"}]}, "does not support tools"),
                           ({"messages": msgs, "response_format": {"type": "json_object"}},
                            "does not support response_format"),
                           ({"messages": msgs, "prompt": "x"}, "unknown request fields: prompt"),
                           ({"messages": msgs, "max_tokens": -1}, "max_tokens must be an integer in [0, "),
                           ({"messages": [{"role": "user", "content": "long " * 100}], "max_tokens": 0},
                            "is longer than the model's context length")]:
            r = httpx.post(url + "/v1/chat/completions", json=bad, timeout=30)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (bad, r.text)
        code, _ = s.stop()
        assert code == 0
    finally:
        s.kill()


def test_serve_without_its_http_stack_says_what_is_missing(tmp_path):
    """A Python without uvicorn (an install that skipped the dependencies): exit 3 naming it, before
    any model loads."""
    (tmp_path / "uvicorn.py").write_text("raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-m", "specpilot", "serve", "--model", "tiny", "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 3, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "serve needs uvicorn" in lines[0], p.stderr


def test_a_port_in_use_or_a_bad_host_is_said_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, code, what in ((["--port", str(port)], 3, "choose another --port"),
                                 (["--port", "0", "--host", "999.1.1.1"], 2, "choose another --host"),
                                 # '' is every interface to the socket layer: it listened on 0.0.0.0
                                 (["--port", "0", "--host", ""], 2, "--host '': give an address"),
                                 (["--port", "0", "--host", " "], 2, "give an address")):
            got, _, err, imported = cli_imports("serve", "--model", "tiny", *args)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert got == code and len(lines) == 1 and what in lines[0], err
            assert imported == [] and "loading model" not in err   # said before torch loads (seconds)


def test_load_generator_refuses_bad_options_and_fails_when_requests_fail(tmp_path):
    gen = [sys.executable, str(REPO / "benchmarks" / "loadgen.py"), "--url", "http://127.0.0.1:1"]
    for bad in (["--random-ids", "4", "--rate", "0"], ["--random-ids", "4", "--concurrency", "1,0"],
                ["--prompts", str(tmp_path / "none.jsonl")],
                # said before any load is sent: a missing folder, a URL with no scheme, what the writer refuses
                ["--random-ids", "4", "--out", str(tmp_path / "no" / "x.json")],
                ["--random-ids", "4", "--out", str(tmp_path / "x.json") + "/"], ["--random-ids", "4", "--out", ""]):
        p = subprocess.run(gen + bad, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (bad, p.stderr)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    p = subprocess.run(gen + ["--prompts", str(prompts), "--random-ids", "4"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "not both" in p.stderr, p.stderr   # one would be ignored
    brace = tmp_path / "brace.txt"
    brace.write_text("{name} is a placeholder\n")   # a JSONL row by its '{': the error says so, and what to write
    p = subprocess.run(gen + ["--prompts", str(brace)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "a line that starts with '{' is a JSONL row" in p.stderr, p.stderr
    assert '{"text": "..."}' in p.stderr
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "loadgen.py"), "--url", "notaurl",
                        "--random-ids", "4"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "give an http:// or https:// URL" in p.stderr, p.stderr
    p = subprocess.run(gen + ["--random-ids", "4", "--num-prompts", "2", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "2 of 2 requests failed" in p.stderr, p.stderr


def test_metrics_labelled_counters_start_with_every_label_at_zero():
    """Each labelled counter is exported at 0 for every outcome and reason from the first scrape,
    never as an unlabelled series that later turns into labelled ones."""
    from types import SimpleNamespace

    from specpilot.engine.metrics import OUTCOMES, REJECTIONS, Histogram, ServeMetrics, STEP_BUCKETS

    stats = SimpleNamespace(tokens=0, verify_steps=0, prefill_passes=0, overlapped_steps=0, eager_steps=0,
                            eager_seconds=0.0, mixed_steps=0, prefill_replays=0, rows=0, proposed=0, accepted=0,
                            tau=lambda: None, step_hist=Histogram(STEP_BUCKETS))
    decoder = SimpleNamespace(stats=stats, load=lambda: (0, 0))
    m = ServeMetrics()
    text = m.render(decoder)
    for o in OUTCOMES:
        assert f'specpilot_requests_total{{outcome="{o}"}} 0' in text.splitlines()
    for r in REJECTIONS:
        assert f'specpilot_rejected_requests_total{{reason="{r}"}} 0' in text.splitlines()
    assert not re.search(r"^specpilot_(rejected_)?requests_total \d", text, re.M)
    m.reject("queue_full")
    assert 'specpilot_rejected_requests_total{reason="queue_full"} 1' in m.render(decoder).splitlines()


def test_sighup_drains_as_sigterm_does(tmp_path):
    """A closing terminal or ssh session sends SIGHUP: the requests in flight are answered, the
    summary printed and written, exit 0, no traceback (it cancelled every handler: plain 500s,
    cut streams, no summary)."""
    summary = tmp_path / "s.json"
    s = ServeProcess("--model", "tiny", "--mode", "chain", "--threads", "1", "--out", summary, "--format", "json")
    try:
        url = s.url()
        results = {}

        def plain():
            results["plain"] = httpx.post(url + "/generate", json=_gen([1, 2, 3], 600, ignore_eos=True), timeout=120)

        def streamed():
            with httpx.stream("POST", url + "/generate", json={**_gen([4, 5], 600, ignore_eos=True), "stream": True},
                              timeout=120) as r:
                results["stream"] = [x for x in r.iter_lines() if x]

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert _wait_running(url, 2)
        s.proc.send_signal(signal.SIGHUP)
        out, err = s.proc.communicate(timeout=120)
        for t in threads:
            t.join(60)
        assert s.proc.returncode == 0, err
        assert "Traceback" not in "".join(s.err) + err, "".join(s.err) + err
        assert results["plain"].status_code == 200 and len(results["plain"].json()["output_ids"]) == 600
        assert results["stream"][-1] == "data: [DONE]"
        assert json.loads(summary.read_text())["requests"] >= 2
    finally:
        s.kill()


def test_the_summary_reaches_stdout_when_out_cannot_be_written_at_exit(tmp_path):
    """--out's folder removed while the server ran: the session's summary was lost with exit 2."""
    folder = tmp_path / "od"
    folder.mkdir()
    s = ServeProcess("--model", "tiny", "--mode", "ar", "--threads", "1", "--out", folder / "x.json",
                     "--format", "json")
    try:
        url = s.url()
        assert httpx.post(url + "/generate", json=_gen([1, 2], 3), timeout=60).status_code == 200
        folder.rmdir()
        code, out = s.stop()
        assert code == 2
        assert json.loads(out)["requests"] == 1
        assert f"--out {folder / 'x.json'}" in "".join(s.err)
    finally:
        s.kill()
