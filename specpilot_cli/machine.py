"""Facts about the machine a measurement ran on (named beside every hardware-dependent number)."""

from __future__ import annotations

import contextlib
import platform


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (``platform`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads counted once; a cgroup CPU quota caps it)."""
    import os

    try:
        logical = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        logical = os.cpu_count() or 1
    pairs, siblings = set(), 0
    try:
        with open("/proc/cpuinfo") as fh:
            phys = core = None
            for line in fh:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    siblings += 1
                elif key == "physical id":
                    phys = val.strip()
                elif key == "core id":
                    core = val.strip()
                    pairs.add((phys, core))
    except OSError:
        pass
    per_core = siblings // len(pairs) if pairs and siblings >= len(pairs) else 1
    cores = max(1, logical // max(per_core, 1))
    try:  # cgroup v2 quota: "max 100000" or "200000 100000"
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            cores = max(1, min(cores, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def default_cpu_threads() -> tuple[int, str]:
    """CPU threads that do not oversubscribe: physical cores, less the load the rest of the machine
    puts on them (1-minute load average), at least 1; with the reason, for the status line."""
    import os

    cores = physical_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    logical = os.cpu_count() or cores
    free = int(logical - load + 0.5)
    threads = max(1, min(cores, free))
    return threads, f"{cores} physical cores, load average {load:.1f} of {logical} CPUs"


_announced: set[str] = set()


def choose_cpu_threads(requested: int | None, what: str = "CPU engine", given_by: str = "--threads") -> int:
    """torch CPU threads for ``what``: ``requested`` (0 = torch's own default) or
    :func:`default_cpu_threads`; the choice is reported once per process on the status log."""
    import logging

    import torch

    if requested:
        n, why = requested, given_by
    elif requested == 0:
        n, why = torch.get_num_threads(), f"torch's default, {given_by} 0"
    else:
        n, why = default_cpu_threads()
        why += "; --threads overrides" if given_by == "--threads" else ""
    if what not in _announced:
        _announced.add(what)
        logging.getLogger("specpilot.status").info(f"{what}: {n} torch thread{'s' if n != 1 else ''} ({why})")
    return n


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's CPU threads set to ``n`` inside the block (0: left as they are) and given back after
    it: the count is the process's, so a library call or an in-process command must not change it
    for what runs next."""
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def free_memory(device: str) -> int | None:
    """Bytes that new tensors on ``device`` can take now: the GPU's free memory with what torch's
    caching allocator holds unused (a model dropped earlier in the process), the CPU's
    ``MemAvailable``; None where unknown."""
    if device.startswith("cuda"):
        import torch

        try:
            dev = torch.device(device)
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            return torch.cuda.mem_get_info(dev)[0] + max(0, cached)
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_count() -> int:
    """GPUs the driver shows: NVML's count (a CPU build of torch sees none on a GPU machine), or
    torch's (ROCm), whichever is larger."""
    n = 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:   # no NVIDIA driver
        pass
    try:
        import torch

        n = max(n, torch.cuda.device_count())
    except Exception:
        pass
    return n


DEVICE_PATTERN = r"cpu|cuda(?::(\d{1,4}))?"   # the devices SpecPilot runs on: cpu, cuda, cuda:N


def check_device(device: str, option: str = "--device") -> str:
    """``device`` when it names a device torch takes (``cpu``, ``cuda``, ``cuda:N``): InputError for
    another name, EnvironmentMissing for a GPU this machine does not have."""
    import re

    from .errors import EnvironmentMissing, InputError

    m = re.fullmatch(DEVICE_PATTERN, device)
    if m is None:
        raise InputError(f"{option} {device}: not a device; use cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise EnvironmentMissing(f"{option} {device}: no CUDA GPU is visible; use cpu")
        if m.group(1) is not None and int(m.group(1)) >= n:
            raise EnvironmentMissing(f"{option} {device}: this machine has {n} CUDA GPU{'s' * (n != 1)} (cuda:0"
                                     f"{f'..cuda:{n - 1}' if n > 1 else ''})")
    return device


def source_revision(folder=None) -> str:
    """The commit a measurement's code came from: ``SPECPILOT_GIT_SHA`` (set where the tree travels
    without its git folder), else ``git rev-parse HEAD`` in ``folder`` (default: this checkout, only
    when the package runs from one: an installed copy inside some other repository says "unknown")."""
    import os
    import subprocess
    from pathlib import Path

    sha = os.environ.get("SPECPILOT_GIT_SHA")
    if sha:
        return sha
    here = Path(__file__).resolve().parent
    root = Path(folder) if folder is not None else here.parent
    try:
        top = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=root, text=True,
                                      stderr=subprocess.DEVNULL).strip()
        if folder is None and Path(top).resolve() != root:
            return "unknown"
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_facts(folder=None) -> dict:
    """What a measured figure names beside it: code revision, date (UTC), Python, torch, CUDA,
    Triton, the GPU (``cpu`` without one) and its driver (NVML)."""
    import datetime as dt
    import sys

    env = {"git_sha": source_revision(folder), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cuda"] = torch.version.cuda
    except Exception:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(env["driver"], bytes):
            env["driver"] = env["driver"].decode()
    except Exception:
        env.setdefault("driver", None)
    env.setdefault("gpu", "cpu")
    return env
