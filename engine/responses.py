"""How ``serve`` answers (:mod:`specpilot.engine.server`): the JSON and error responses, a
non-streaming call's wait for its requests (:func:`collect`), and the two streams, SGLang's
(:func:`stream_sglang`, cumulative text per event) and OpenAI's (:func:`stream_openai`, a delta per
event), each cancelling its request when the client goes away."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from specpilot.engine import openai_api as oa
from specpilot.engine.batch.requests import Request
from specpilot.engine.http_api import Sampling

if TYPE_CHECKING:
    from specpilot.engine.server import ServeState

RETRY_AFTER = "1"


# OpenAI's error types by status, as SGLang's OpenAI routes name them (``create_error_response``)
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "BadRequestError",
               415: "BadRequestError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int) -> dict:
    """OpenAI's error object (``message``, ``type``, ``param``, ``code``; an OpenAI client reads
    ``error``) with the message at the top level too, where SGLang's native routes put it."""
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}, "message": message}


def json_response(obj, status: int = 200, headers: dict | None = None):
    from fastapi.responses import Response

    return Response(json.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(message: str, status: int, headers: dict | None = None):
    return json_response(error_body(message, status), status, headers)


async def _wait_disconnect(request) -> None:
    """Returns when the client has closed the connection (the body is read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_update(updates: asyncio.Queue, disc: asyncio.Future):
    """The next ``(request, finished)`` update, or None once the client has gone (``disc`` done)."""
    if disc.done():
        return None
    get = asyncio.ensure_future(updates.get())
    try:
        done, _ = await asyncio.wait({get, disc}, return_when=asyncio.FIRST_COMPLETED)
    finally:   # cancelled (Starlette's own disconnect listener ends the stream): no waiter left behind
        if not get.done():
            get.cancel()
    return get.result() if get in done else None


def final_status(reqs: list[Request]) -> tuple[int, str] | None:
    for r in reqs:
        if r.finish and r.finish["type"] == "abort":
            msg = str(r.finish.get("message", "aborted"))
            return (500 if msg.startswith("engine error") else 503), msg
    return None


async def collect(state: ServeState, request, reqs: list[Request], sampling: list[Sampling], updates: asyncio.Queue):
    """Wait for every request of a non-streaming call: their answers (``ServeState.answer``), or the
    error response when the client left or the engine failed them."""
    left = {id(r) for r in reqs}
    disc = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while left:
            got = await _next_update(updates, disc)
            if got is None:
                for r in reqs:
                    state.decoder.cancel(r)
                return error_response("client disconnected", 499)
            r, fin = got
            if fin:
                left.discard(id(r))
    finally:
        disc.cancel()
    bad = final_status(reqs)
    if bad is not None:
        return error_response(bad[1], bad[0], {"Retry-After": RETRY_AFTER} if bad[0] == 503 else None)
    return [state.answer(r, sp) for r, sp in zip(reqs, sampling)]


def sendable(full: str, sent: str, stops=(), hold: int = 0) -> str:
    """The text a stream may send after ``sent`` (what it sent so far) of the text decoded so far,
    ``full``: none past a stop string in it or within ``hold`` characters of its end, and not a
    trailing character whose bytes have not all come (U+FFFD until they do), since text once sent
    cannot be taken back; nothing while ``full`` does not extend ``sent``."""
    end = len(full) - hold
    for stop in stops:
        at = full.find(stop)
        if at >= 0:
            end = min(end, at)
    while end > len(sent) and full[end - 1] == "\ufffd":
        end -= 1
    return full[len(sent):end] if end > len(sent) and full.startswith(sent) else ""


async def stream_sglang(state: ServeState, request, r: Request, sp: Sampling, updates: asyncio.Queue):
    """SGLang's streaming answer: one event per step that delivered tokens (cumulative text and ids).
    Until the last event the text stops short of a character whose bytes have not all come
    (:func:`sendable`; SGLang's incremental detokenizer holds it back too), so each event's text
    extends the one before; the last carries the answer's whole text, cut before a matched stop
    string (so it can be shorter than the one before, as SGLang's). A client that goes away, while
    the request waits for a slot too, cancels it (:func:`_next_update`)."""
    sent, text = -1, ""
    disc = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while True:
            got = await _next_update(updates, disc)
            if got is None:   # the client left: the request is cancelled (a queued one never runs)
                return
            _, fin = got
            while not updates.empty() and not fin:   # coalesce updates that queued meanwhile
                _, fin = updates.get_nowait()
            if len(r.output) != sent or fin:
                sent = len(r.output)
                out = state.answer(r, sp)
                if not fin:
                    out["text"] = text = text + sendable(out["text"], text, sp.stop)
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
            if fin:
                break
        yield b"data: [DONE]\n\n"
    finally:
        disc.cancel()
        if not r.done:
            state.decoder.cancel(r)


async def stream_openai(state: ServeState, request, r: Request, sp: Sampling, updates: asyncio.Queue, call):
    """OpenAI's streaming answer: each event carries the text added since the last (a delta); a chat
    stream's first event is the role alone (``delta: {"role": "assistant", "content": ""}``) and its
    last before the usage the finish reason alone (``delta: {}``), as SGLang's; a completions
    stream's finish reason comes on its last text event. Text
    that may be the start of a stop string, or a character whose bytes have not all come, is held
    back until the next step shows what it is: a delta once sent cannot be taken back. A client
    that goes away cancels the request, as in :func:`stream_sglang`."""
    eng = state.engine
    hold = max((len(s) for s in sp.stop), default=1) - 1
    sent, first, tokens = "", True, 0
    disc = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while True:
            got = await _next_update(updates, disc)
            if got is None:
                return
            _, fin = got
            while not updates.empty() and not fin:
                _, fin = updates.get_nowait()
            if first and call.chat:   # the role alone first (OpenAI's, SGLang's), when the first update comes
                counts = (len(r.prompt_ids), 0) if call.continuous_usage else None
                yield b"data: " + json.dumps(oa.role_chunk(call, counts)).encode() + b"\n\n"
                first = False
            if fin:
                if r.finish and r.finish["type"] == "abort":
                    text, reason = "", "abort"
                else:
                    full = state.answer(r, sp)["text"]
                    text, reason = (full[len(sent):] if full.startswith(sent) else ""), oa.finish_reason(r.finish)
            else:
                # the engine thread may have appended the next step's tokens meanwhile: a stop string
                # already in the text is never sent, whatever this update said
                full = eng.decode(r.output, skip_special_tokens=sp.skip_special_tokens)
                text, reason = sendable(full, sent, sp.stop, hold), None
            # a chat stream ends as SGLang's does (serving_chat.py, _generate_chat_stream): the last
            # text in a content event of its own, then an event with an empty delta and the finish
            # reason alone; a completions stream puts the finish reason on its last text event
            own_finish = fin and call.chat
            # with the usage in every event, an event is due whenever tokens came, text or not
            if text or first or (fin and not own_finish) or (call.continuous_usage and len(r.output) > tokens):
                sent, tokens = sent + text, len(r.output)
                counts = (len(r.prompt_ids), tokens) if call.continuous_usage else None
                yield (b"data: " + json.dumps(oa.chunk(call, text, None if own_finish else reason, counts)).encode()
                       + b"\n\n")
                first = False
            if own_finish:   # no usage on it, as SGLang's has none (the usage event follows if asked)
                yield b"data: " + json.dumps(oa.chunk(call, None, reason)).encode() + b"\n\n"
            if fin:
                break
        if call.include_usage:
            yield b"data: " + json.dumps(oa.usage_chunk(call, len(r.prompt_ids), len(r.output))).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        disc.cancel()
        if not r.done:
            state.decoder.cancel(r)
