"""A request of the batched decoder: its prompt, its stop conditions, its progress and its result.

The engine thread owns every field but ``cancelled`` (set from any thread). ``on_update`` is
called on the engine thread after each step that gave the request tokens or finished it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    id: object = 0
    stop_ids: frozenset = frozenset()          # tokens that end the request (EOS unless ignore_eos, stop_token_ids)
    eos_ids: frozenset = frozenset()           # which of them are the model's EOS (stop_reason "eos")
    stop_strings: tuple = ()                   # texts that end the request (needs ``decode``)
    decode: Callable | None = None             # ids -> text
    on_update: Callable | None = None          # (request, new ids, finished) on the engine thread
    record_lattice: bool = False
    arrival_step: int = 0                      # generate_many: the scheduler step it arrives at

    # progress (engine thread)
    output: list[int] = field(default_factory=list)   # tokens delivered (up to the finish)
    full: list[int] = field(default_factory=list)     # every committed token after the prompt
    finish: dict | None = None
    slot: int | None = None
    prefilled: int = 0
    n_cache: int = 0
    steps: int = 0
    accepts: list[int] = field(default_factory=list)
    proposed: int = 0                          # draft tokens its verify steps checked (tree nodes, chain drafts)
    tlv: object = None                         # mode tlv: the request's cycles (engine.tlv.TLVStats)
    lattice: list[dict] = field(default_factory=list)
    tail: int = 0                              # tokens still decoded after the finish (lattice targets)
    cancelled: bool = False
    # times (time.perf_counter)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    token_times: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens delivered then)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def stop_reason(self) -> str:
        """``length``, ``eos`` (a model EOS token), ``stop`` (another stop token or a stop text) or ``abort``."""
        if self.finish is None:
            return "running"
        kind = self.finish["type"]
        if kind == "stop" and self.finish.get("matched") in self.eos_ids:
            return "eos"
        return kind

    def room(self) -> int:
        """The tokens the request can still take before its ``max_new_tokens``."""
        return self.max_new_tokens - len(self.output)

    def offer(self, toks: list[int], now: float) -> list[int]:
        """Deliver committed tokens until a stop condition holds; returns the tokens delivered."""
        taken = []
        for t in toks:
            if self.finish is not None:
                break
            self.output.append(int(t))
            taken.append(int(t))
            n = len(self.output)
            if t in self.stop_ids:
                self.finish = {"type": "stop", "matched": int(t)}
            elif self.stop_strings and self.decode is not None:
                text = self.decode(self.output)
                # the earliest match, whatever the list's order: the text is cut before it
                found = [(text.find(s), i) for i, s in enumerate(self.stop_strings) if s in text]
                if found:
                    self.finish = {"type": "stop", "matched": self.stop_strings[min(found)[1]]}
            if self.finish is None and n >= self.max_new_tokens:
                self.finish = {"type": "length", "length": n}
        if taken:
            if self.t_first is None:
                self.t_first = now
            self.token_times.append((now, len(taken)))
        if self.finish is not None and self.t_done is None:
            self.t_done = now
        return taken

    def abort(self, message: str) -> None:
        if self.finish is None:
            self.finish = {"type": "abort", "message": message}
            self.t_done = time.perf_counter()
