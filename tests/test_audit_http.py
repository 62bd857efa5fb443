"""The audit's HTTP path against real servers on loopback, never a mock of the client.

- ``specpilot serve`` (the embedded engine, SGLang-native /generate) serving a tiny Llama folder:
  outputs match the model's own greedy decoding, a full audit runs over HTTP, and killing the
  server mid-run keeps the outputs already collected.
- Small stdlib HTTP servers on loopback that misbehave for real: garbage bodies, no output_ids,
  HTTP 500, never answering (timeout), closing the connection, dying after two answers.
"""

from __future__ import annotations

import json
import signal
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specpilot.auditors.http_client import GenerateClient, ServerError, parse_generate_response
from specpilot.auditors.outputs import Prompt, read_outputs

import stub_generate

V = 96
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [20, 21, 22, 23, 24], [30, 31]]


def _make_tiny(folder):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _make_tiny(tmp_path_factory.mktemp("audit_http") / "model")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("audit_http_prompts") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"r{i}", "prompt_ids": ids}) + "\n"
                         for i, ids in enumerate(PROMPTS)))
    return p


class _Serve:
    """``specpilot serve`` in a subprocess on a free loopback port; started early, awaited lazily."""

    def __init__(self, model_dir):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", "--model", model_dir, "--mode",
                                      "tree", "--nodes", "8", "--port", "0", "--threads", "1"],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.url = None
        self.log: list[str] = []

    def wait(self, timeout=180.0):
        if self.url:
            return self.url
        found = {}

        def reader():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
                if m and "url" not in found:
                    found["url"] = m.group(1)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        deadline = time.time() + timeout
        while time.time() < deadline and "url" not in found:
            if self.proc.poll() is not None:
                time.sleep(0.2)
                pytest.fail("specpilot serve exited: " + "".join(self.log)[-800:])
            time.sleep(0.1)
        if "url" not in found:
            pytest.fail("specpilot serve did not start in time: " + "".join(self.log)[-800:])
        self.url = found["url"]
        client = GenerateClient(self.url, timeout=30)
        for _ in range(100):
            try:
                client.health()
                break
            except ServerError:
                time.sleep(0.1)
        return self.url

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def serve(tiny_dir):
    s = _Serve(tiny_dir)  # starts loading now; the stdlib-server tests below run meanwhile
    yield s
    s.stop()


# ----------------------------------------------------------------------------------------------
# misbehaving servers (real sockets on loopback)
def _good_answer(body):
    ids = body["input_ids"]
    n = body["sampling_params"]["max_new_tokens"]
    out = [(ids[-1] + k + 1) % V for k in range(n)]
    return {"text": "", "output_ids": out, "meta_info": {"completion_tokens": len(out)}}


