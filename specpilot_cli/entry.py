"""The ``specpilot`` console script: SIGINT, SIGTERM and SIGHUP end the process cleanly from its
first line. Importing the CLI (click, and a verb's libraries such as torch) takes long enough for a
signal to land before the CLI installs its own handlers (:mod:`specpilot.signals`, for the length
of one command), and Python's default would print a traceback. Until then nothing has been
started or written, so a signal here only says so and exits with 128 + its number.

Once the command has ended (:func:`finished`), its exit status stands: a signal while the process
exits (joining threads, exit handlers, the interpreter's teardown, which with torch loaded takes a
tenth of a second or more) ends it at once with that status and says nothing, and from the exit
handlers on the signals are ignored, since the interpreter's teardown puts back the default
handlers (death by the signal, no word) for any handler of its own."""

from __future__ import annotations

import atexit
import os
import signal
import sys

NAMES = ("SIGINT", "SIGTERM", "SIGHUP")


_ended: list[int] = []   # the finished command's exit status


def finished(code: int) -> None:
    """The command has ended with ``code``: a later signal does not change it."""
    _ended[:] = [code]


def _stopped(signum, frame):  # noqa: ARG001
    for stream in (sys.stdout, sys.stderr):   # what a finished command printed is kept
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to keep
            pass
    if _ended:
        os._exit(_ended[0])
    os.write(2, f"specpilot: interrupted by {signal.Signals(signum).name}\n".encode())
    os._exit(128 + signum)


def _ignore_from_here() -> None:
    """The last exit handler: past it the teardown resets Python-level handlers to the default."""
    if not _ended:
        return
    for name in NAMES:
        s = getattr(signal, name, None)
        if s is not None and signal.getsignal(s) is _stopped:
            signal.signal(s, signal.SIG_IGN)


def install() -> None:
    atexit.register(_ignore_from_here)   # registered first, so it runs after every other exit handler
    for name in NAMES:
        s = getattr(signal, name, None)
        if s is not None and signal.getsignal(s) is not signal.SIG_IGN:   # nohup's SIGHUP stays ignored
            signal.signal(s, _stopped)


def main() -> None:
    install()
    from .cli import main as run

    run()
