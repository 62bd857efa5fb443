"""``benchmarks/loadgen.py``'s open loop (``--rate``): arrivals are not held back by the answers.

SGLang's ``bench_serving`` caps the requests in flight only when ``--max-concurrency`` is given
(default None, ``benchmark/serving.py``); so does the load generator: ``--rate`` alone puts no cap,
``--concurrency`` (or SGLang's name, ``--max-concurrency``) given explicitly does. The server here
is a stand-in on loopback that takes 0.25 s per request and counts how many it holds at once.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECONDS = 0.25   # each request's answer time


class _Slow(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        srv = self.server
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.now += 1
            srv.peak = max(srv.peak, srv.now)
        time.sleep(SECONDS)
        with srv.lock:
            srv.now -= 1
        body = json.dumps({"text": "ab", "output_ids": [1, 2], "meta_info": {
            "prompt_tokens": 4, "completion_tokens": 2, "finish_reason": {"type": "length", "length": 2}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def slow_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    srv.daemon_threads = True
    srv.lock, srv.now, srv.peak = threading.Lock(), 0, 0
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _run(loadgen, srv, tmp_path, *extra):
    out = tmp_path / "lg.json"
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    code = loadgen.main(["--url", url, "--random-ids", "4", "--vocab", "100", "--num-prompts", "8",
                         "--max-new-tokens", "2", "--no-stream", "--rate", "200", "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_rate_alone_puts_no_cap_on_requests_in_flight(loadgen, slow_server, tmp_path, capsys):
    """8 arrivals at 200/s against 0.25 s answers: they overlap. With the old default (--concurrency
    1 applied in rate mode) they went one at a time: 8 x 0.25 s, one in flight."""
    res = _run(loadgen, slow_server, tmp_path)
    assert len(res) == 1 and res[0]["completed"] == 8 and res[0]["rate"] == 200
    assert slow_server.peak >= 3, slow_server.peak
    assert res[0]["concurrency"] is None
    # the client counts a request in flight from its send, the server from its handler's start: on a
    # loaded machine the server may not yet hold every request the client has sent
    assert res[0]["max_in_flight"] >= slow_server.peak
    assert res[0]["duration_s"] < 8 * SECONDS
    assert "no cap on requests in flight" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--concurrency", "--max-concurrency"])
def test_an_explicit_cap_holds_in_rate_mode(loadgen, slow_server, tmp_path, capsys, flag):
    res = _run(loadgen, slow_server, tmp_path, flag, "2")
    assert res[0]["completed"] == 8 and res[0]["concurrency"] == 2
    assert slow_server.peak == 2 and res[0]["max_in_flight"] == 2
    assert "at most 2 in flight" in capsys.readouterr().out


def test_closed_loop_still_defaults_to_one_client(loadgen, slow_server, tmp_path):
    out = tmp_path / "closed.json"
    url = f"http://127.0.0.1:{slow_server.server_address[1]}"
    assert loadgen.main(["--url", url, "--random-ids", "4", "--num-prompts", "2", "--max-new-tokens", "2",
                         "--no-stream", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res[0]["concurrency"] == 1 and res[0]["rate"] is None and slow_server.peak == 1


def test_bad_prompt_rows_and_an_out_over_the_prompts_are_refused_before_any_load(loadgen, slow_server, tmp_path,
                                                                                  capsys):
    """A JSONL row the server would refuse is bad input (exit 2, its line named), not a run of
    failed requests (exit 1); --out naming the prompts file (or a link to it) would replace the
    prompts with the summaries."""
    url = f"http://127.0.0.1:{slow_server.server_address[1]}"
    base = ["--url", url, "--num-prompts", "2", "--max-new-tokens", "2", "--no-stream"]
    for i, row in enumerate(('{"text": 5}', '{"prompt_ids": [1, "a"]}', '{"prompt_ids": []}', '{"prompt": "hi"}',
                             '{"prompt_ids": [true]}', '{"text": ""}')):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text('{"text": "fine"}\n' + row + "\n")
        assert loadgen.main(base + ["--prompts", str(bad)]) == 2, row
        err = capsys.readouterr().err
        assert f"--prompts {bad}: line 2: " in err and len(err.strip().splitlines()) == 1, err
    assert slow_server.peak == 0   # nothing was sent
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nworld\n")
    link = tmp_path / "link.txt"
    link.symlink_to(prompts)
    hard = tmp_path / "hard.txt"
    hard.hardlink_to(prompts)
    for out in (prompts, link, hard):
        assert loadgen.main(base + ["--prompts", str(prompts), "--out", str(out)]) == 2
        assert "is the --prompts file" in capsys.readouterr().err
    assert prompts.read_text() == "hello\nworld\n" and slow_server.peak == 0
    ok = tmp_path / "rows.jsonl"
    ok.write_text('{"text": "a"}\n\n{"prompt_ids": [1, 2]}\n')
    assert loadgen.read_prompts(str(ok)) == ["a", [1, 2]]


def test_the_duration_ends_with_the_last_answer_not_an_arrival_gap_after_it(loadgen, slow_server, tmp_path):
    """One request at 0.2/s: the run is its 0.25 s answer; a gap drawn after the last arrival (9.3 s
    with seed 0) was counted in the duration and cut the request throughput by that much."""
    out = tmp_path / "one.json"
    url = f"http://127.0.0.1:{slow_server.server_address[1]}"
    assert loadgen.main(["--url", url, "--random-ids", "4", "--num-prompts", "1", "--max-new-tokens", "2",
                         "--no-stream", "--rate", "0.2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())[0]
    assert res["completed"] == 1 and SECONDS <= res["duration_s"] < 3, res["duration_s"]
