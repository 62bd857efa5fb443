"""The ``POST /generate`` contract ``specpilot serve`` keeps: SGLang's native request, checked.

Every field of a request is either honoured, accepted because it cannot change a greedy answer
(``temperature`` 0, any ``top_p``/``top_k``/``min_p`` then, a ``sampling_seed``, SGLang's logging
and routing fields at their defaults, ``stop_regex``/``beam_width``/``watermark`` at null), or
refused with a 400 that names it (unknown names: the first few and a count of the rest). A request
with no sampling parameter is greedy; but SGLang's absent ``temperature`` is 1.0, so ``top_p`` < 1,
a ``top_k`` that keeps more than one token or ``min_p`` > 0 without ``temperature`` would sample
there: they are refused by name (send ``temperature`` 0 for greedy decoding). Malformed bodies of
every kind (not JSON, not UTF-8, NaN or Infinity, nesting deeper than ``MAX_DEPTH``, lone
surrogates, wrong types, out-of-range numbers) are :class:`BadRequest` (HTTP 400), never an
exception that escapes.

Honoured sampling parameters: ``max_new_tokens`` (0 as SGLang takes it: the prompt is checked as
any prompt is, the answer is empty with ``finish_reason`` ``{"type": "length", "length": 0}``;
absent, 128, and ``null``, unbounded, each clipped to what fits after the prompt, as SGLang's
scheduler clips them, where a given value is checked against the context),
``stop`` (strings; the text is cut before the match unless ``no_stop_trim``), ``stop_token_ids``
(the matched token stays in ``output_ids`` and leaves the text unless ``no_stop_trim``),
``ignore_eos``, ``skip_special_tokens``, ``n`` = 1. ``min_new_tokens`` above 0 is refused: SGLang
masks the stop tokens' logits until then, which changes the greedy answer (its own speculative
workers refuse it too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from specpilot.fileio import is_int, is_num

MAX_DEPTH = 32          # JSON nesting a request may have (a real one has 3)
MAX_STOP = 64           # stop strings / stop token ids per request
MAX_NEW_TOKENS = 1 << 20
SAMPLING_EPS = 1e-6   # SGLang 0.5.23's _SAMPLING_EPS: a temperature in [0, it) is greedy
DEFAULT_MAX_NEW = 128   # SGLang's SamplingParams.max_new_tokens default
TOP_K_ALL = 1 << 30     # SGLang's top_k for the whole vocabulary (what -1 and null become)
NAMES_SHOWN = 5         # names an error lists before counting the rest
NAME_WIDTH = 40         # characters of a name an error shows


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` (400 unless said) with the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Sampling:
    max_new_tokens: int = DEFAULT_MAX_NEW
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class GenerateCall:
    """A checked /generate request: one prompt per engine request."""

    prompts: list[list[int]]
    sampling: list[Sampling]
    batched: bool                       # answer with a list
    stream: bool = False
    rids: list[str | None] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- JSON
def _no_constant(name):
    raise BadRequest(f"body is not valid JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise BadRequest(f"body is not valid JSON for this server: the number {text[:20]} overflows a double")
    return x


def _depth(obj, limit: int) -> int:
    """Nesting depth of ``obj`` (iterative; stops past ``limit``)."""
    stack, deepest = [(obj, 1)], 0
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return deepest


def _check_strings(obj) -> None:
    """Refuse strings that are not Unicode text (lone surrogates from ``\\ud800`` escapes)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest("body holds a string with a lone surrogate (\\ud800-\\udfff escape without its "
                                 "pair); send valid Unicode text") from None
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def parse_json(raw: bytes):
    """The body as JSON (UTF-8), or :class:`BadRequest` saying why not."""
    if not raw:
        raise BadRequest("request needs a JSON body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"body is not UTF-8 ({e.reason} at byte {e.start})") from None
    # a cheap bound before parsing: json's recursion ends in RecursionError far deeper than this
    if text.count("[") + text.count("{") > MAX_DEPTH and _bracket_depth(text) > MAX_DEPTH:
        raise BadRequest(f"body nests deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise BadRequest(f"body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:   # e.g. an integer longer than Python converts (4300 digits)
        raise BadRequest(f"body holds a number this server does not read ({str(e)[:80]})") from None
    except RecursionError:
        raise BadRequest(f"body nests deeper than {MAX_DEPTH} levels") from None
    if _depth(obj, MAX_DEPTH) > MAX_DEPTH:
        raise BadRequest(f"body nests deeper than {MAX_DEPTH} levels")
    _check_strings(obj)
    return obj


def _bracket_depth(text: str) -> int:
    """Deepest bracket nesting outside strings (an upper bound of the JSON depth)."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > best:
                best = depth
                if best > MAX_DEPTH:
                    return best
        elif ch in "]}":
            depth -= 1
    return best


# ------------------------------------------------------------------------------- the contract
def name_list(names) -> str:
    """``a, b, c, d, e and 99995 more``: a refusal names a few of the fields, each cut to
    ``NAME_WIDTH`` characters, and counts the rest (a body of 100k unknown keys, or one key of a
    megabyte, is not echoed back)."""
    names = list(names)
    shown = [n if len(n) <= NAME_WIDTH else n[:NAME_WIDTH] + "..." for n in names[:NAMES_SHOWN]]
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


def _int(params: dict, key: str, lo: int, hi: int, default: int, name=lambda k: f"sampling_params.{k}") -> int:
    v = params.get(key, default)
    if v is None:
        return default
    if not is_int(v) or not lo <= v <= hi:
        raise BadRequest(f"{name(key)} must be an integer in [{lo}, {hi}], got {json.dumps(v)[:40]}")
    return v


def _bool(params: dict, key: str, default: bool, name=lambda k: f"sampling_params.{k}") -> bool:
    v = params.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name(key)} must be true or false")
    return v


# values that cannot change a greedy answer, per sampling parameter: accepted and ignored
_NEUTRAL = {
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: v in (None, {}),
    "json_schema": lambda v: v in (None, ""),     # SGLang: an empty grammar is no grammar
    "regex": lambda v: v in (None, ""),
    "ebnf": lambda v: v in (None, ""),
    "structural_tag": lambda v: v in (None, ""),
    "custom_params": lambda v: v in (None, {}),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    # SGLang 0.5.23's SamplingParams: no stop regex (null, or an empty list: nothing to match), no
    # beam search (null or 1: BeamCoordinator.request_beam_width's "not a beam request"), no watermark
    # (null, or enabled false: resolve_watermark_request turns it off)
    "stop_regex": lambda v: v in (None, []),
    "beam_width": lambda v: v is None or (is_int(v) and v == 1),
    "watermark": lambda v: v is None or v == {"enabled": False},
    "sampling_seed": lambda v: v is None or is_int(v),
    "seed": lambda v: v is None or is_int(v),
    "min_new_tokens": lambda v: v is None or (is_int(v) and v == 0),   # >0 masks stop tokens: a new answer
    "stream_interval": lambda v: v is None or (is_int(v) and v >= 1),
}

# the type each neutral parameter has, for a message that says a wrong type is one
_NEUTRAL_TYPES = {
    "frequency_penalty": ("a number", is_num), "presence_penalty": ("a number", is_num),
    "repetition_penalty": ("a number", is_num), "seed": ("an integer", is_int), "sampling_seed": ("an integer", is_int),
    "min_new_tokens": ("an integer", is_int), "stream_interval": ("an integer", is_int),
    "beam_width": ("an integer", is_int),
    "logit_bias": ("an object", lambda v: isinstance(v, dict)),
    "custom_params": ("an object", lambda v: isinstance(v, dict)),
    "spaces_between_special_tokens": ("true or false", lambda v: isinstance(v, bool)),
}
_HONOURED = {"max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
             "no_stop_trim", "n", "temperature", "top_k", "top_p", "min_p"}

# top-level fields: honoured, or accepted at their neutral value
_TOP_HONOURED = {"text", "input_ids", "sampling_params", "stream", "rid"}
_TOP_NEUTRAL = {
    "return_logprob": lambda v: v in (None, False),
    "logprob_start_len": lambda v: v is None or is_int(v),
    "top_logprobs_num": lambda v: v in (None, 0),
    "token_ids_logprob": lambda v: v is None,
    "return_text_in_logprobs": lambda v: v is None or isinstance(v, bool),
    "lora_path": lambda v: v is None,
    "lora_id": lambda v: v is None,
    "image_data": lambda v: v in (None, []),
    "video_data": lambda v: v in (None, []),
    "audio_data": lambda v: v in (None, []),
    "input_embeds": lambda v: v is None,
    "return_hidden_states": lambda v: v in (None, False),
    "return_routed_experts": lambda v: v in (None, False),
    "custom_logit_processor": lambda v: v is None,
    "session_params": lambda v: v is None,
    "log_metrics": lambda v: v is None or isinstance(v, bool),
    "bootstrap_host": lambda v: v is None,
    "bootstrap_port": lambda v: v is None,
    "bootstrap_room": lambda v: v is None,
    "priority": lambda v: v is None or is_int(v),
}


def parse_sampling(params, group: str = "sampling_params", rename: dict[str, str] | None = None,
                   default_max_new: int = DEFAULT_MAX_NEW, least_new: int = 0) -> Sampling:
    """Check sampling parameters (SGLang's names). Errors name a parameter ``group.key``, or the
    bare key when ``group`` is empty, through ``rename`` (the OpenAI routes' ``max_tokens`` is
    ``max_new_tokens`` here). ``max_new_tokens`` may be ``least_new`` or more: 0 on ``/generate``
    (SGLang's ``SamplingParams.verify`` refuses only a negative value)."""
    rename = rename or {}

    def name(key: str) -> str:
        return f"{group}.{rename.get(key, key)}" if group else rename.get(key, key)

    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"{group or 'the request'} must be an object")
    unknown = sorted(rename.get(k, k) for k in params if k not in _HONOURED and k not in _NEUTRAL)
    if unknown:
        raise BadRequest(f"unknown {group or 'fields'}: {name_list(unknown)}")
    for k, (what, ok) in _NEUTRAL_TYPES.items():
        if params.get(k) is not None and not ok(params[k]):
            raise BadRequest(f"{name(k)} must be {what}")
    refused = sorted(rename.get(k, k) for k, ok in _NEUTRAL.items() if k in params and not ok(params[k]))
    if refused:
        raise BadRequest("the embedded engine decodes greedily and cannot honour "
                         f"{(group + ' ') if group else ''}{', '.join(refused)} (leave them out or at their neutral "
                         "values)")
    t = params.get("temperature")
    absent = t is None   # SGLang: absent or null is 1.0 (sampling); here greedy, unless sampling is asked
    if absent:
        t = 0.0
    if not is_num(t) or t < 0:
        raise BadRequest(f"{name('temperature')} must be a number >= 0")
    top_k = params.get("top_k", None)
    if top_k is not None and (not is_int(top_k) or (top_k < 1 and top_k != -1)):
        raise BadRequest(f"{name('top_k')} must be -1 or an integer >= 1")
    for key, lo in (("top_p", 0.0), ("min_p", 0.0)):
        v = params.get(key, None)
        if v is not None and (not is_num(v) or not lo <= v <= 1.0 or (key == "top_p" and v == 0)):
            raise BadRequest(f"{name(key)} must be a number in {'(0, 1]' if key == 'top_p' else '[0, 1]'}")
    if absent and top_k != 1:   # top_k 1 is greedy whatever the rest (SGLang's own greedy)
        sampled = [k for k, neutral in (("top_p", lambda v: v == 1), ("top_k", lambda v: v == -1 or v >= TOP_K_ALL),
                                        ("min_p", lambda v: v == 0))
                   if params.get(k) is not None and not neutral(params[k])]
        if sampled:
            raise BadRequest(f"{(group + ' ') if group else ''}{', '.join(rename.get(k, k) for k in sampled)} without "
                             "temperature: SGLang samples when temperature is absent (1.0 is its default), and the "
                             "embedded engine decodes greedily only; send temperature 0 for greedy decoding")
    if t >= SAMPLING_EPS and top_k != 1:   # SGLang decodes greedily below it (SamplingParams.__init__)
        raise BadRequest(f"{name('temperature')}: the embedded engine decodes greedily only; use temperature 0 "
                         "(or top_k 1)")
    if _int(params, "n", 1, 1, 1, name) != 1:
        raise BadRequest(f"{name('n')} must be 1")
    max_new = _int(params, "max_new_tokens", least_new, MAX_NEW_TOKENS, default_max_new, name)
    stop = params.get("stop", None)
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise BadRequest(f"{name('stop')} must be a non-empty string or a list of up to {MAX_STOP} of them")
    ids = params.get("stop_token_ids", None)
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(is_int(i) and i >= 0 for i in ids) or len(ids) > MAX_STOP:
        raise BadRequest(f"{name('stop_token_ids')} must be a list of up to {MAX_STOP} token ids")
    return Sampling(max_new_tokens=max_new, stop=tuple(stop), stop_token_ids=frozenset(ids),
                    ignore_eos=_bool(params, "ignore_eos", False, name),
                    skip_special_tokens=_bool(params, "skip_special_tokens", True, name),
                    no_stop_trim=_bool(params, "no_stop_trim", False, name))


def check_stop_ids(sampling: list[Sampling], vocab_size: int | None, name: str = "sampling_params.stop_token_ids"):
    if vocab_size is None:
        return
    for s in sampling:
        bad = next((t for t in s.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise BadRequest(f"{name}: {bad} is outside the vocabulary (0..{vocab_size - 1})")


def check_ids(prompts, vocab_size: int | None, what: str = "input_ids") -> None:
    """Token-id prompts: each a non-empty list of ids in the vocabulary."""
    for p in prompts:
        if not isinstance(p, list) or not p or not all(is_int(t) for t in p):
            raise BadRequest(f"{what} must be a non-empty list of integers (or a list of such lists)")
        if vocab_size is not None:
            bad = next((t for t in p if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise BadRequest(f"{what}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def encode_texts(texts: list[str], encode, what: str = "text") -> list[list[int]]:
    """Text prompts through ``encode`` (None: the model has no tokenizer)."""
    if encode is None:
        raise BadRequest(f"this model has no tokenizer; send token ids instead of {what}")
    prompts = []
    for t in texts:
        try:
            p = encode(t)
        except Exception as e:   # a tokenizer failing on odd text is the request's problem
            raise BadRequest(f"cannot tokenize {what} ({type(e).__name__}: {str(e)[:120]})") from None
        if not p:
            raise BadRequest(f"{what} tokenizes to no tokens")
        prompts.append(p)
    return prompts


def check_fields(body, honoured: set[str], neutral: dict) -> None:
    """A request object's top-level fields: each honoured, or at the value ``neutral[field]`` accepts."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(k for k in body if k not in honoured and k not in neutral)
    if unknown:
        raise BadRequest(f"unknown request fields: {name_list(unknown)}")
    refused = sorted(k for k, ok in neutral.items() if k in body and not ok(body[k]))
    if refused:
        raise BadRequest(f"the embedded engine does not support {', '.join(refused)} (leave them out or at their "
                         "defaults)")


def clip_room(room: int) -> int:
    """The new tokens a request that gives no bound of its own may take: the room its prompt leaves,
    at least one (a prompt with no room is refused for its length) and at most MAX_NEW_TOKENS."""
    return max(1, min(room, MAX_NEW_TOKENS))


def _default_max_new(params, prompt_len: int, room) -> int:
    """``max_new_tokens`` when a request gives none, as SGLang 0.5.23 sets it: the field absent,
    ``SamplingParams``' 128; ``null``, no bound of its own (``None``); either way clipped by its
    scheduler to what fits in the context (``Scheduler.init_req_max_new_tokens``). Its tokenizer
    manager checks a prompt and ``max_new_tokens`` against the context only when the field is given,
    so neither is refused for the default. ``room(prompt_len)``: the most new tokens the engine
    takes after that prompt (None: no clipping, the 128)."""
    if room is None:
        return DEFAULT_MAX_NEW
    fits = clip_room(room(prompt_len))
    if isinstance(params, dict) and "max_new_tokens" in params and params["max_new_tokens"] is None:
        return fits
    return min(DEFAULT_MAX_NEW, fits)


def parse_generate(body, encode=None, vocab_size: int | None = None, room=None) -> GenerateCall:
    """Check a /generate body (parsed JSON). ``encode(text) -> ids`` tokenizes text prompts (None:
    the model has no tokenizer); ``vocab_size`` bounds token ids; ``room(prompt_len)``, the most new
    tokens that fit after a prompt, clips a ``max_new_tokens`` the request does not give
    (:func:`_default_max_new`; None: the default is 128 whatever the prompt)."""
    check_fields(body, _TOP_HONOURED, _TOP_NEUTRAL)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if ids is not None:
        batched = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
        prompts = ids if batched else [ids]
        check_ids(prompts, vocab_size)
    else:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("text must be a non-empty string (or a list of them)")
        prompts = encode_texts(texts, encode)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise BadRequest(f"sampling_params is a list of {len(sp)} but there are {len(prompts)} prompts")
        sampling = [parse_sampling(s, default_max_new=_default_max_new(s, len(p), room)) for s, p in zip(sp, prompts)]
    else:
        sampling = [parse_sampling(sp, default_max_new=_default_max_new(sp, len(p), room)) for p in prompts]
    check_stop_ids(sampling, vocab_size)
    rid = body.get("rid")
    if rid is None:
        rids = [None] * len(prompts)
    elif isinstance(rid, str) and not batched:
        rids = [rid]
    elif isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise BadRequest("rid must be a string (or a list of one per prompt)")
    if stream and batched:
        raise BadRequest("stream with a list of prompts is not supported; send one request per prompt")
    return GenerateCall(prompts, sampling, batched, stream, rids)
