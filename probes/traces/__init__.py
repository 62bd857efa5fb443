"""Trace readers: Nsight Systems SQLite / .nsys-rep, PyTorch profiler (Kineto) JSON.

``read_trace(path, request)`` sniffs the format from the file's first bytes (not its name) and
returns an :class:`~specpilot.probes.traces.model.Aggregate`: steps and per-step kernel groups.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from specpilot.errors import InputError

from .model import Aggregate, GPUInfo, KernelGroup, Range, StepInfo, StepRequest

__all__ = ["read_trace", "sniff", "Aggregate", "GPUInfo", "KernelGroup", "Range", "StepInfo", "StepRequest"]


def sniff(path: str | os.PathLike) -> str:
    """'nsys-sqlite', 'nsys-rep' or 'kineto'; InputError for anything else."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if p.is_dir():
        raise InputError(f"{path}: is a folder, expected a trace file")
    with open(p, "rb") as fh:
        head = fh.read(64)
    if not head:
        raise InputError(f"{path}: empty file")
    if head.startswith(b"SQLite format 3\x00"):
        return "nsys-sqlite"
    if head[:2] == b"\x1f\x8b":
        return "kineto"
    if p.suffix in (".nsys-rep", ".qdrep", ".qdstrm"):
        if p.suffix == ".qdstrm":
            raise InputError(f"{path}: a raw .qdstrm stream; import it first (QdstrmImporter -i {p.name}) "
                             "to get an .nsys-rep")
        return "nsys-rep"
    text = head.lstrip()
    if text[:1] in (b"{", b"["):
        return "kineto"
    raise InputError(f"{path}: unknown trace format (expected an Nsight Systems .sqlite/.nsys-rep export "
                     "or a PyTorch profiler .json/.json.gz)")


def read_trace(path: str | os.PathLike, request: StepRequest | None = None,
               on_read: Callable[[int], None] | None = None) -> Aggregate:
    """``on_read(n)`` is called as work proceeds: bytes of JSON read, or SQLite progress ticks."""
    kind = sniff(path)
    if kind == "nsys-sqlite":
        from .nsys_sqlite import read_nsys_sqlite

        return read_nsys_sqlite(path, request, on_read)
    if kind == "nsys-rep":
        from .nsys_rep import export_sqlite
        from .nsys_sqlite import read_nsys_sqlite

        db, temporary = export_sqlite(path)
        try:
            agg = read_nsys_sqlite(db, request, on_read)
            agg.path = str(path)
            agg.notes.append(f"exported with nsys to {'a temporary file' if temporary else db}")
            return agg
        finally:
            if temporary:
                shutil.rmtree(db.parent, ignore_errors=True)
    from .kineto import read_kineto

    return read_kineto(path, request, on_read)
