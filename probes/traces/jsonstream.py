"""Streaming reader for Chrome-trace JSON (PyTorch profiler / Kineto), plain or gzip.

``iter_chrome_trace`` walks the top-level object key by key; the ``traceEvents`` array is
decoded one event at a time from a sliding text buffer, so a 1 GB trace never sits in memory
whole. Other top-level values (``deviceProperties`` ...) are small and decoded whole.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from typing import Callable, Iterator

from specpilot.errors import InputError

CHUNK = 1 << 20
MAX_VALUE = 256 << 20  # one JSON value larger than this is treated as malformed
BATCH_MIN = 4096  # decode events in batches when at least this much text is buffered
_WS = " \t\r\n"
_NUM = "0123456789+-.eE"


def open_text(path: str | os.PathLike):
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


class _Buf:
    def __init__(self, fh, path, on_read: Callable[[int], None] | None):
        self.fh, self.path, self.on_read = fh, str(path), on_read
        self.s = ""
        self.i = 0
        self.base = 0   # characters dropped from the front of ``s``: s[i] is character base + i
        self.eof = False
        self.dec = json.JSONDecoder()

    def more(self) -> bool:
        if self.eof:
            return False
        try:
            chunk = self.fh.read(CHUNK)
        except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
            kind = "gzip stream is corrupt or truncated" if isinstance(e, (EOFError, OSError, zlib.error)) else "not UTF-8 text"
            raise InputError(f"{self.path}: {kind} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if not chunk:
            self.eof = True
            return False
        if self.on_read:
            self.on_read(len(chunk))
        if self.i > CHUNK:
            self.base += self.i
            self.s = self.s[self.i:]
            self.i = 0
        self.s += chunk
        return True

    def skip_ws(self) -> str:
        """Skip whitespace; return the next character ('' at end of input)."""
        while True:
            s, i, n = self.s, self.i, len(self.s)
            while i < n and s[i] in _WS:
                i += 1
            self.i = i
            if i < n:
                return s[i]
            if not self.more():
                return ""

    def expect(self, ch: str, where: str) -> None:
        got = self.skip_ws()
        if got != ch:
            self.fail(f"expected {ch!r} {where}, found {got!r}" if got else f"ended early, expected {ch!r} {where}")
        self.i += 1

    def value(self):
        self.skip_ws()
        while True:
            try:
                obj, end = self.dec.raw_decode(self.s, self.i)
            except RecursionError:
                self.fail("nested too deeply")
            except json.JSONDecodeError as e:
                # a value cut by the chunk boundary fails at the end of the buffer (or inside a string
                # that the boundary left open); an error well before the end is malformed JSON
                cut = e.msg.startswith("Unterminated string") or len(self.s) - e.pos <= 16
                if len(self.s) - self.i > MAX_VALUE or not cut:
                    self.fail(f"malformed JSON ({e.msg} at character {e.pos})")
                if not self.more():
                    self.fail(f"truncated or malformed JSON ({e.msg})")
                continue
            if isinstance(obj, (int, float)) and not isinstance(obj, bool) and not self.eof:
                # "-100." at the end of the buffer may be "-100.5": read on before trusting it
                k, s = end, self.s
                while k < len(s) and s[k] in _NUM:
                    k += 1
                if k == len(s) and self.more():
                    continue
            self.i = end
            return obj

    def fail(self, msg: str):
        raise InputError(f"{self.path}: not a valid trace JSON: {msg}")


def iter_chrome_trace(path: str | os.PathLike, on_header: Callable[[str, object], None],
                      on_read: Callable[[int], None] | None = None) -> Iterator[dict]:
    """Yield each event of ``traceEvents``; other top-level keys go to ``on_header(key, value)``.

    Accepts the object form ``{"traceEvents": [...], ...}`` and the bare array form ``[...]``.
    """
    try:
        fh = open_text(path)
    except OSError as e:
        raise InputError(f"{path}: cannot open ({e})") from None
    with fh:
        b = _Buf(fh, path, on_read)
        first = b.skip_ws()
        if first == "":
            b.fail("the file is empty")
        if first == "[":
            b.i += 1
            yield from _array(b)
        elif first == "{":
            b.i += 1
            seen_events = False
            while True:
                c = b.skip_ws()
                if c == "}":
                    b.i += 1
                    break
                if c == ",":
                    b.i += 1
                    continue
                if c != '"':
                    b.fail(f"expected a key, found {c!r}" if c else "ended inside the top-level object")
                key = b.value()
                b.expect(":", f"after key {key!r}")
                if key == "traceEvents":
                    if b.skip_ws() != "[":
                        b.fail("traceEvents is not an array")
                    b.i += 1
                    seen_events = True
                    yield from _array(b)
                else:
                    on_header(key, b.value())
            if not seen_events:
                b.fail("no traceEvents array (is this a PyTorch profiler / Chrome trace?)")
        else:
            b.fail(f"starts with {first!r}, not a JSON object or array")
        if b.skip_ws() != "":
            b.fail("trailing data after the trace object")


def _array(b: _Buf) -> Iterator[dict]:
    """Events of the array. Fast path: cut the buffer after the last ``}, {`` and decode all
    events before it with one ``json.loads`` (valid only if the cut falls between events; if it
    falls inside one, the decode fails and that stretch is decoded one event at a time)."""
    loads = json.loads
    slow_until = -1   # after a failed batch: one event at a time up to the character it failed at
    while True:
        c = b.skip_ws()
        if c == "]":
            b.i += 1
            return
        if c == ",":
            b.i += 1
            continue
        if c == "":
            b.fail("ended inside traceEvents (truncated file?)")
        if c == "{" and len(b.s) - b.i > BATCH_MIN and b.base + b.i > slow_until:
            cut = _last_boundary(b.s, b.i)
            if cut is not None:
                try:
                    batch = loads("[" + b.s[b.i:cut + 1] + "]")
                except RecursionError:
                    b.fail("nested too deeply")
                except ValueError as e:
                    # retrying the batch after each event would parse the same stretch again per
                    # event (a corrupt 600 KB gzipped trace took 9-33 s to reject)
                    batch = None
                    slow_until = b.base + b.i + max(getattr(e, "pos", cut + 1 - b.i) - 1, 0)
                if batch is not None:
                    b.i = cut + 1
                    for ev in batch:
                        if isinstance(ev, dict):
                            yield ev
                    if len(b.s) - b.i < CHUNK:
                        b.more()
                    continue
        ev = b.value()
        if isinstance(ev, dict):
            yield ev


def _last_boundary(s: str, start: int) -> int | None:
    """Index of the '}' of the last ``}, {`` after ``start`` (None when there is none)."""
    end = len(s)
    while True:
        j = s.rfind("{", start + 1, end)
        if j < 0:
            return None
        k = j - 1
        while k > start and s[k] in _WS:
            k -= 1
        if s[k] == ",":
            k -= 1
            while k > start and s[k] in _WS:
                k -= 1
            if s[k] == "}":
                return k
        end = j
