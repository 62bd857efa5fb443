"""Per-device scratch buffers for kernels whose last program reduces (split-K, split-KV).

Such a kernel writes its partial results to a float32 workspace, counts finished programs per
output block with an atomic counter, and lets the last one combine the partials in a fixed order
(deterministic, no atomics on the data) and reset the counter to zero. Launches on one stream can
therefore share the buffers: :func:`scratch` (float32, contents undefined) and :func:`counters`
(int32, zero between launches). A buffer that is outgrown is replaced by a larger one but kept
alive, because a CUDA graph captured earlier still points at it.
"""

from __future__ import annotations

import torch

_BUFFERS: dict = {}
_RETIRED: list = []


def _get(device, name: str, numel: int, dtype: torch.dtype, minimum: int, zero: bool) -> torch.Tensor:
    key = (str(device), name)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        size = max(numel, minimum)
        buf = (torch.zeros if zero else torch.empty)(size, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf


def scratch(device, name: str, numel: int) -> torch.Tensor:
    """At least ``numel`` float32 values (at least 1 Mi), contents undefined."""
    return _get(device, name, numel, torch.float32, 1 << 20, zero=False)


def counters(device, name: str, numel: int) -> torch.Tensor:
    """At least ``numel`` int32 counters, zero; kernels must leave them at zero."""
    return _get(device, name, numel, torch.int32, 4096, zero=True)
