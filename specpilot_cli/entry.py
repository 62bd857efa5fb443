"""The ``specpilot`` console script: SIGINT, SIGTERM and SIGHUP end the process cleanly from its
first line. Importing the CLI (click, and a verb's libraries such as torch) takes long enough for a
signal to land before the CLI installs its own handlers (:mod:`specpilot.signals`, for the length
of one command), and Python's default would print a traceback. Until then nothing has been
started or written, so a signal here only says so and exits with 128 + its number; after the
command the same handler answers a signal that arrives while the process exits."""

from __future__ import annotations

import os
import signal
import sys

NAMES = ("SIGINT", "SIGTERM", "SIGHUP")


def _stopped(signum, frame):  # noqa: ARG001
    for stream in (sys.stdout, sys.stderr):   # what a finished command printed is kept
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to keep
            pass
    os.write(2, f"specpilot: interrupted by {signal.Signals(signum).name}\n".encode())
    os._exit(128 + signum)


def install() -> None:
    for name in NAMES:
        s = getattr(signal, name, None)
        if s is not None and signal.getsignal(s) is not signal.SIG_IGN:   # nohup's SIGHUP stays ignored
            signal.signal(s, _stopped)


def main() -> None:
    install()
    from .cli import main as run

    run()
