"""The servers a round starts with the user's own commands: each in its own process group, ready
once ``/health`` answers, stopped with its whole group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from specpilot.errors import EnvironmentMissing


class Server:
    """A server the round started (its process group), or one that was already running."""

    def __init__(self, url: str, proc: subprocess.Popen | None, log: Path | None):
        self.url, self.proc, self.log = url, proc, log

    def stop(self) -> None:
        """SIGTERM to the server's process group, and wait until no process of it is left (the shell
        that started the server may exit before the server has drained), SIGKILL after 30 s."""
        if self.proc is None:
            return
        group = self.proc.pid
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while group_alive(group) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not group_alive(group):
                break
        try:
            self.proc.wait(timeout=1)   # reap the shell
        except subprocess.TimeoutExpired:
            pass


def group_alive(group: int) -> bool:
    """Whether a process that is not a zombie is left in process group ``group`` (Linux: /proc;
    elsewhere any member, zombies included)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        try:
            os.killpg(group, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


def healthy(url: str, timeout: float = 5.0) -> bool:
    from specpilot.auditors.http_client import GenerateClient

    try:
        GenerateClient(url, timeout=timeout).health()
        return True
    except Exception:
        return False


def start_server(command: str, url: str, cwd: Path, log: Path, ready_timeout: float) -> Server:
    """Run ``command`` in a shell (its own process group), wait until ``url``/health answers. A
    server already answering at ``url`` is refused first: it, not the one started, would be timed."""
    if healthy(url, timeout=2.0):
        raise EnvironmentMissing(f"{url} already answers before its server is started (another server on that "
                                 "port?); give the candidate a free port")
    fh = open(log, "ab")
    proc = subprocess.Popen(command, shell=True, cwd=str(cwd), stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True)
    fh.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < ready_timeout:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            raise EnvironmentMissing(f"the server command exited with {proc.returncode} before answering "
                                     f"({' '.join(tail)[:200]}; log {log})")
        if healthy(url, timeout=2.0):
            return Server(url, proc, log)
        time.sleep(0.5)
    Server(url, proc, log).stop()
    raise EnvironmentMissing(f"{url} did not answer /health within {ready_timeout:.0f} s (log {log})")
