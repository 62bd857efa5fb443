"""A client for SGLang-compatible servers' native ``/generate`` endpoint, with token ids in and out.

Request (greedy)::

    POST /generate {"input_ids": [...], "sampling_params": {"temperature": 0, "max_new_tokens": N}}

Response: a JSON object with ``output_ids`` (the generated token ids; SGLang >= 0.4 and
``specpilot serve``), or, from older servers, ``meta_info.output_token_logprobs`` entries
``[logprob, token_id, text]`` when ``return_logprob`` was asked for. ``GET /health`` answers 200
when the server is up.

Every failure raises :class:`ServerError` (exit 3) with one line that says what happened and
where: the server is unreachable, it did not answer within the timeout, it closed the
connection (died), it answered with an HTTP error, or its answer is not what /generate returns.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.fileio import is_int
from specpilot.limits import MAX_TOKEN_ID


class ServerError(EnvironmentMissing):
    """The server failed us (exit 3): unreachable, timed out, died, HTTP error, malformed answer."""


class RequestRefused(InputError):
    """The server refused the request itself (HTTP 400): bad input, exit 2 (asking again cannot help)."""


def parse_url(url: str) -> str:
    """Normalise ``http://host:port[/prefix]``; raise InputError when it is not an http(s) URL."""
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise InputError(f"{url!r}: not a URL ({e}); expected one like http://127.0.0.1:30000") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise InputError(f"{url!r}: expected a server URL like http://127.0.0.1:30000")
    if u.port is not None and not 0 < u.port < 65536:
        raise InputError(f"{url!r}: bad port {u.port}")
    if u.query or u.fragment:   # the routes are appended to the path: /health after "?x=1" is no route
        raise InputError(f"{url!r}: a server URL has no query or fragment; give http://host:port[/prefix]")
    if u.path.rstrip("/").endswith(("/generate", "/v1/completions", "/v1/chat/completions")):
        raise InputError(f"{url!r}: give the server's address without the route (http://{u.host}"
                         f"{':' + str(u.port) if u.port else ''}); SpecPilot adds /generate itself")
    return url.rstrip("/")


# httpx's words (h11's) for a connection that ended before the answer did
_DISCONNECTED = "disconnected without sending a response"
_CUT_SHORT = "closed connection without sending complete message body"


