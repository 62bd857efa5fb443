"""Interrupts in one place: SIGINT, SIGTERM and SIGHUP end a run the same clean way.

The CLI installs the handlers for the length of one command (:func:`installed`). A signal raises
:class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, so every ``finally`` and
``except BaseException`` on the way out runs: atomic writers remove their temporary files and
verbs save their resumable state. What no ``finally`` sees is tracked here and ended by
:func:`cleanup`, which the CLI runs on every exit:

- temporary paths (:func:`track_temp`, :func:`register_temp`; ``specpilot.fileio`` creates and
  registers its ``.part`` files and folders inside :func:`deferred`, so a signal cannot fall between
  the two), removed;
- child processes started with :func:`spawn`, each in its own process group (a benchmark
  command and everything it starts), whose groups are ended (SIGTERM, then SIGKILL).

Further signals while a run unwinds are ignored, so cleanup itself is not cut short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None)

_temps: dict[str, None] = {}
_children: dict[int, subprocess.Popen] = {}
_lock = threading.Lock()
_unwinding: list[int] = []
_defer = {"depth": 0, "pending": None}   # a critical section of the main thread, a signal it held back
_after = {"ignore": False,   # the handlers the command leaves behind: the old ones, or ignore (ignore_to_exit)
          "ended": False}    # the command has its exit status (ended): a signal no longer interrupts it


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; exit status 128 + the signal number (130 for SIGINT)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(self.name)

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame):  # noqa: ARG001
    if _unwinding or _after["ended"]:
        return  # already stopping: let the cleanup finish; or ended: the handlers put back answer it
    if _defer["depth"]:   # inside deferred(): raised when the block ends
        _defer["pending"] = _defer["pending"] or signum
        return
    _unwinding.append(signum)
    raise Interrupted(signum)


@contextlib.contextmanager
def deferred():
    """A signal arriving in the block raises :class:`Interrupted` when the block ends, not inside
    it: a temporary path is created and registered for removal as one step, so no signal can land
    between the two and leave it behind. Only the main thread (where handlers run) defers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _defer["depth"] += 1
    try:
        yield
    finally:
        _defer["depth"] -= 1
        if not _defer["depth"]:
            signum, _defer["pending"] = _defer["pending"], None
            if signum is not None and not _unwinding:
                _unwinding.append(signum)
                raise Interrupted(signum)


@contextlib.contextmanager
def installed():
    """Handle SIGINT/SIGTERM/SIGHUP as :class:`Interrupted` inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    for s in SIGNALS:
        try:
            if signal.getsignal(s) is signal.SIG_IGN:   # ignored by whoever started us (nohup): stays so
                continue
            old[s] = signal.signal(s, _handler)
        except (OSError, ValueError):
            pass
    _unwinding.clear()
    _after["ended"] = False
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_IGN if _after["ignore"] else h)
        _unwinding.clear()
        _defer["pending"] = None


def ignore_to_exit() -> None:
    """Once the command has ended on a signal of its own choosing (serve's drain), further
    signals until the process exits are part of that end: ignored, not a 143 or a kill."""
    _after["ignore"] = True
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(s, signal.SIG_IGN)


def ended() -> None:
    """The command has its exit status: a signal until the handlers go back at the block's end is
    dropped (the console script's own handler keeps that status for later ones)."""
    _after["ended"] = True


def stopping() -> bool:
    """True once a signal has started to end the run."""
    return bool(_unwinding)


def stopped_by() -> int | None:
    """The signal that started to end the run, if one did."""
    return _unwinding[0] if _unwinding else None


# ----------------------------------------------------------------------------------- temporaries

@contextlib.contextmanager
def track_temp(path: str | os.PathLike):
    """Remove ``path`` (a file or a folder) in :func:`cleanup` unless the block renamed it away."""
    key = str(path)
    register_temp(key)
    try:
        yield key
    finally:
        forget_temp(key)


def register_temp(path: str | os.PathLike) -> None:
    """Remove ``path`` in :func:`cleanup` if it still exists then (renamed away: nothing to do)."""
    with _lock:
        _temps[str(path)] = None


def forget_temp(path: str | os.PathLike) -> None:
    """Stop tracking ``path`` (renamed into place or removed by its writer)."""
    with _lock:
        _temps.pop(str(path), None)


def _remove(path: str) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            p.unlink()


# ------------------------------------------------------------------------------------ children

def spawn(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a new process group that :func:`end` and :func:`cleanup` end."""
    kwargs["start_new_session"] = True
    p = subprocess.Popen(args, **kwargs)
    with _lock:
        _children[p.pid] = p
    return p


def end(p: subprocess.Popen, grace: float = 2.0) -> None:
    """End ``p``'s whole process group: SIGTERM, then SIGKILL after ``grace`` seconds; reap ``p``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(p.pid):
            if p.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=0.05)
            else:
                time.sleep(0.02)
        if not _group_alive(p.pid):
            break
    with contextlib.suppress(Exception):
        p.communicate(timeout=5)
    forget(p)


def forget(p: subprocess.Popen) -> None:
    """Stop tracking ``p`` (it finished and was reaped)."""
    with _lock:
        _children.pop(p.pid, None)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------- cleanup

def cleanup() -> None:
    """End tracked child process groups and remove tracked temporary paths."""
    with _lock:
        children = list(_children.values())
        temps = list(_temps)
    for p in children:
        end(p, grace=1.0)
    for t in temps:
        _remove(t)
    with _lock:
        _temps.clear()
        _children.clear()
