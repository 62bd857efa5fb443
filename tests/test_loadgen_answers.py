"""``benchmarks/loadgen.py`` on answers a real server can give besides a clean one: an OpenAI stream
whose usage comes only at the end, an answer the server aborted (streamed or not), a stream with no
tokens or cut off before its end; and an interrupt that keeps the levels already run.

The server is a stand-in on loopback that answers by path prefix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GAP = 0.05   # seconds between streamed events


def _sglang_event(n, finish=None):
    return {"text": "x" * n, "output_ids": [1] * n,
            "meta_info": {"prompt_tokens": 3, "completion_tokens": n, "finish_reason": finish}}


class _Answers(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _event(self, obj):
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body.get("max_tokens") or body["sampling_params"]["max_new_tokens"]
        kind = self.path.split("/")[1]
        self.send_response(200)
        if not body.get("stream"):
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            abort = {"type": "abort", "message": "aborted by server"}
            if kind == "oai":
                ans = {"choices": [{"index": 0, "text": "xx", "finish_reason": "abort"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
            else:
                ans = _sglang_event(2, abort if kind == "abort" else {"type": "length", "length": n})
            self.wfile.write(json.dumps(ans).encode())
            return
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if kind == "empty":
            self._event(b"[DONE]")
        elif kind == "short":           # 3 tokens, then the connection ends: no finish, no [DONE]
            for k in (1, 2, 3):
                time.sleep(GAP)
                self._event(_sglang_event(k))
        elif kind == "abort":
            self._event(_sglang_event(2, {"type": "abort", "message": "aborted by server"}))
            self._event(b"[DONE]")
        elif kind == "oai":             # two tokens an event, the usage only in a closing event
            for k in range(n // 2):
                time.sleep(GAP)
                self._event({"choices": [{"index": 0, "text": "ab",
                                          "finish_reason": None if k < n // 2 - 1 else "length"}]})
            self._event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                                  "total_tokens": n + 3}})
            self._event(b"[DONE]")
        else:                           # a clean SGLang stream: one token an event
            for k in range(1, n + 1):
                time.sleep(GAP / 5)
                self._event(_sglang_event(k, {"type": "length", "length": n} if k == n else None))
            self._event(b"[DONE]")


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _load(loadgen, url, **kw):
    return loadgen.run_load(url, [[1, 2, 3]], max_new_tokens=8, num_prompts=3, **kw)


def test_an_openai_stream_with_usage_only_at_the_end_counts_a_gap_per_event(loadgen, server):
    """4 events of 2 tokens, then usage 8: bench_serving's one gap per text event (3 of ~50 ms), not
    4 more gaps of ~0 ms from the closing usage (which made the ITL p50 0)."""
    res = _load(loadgen, server + "/oai", api="openai")
    assert res["completed"] == 3 and res["output_tokens"] == 24
    assert res["itl_ms"]["p50"] > 0.6 * GAP * 1e3, res["itl_ms"]
    assert res["input_tokens"] == 9


@pytest.mark.parametrize("api, stream, path", [("sglang", True, "/abort"), ("sglang", False, "/abort"),
                                               ("openai", False, "/oai")])
def test_an_answer_the_server_aborted_is_a_failure_streamed_or_not(loadgen, server, api, stream, path):
    res = _load(loadgen, server + path, api=api, stream=stream)
    assert res["completed"] == 0 and res["failed"] == 3, res
    assert res["errors"][0] in ("aborted by server", "aborted"), res["errors"]


@pytest.mark.parametrize("path, error", [("/empty", "no tokens in the stream"),
                                         ("/short", "the stream ended before the answer did")])
def test_a_stream_without_tokens_or_cut_off_is_a_failure(loadgen, server, path, error):
    res = _load(loadgen, server + path)
    assert res["completed"] == 0 and res["failed"] == 3 and res["errors"][0].startswith(error), res


def test_a_clean_stream_is_still_answered(loadgen, server):
    res = _load(loadgen, server + "/ok")
    assert res["completed"] == 3 and res["output_tokens"] == 24 and res["failed"] == 0, res


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_keeps_the_finished_levels(server, tmp_path, sig, code):
    """A signal in the second level: one line, and the first level's summary written (a traceback
    and nothing written before)."""
    out = tmp_path / "lg.json"
    p = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "loadgen.py"), "--url", server + "/ok",
                          "--random-ids", "3", "--num-prompts", "2", "--max-new-tokens", "50", "--concurrency",
                          "1,1", "--out", str(out)],   # a level of about 1 s
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    # wait for the first level's summary line, then interrupt the second
    line = p.stdout.readline()
    assert line.startswith("== concurrency 1: 2/2 ok"), line + p.stderr.read()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert err.strip().splitlines()[-1].startswith("loadgen: interrupted by") and "Traceback" not in err, err
    assert len(json.loads(out.read_text())) == 1
