"""Requests to a server, several in flight at once, on threads the process's exit does not wait for.

``concurrent.futures`` would serve, but its worker threads are joined when the interpreter exits:
a signal that stops a collection would still wait out every request in flight (each up to
``--timeout``), and a pool left by ``with`` even sends the queued ones. Here the workers are daemon
threads: a signal hands out no more requests and the process ends at once, closing the
connections of the requests in flight (a server that cancels on disconnect, as ``serve`` and
SGLang do, frees their slots).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

POLL_S = 0.2   # how often the caller's wait looks whether every worker has ended


def in_threads(fn: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[tuple[int, R]]:
    """``fn(item)`` for every item, ``workers`` at once; yields ``(index, result)`` as each completes.

    The first exception a call raises stops handing out items: the calls already running finish
    and are yielded, then that exception is raised. Leaving the iteration early (a signal raised in
    the caller) hands out nothing more and waits for nothing."""
    items = list(items)
    if not items:
        return
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(items)):
        todo.put(i)
    done: queue.SimpleQueue[tuple[int, object, BaseException | None]] = queue.SimpleQueue()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((i, fn(items[i]), None))
            except BaseException as e:  # noqa: BLE001 - carried to the caller's thread
                stop.set()
                done.put((i, None, e))

    threads = [threading.Thread(target=work, name=f"specpilot-request-{k}", daemon=True)
               for k in range(min(workers, len(items)))]
    for t in threads:
        t.start()
    error: BaseException | None = None
    try:
        while True:
            try:
                i, result, e = done.get(timeout=POLL_S)
            except queue.Empty:
                # a worker puts its last result before it ends, so none is left once all have ended
                if not any(t.is_alive() for t in threads) and done.empty():
                    break
                continue
            if e is None:
                yield i, result   # type: ignore[misc]
            elif error is None:
                error = e
        if error is not None:
            raise error
    finally:
        stop.set()