def _caused_by(exc: BaseException, kind: type) -> bool:
    """Whether ``kind`` is in the chain of exceptions behind ``exc``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@functools.lru_cache(maxsize=1)
def _tls():
    """One TLS context for every request of the process: each request opens its own connection,
    and a context of its own would load the CA certificates again (about 20 ms of CPU each)."""
    return httpx.create_ssl_context()


class GenerateClient:
    """Greedy generation through a server's native ``/generate`` endpoint."""

    def __init__(self, url: str, timeout: float = 120.0, return_logprob: bool = False):
        if not timeout > 0:
            raise InputError(f"--timeout {timeout}: must be positive")
        self.url = parse_url(url)
        self.timeout = float(timeout)
        self.return_logprob = return_logprob

    # -----------------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None, started: list | None = None):
        """One HTTP request on its own connection (calls may come from several threads at once). A
        server that is busy (503 with ``Retry-After``) is asked again after the wait it names, for
        up to ``timeout`` seconds in all; ``started`` gets the time the answered attempt began."""
        deadline = time.perf_counter() + self.timeout
        while True:
            if started is not None:
                started[:] = [time.perf_counter()]
            resp = self._send(path, body)
            wait = _retry_after(resp) if resp.status_code == 503 else None
            if wait is None or time.perf_counter() + wait >= deadline:
                break
            time.sleep(wait)
        if resp.status_code >= 400:
            detail = resp.content[:200].decode("utf-8", "replace").strip().replace("\n", " ")
            error = RequestRefused if resp.status_code == 400 else ServerError
            raise error(f"{self.url + path}: server answered HTTP {resp.status_code} {resp.reason_phrase}"
                        + (f": {detail}" if detail else ""))
        return resp.status_code, resp.content

    def _send(self, path: str, body: dict | None):
        target = self.url + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        try:
            return httpx.request("GET" if body is None else "POST", target, headers=headers,
                                 content=None if body is None else json.dumps(body).encode(),
                                 timeout=self.timeout, follow_redirects=True, verify=_tls())
        except httpx.TimeoutException:
            raise ServerError(f"{target}: no answer within {self.timeout:g} s (--timeout)") from None
        except httpx.ConnectError as e:
            if _caused_by(e, ConnectionRefusedError):
                raise ServerError(f"{target}: connection refused; is the server running at {self.url}?") from None
            raise ServerError(f"{target}: cannot reach the server ({e})") from None
        except (httpx.ReadError, httpx.WriteError) as e:
            raise ServerError(f"{target}: the server closed the connection without a full answer "
                              "(did it crash or get killed?)" + (f": {e}" if str(e) else "")) from None
        except httpx.RemoteProtocolError as e:
            if _DISCONNECTED in str(e) or _CUT_SHORT in str(e):
                raise ServerError(f"{target}: the server closed the connection without a full answer "
                                  "(did it crash or get killed?)") from None
            raise ServerError(f"{target}: malformed HTTP answer ({str(e)[:80]})") from None
        except (httpx.HTTPError, OSError) as e:
            raise ServerError(f"{target}: connection failed ({e})") from None

    def health(self) -> None:
        """Raise ServerError unless ``GET /health`` answers 200."""
        status, _ = self._request("/health", None)
        if status != 200:
            raise ServerError(f"{self.url}/health: answered HTTP {status}, expected 200")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``input_ids``: the generated token ids."""
        return self.generate_full(input_ids, max_new_tokens).output_ids

    def generate_full(self, input_ids: Sequence[int], max_new_tokens: int) -> "GenerateResult":
        """Greedy continuation with the server's ``meta_info`` and the request's wall time."""
        body = {"input_ids": list(map(int, input_ids)),
                "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)}}
        if self.return_logprob:
            body["return_logprob"] = True
        started: list = []
        _, raw = self._request("/generate", body, started)
        seconds = time.perf_counter() - started[0]   # the answered attempt's, not a busy server's waits
        meta: dict = {}
        ids = parse_generate_response(raw, self.url + "/generate", max_new_tokens, meta_out=meta)
        return GenerateResult(ids, meta, seconds)


MAX_RETRY_AFTER_S = 30.0


def _retry_after(resp) -> float | None:
    """The seconds a 503's ``Retry-After`` asks for (a number, at most :data:`MAX_RETRY_AFTER_S`), or None."""
    try:
        wait = float(resp.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(wait, MAX_RETRY_AFTER_S) if wait >= 0 else None


@dataclass
class GenerateResult:
    output_ids: list[int]
    meta_info: dict
    seconds: float  # wall time of the HTTP request, connection included


def _bad(where: str, what: str) -> ServerError:
    return ServerError(f"{where}: malformed /generate answer: {what}")


def parse_generate_response(raw: bytes, where: str, max_new_tokens: int | None = None,
                            meta_out: dict | None = None) -> list[int]:
    """The generated ids from a /generate answer, checked for shape and consistency."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        snippet = raw[:60].decode("utf-8", "replace").replace("\n", " ")
        raise _bad(where, f"not JSON (starts with {snippet!r})") from None
    except RecursionError:   # the server's failure, not the user's input
        raise _bad(where, "JSON nested too deeply to read") from None
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise _bad(where, f"expected a JSON object, got {type(obj).__name__}")
    meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
    if meta_out is not None:
        meta_out.update(meta)
    ids = obj.get("output_ids")
    if ids is None and isinstance(meta.get("output_token_logprobs"), list):
        try:
            ids = [entry[1] for entry in meta["output_token_logprobs"]]
        except (TypeError, IndexError, KeyError):
            raise _bad(where, "meta_info.output_token_logprobs entries are not [logprob, token_id, ...]") from None
    if ids is None:
        keys = ", ".join(sorted(map(str, obj))) or "none"
        raise _bad(where, f"no \"output_ids\" (keys: {keys}); the server must return generated token ids "
                          "(SGLang >= 0.4 does)")
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise _bad(where, f"\"output_ids\" is not a list of token ids (integers in 0..{MAX_TOKEN_ID})")
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise _bad(where, f"{len(ids)} tokens returned for max_new_tokens={max_new_tokens}")
    ct = meta.get("completion_tokens")
    if isinstance(ct, int) and not isinstance(ct, bool) and ct != len(ids):
        raise _bad(where, f"meta_info.completion_tokens={ct} but {len(ids)} output_ids")
    return ids