class _Stdlib:
    def __init__(self, behaviour):
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, payload: bytes):
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._send(200, b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests += 1
                behaviour(self, body, outer.requests)

        self.requests = 0
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def stdlib_server():
    made = []

    def make(behaviour):
        s = _Stdlib(behaviour)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _collect(run_cli, url, prompts_file, save, *extra):
    return run_cli("audit", "collect", url, "--prompts", prompts_file, "--save", save, "--max-new-tokens", 4,
                   *extra)


def test_garbage_after_two_answers_keeps_partial(run_cli, stdlib_server, prompts_file, tmp_path, serve):
    def behaviour(h, body, n):
        if n <= 2:
            h._send(200, json.dumps(_good_answer(body)).encode())
        else:
            h._send(200, b"<html>oops</html>")

    s = stdlib_server(behaviour)
    save = tmp_path / "partial.jsonl"
    code, out, err = _collect(run_cli, s.url, prompts_file, save)
    assert code == 3, err
    assert err.startswith("specpilot: error:") and len(err.strip().splitlines()) == 1
    assert "malformed /generate answer: not JSON" in err and "kept the 2 of 5 outputs" in err and str(save) in err
    rows = read_outputs(save).rows
    assert [r.id for r in rows] == ["r0", "r1"]
    assert rows[0].output_ids == [9, 10, 11, 12] and rows[0].prompt_ids == PROMPTS[0]


def _fails_at(request: int, status: int, payload: bytes):
    """A server that answers well except for its ``request``-th request (1-based)."""
    def behaviour(h, body, n):
        if n == request:
            h._send(status, payload)
        else:
            h._send(200, json.dumps(_good_answer(body)).encode())
    return behaviour


def test_an_answer_nested_too_deeply_is_the_servers_failure_and_keeps_partial(run_cli, stdlib_server, prompts_file,
                                                                              tmp_path):
    s = stdlib_server(_fails_at(3, 200, b"[" * 100_000 + b"]" * 100_000))
    save = tmp_path / "deep.jsonl"
    code, _, err = _collect(run_cli, s.url, prompts_file, save)
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert "malformed /generate answer: JSON nested too deeply to read" in err and "kept the 2 of 5 outputs" in err
    assert [r.id for r in read_outputs(save).rows] == ["r0", "r1"]


def test_concurrent_requests_keep_completed_outputs_on_failure(run_cli, stdlib_server, prompts_file, tmp_path):
    s = stdlib_server(_fails_at(3, 200, b"garbage"))
    save = tmp_path / "conc.jsonl"
    code, out, err = _collect(run_cli, s.url, prompts_file, save, "--concurrency", 2)
    assert code == 3 and "not JSON" in err
    rows = read_outputs(save).rows
    kept = re.search(r"kept the (\d) of 5", err)
    assert kept and int(kept.group(1)) == len(rows) and 2 <= len(rows) <= 4
    by_id = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    for r in rows:  # every kept row is a complete, correct answer for its own prompt, in prompt order
        assert r.prompt_ids == by_id[r.id] and r.output_ids == [(r.prompt_ids[-1] + k + 1) % V for k in range(4)]
    assert [r.id for r in rows] == sorted((r.id for r in rows), key=lambda x: int(x[1:]))


@pytest.mark.parametrize("answer, message", [
    ({"text": "hi", "meta_info": {}}, "no \"output_ids\""),
    ({"output_ids": [1, "x"]}, "not a list of token ids (integers in 0..2147483647)"),
    # one its own reader would refuse: it is never saved
    ({"output_ids": [1, 10 ** 12]}, "not a list of token ids (integers in 0..2147483647)"),
    ({"output_ids": [1, 2], "meta_info": {"completion_tokens": 3}}, "completion_tokens=3"),
    ({"output_ids": [1, 2, 3, 4, 5, 6]}, "6 tokens returned for max_new_tokens=4"),
    ([1, 2, 3], "expected a JSON object"),
])
def test_malformed_answers(stdlib_server, answer, message):
    s = stdlib_server(lambda h, body, n: h._send(200, json.dumps(answer).encode()))
    with pytest.raises(ServerError, match=re.escape(message)):
        GenerateClient(s.url, timeout=5).generate([1, 2], 4)


def test_requests_share_one_tls_context(stdlib_server, monkeypatch):
    """Each request opens its own connection but not its own TLS context (loading the CA
    certificates again cost about 20 ms of CPU per request)."""
    import ssl

    from specpilot.auditors import http_client

    made, real = [], ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: made.append(1) or real(*a, **kw))
    http_client._tls.cache_clear()
    s = stdlib_server(lambda h, body, n: h._send(200, json.dumps(_good_answer(body)).encode()))
    client = GenerateClient(s.url, timeout=5)
    client.health()
    assert [client.generate([1, 2], 3) for _ in range(3)] == [[3, 4, 5]] * 3
    assert len(made) == 1 and s.requests == 3


def test_http_error_status(stdlib_server):
    s = stdlib_server(lambda h, body, n: h._send(500, b'{"error": "CUDA out of memory"}'))
    with pytest.raises(ServerError, match="HTTP 500.*CUDA out of memory"):
        GenerateClient(s.url, timeout=5).generate([1], 4)


