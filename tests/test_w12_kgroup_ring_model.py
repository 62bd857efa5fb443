"""A model of the K groups' TMA ring (``kernels/w12/mma_tma.py``, ``tma=3, kgroups=G``) with the
mbarrier's parity semantics, run under random interleavings with TMA copies that land out of order.

It checks the rule :func:`mma_tma.check` enforces: with a ring depth that is a multiple of the
group count every group reads only the records it waited for, on the split grid and on a
stream-K run (block ends, the ``done``/``free`` meeting, masked first steps; the schedule of
``lab/w12/mma_stream.py``); with 4 groups on 6 stages a group's parity wait passes on a stage whose
record is still in flight (the H200 hangs on that config).
"""

from __future__ import annotations

import random

import pytest

from specpilot.kernels.w12 import mma, mma_tma


def schedule(nb: int, kt: int, programs: int) -> tuple[int, int, int]:
    """The stream-K schedule (``lab/w12/mma_stream.py``): records per program, programs, slots."""
    total = nb * kt
    per = -(-total // max(1, min(programs, total)))
    progs = -(-total // per)
    return per, progs, min(progs, -(-(kt - 1) // per) + 1)


class Barrier:
    """An mbarrier: a phase completes after ``count`` arrivals; ``wait(parity)`` passes while the
    number of completed phases has the other parity (so a fresh barrier passes parity 1)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phases = 0, self.phases + 1

    def passes(self, parity: int) -> bool:
        return (self.phases & 1) != parity


def simulate(segments: list[int], stages: int, groups: int, seed: int, lag: int = 40) -> list[str]:
    """One program: ``segments`` are the record counts of its row blocks in ring order (one for the
    split grid, several on a stream-K run). Returns the stale reads seen (empty: none), or
    ``["hang"]`` when the program stops making progress."""
    rng = random.Random(seed)
    n = sum(segments)
    ready = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(1) for _ in range(stages)]
    done, free = Barrier(groups - 1), Barrier(1)
    held = [None] * stages           # the record each stage holds once its copy has landed
    flight: list[list[int]] = []     # [steps left, stage, record]
    stale: list[str] = []

    def producer():
        for i in range(n):
            s = i % stages
            while not empty[s].passes(((i // stages) & 1) ^ 1):
                yield False
            flight.append([rng.randint(0, lag), s, i])
            yield True

    def group(g: int):
        i0 = 0
        for seg, cnt in enumerate(segments):
            first = (g - i0 % groups) % groups
            for j in [first] + list(range(first + groups, cnt, groups)):
                if j < cnt:              # a real record (else: the masked first step, no wait)
                    i = i0 + j
                    s = i % stages
                    while not ready[s].passes((i // stages) & 1):
                        yield False
                    if held[s] != i:
                        stale.append(f"group {g} read record {held[s]} for {i}")
                    empty[s].arrive()
                yield True
            if g == 0:
                while not done.passes(seg & 1):
                    yield False
                free.arrive()
            else:
                while seg > 0 and not free.passes((seg - 1) & 1):
                    yield False
                done.arrive()
            i0 += cnt
            yield True

    live = {"copy": producer(), **{g: group(g) for g in range(groups)}}
    idle = 0
    while live:
        for f in flight[:]:
            f[0] -= 1
            if f[0] < 0:
                flight.remove(f)
                held[f[1]] = f[2]
                ready[f[1]].arrive()
        name = rng.choice(list(live))
        try:
            idle = 0 if next(live[name]) else idle + 1
        except StopIteration:
            del live[name]
        if idle > 5000 and not flight:
            return stale + ["hang"]
    return stale


def stream_segments(n: int, k: int, pid: int, sms: int = 132) -> list[int]:
    """The record counts per row block of stream-K program ``pid`` for an ``n x k`` layer."""
    nb, kt = n // 64, k // 64
    per, progs, _ = schedule(nb, kt, sms)
    g, end, out = pid * per, min((pid + 1) * per, nb * kt), []
    while g < end:
        cnt = min(end, (g // kt + 1) * kt) - g
        out.append(cnt)
        g += cnt
    return out


@pytest.mark.parametrize("stages,groups", [(8, 4), (12, 4), (4, 4), (6, 2), (10, 2)])
def test_depth_a_multiple_of_the_groups_reads_only_landed_records(stages, groups):
    mma_tma.check(mma.MmaConfig(64, 1, 4, stages, tma=3, kgroups=groups))
    for seed in range(3):
        assert simulate([64], stages, groups, seed) == []                       # the split grid
        assert simulate([5], stages, groups, seed) == []                        # groups without records
        for pid in (0, 1, 7, 60):                                               # 4096 -> 6144 stream-K
            assert simulate(stream_segments(6144, 4096, pid), stages, groups, seed) == []
    assert simulate(stream_segments(28672, 4096, 3), stages, groups, 0) == []   # 4-5 block ends


def test_six_stages_for_four_groups_read_stale_records_and_are_refused():
    seen = [simulate(stream_segments(6144, 4096, pid), 6, 4, seed) for pid in range(6) for seed in range(2)]
    assert any(s for s in seen)          # a stale read (and then a hang) under some interleaving
    assert any(any("read record" in x for x in s) for s in seen)
    with pytest.raises(ValueError, match="multiple"):
        mma_tma.check(mma.MmaConfig(64, 1, 4, 6, tma=3, kgroups=4))
