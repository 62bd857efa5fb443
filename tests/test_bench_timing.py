"""``benchmarks/common.py``'s interleaved timing: every fn once per round, in turn; the median per fn."""

import importlib.util
from pathlib import Path


def _common():
    spec = importlib.util.spec_from_file_location(
        "bench_common", Path(__file__).resolve().parents[1] / "benchmarks" / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_time_interleaved_takes_turns_and_the_median(monkeypatch):
    common = _common()
    calls, fake = [], {"a": iter([5.0, 1.0, 3.0]), "b": iter([9.0, 7.0, 8.0])}

    def timed(fn, reps, flush):
        calls.append(fn())
        return next(fake[calls[-1]])

    monkeypatch.setattr(common, "time_cuda_graph", timed)
    assert common.time_interleaved([lambda: "a", lambda: "b"], reps=3) == [3.0, 8.0]
    assert calls == ["a", "b"] * 3
    fake.update(a=iter([5.0, 1.0, 3.0, 4.0]), b=iter([9.0, 7.0, 8.0, 10.0]))   # an even count: the middle two's mean
    assert common.time_interleaved([lambda: "a", lambda: "b"], rounds=4, reps=3) == [3.5, 8.5]


def test_the_serve_benchmark_fails_at_once_when_the_server_exits_before_it_listens():
    """``serve_bench.Served``: a server that dies at start (an import error on a GPU machine, a bad
    option) fails the benchmark with its stderr and exit code, not after the readiness timeout."""
    import sys
    import time

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from serve_bench import Served

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2\).*unknown model"):
        Served(["--model", "no-such-model"], timeout=120)
    assert time.monotonic() - t0 < 60


def test_the_byte_floors_are_those_of_the_gpu_the_run_is_on(monkeypatch):
    """``floors_gpu``: batch_gpu's and hybrid_gpu's ``of_floor`` take the floors of the GPU CUDA
    names (an H100 run measured against the H200's floors read 62% where it was at 89%)."""
    import pytest
    import torch

    common = _common()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    assert common.floors_gpu().key == "h100-sxm"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert common.floors_gpu().key == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Some Future GPU")
    with pytest.raises(SystemExit, match="no catalog entry for 'Some Future GPU'"):
        common.floors_gpu()
