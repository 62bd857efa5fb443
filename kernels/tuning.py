"""Measured kernel configurations, as data: one JSON table per op and GPU architecture.

``kernels/<op>/tuned/<arch>.json`` (``arch``: ``sm90`` for compute capability 9.0)::

    {"schema": "specpilot.tuning/1", "op": "w12", "arch": "sm90",
     "measured": {"gpu": "NVIDIA H200", "benchmarks": {"mma": "lab/w12/sweep.py --mode mma", ...}},
     "entries": [{"kernel": "mma", "n": 6144, "k": 4096, "rows": [17, 32], "config": {...},
                  "date": "2026-12-01", "note": "why it won"}, ...]}

An entry names a kernel, the key it applies to (the op's fields: ``n`` and ``k`` for a layer,
``epilogue`` for the fused decode kernels, ``head_dim`` for the attention; ``rows`` ``[lo, hi]`` a
range of x rows, ``hi`` null for no bound; ``requests``, the same for a batched step's requests)
and the kernel's config fields. A kernel takes the first entry of its own that matches;
the ops' own code decides which kernel runs (:mod:`specpilot.kernels.w12.routing`).

A device takes the table of its own architecture, else the :data:`FALLBACK` one (the only
architecture measured): the kernels skip entries whose configs a device cannot run (TMA below
sm_90, wgmma outside 9.x), so other GPUs get what they support of it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

SCHEMA = "specpilot.tuning/1"
FALLBACK = "sm90"


def arch_of(capability: tuple[int, int] | None) -> str | None:
    """``sm90`` for compute capability (9, 0); None for no GPU."""
    return None if capability is None else f"sm{capability[0]}{capability[1]}"


@lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    import torch

    return arch_of(torch.cuda.get_device_capability(index))


def device_arch(device) -> str | None:
    """The architecture of a CUDA ``device`` (a ``torch.device`` or index), None otherwise."""
    import torch

    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return None
    return _device_arch(device.index if device.index is not None else torch.cuda.current_device())


def _path(op: str, arch: str):
    return resources.files("specpilot.kernels").joinpath(op, "tuned", f"{arch}.json")


@lru_cache(maxsize=None)
def table(op: str, arch: str | None = None) -> dict:
    """The table of ``op`` for ``arch`` (its own file, else :data:`FALLBACK`'s), checked and indexed:
    the file's fields plus ``index``: (kernel, key fields other than rows) -> entries in file order."""
    path = _path(op, arch) if arch else None
    if path is None or not path.is_file():
        path = _path(op, FALLBACK)
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA or data.get("op") != op:
        raise ValueError(f"{path}: not a {SCHEMA} table of {op!r}")
    index: dict = {}
    for e in data["entries"]:
        index.setdefault(_key(e["kernel"], {k: v for k, v in e.items() if k in _KEY_FIELDS}), []).append(e)
    return dict(data, index=index)


_KEY_FIELDS = ("n", "k", "epilogue", "head_dim")


def _key(kernel: str, fields: dict) -> tuple:
    return (kernel,) + tuple(sorted(fields.items()))


def lookup(op: str, kernel: str, arch: str | None = None, rows: int | None = None, requests: int | None = None,
           **key) -> list[dict]:
    """The entries of ``kernel`` in ``op``'s table for ``arch`` that match ``key`` (e.g. ``n``,
    ``k``) and cover ``rows`` and ``requests``, in file order."""
    found = table(op, arch)["index"].get(_key(kernel, key), ())
    return [e for e in found if (rows is None or _covers(e.get("rows"), rows))
            and (requests is None or _covers(e.get("requests"), requests))]


def _covers(span, m: int) -> bool:
    if span is None:
        return True
    lo, hi = span
    return lo <= m and (hi is None or m <= hi)