def test_a_prompt_the_server_refuses_is_bad_input_named_by_its_id(run_cli, stdlib_server, prompts_file, tmp_path):
    s = stdlib_server(_fails_at(2, 400, b'{"error": {"message": "input_ids: token id 99999 is outside the vocabulary"}}'))
    save = tmp_path / "refused.jsonl"
    code, out, err = _collect(run_cli, s.url, prompts_file, save)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "prompt 'r1': " in line and "HTTP 400" in line and "kept the 1 of 5 outputs" in line
    assert "fix or leave out that prompt, then continue with --resume" in line
    assert [r.id for r in read_outputs(save).rows] == ["r0"]


def test_timeout(run_cli, stdlib_server, prompts_file, tmp_path):
    release = threading.Event()

    def behaviour(h, body, n):
        if n == 1:
            h._send(200, json.dumps(_good_answer(body)).encode())
        else:
            release.wait(10)  # never answers in time

    s = stdlib_server(behaviour)
    save = tmp_path / "t.jsonl"
    t0 = time.time()
    code, out, err = _collect(run_cli, s.url, prompts_file, save, "--timeout", "0.5")
    release.set()
    assert code == 3 and "no answer within 0.5 s" in err and "kept the 1 of 5" in err
    assert time.time() - t0 < 8
    assert len(read_outputs(save).rows) == 1


def test_connection_closed_without_answer(stdlib_server):
    def behaviour(h, body, n):
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)

    s = stdlib_server(behaviour)
    with pytest.raises(ServerError, match="closed the connection"):
        GenerateClient(s.url, timeout=5).generate([1], 4)


