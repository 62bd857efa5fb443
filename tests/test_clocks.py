"""engine/clocks.py: the SM clock, power and slowdown reasons sampled while a run decodes (a fake NVML)."""

import sys
import time
import types

import pytest

from specpilot.engine import clocks
from specpilot.engine.clocks import ClockWatch, clock_line


def fake_nvml(script):
    """A pynvml stand-in whose device reports ``script``'s (MHz, mW, reason bits) in turn, then the last."""
    state = {"i": 0}

    def current():
        return script[min(state["i"], len(script) - 1)]

    def reasons(h):          # the last query of a sample advances the script
        bits = current()[2]
        state["i"] += 1
        return bits

    return types.SimpleNamespace(
        NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: "gpu0",
        nvmlDeviceGetHandleByPciBusId=lambda bus: "gpu0", nvmlDeviceGetClockInfo=lambda h, kind: current()[0],
        nvmlDeviceGetPowerUsage=lambda h: current()[1], nvmlDeviceGetCurrentClocksEventReasons=reasons,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980, nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000)


@pytest.fixture
def nvml(monkeypatch):
    def install(script):
        nv = fake_nvml(script)
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        monkeypatch.setattr(clocks, "_handle", lambda nv, device: "gpu0")
        return nv
    return install


def test_off_cuda_there_is_nothing_to_watch():
    with ClockWatch("cpu") as w:
        pass
    assert w.summary() is None and clock_line(w.summary()) is None


def test_a_power_capped_run_is_summarized_and_named(nvml):
    # full clock, then the power cap lowers it (bit 0x4), plus the idle bit (0x1) that is no slowdown
    nvml([(1980, 690_000, 0x1)] * 3 + [(1575, 702_000, 0x4)] * 2)
    w = ClockWatch("cuda:0", period_s=0.001)
    for _ in range(5):
        w.sample()
    s = w.summary()
    assert s["sm_mhz"] == {"min": 1575, "median": 1980, "max": 1980} and s["gpu_max_sm_mhz"] == 1980
    assert s["power_w"]["max"] == pytest.approx(702.0) and s["power_limit_w"] == pytest.approx(700.0)
    assert s["slowed"] == pytest.approx(0.4) and s["reasons"] == ["sw_power_cap"]
    line = clock_line(s)
    assert line.startswith("GPU clock: SM 1575-1980 MHz (median 1980), power up to 702 W of 700 W; slowed "
                           "(sw_power_cap) in 40% of 5 samples")


def test_a_run_at_full_clock_says_so_without_a_warning(nvml):
    nvml([(1980, 500_000, 0)])
    with ClockWatch("cuda:0", period_s=0.001) as w:
        time.sleep(0.02)
    s = w.summary()
    assert s["samples"] >= 2 and s["slowed"] == 0 and s["reasons"] == []   # entry and exit at least
    assert "slowed" not in clock_line(s)
    assert not w._thread.is_alive()


def test_a_failing_query_loses_a_sample_not_the_run(nvml):
    nv = nvml([(1980, 500_000, 0)])
    w = ClockWatch("cuda:0")
    nv.nvmlDeviceGetPowerUsage = lambda h: (_ for _ in ()).throw(RuntimeError("NVML gone"))
    w.sample()
    assert w.samples == [] and w.summary() is None


def test_no_nvml_means_no_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)     # import fails
    with ClockWatch("cuda:0") as w:
        pass
    assert w.summary() is None
