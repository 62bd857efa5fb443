"""Fuzz: ``specpilot serve``'s HTTP contract on mutated request bodies.

Written against the contract, not the server's code, so they hold for any server behind
``specpilot serve``: every body to ``POST /generate`` (and the OpenAI routes) gets 200 (a request that is still valid)
or 400 with a JSON error message, never a 500 and never a dead server. The default run sends each
mutation kind of every seed body once; ``-m slow`` sends 8 seeds of each.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import httpx
import pytest

from fuzzing import KINDS, mutate


SEED_BODIES = [
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
    ("/generate", {"input_ids": [[5, 9], [7, 7, 7]], "sampling_params": {"max_new_tokens": 3}}),
    ("/generate", {"text": "abcabc", "sampling_params": {"max_new_tokens": 2, "top_k": 1}}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 2, "stop": ["x"], "stream": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
]


@pytest.fixture(scope="module")
def server():
    """``specpilot serve`` (tiny random model, AR) on a free loopback port: (host, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", "--model", "tiny", "--mode", "ar",
                             "--port", "0", "--threads", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    found = None
    for line in proc.stderr:
        m = re.search(r"on http://(127\.0\.0\.1):(\d+)", line)
        if m:
            found = (m.group(1), int(m.group(2)))
            break
        if time.time() > deadline:
            break
    if found is None:
        proc.kill()
        pytest.fail("specpilot serve did not start")
    yield found
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post(server, body: bytes, timeout: float = 60.0, path: str = "/generate") -> tuple[int, bytes]:
    host, port = server
    r = httpx.post(f"http://{host}:{port}{path}", content=body, headers={"Content-Type": "application/json"},
                   timeout=timeout)
    return r.status_code, r.content


def check(server, body: bytes, what: str, path: str = "/generate") -> None:
    status, payload = post(server, body, path=path)
    where = f"{what}: body {body[:200]!r} -> {status} {payload[:300]!r}"
    assert status in (200, 400), where
    if status == 400:
        doc = json.loads(payload)
        message = doc.get("error", {}).get("message") if isinstance(doc.get("error"), dict) else doc.get("error")
        assert isinstance(message, str) and message, where


def alive(server) -> bool:
    host, port = server
    return httpx.get(f"http://{host}:{port}/health", timeout=10).status_code == 200


def _bodies(seeds):
    for i, (path, body) in enumerate(SEED_BODIES):
        raw = json.dumps(body).encode()
        for kind in KINDS:
            if kind == "empty":
                continue  # no body at all: its own case below
            for seed in seeds:
                yield path, f"{path} body {i} {kind} {seed}", mutate(raw, kind, random.Random(f"http/{i}/{kind}/{seed}"))


def test_fuzz_http_bodies(server):
    for path, what, body in _bodies([0]):
        check(server, body, what, path)
    assert alive(server)


@pytest.mark.slow
def test_fuzz_http_bodies_many_seeds(server):
    for path, what, body in _bodies(range(1, 9)):
        check(server, body, what, path)
    assert alive(server)


@pytest.mark.parametrize("body", [
    b"",
    b"null",
    b"[]",
    b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1e999}}',
    b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000000000000000000000000000000}}',
    b'{"input_ids": [1000000000000000000000000000000], "sampling_params": {"max_new_tokens": 2}}',
    b'{"input_ids": [-1, 2], "sampling_params": {"max_new_tokens": 2}}',
    b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',
    b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}',
    b"\xff\xfe\x00{",
], ids=["empty", "null", "list", "inf-tokens", "huge-tokens", "huge-id", "negative-id", "nan-temperature",
        "lone-surrogate", "binary"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_http_bad_body_is_400(server, body, path):
    check(server, body, "fixed case", path)
    assert alive(server)


def test_http_deeply_nested_body_is_400(server):
    """JSON nested past the parser's recursion limit is a bad request, not a server error."""
    check(server, b"[" * 100_000 + b"]" * 100_000, "deeply nested")
    assert alive(server)
