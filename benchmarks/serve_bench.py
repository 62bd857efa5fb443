"""Shared by the serve benchmarks: start ``specpilot serve`` in a subprocess, load it with
:mod:`loadgen` at several closed-loop concurrencies, stop it with SIGTERM (exit 0 expected)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def specpilot_cmd() -> list[str]:
    """The ``specpilot`` command for a subprocess, through ``common.bootstrap``: the installed
    package, else the working tree's folders (the lent GPU machine runs from a plain copy)."""
    boot = (f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); from common import bootstrap; "
            "bootstrap(); from specpilot.cli import main; main()")
    return [sys.executable, "-c", boot]


class Served:
    def __init__(self, args: list[str], timeout: float = 900):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([*specpilot_cmd(), "serve", *args, "--port", "0",
                                      "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.err, self.url = [], None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.err.append(line)
                m = re.search(r"on (http://[\d.]+:\d+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        # a server that exits before it listens (an import error, a bad option) fails the benchmark now
        while not ready.wait(1.0):
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.proc.kill()
                time.sleep(0.5)   # the reader thread takes the last lines
                why = f"exited with code {code}" if code is not None else "timed out"
                raise RuntimeError(f"specpilot serve did not start ({why}): " + "".join(self.err)[-2000:])
        import httpx

        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=300)
        return self.proc.returncode, out


def sweep(args: list[str], prompts: list, levels: list[int], max_new: int, requests_at, label: str,
          warmup: int = 0) -> list[dict]:
    """One server, closed-loop loads at ``levels`` clients (``requests_at(c)`` requests each)."""
    from loadgen import print_summary, run_load

    s = Served(args)
    rows = []
    try:
        if warmup:   # first steps capture CUDA graphs and compile kernels
            run_load(s.url, prompts, max_new_tokens=8, concurrency=warmup, num_prompts=warmup)
        for c in levels:
            res = run_load(s.url, prompts, max_new_tokens=max_new, concurrency=c, num_prompts=requests_at(c))
            res["server"] = label
            print_summary(res)
            rows.append(res)
    finally:
        code, _ = s.stop()
        for r in rows:
            r["server_exit"] = code
    return rows
