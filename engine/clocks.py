"""The GPU's SM clock and power while the engine decodes, sampled from NVML (``nvidia-ml-py``).

A rows probe times a few hundred step replays; a decode loop runs for seconds, long enough for a GPU
to reach its power limit and lower its clock. On the H200 the W12 AR loop of Llama-3.1-8B shapes
can draw the 700 W limit within a second: in one run the SM clock fell from 1980 to about 1575 MHz
after 190 steps and the steps from 3.6 to 4.0-4.4 ms (the bf16 loop, bound by memory, stays near
3.96 ms). :class:`ClockWatch`
samples the SM clock, the power and NVML's clock-event reasons on a thread while a run decodes, so a
run's figures say whether they were taken at full clock and ``ceiling --check`` can say so.
"""

from __future__ import annotations

import statistics
import threading

# NVML clock-event reasons that lower the clock below what the application asked for
SLOWDOWNS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
             0x80: "hw_power_brake"}
SLOWDOWN_BITS = sum(SLOWDOWNS)


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:   # noqa: BLE001 - no NVML (no driver, no package): no clock figures, nothing else changes
        return None


def _handle(nv, device):
    """The NVML handle of torch CUDA ``device`` (by PCI bus id: NVML ignores CUDA_VISIBLE_DEVICES)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        try:
            return nv.nvmlDeviceGetHandleByPciBusId(pci)
        except Exception:   # noqa: BLE001 - fall back to the index below
            pass
    return nv.nvmlDeviceGetHandleByIndex(torch.device(device).index or 0)


class ClockWatch:
    """``with ClockWatch(device) as w: ...`` samples every ``period_s`` (and once at entry and at exit);
    ``w.summary()`` is None off CUDA or without NVML. Sampling is a thread that sleeps between NVML
    queries; it takes no GPU time."""

    def __init__(self, device, period_s: float = 0.02):
        self.period_s = period_s
        self.samples: list[tuple[int, float, int]] = []   # (SM MHz, W, clock-event reason bits)
        self._nv = self._h = None
        self._stop = threading.Event()
        self._thread = None
        if getattr(device, "type", str(device).split(":")[0]) == "cuda":
            self._nv = _nvml()
            if self._nv is not None:
                try:
                    self._h = _handle(self._nv, device)
                except Exception:   # noqa: BLE001
                    self._nv = None

    def _reasons(self) -> int:
        nv = self._nv
        get = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)   # the older name below
               or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        return int(get(self._h))

    def sample(self) -> None:
        nv = self._nv
        try:
            self.samples.append((int(nv.nvmlDeviceGetClockInfo(self._h, nv.NVML_CLOCK_SM)),
                                 nv.nvmlDeviceGetPowerUsage(self._h) / 1e3, self._reasons()))
        except Exception:   # noqa: BLE001 - a failed query loses one sample, not the run
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> "ClockWatch":
        if self._nv is not None:
            self.sample()
            self._thread = threading.Thread(target=self._loop, name="specpilot-clocks", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()

    def summary(self) -> dict | None:
        """SM clock (min, median, max MHz and the GPU's maximum), power (median, max W and the
        enforced limit), the share of samples with a slowdown reason and the reasons seen."""
        if self._nv is None or not self.samples:
            return None
        nv = self._nv
        mhz = [s[0] for s in self.samples]
        watts = [s[1] for s in self.samples]
        seen = 0
        for s in self.samples:
            seen |= s[2]
        slowed = sum(1 for s in self.samples if s[2] & SLOWDOWN_BITS) / len(self.samples)
        try:
            max_mhz = int(nv.nvmlDeviceGetMaxClockInfo(self._h, nv.NVML_CLOCK_SM))
            limit = nv.nvmlDeviceGetEnforcedPowerLimit(self._h) / 1e3
        except Exception:   # noqa: BLE001
            max_mhz, limit = None, None
        return {"samples": len(self.samples), "period_s": self.period_s,
                "sm_mhz": {"min": min(mhz), "median": statistics.median(mhz), "max": max(mhz)},
                "gpu_max_sm_mhz": max_mhz,
                "power_w": {"median": statistics.median(watts), "max": max(watts)}, "power_limit_w": limit,
                "slowed": slowed, "reasons": [name for bit, name in sorted(SLOWDOWNS.items()) if seen & bit]}


def clock_line(c: dict | None) -> str | None:
    """One line for a report: the clock range and, when the GPU slowed, why and what it means."""
    if not c:
        return None
    mhz, pw = c["sm_mhz"], c["power_w"]
    limit = f" of {c['power_limit_w']:.0f} W" if c.get("power_limit_w") else ""
    line = (f"GPU clock: SM {mhz['min']:.0f}-{mhz['max']:.0f} MHz (median {mhz['median']:.0f}), power up to "
            f"{pw['max']:.0f} W{limit}")
    if c["slowed"] > 0:
        line += (f"; slowed ({', '.join(c['reasons'])}) in {100 * c['slowed']:.0f}% of {c['samples']} samples: "
                 "this run's steps are slower than a probe's at full clock")
    return line
