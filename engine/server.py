"""``specpilot serve``: SGLang's native HTTP API over the batched engine (FastAPI + uvicorn).

- ``POST /generate`` (``PUT`` too, as SGLang's): text or input_ids (one prompt or a list),
  ``sampling_params``, ``stream`` (SGLang's server-sent events: ``data: {cumulative text,
  output_ids, meta_info}`` per step, then ``data: [DONE]``). A request for ``max_new_tokens`` 0
  is answered without the engine once its prompt is checked: an empty answer, ``finish_reason``
  ``{"type": "length", "length": 0}``. A prompt of the context length (``max_model_len``) or
  more, or a prompt and a given ``max_new_tokens`` over it, is a 400 with SGLang's message
  (:func:`check_context`); a ``max_new_tokens`` the request does not give is clipped to what fits
  (SGLang's scheduler). The contract is :mod:`specpilot.engine.http_api`; bad requests of every
  kind get 400 with ``{"error": {"message": ...}}``. Concurrent requests are decoded together by one
  :class:`~specpilot.engine.batch.scheduler.BatchDecoder` on an engine thread; beyond its slots
  they wait in a bounded queue (full: 503 with ``Retry-After``). A client that goes away cancels
  its request and frees its slot at the next step (a queued one leaves the queue unrun).
- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and
  ``/v1/models/{model}``: the OpenAI-compatible routes (:mod:`specpilot.engine.openai_api`),
  streamed as OpenAI streams (a text delta per event).
- ``GET /health``, ``/health_generate``, ``/ready``, ``/model_info`` and ``/server_info`` (SGLang's
  shapes; ``/get_model_info``, ``/get_server_info`` the same), ``/metrics`` (Prometheus text),
  ``/flush_cache`` (GET or POST: zeroes the cache slots when idle, else 400).
- SIGTERM or SIGINT: stop admitting (503), let the requests in flight finish for up to ``grace``
  seconds, fail the rest (503, or a final stream event with ``finish_reason`` abort), exit. A
  second signal skips the wait (the rest still get their answer); a third closes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Request as HTTPRequest

from specpilot.engine.batch.requests import Request
from specpilot.engine.batch.scheduler import QueueFull, percentile
from specpilot.engine import openai_api as oa
from specpilot.engine.http_api import BadRequest, Sampling, parse_generate, parse_json
from specpilot.engine.listen import bind
from specpilot.engine.metrics import COMPLETED, ServeMetrics, inter_token_gaps
from specpilot.engine.responses import (RETRY_AFTER, collect, error_body, error_response, json_response,
                                        stream_openai, stream_sglang)
from specpilot.errors import InputError

MAX_BODY = 64 << 20
# the spec a server reports names its batch even at the spec's default of 1: ``serve``'s own
# default is larger, so the spec fed back to it would start another server
SERVED_ALWAYS = ("batch",)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    backlog: int = 2048          # the listen socket's queue of connections not yet accepted
    max_queue: int = 1024        # requests waiting for a slot before 503
    grace: float = 30.0          # seconds in-flight requests get to finish after SIGTERM
    log: Callable[[str], None] | None = None   # one line per finished request


@dataclass
class ServeState:
    engine: object
    decoder: object
    options: ServeOptions
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    started: float = field(default_factory=time.time)
    draining: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    stop_engine: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    engine_errors: list = field(default_factory=list)
    live_rids: set = field(default_factory=set)   # the request ids a client chose, of requests in flight

    # ---- the engine thread ----
    def start_engine(self) -> None:
        self.thread = threading.Thread(target=self.decoder.run_forever, name="specpilot-engine",
                                       args=(self.stop_engine, self._engine_error), daemon=True)
        self.thread.start()

    def _engine_error(self, e: Exception) -> None:
        """A bug in the engine: its requests fail (500), the server goes on; the traceback goes to stderr."""
        import sys
        import traceback

        self.engine_errors.append(e)
        sys.stderr.write("specpilot serve: engine error (requests in flight failed):\n"
                         + "".join(traceback.format_exception(e)))

    def join_engine(self) -> None:
        self.stop_engine.set()
        if self.thread is not None:
            self.thread.join()

    # ---- answers ----
    def answer(self, r: Request, sp: Sampling) -> dict:
        eng = self.engine
        fin = r.finish
        shown = r.output
        matched = fin.get("matched") if fin and fin["type"] == "stop" and not sp.no_stop_trim else None
        if isinstance(matched, int) and not isinstance(matched, bool) and shown and shown[-1] == matched:
            shown = shown[:-1]   # SGLang's detokenizer leaves a matched stop token out of the text
        text = eng.decode(shown, skip_special_tokens=sp.skip_special_tokens)
        if isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        end = r.t_done or time.perf_counter()
        meta = {"id": str(r.id), "prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.output),
                "cached_tokens": 0}
        # SGLang 0.5.23 (TokenizerManager._calculate_spec_decoding_metrics): with a speculative
        # algorithm, once the request is finished and had verify passes, completion tokens per verify
        # pass (the prefill's token and each pass's bonus token counted); else no spec fields at all.
        # Its draft counts: the drafts its passes checked (SGLang's fixed draft size per pass, here
        # each pass's tree nodes or chain drafts) and how many were accepted, and their ratio
        if fin is not None and r.steps and self.engine.spec.mode != "ar":
            meta["spec_verify_ct"] = r.steps
            meta["spec_accept_length"] = len(r.output) / r.steps
            if r.proposed:
                correct = sum(r.accepts)
                meta.update({"spec_accept_rate": correct / r.proposed, "spec_num_correct_drafts": correct,
                             "spec_num_proposed_drafts": r.proposed})
        meta.update({"e2e_latency": end - r.t_arrival,
                     "ttft": (r.t_first - r.t_arrival) if r.t_first is not None else None,
                     "finish_reason": fin})
        return {"text": text, "output_ids": list(r.output), "meta_info": meta}

    def finished(self, r: Request) -> None:
        """Book-keeping of a finished engine request (metrics, the request log)."""
        self.live_rids.discard(r.id)
        reason = r.stop_reason
        if reason == "abort" and str(r.finish.get("message", "")).startswith("engine error"):
            reason = "error"
        self.metrics.request_done(r, reason)
        if self.options.log is not None:
            gaps = inter_token_gaps(r.token_times)
            ttft = f"{r.t_first - r.t_arrival:.3f} s" if r.t_first is not None else "-"
            itl = f"{sum(gaps) / len(gaps):.4f} s" if gaps else "-"
            self.options.log(f"request {r.id}: prompt {len(r.prompt_ids)} tokens, {len(r.output)} generated, "
                             f"ttft {ttft}, itl {itl}, e2e {(r.t_done or time.perf_counter()) - r.t_arrival:.3f} s, "
                             f"{r.steps} verify passes, finish {reason}")

    def server_info(self) -> dict:
        """``/server_info`` (and ``/get_server_info``): the engine, its rules and totals, and SGLang's
        ``internal_states`` (one, as a server of one data-parallel rank has), whose
        ``avg_spec_accept_length`` SGLang's ``bench_serving`` reads: tokens per request per verify
        pass since start (the tau of ``/metrics``), left out in mode ar as SGLang leaves it out
        without a speculative algorithm, and before the first verify pass."""
        eng, dec = self.engine, self.decoder
        running, waiting = dec.load()
        st = dec.stats
        internal = {"effective_max_running_requests_per_dp": dec.batch}
        if eng.spec.mode != "ar" and st.tau() is not None:
            internal["avg_spec_accept_length"] = st.tau()
        return {"engine": eng.spec.text(always=SERVED_ALWAYS), "model": eng.model_name, "model_path": eng.model_name,
                **eng.info,
                "batch_warmup_seconds": dec.warmup_seconds,
                "max_running_requests": dec.batch, "max_queued_requests": self.options.max_queue,
                **{k: eng.spec.rule(k) for k in ("budget", "block", "admit", "admit_rows")},
                "running": running, "waiting": waiting, "draining": self.draining,
                "completion_tokens": st.tokens, "spec_verify_ct": st.verify_steps, "tau": st.tau(),
                "uptime_s": time.time() - self.started, "internal_states": [internal]}

    def model_info(self) -> dict:
        """``/model_info`` (and ``/get_model_info``) in SGLang 0.5.23's shape, with the engine.
        ``tokenizer_path`` is the model's folder where its tokenizer comes from one: SGLang's
        ``bench_serving`` loads the tokenizer from it when it is given none (a catalog name such as
        ``smollm2`` is no tokenizer it could load)."""
        eng = self.engine
        raw = getattr(eng.model.spec, "raw", None) or {}
        folder = eng.info.get("weights")
        tok = folder if eng.tokenizer is not None and folder not in (None, "random") else eng.model_name
        return {"model_path": eng.model_name, "served_model_name": eng.model_name, "tokenizer_path": tok,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": None,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": raw.get("model_type"), "architectures": raw.get("architectures"),
                "engine": eng.spec.text(always=SERVED_ALWAYS)}

    def summary(self) -> dict:
        m, st = self.metrics, self.decoder.stats
        ok = sum(v for k, v in m.finished.items() if k in COMPLETED)
        pct = {f"{k}_p{q}": percentile(v, q) for k, v in m.samples.items() for q in (50, 90, 99)}
        # named as /metrics names them: bad requests are rejected_requests_total{reason="bad_request"},
        # errors requests_total{outcome="error"} (the engine failed them), rejected the queue's refusals
        return {"requests": ok, "bad_requests": m.rejected.get("bad_request", 0), "errors": m.finished.get("error", 0),
                "aborted": m.finished.get("abort", 0),
                "rejected": sum(v for k, v in m.rejected.items() if k != "bad_request"),
                # spec_verify_ct: batched steps, each once; request_passes: each request's share of them
                # (the denominator of tau: (tokens - requests' first tokens) / request passes)
                "completion_tokens": m.completion_tokens, "spec_verify_ct": st.verify_steps,
                "request_passes": st.request_steps, "tau": st.tau(), "busy_seconds": st.step_seconds, **pct}


async def _read_body(request) -> bytes:
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):   # the body would be read as JSON as it came, whatever it is
        raise BadRequest(f"Content-Encoding {coding!r} is not supported; send the body uncompressed", 415)
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > MAX_BODY:
        raise BadRequest(f"body of {int(n)} bytes is over the limit of {MAX_BODY >> 20} MiB", 413)
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise BadRequest(f"body is over the limit of {MAX_BODY >> 20} MiB", 413)
            chunks.append(chunk)
    except ClientDisconnect:   # nobody reads the answer; counted as a bad request, not logged as a crash
        raise BadRequest("the client closed the connection before sending its whole body", 400) from None
    return b"".join(chunks)


def make_app(state: ServeState):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    eng, dec = state.engine, state.decoder
    context = context_len(dec)
    eos = frozenset(eng.eos_ids)
    vocab = eng.model.spec.vocab_size
    encode = (lambda t: eng.encode(t, chat=False)) if eng.tokenizer is not None else None

    def room(prompt_len: int) -> int:
        """The most new tokens the engine takes after a prompt (the context less the prompt): what a
        request that gives no max_new_tokens / max_tokens is clipped to."""
        return context - prompt_len

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc):
        return error_response(str(exc.detail), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return error_response(f"bad request: {exc.errors()[:1]}", 400)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):   # a bug of ours: say so, without the traceback
        return error_response(f"internal error: {type(exc).__name__}", 500)

    def refuse(reason: str, message: str, status: int, headers: dict | None = None):
        state.metrics.reject(reason)
        return error_response(message, status, headers)

    def submit(prompts, sampling, rids):
        """The engine requests of a call, queued (all or none), and the queue of their updates;
        or the error response."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def delivered(r, done):
            if done:
                state.finished(r)
            updates.put_nowait((r, done))

        def on_update(r, new, done):   # engine thread
            try:
                loop.call_soon_threadsafe(delivered, r, done)
            except RuntimeError:       # the loop is gone (shutdown)
                pass

        chosen = [r for r in rids if r]   # an empty rid is no rid: the request gets an id of its own
        # SGLang refuses a request id that is in use: its answers would be confused
        twice = next((r for i, r in enumerate(chosen) if r in chosen[:i]), None)
        if twice is not None:
            return None, refuse("bad_request", f"rid {twice!r} is given twice in this request's list", 400)
        dup = next((r for r in chosen if r in state.live_rids), None)
        if dup is not None:
            return None, refuse("bad_request", f"rid {dup!r} is already in use by a request in flight", 400)
        reqs = []
        for p, sp, rid in zip(prompts, sampling, rids):
            # SGLang 0.5.23 (Req._check_token_based_finish): ignore_eos turns off every token stop,
            # stop_token_ids included; stop strings still apply
            stop_ids = frozenset() if sp.ignore_eos else frozenset(sp.stop_token_ids) | eos
            reqs.append(Request(p, sp.max_new_tokens, id=rid or uuid.uuid4().hex, stop_ids=stop_ids, eos_ids=eos,
                                stop_strings=sp.stop,
                                decode=(lambda ids, s=sp: eng.decode(ids, skip_special_tokens=s.skip_special_tokens)),
                                on_update=on_update))
        # max_new_tokens 0 (SGLang's way to score or cache a prompt): nothing to compute, so the
        # request never reaches the engine; its prompt is checked like any other, then it is answered
        run = [r for r in reqs if r.max_new_tokens > 0]
        try:
            for r in reqs:
                check_context(len(r.prompt_ids), r.max_new_tokens, context)
            for r in reqs:
                if r.max_new_tokens == 0:
                    check_prompt(dec, r.prompt_ids)
            if run:
                dec.submit_all(run)   # all of a list request, or none; each checked first
            state.live_rids.update(chosen)
        except InputError as e:    # a request the engine cannot run, or a list longer than slots + queue
            return None, refuse("bad_request", str(e), 400)
        except QueueFull as e:
            return None, refuse("queue_full" if not state.draining else "draining",
                                f"server busy: {e}; retry later", 503, {"Retry-After": RETRY_AFTER})
        for r in reqs:
            if r.max_new_tokens == 0:   # SGLang's FINISH_LENGTH(length=0): no token, the answer empty
                r.finish, r.t_done = {"type": "length", "length": 0}, time.perf_counter()
                delivered(r, True)
        return (reqs, updates), None

    async def checked(request, parse):
        if state.draining:
            return None, refuse("draining", "the server is shutting down", 503, {"Retry-After": RETRY_AFTER})
        try:
            body = await _read_body(request)
            # parsing and tokenizing off the event loop: a long text (up to the body limit, tens of MB)
            # takes seconds to tokenize, and every other client's request and stream waits on the loop
            return await asyncio.to_thread(lambda: parse(parse_json(body))), None
        except BadRequest as e:
            return None, refuse("bad_request", str(e), e.status)

    @app.api_route("/generate", methods=["POST", "PUT"])   # SGLang takes both
    async def generate(request: HTTPRequest):
        call, bad = await checked(request, lambda body: parse_generate(body, encode, vocab, room))
        if bad is not None:
            return bad
        started, bad = submit(call.prompts, call.sampling, call.rids)
        if bad is not None:
            return bad
        reqs, updates = started
        if call.stream:
            return StreamingResponse(stream_sglang(state, request, reqs[0], call.sampling[0], updates),
                                     media_type="text/event-stream")
        outs = await collect(state, request, reqs, call.sampling, updates)
        if not isinstance(outs, list):
            return outs
        return json_response(outs if call.batched else outs[0])

    async def openai(request, parse):
        call, bad = await checked(request, parse)
        if bad is not None:
            return bad
        # the engine requests carry the id the client gets (--log-requests names them so), one per prompt
        n = len(call.prompts)
        started, bad = submit(call.prompts, call.sampling,
                              [call.response_id] if n == 1 else [f"{call.response_id}-{i}" for i in range(n)])
        if bad is not None:
            return bad
        reqs, updates = started
        if call.stream:
            return StreamingResponse(stream_openai(state, request, reqs[0], call.sampling[0], updates, call),
                                     media_type="text/event-stream")
        outs = await collect(state, request, reqs, call.sampling, updates)
        if not isinstance(outs, list):
            return outs
        return json_response(oa.response(call, outs))

    served = eng.model_name
    chat_encode = eng.encode_messages if eng.has_chat_template else None

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await openai(request, lambda body: oa.parse_completion(body, encode, vocab, served))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await openai(request, lambda body: oa.parse_chat(body, chat_encode, vocab, served, room))

    @app.get("/v1/models")
    async def list_models():
        return json_response(oa.models(served, int(state.started), context))

    @app.get("/v1/models/{model:path}")   # OpenAI's retrieve-model route, as SGLang serves it
    async def get_model(model: str):
        if model != served:
            return error_response(f"model {model!r} is not served here (the served model: {served!r})", 404)
        return json_response(oa.models(served, int(state.started), context)["data"][0])

    @app.api_route("/health", methods=["GET", "HEAD"])   # load balancers probe with HEAD
    async def health():
        if state.draining:
            return error_response("the server is shutting down", 503)
        return Response(status_code=200)

    @app.api_route("/health_generate", methods=["GET", "HEAD"])
    async def health_generate():
        alive = state.thread is not None and state.thread.is_alive()
        if state.draining or not alive:
            return error_response("the engine is not serving", 503)
        return Response(status_code=200)

    @app.get("/ready")   # SGLang's: whether the server takes new requests
    async def ready():
        alive = state.thread is not None and state.thread.is_alive()
        if state.draining or not alive:
            return error_response("the server is not taking requests", 503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")   # SGLang's older name, the same answer
    async def model_info():
        return json_response(state.model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return json_response(state.server_info())

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(dec), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if dec.flush():
            return Response("Cache flushed.\n", media_type="text/plain")
        return error_response("requests are running or waiting; the cache was not flushed", 400)

    return app


def context_len(dec) -> int:
    """The context length a request may use (``/v1/models``' ``max_model_len``): the cache slots less
    the draft rows a step adds."""
    return dec.cache.max_seq - dec.capacity_needed(0, 0)


def check_context(prompt_len: int, max_new: int, context: int) -> None:
    """SGLang's length checks of a request (``TokenizerManager._validate_one_request``, 0.5.23), with
    its messages: a prompt of ``context`` tokens or more is refused whatever ``max_new`` is (0
    included), and so is a prompt and ``max_new`` that add up to more than ``context``. InputError."""
    hint = " (the context is --ctx less the draft rows a step adds; raise --ctx)"
    if prompt_len >= context:
        raise InputError(f"The input ({prompt_len} tokens) is longer than the model's context length ({context} "
                         f"tokens).{hint}")
    if prompt_len + max_new > context:
        raise InputError(f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                         f"You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the "
                         f"input messages and {max_new} tokens for the completion. Please reduce the number of "
                         f"tokens in the input messages or the completion to fit within the limit.{hint}")


def check_prompt(dec, ids: list[int]) -> None:
    """The decoder's check of a request (``BatchDecoder.check``) for one that asks for no new
    token: the prompt's ids in the vocabulary, and the prompt within the context (the cache slots
    it would take with no new token: what ``/v1/models`` gives as ``max_model_len``). InputError."""
    from specpilot.engine.decode import check_request

    check_request(ids, 0, dec.model.spec.vocab_size, dec.capacity_needed, dec.cache.max_seq,
                  least_new=0, mode=dec.mode)


def _protocol():
    """uvicorn's h11 protocol, answering malformed HTTP (a bad Content-Length, broken headers) with
    a JSON 400 like every other refusal."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JSONErrorProtocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}", 400)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JSONErrorProtocol


class Server:
    """The HTTP server and its engine thread; :meth:`run` blocks until shut down."""

    def __init__(self, engine, options: ServeOptions, sock: socket.socket | None = None):
        self.options = options
        decoder = engine.batch_decoder(max_queue=options.max_queue)
        need = decoder.capacity_needed(1, 1)
        if need > decoder.cache.max_seq:   # every request would be refused: do not start
            raise InputError(f"--ctx {decoder.cache.max_seq}: a one-token prompt and one new token need {need} cache "
                             "slots with these draft options; raise --ctx")
        self.state = ServeState(engine, decoder, options)
        self.skip_grace = False   # a second signal: fail the requests in flight now, cleanly
        self.sock = sock if sock is not None else bind(options.host, options.port, options.backlog)
        self.port = self.sock.getsockname()[1]

    def run(self) -> dict:
        import uvicorn

        state = self.state
        config = uvicorn.Config(make_app(state), http=_protocol(), backlog=self.options.backlog, lifespan="off",
                                log_level="error", access_log=False, timeout_keep_alive=5,
                                timeout_graceful_shutdown=max(5, int(self.options.grace) + 5))
        server = _uvicorn_server(config, self)
        state.start_engine()
        try:
            server.run(sockets=[self.sock])
        finally:
            state.join_engine()
            state.decoder.abort_all("the server is shutting down")
            self.sock.close()
        return state.summary()

    async def drain(self, server) -> None:
        """Stop admitting, wait up to ``grace`` s for the requests in flight, fail the rest, stop."""
        state = self.state
        state.draining = True
        with state.decoder.cond:
            state.decoder.draining = True
        deadline = time.monotonic() + self.options.grace
        while not state.decoder.idle() and time.monotonic() < deadline and not self.skip_grace:
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, state.join_engine)
        state.decoder.abort_all("the server is shutting down")
        await asyncio.sleep(0.2)   # the handlers answer the aborted requests
        server.should_exit = True


def _uvicorn_server(config, owner: Server):
    """A uvicorn server whose SIGTERM/SIGINT start :meth:`Server.drain` instead of closing at once
    (a second signal closes without waiting)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, but once a shutdown began the signals that follow belong to it until the
            process exits: handed back to the command's handlers, a late one (while the loop
            closes, or the interpreter ends) made exit 0 a 143 or a kill."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            # SIGHUP too: a closing terminal or ssh session ends the server as SIGTERM does (drained)
            original = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
            try:
                yield
            finally:
                if owner.state.draining:
                    from specpilot.signals import ignore_to_exit

                    ignore_to_exit()
                else:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

        async def startup(self, sockets=None):
            owner.state.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):
            loop = owner.state.loop
            if loop is None or owner.skip_grace:   # not serving yet, or a third signal: close at once
                self.force_exit = True
                self.should_exit = True
                return
            if owner.state.draining:   # a second signal: no more grace, but the requests still get their end
                owner.skip_grace = True
                return
            owner.state.draining = True
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(owner.drain(self)))

    return _Server(config)
