"""An SGLang-native HTTP API subset over the embedded engine (stdlib ``http.server``).

Endpoints (what SpecPilot's clients use):

- ``POST /generate`` with ``text`` (str or list) or ``input_ids`` (list or list of lists),
  ``sampling_params`` {``max_new_tokens``, greedy only: ``temperature`` 0 / ``top_k`` 1}. Returns
  ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
  "spec_verify_ct", "e2e_latency", "finish_reason"}}`` (a list for batched input).
- ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``, ``GET /get_server_info``,
  ``/flush_cache`` (200; the engine keeps nothing between requests).

Requests run one at a time (one engine, one cache); bad requests get HTTP 400 with a message.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from specpilot.errors import InputError

MAX_BODY = 64 << 20


class BadRequest(Exception):
    pass


@dataclass
class ServerStats:
    requests: int = 0
    errors: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    busy_seconds: float = 0.0
    started: float = field(default_factory=time.time)


def _sampling(params) -> int:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    t = params.get("temperature", 0.0)
    top_k = params.get("top_k", None)
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise BadRequest("sampling_params.temperature must be a number")
    if t > 1e-6 and top_k != 1:
        raise BadRequest("the embedded engine decodes greedily only: use temperature 0 (or top_k 1)")
    n = params.get("max_new_tokens", 128)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest("sampling_params.max_new_tokens must be a positive integer")
    for key in ("n",):
        if params.get(key, 1) != 1:
            raise BadRequest(f"sampling_params.{key} must be 1")
    return n


def handle_generate(engine, body: dict, stats: ServerStats, lock: threading.Lock):
    """The /generate logic without HTTP; returns a JSON-able object or raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded engine")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    max_new = _sampling(body.get("sampling_params"))
    batched = False
    if ids is not None:
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            batched, prompts = True, ids
        else:
            prompts = [ids]
        for p in prompts:
            if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise BadRequest("input_ids must be a non-empty list of integers (or a list of such lists)")
    else:
        if isinstance(text, list):
            batched, texts = True, text
        else:
            texts = [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("text must be a non-empty string (or a list of them)")
        if engine.tokenizer is None:
            raise BadRequest(f"model {engine.model_name} has no tokenizer; send input_ids")
        prompts = [engine.encode(t, chat=False) for t in texts]
    outs = []
    for p in prompts:
        t0 = time.perf_counter()
        with lock:
            t1 = time.perf_counter()
            try:
                r = engine.generate(p, max_new)
            except InputError as e:
                raise BadRequest(str(e)) from None
            t2 = time.perf_counter()
            dt = t2 - t0  # e2e: includes waiting for the engine, as a client sees it
            stats.requests += 1
            stats.completion_tokens += len(r.output_ids)
            stats.verify_steps += r.steps
            stats.busy_seconds += t2 - t1
        fin = ({"type": "stop", "matched": r.output_ids[-1]} if r.stop_reason == "eos"
               else {"type": "length", "length": len(r.output_ids)})
        outs.append({"text": engine.decode(r.output_ids), "output_ids": r.output_ids,
                     "meta_info": {"id": uuid.uuid4().hex, "prompt_tokens": len(p),
                                   "completion_tokens": len(r.output_ids), "spec_verify_ct": r.steps,
                                   "spec_accept_length": r.tau, "e2e_latency": dt, "finish_reason": fin}})
    return outs if batched else outs[0]


def make_server(engine, host: str = "127.0.0.1", port: int = 30000, log=None) -> ThreadingHTTPServer:
    stats = ServerStats()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "specpilot-engine"

        def log_message(self, fmt, *args):  # quiet unless a log function is given
            if log is not None:
                log(fmt % args)

        def _send(self, code: int, obj=None, text: str | None = None):
            payload = (json.dumps(obj) if text is None else text).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if text is None else "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/health", "/health_generate", "/flush_cache"):
                self._send(200, text="")
            elif path == "/get_model_info":
                self._send(200, {"model_path": engine.model_name, "tokenizer_path": engine.model_name,
                                 "is_generation": True, "engine": str(engine.spec)})
            elif path == "/get_server_info":
                self._send(200, {"engine": str(engine.spec), "model": engine.model_name, **engine.info,
                                 "requests": stats.requests, "completion_tokens": stats.completion_tokens,
                                 "spec_verify_ct": stats.verify_steps, "uptime_s": time.time() - stats.started})
            else:
                self._send(404, {"error": {"message": f"no such endpoint: GET {path}"}})

        def do_POST(self):
            path = self.path.split("?")[0]
            if path == "/flush_cache":  # nothing is cached across requests
                self._send(200, text="")
                return
            if path != "/generate":
                self._send(404, {"error": {"message": f"no such endpoint: POST {path}"}})
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
                if n <= 0 or n > MAX_BODY:
                    raise BadRequest("request needs a JSON body (Content-Length 1..64 MiB)")
                try:
                    body = json.loads(self.rfile.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"body is not valid JSON ({e})") from None
                self._send(200, handle_generate(engine, body, stats, lock))
            except BadRequest as e:
                stats.errors += 1
                self._send(400, {"error": {"message": str(e)}, "message": str(e)})
            except Exception as e:  # an engine bug must not kill the server
                stats.errors += 1
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    srv.stats = stats
    return srv
