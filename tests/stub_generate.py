"""A stand-in for an SGLang ``/generate`` server, in its own process, that fails on purpose: the
client tests' way to meet a server that dies or stalls in the middle of a request.

:func:`start` runs it on a free loopback port. It answers every ``POST`` with three copies of the
last input id plus one, and on request number ``after`` (counted from 0) it either exits at once
(``die``: the connection drops mid-request), sleeps 300 s (``stall``) or answers 503 with
``Retry-After: 1`` once (``busy``; the next request is answered). With ``log`` it appends
each answered request's ``input_ids`` to that file, one JSON list a line. It is written on the
standard library's ``http.server`` because it has to misbehave below any framework: exit without a
response, hold a request open.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    mode, after = sys.argv[1], int(sys.argv[2])
    log = sys.argv[3] if len(sys.argv) > 3 else None
    served = 0
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def _send(self, payload):
            self.send_response(200); self.send_header("Content-Length", str(len(payload))); self.end_headers()
            self.wfile.write(payload); self.wfile.flush()
        def do_GET(self): self._send(b"")
        def do_POST(self):
            global served, after
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if served == after:
                if mode == "die":
                    os._exit(1)
                if mode == "busy":
                    after = -1
                    self.send_response(503); self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0"); self.end_headers(); self.wfile.flush()
                    return
                time.sleep(300)
            served += 1
            if log:
                with open(log, "a") as fh:
                    fh.write(json.dumps(body["input_ids"]) + "\\n")
            self._send(json.dumps({"output_ids": [body["input_ids"][-1] + 1] * 3}).encode())
    srv = HTTPServer(("127.0.0.1", 0), H)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
""")


def start(mode: str, after: int, log: Path | None = None) -> tuple[subprocess.Popen, int]:
    """The stub process (``mode`` ``die``, ``stall`` or ``busy`` at request ``after``) and its port."""
    if mode not in ("die", "stall", "busy"):
        raise ValueError(f"mode is die, stall or busy, got {mode!r}")
    args = [sys.executable, "-c", _SCRIPT, mode, str(after)] + ([str(log)] if log is not None else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())
