"""Facts about the machine a measurement ran on (named beside every hardware-dependent number)."""

from __future__ import annotations

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
