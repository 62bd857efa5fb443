"""The OpenAI-compatible routes ``specpilot serve`` keeps beside SGLang's ``/generate``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (the shapes OpenAI, vLLM and SGLang
answer, which load generators such as ``vllm bench serve``, genai-perf and SGLang's
``bench_serving --backend sglang-oai`` send), ``GET /v1/models``. The rules are ``/generate``'s
(:mod:`specpilot.engine.http_api`): every field is honoured, accepted at a value that cannot change
a greedy answer, or refused with a 400 naming it. A request without ``temperature`` is greedy, as
on ``/generate``, unless it asks for sampling: ``top_p`` < 1, a ``top_k`` above 1 or ``min_p`` > 0
without ``temperature`` (SGLang's absent temperature is 1.0 and samples) are a 400 naming them.

Honoured: ``prompt`` (a string, a list of strings, token ids or a list of token-id lists) or
``messages`` (through the model's chat template), ``max_tokens`` (completions: 16 when absent, as
OpenAI's, and at least 1, as SGLang's ``CompletionRequest`` validator says; chat: what fits in the
context when absent, and 0 taken, as SGLang's chat route takes it: the prompt checked, an empty
answer with ``finish_reason`` ``length``; ``max_completion_tokens`` too, on chat only: the
completions request has no such field, a 400 names it), ``stop``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``stream`` and
``stream_options`` (``include_usage``, vLLM's ``continuous_usage_stats``), ``n`` = 1.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from specpilot.fileio import is_int

from .http_api import (BadRequest, Sampling, check_fields, check_ids, check_stop_ids, clip_room, encode_texts,
                       name_list, parse_sampling)

# OpenAI's names for the sampling parameters /generate has
_RENAME = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
_SHOWN = {"min_new_tokens": "min_tokens"}
_SAMPLING = {"max_tokens", "max_completion_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
             "skip_special_tokens", "n", "temperature", "top_k", "top_p", "min_p", "seed", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "logit_bias", "no_stop_trim", "stop_regex", "watermark"}

# other fields, at values that cannot change a greedy answer
_NEUTRAL_COMPLETION = {
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "logprobs": lambda v: v is None,
    "suffix": lambda v: v is None,
    "user": lambda v: v is None or isinstance(v, str),
}
# what OpenAI's clients may send that touches no answer: storage, tags, the tier of service
_BOOKKEEPING = {
    "store": lambda v: v is None or isinstance(v, bool),
    "metadata": lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "service_tier": lambda v: v is None or isinstance(v, str),
}
_NEUTRAL_COMPLETION.update(_BOOKKEEPING)
_NEUTRAL_CHAT = {
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "user": lambda v: v is None or isinstance(v, str),
    **_BOOKKEEPING,
}
_ROLES = ("system", "user", "assistant", "developer")


@dataclass
class OpenAICall:
    """A checked completions or chat request: one engine request per prompt."""

    chat: bool
    model: str
    prompts: list[list[int]]
    sampling: list[Sampling]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id


def _model(body: dict, served: str) -> str:
    # any name is taken, as SGLang takes it: load generators send whatever name they were given
    m = body.get("model")
    if m is None:
        return served
    if not isinstance(m, str) or not m:
        raise BadRequest("model must be a non-empty string")
    return m


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` and ``.continuous_usage_stats`` (vLLM's: the
    usage so far in every event, which is how a load generator counts the tokens of an event)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False, False
    if not stream:
        raise BadRequest("stream_options needs stream: true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options must be an object with include_usage and continuous_usage_stats")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        v = opts.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise BadRequest(f"stream_options.{key} must be true or false")
        flags.append(v)
    return True, flags[0], flags[1]


# a bookkeeping field of another type is a malformed request, not a feature the engine lacks
_SHAPES = {"user": "a string", "store": "true or false", "metadata": "an object of string values",
           "service_tier": "a string"}


def _fields(body, neutral: dict, own: set[str], sampling: set[str] = _SAMPLING) -> None:
    for k, shape in _SHAPES.items():
        if isinstance(body, dict) and body.get(k) is not None and k in neutral and not neutral[k](body[k]):
            raise BadRequest(f"{k} must be {shape}")
    check_fields(body, own | sampling | {"model", "stream", "stream_options"}, neutral)


def _sampling(body: dict, prompts: list[list[int]], default_max, vocab_size: int | None,
              least_new: int) -> list[Sampling]:
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BadRequest("give max_tokens or max_completion_tokens, not both")
    params = {_RENAME.get(k, k): v for k, v in body.items() if k in _SAMPLING}
    shown = dict(_SHOWN, max_new_tokens="max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
    out = []
    for p in prompts:
        fits = default_max(len(p))
        out.append(parse_sampling(params, group="", rename=shown, default_max_new=clip_room(fits),
                                  least_new=least_new))
    check_stop_ids(out, vocab_size, "stop_token_ids")
    return out


def parse_completion(body, encode, vocab_size: int | None, served: str) -> OpenAICall:
    """Check a ``/v1/completions`` body (parsed JSON). ``encode(text) -> ids`` (None: no tokenizer)."""
    # max_completion_tokens is the chat request's: SGLang's CompletionRequest has max_tokens only
    try:
        _fields(body, _NEUTRAL_COMPLETION, {"prompt"}, _SAMPLING - {"max_completion_tokens"})
    except BadRequest as e:
        if isinstance(body, dict) and "max_completion_tokens" in body:
            raise BadRequest(f"{e} (/v1/completions takes max_tokens; max_completion_tokens belongs "
                             "to /v1/chat/completions)") from None
        raise
    model = _model(body, served)
    stream, usage, continuous = _stream(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = encode_texts([prompt], encode, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        prompts = encode_texts(prompt, encode, "prompt")
    elif isinstance(prompt, list) and prompt and all(is_int(x) for x in prompt):
        prompts = [prompt]
        check_ids(prompts, vocab_size, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
        prompts = prompt
        check_ids(prompts, vocab_size, "prompt")
    else:
        raise BadRequest("prompt must be a non-empty string, a list of strings, a list of token ids or a list of "
                         "such lists")
    if stream and len(prompts) > 1:
        raise BadRequest("stream with several prompts is not supported; send one request per prompt")
    # max_tokens 0 is a 400 here: SGLang's CompletionRequest refuses it ("max_tokens must be positive")
    return OpenAICall(False, model, prompts, _sampling(body, prompts, lambda n: 16, vocab_size, 1), stream, usage,
                      continuous)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in c):
        return "".join(p["text"] for p in c)
    raise BadRequest(f"messages[{i}].content must be a string or a non-empty list of text parts "
                     "({type: text, text})")


def parse_chat(body, chat_encode, vocab_size: int | None, served: str, room) -> OpenAICall:
    """Check a ``/v1/chat/completions`` body. ``chat_encode(messages) -> ids`` applies the model's chat
    template (None: the model has none); ``room(prompt_len)``: the most new tokens that fit."""
    _fields(body, _NEUTRAL_CHAT, {"messages"})
    model = _model(body, served)
    stream, usage, continuous = _stream(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role among {', '.join(_ROLES)}")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise BadRequest(f"messages[{i}]: unsupported fields {name_list(extra)}")
        if "name" in m and not (isinstance(m["name"], str) and m["name"]):
            raise BadRequest(f"messages[{i}].name must be a non-empty string")
        # the participant's name goes to the chat template with the message, as SGLang passes it
        clean.append({"role": m["role"], "content": _content(m, i), **({"name": m["name"]} if "name" in m else {})})
    if chat_encode is None:
        raise BadRequest("this model has no chat template; use /v1/completions")
    try:
        ids = chat_encode(clean)
    except Exception as e:   # a template refusing a message order is the request's problem
        raise BadRequest(f"the chat template refused the messages ({type(e).__name__}: {str(e)[:120]})") from None
    if not ids:
        raise BadRequest("messages render to no tokens")
    # max_tokens 0 is taken here, as SGLang's ChatCompletionRequest takes it (no validator; 0 new
    # tokens). SGLang reads max_completion_tokens 0 as absent (``max_completion_tokens or max_tokens``);
    # here it is 0 new tokens as well, as the field says
    return OpenAICall(True, model, [ids], _sampling(body, [ids], room, vocab_size, 0), stream, usage, continuous)


# ---------------------------------------------------------------------------------- answers
def finish_reason(finish: dict | None) -> str | None:
    """OpenAI's finish reason for an engine request's ``finish``: its type already is one (``length``;
    ``stop`` for EOS, a stop token or a stop string; ``abort`` as vLLM says it)."""
    return finish["type"] if finish else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(call: OpenAICall, answers: list[dict]) -> dict:
    """The whole answer from ``/generate``-style answers (text, meta_info), one per prompt."""
    choices = []
    for i, a in enumerate(answers):
        reason = finish_reason(a["meta_info"]["finish_reason"])
        if call.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": a["text"]}, "logprobs": None,
                            "finish_reason": reason})
        else:
            choices.append({"index": i, "text": a["text"], "logprobs": None, "finish_reason": reason})
    total = usage(sum(a["meta_info"]["prompt_tokens"] for a in answers),
                  sum(a["meta_info"]["completion_tokens"] for a in answers))
    return {"id": call.response_id, "object": call.object, "created": call.created, "model": call.model,
            "choices": choices, "usage": total}


def chunk(call: OpenAICall, text: str | None, reason: str | None, counts: tuple[int, int] | None = None) -> dict:
    """One streamed event: the new text (a delta), the finish reason on the last (a completions
    stream's last text; a chat stream's own last event, ``text`` None: an empty delta, as SGLang's),
    and with ``counts`` (prompt, completion tokens so far) the usage so far. A chat stream's first
    event is :func:`role_chunk`; these carry no role."""
    if call.chat:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": call.response_id, "object": obj, "created": call.created, "model": call.model, "choices": [choice]}
    if counts is not None:
        out["usage"] = usage(*counts)
    return out


def role_chunk(call: OpenAICall, counts: tuple[int, int] | None = None) -> dict:
    """A chat stream's first event, as OpenAI and SGLang send it: ``delta: {"role": "assistant",
    "content": ""}``, no finish reason; the content follows in the events after it."""
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    out = {"id": call.response_id, "object": "chat.completion.chunk", "created": call.created, "model": call.model,
           "choices": [choice]}
    if counts is not None:
        out["usage"] = usage(*counts)
    return out


def usage_chunk(call: OpenAICall, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": call.response_id, "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created, "model": call.model, "choices": [], "usage": usage(prompt_tokens,
                                                                                     completion_tokens)}


def models(served: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created,
                                        "owned_by": "specpilot", "root": served, "max_model_len": max_model_len}]}