@pytest.mark.parametrize("reply, message", [
    (b"garbage\r\n\r\n", "malformed HTTP answer (illegal status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed HTTP answer (illegal header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"output", "closed the connection without a full answer"),
])
def test_broken_http_answers(reply, message):
    """A raw socket answers once: a status line or header that is not HTTP is malformed, a body cut
    short is a connection closed early; each one line (ServerError, exit 3)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer():
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(ServerError, match=re.escape(message)):
            GenerateClient(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=5).generate([1], 4)
    finally:
        t.join(5)
        srv.close()


def test_nothing_listening(run_cli, prompts_file, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, out, err = _collect(run_cli, f"http://127.0.0.1:{port}", prompts_file, tmp_path / "x.jsonl")
    assert code == 3 and "connection refused" in err
    assert not (tmp_path / "x.jsonl").exists()  # nothing was collected: no file


def test_bad_urls(run_cli, prompts_file, tmp_path):
    code, out, err = _collect(run_cli, "http://", prompts_file, tmp_path / "x.jsonl")
    assert code == 2 and "server URL" in err
    code, out, err = _collect(run_cli, "http://127.0.0.1:99999", prompts_file, tmp_path / "x.jsonl")
    assert code == 2 and "bad port" in err
    for url in ("http://[::1", "http://localhost:abc"):
        code, out, err = _collect(run_cli, url, prompts_file, tmp_path / "x.jsonl")
        assert code == 2 and "not a URL" in err and len(err.strip().splitlines()) == 1, err
    # the routes are appended to the URL: a query, a fragment or a route of its own make none of them
    for url, words in (("http://127.0.0.1:9?x=1", "no query or fragment"), ("http://127.0.0.1:9#a", "no query"),
                       ("http://127.0.0.1:9/generate", "without the route (http://127.0.0.1:9)")):
        code, out, err = _collect(run_cli, url, prompts_file, tmp_path / "x.jsonl")
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    from specpilot.auditors.systems import parse_system

    assert parse_system("HTTP://127.0.0.1:30000").kind == "http"   # a scheme in capitals is a URL, not a file


def test_server_process_dies_mid_run(run_cli, prompts_file, tmp_path):
    proc, port = stub_generate.start("die", 2)
    try:
        save = tmp_path / "died.jsonl"
        code, out, err = _collect(run_cli, f"http://127.0.0.1:{port}", prompts_file, save)
        assert code == 3, err
        assert "closed the connection" in err and "kept the 2 of 5" in err
        assert [r.output_ids for r in read_outputs(save).rows] == [[9, 9, 9], [11, 11, 11]]
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_busy_server_is_asked_again_after_its_retry_after(run_cli, prompts_file, tmp_path):
    proc, port = stub_generate.start("busy", 2)
    try:
        save = tmp_path / "busy.jsonl"
        t0 = time.perf_counter()
        code, out, err = _collect(run_cli, f"http://127.0.0.1:{port}", prompts_file, save)
        assert code == 0 and len(read_outputs(save).rows) == 5, err
        assert time.perf_counter() - t0 >= 1.0   # it waited the second Retry-After asked for
    finally:
        proc.kill()
        proc.wait()


def test_audit_check_keeps_partial_outputs_when_server_dies(run_cli, prompts_file, tmp_path, tiny_dir):
    stock = tmp_path / "stock.jsonl"
    stock.write_text("".join(json.dumps({"schema": "specpilot.outputs/1", "id": f"r{i}", "prompt_ids": p,
                                         "output_ids": [1, 2]}) + "\n" for i, p in enumerate(PROMPTS)))
    proc, port = stub_generate.start("die", 2)
    try:
        saved = tmp_path / "outs"
        code, out, err = run_cli("audit", f"http://127.0.0.1:{port}", "--against", stock, "--scorer", tmp_path,
                                 "--prompts", prompts_file, "--save-outputs", saved)
        assert code == 2 and "config.json" in err and not saved.exists()  # a bad --scorer fails before any run
        code, out, err = run_cli("audit", f"http://127.0.0.1:{port}", "--against", stock, "--scorer", tiny_dir,
                                 "--prompts", prompts_file, "--save-outputs", saved)
        assert code == 3 and "kept the 2 of 5" in err and out == ""
        assert len(read_outputs(saved / "system.outputs.jsonl").rows) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_response_parser_accepts_sglang_logprob_form():
    raw = json.dumps({"text": "ab", "meta_info": {"output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
                                                  "completion_tokens": 2}}).encode()
    assert parse_generate_response(raw, "x", 4) == [7, 8]
    assert parse_generate_response(json.dumps([{"output_ids": [3]}]).encode(), "x", 4) == [3]


# ----------------------------------------------------------------------------------------------
# the real `specpilot serve` (these run last: the server loads while the tests above run)
def test_collect_from_specpilot_serve_matches_greedy(run_cli, serve, tiny_dir, prompts_file, tmp_path):
    from specpilot.auditors.scorer import Scorer
    from specpilot.auditors.selftest import greedy

    url = serve.wait()
    save = tmp_path / "served.jsonl"
    code, out, err = run_cli("audit", "collect", url, "--prompts", prompts_file, "--save", save,
                             "--max-new-tokens", 6, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["tokens"] == 30
    full = GenerateClient(url, timeout=30).generate_full(PROMPTS[0], 3)  # the form compare reuses
    assert full.meta_info["completion_tokens"] == len(full.output_ids) == 3 and full.seconds > 0
    rows = read_outputs(save).rows
    model = Scorer.load(tiny_dir, device="cpu").model
    assert [r.output_ids for r in rows] == greedy(model, PROMPTS, 6)
    # several requests in flight: same outputs, prompt order kept
    save3 = tmp_path / "served3.jsonl"
    code, out, err = run_cli("audit", "collect", url, "--prompts", prompts_file, "--save", save3,
                             "--max-new-tokens", 6, "--concurrency", 3)
    assert code == 0, err
    assert [(r.id, r.output_ids) for r in read_outputs(save3).rows] == [(r.id, r.output_ids) for r in rows]


def test_audit_over_http_end_to_end(run_cli, serve, tiny_dir, prompts_file, tmp_path):
    url = serve.wait()
    saved = tmp_path / "outs"
    code, out, err = run_cli("audit", url, "--against", f"engine:model={tiny_dir},mode=ar", "--scorer", tiny_dir,
                             "--prompts", prompts_file, "--max-new-tokens", 6, "--save-outputs", saved,
                             "--device", "cpu", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["verdict"] == "pass"
    sysrow = [s for s in data["systems"] if s["role"] == "system"][0]
    assert sysrow["tokens"] == 30 and sysrow["mismatch_rate"] == 0.0
    assert sorted(p.name for p in saved.iterdir()) == ["stock.outputs.jsonl", "system.outputs.jsonl"]


def test_specpilot_serve_killed_mid_run_keeps_outputs(serve, tmp_path):
    from specpilot.auditors.systems import CollectError, HttpGenerator, collect

    url = serve.wait()
    save = tmp_path / "killed.jsonl"

    def kill_after_two(row):
        if int(row.id[1:]) == 1:
            serve.proc.kill()
            serve.proc.wait()

    prompts = [Prompt(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    with pytest.raises(CollectError) as ei:
        collect(HttpGenerator(url, timeout=10), prompts, 4, save_to=str(save), on_row=kill_after_two)
    assert ei.value.exit_code == 3 and ei.value.kept == 2
    assert "connection refused" in str(ei.value) and "kept the 2 of 5" in str(ei.value)
    assert [r.id for r in read_outputs(save).rows] == ["r0", "r1"]


def test_a_signal_stops_a_concurrent_collection_at_once_and_keeps_its_rows(tmp_path):
    """--concurrency 4 against a server that stalls at its 4th request: SIGTERM drops the queued
    requests and abandons the ones in flight (the process's exit waited for them, each up to
    --timeout, and dropped the rows they brought) and keeps the rows that completed."""
    proc, port = stub_generate.start("stall", 3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"r{i}", "prompt_ids": [i + 1, 2]})
                               + "\n" for i in range(40)))
    save = tmp_path / "s.jsonl"
    try:
        run = subprocess.Popen([sys.executable, "-m", "specpilot", "audit", "collect", f"http://127.0.0.1:{port}",
                                "--prompts", str(prompts), "--save", str(save), "--max-new-tokens", "4",
                                "--concurrency", "4", "--timeout", "60"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(4)   # three answered, the rest stuck behind the stalled request
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=90)
        assert run.returncode == 143, err
        assert time.monotonic() - t0 < 5, err   # neither the request in flight nor the 36 queued waited out
        assert "kept the 3 of 40" in err and err.count("\n") == 1, err
        assert len(read_outputs(save).rows) == 3
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_request_lets_the_ones_in_flight_finish_and_keeps_them():
    """A failure (unlike a signal) hands out no more requests but keeps what the ones already
    running bring; then it is raised."""
    import threading

    from specpilot.auditors.fanout import in_threads

    running = threading.Barrier(3, timeout=10)

    def one(x):
        if x < 3:
            running.wait()   # the first three are all in flight before one fails
        if x == 1:
            raise ValueError("refused")
        time.sleep(0.3)
        return x

    got = []
    with pytest.raises(ValueError, match="refused"):
        for i, r in in_threads(one, [0, 1, 2, 3, 4, 5], 3):
            got.append((i, r))
    assert sorted(got) == [(0, 0), (2, 2)], got   # the two in flight kept, nothing past them sent


def test_collect_does_not_replace_an_earlier_collection_without_resume(run_cli, prompts_file, tmp_path):
    save = tmp_path / "earlier.jsonl"
    save.write_text(json.dumps({"schema": "specpilot.outputs/1", "id": "r0", "prompt_ids": PROMPTS[0],
                                "output_ids": [9, 9, 9]}) + "\n")
    code, _, err = _collect(run_cli, "http://127.0.0.1:9", prompts_file, save)
    assert code == 2 and "holds the rows of an earlier collection; continue it with --resume" in err
    assert len(read_outputs(save).rows) == 1
    # --resume is not advised where it would refuse the rows: another prompt set's, or no outputs at all
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"schema": "specpilot.outputs/1", "id": "x", "prompt_ids": [1, 2],
                                 "output_ids": [9]}) + "\n")
    code, _, err = _collect(run_cli, "http://127.0.0.1:9", prompts_file, other)
    assert code == 2 and "1 of its 1 rows answer none of --prompts" in err and "choose another --save" in err, err
    assert "continue it with --resume" not in err and err.count("\n") == 1
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    code, _, err = _collect(run_cli, "http://127.0.0.1:9", prompts_file, junk)
    assert code == 2 and "holds rows that are not a collection's outputs" in err and "--resume" not in err, err
    assert junk.read_text() == "not json\n" and other.read_text().startswith('{"schema"')
