"""Overlapped AR steps: while the GPU runs step k + 1, the host takes step k's tokens.

In AR mode a request's next row is its last argmax at the next cache position, so the step after
a bucket graph's replay can be fed on the device: the graph's static inputs advance in place (the
row's token becomes its argmax, its position and cache position move on by one, the new position
is unmasked) and the graph replays again before the host has read anything. The host then copies
step k's argmax out (one pinned buffer, one event), delivers the tokens and checks the stop
conditions while step k + 1 runs, so the host work between steps no longer leaves the GPU idle.

A streak lasts while its set of requests stays the same. When a request finishes or is cancelled,
or a waiting request could take a free slot, the scheduler ends it: the step in flight is taken
too, without the rows of requests that finished before it (such a row wrote one cache position
past its request's last token, which nothing reads, and in a hybrid advanced a recurrent state
that the slot's next request starts from zero or takes over by a copy).
"""

from __future__ import annotations

import torch


class Streak:
    """Overlapped one-row steps of the requests ``reqs`` (in slots ``0 .. len(reqs) - 1``) on the
    runner's bucket graph (``B`` requests x 1 row), whose first step is already launched."""

    def __init__(self, runner, reqs: list, B: int):
        self.runner, self.reqs, self.B = runner, list(reqs), B
        dev = runner.model.device
        self.live = torch.zeros(B, dtype=torch.bool, device=dev)
        self.live[:len(self.reqs)] = True
        cuda = dev.type == "cuda"
        self.host = torch.empty(B, dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def _copy_out(self) -> None:
        self.host.copy_(self.runner.output(self.B, 1), non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def next(self) -> list[int]:
        """Launch the next step, fed from the one in flight, and return the in-flight step's
        argmax per request (waits for that step only)."""
        self._copy_out()   # queued before the next replay overwrites the graph's output
        self.runner.advance(self.B, self.live)
        self.runner.replay(self.B, 1)
        if self.event is not None:
            self.event.synchronize()
        return self.host[:len(self.reqs)].tolist()

    def last(self) -> list[int]:
        """The argmax per request of the step in flight (waits for it); nothing more is launched."""
        self._copy_out()
        if self.event is not None:
            self.event.synchronize()
        return self.host[:len(self.reqs)].tolist()
