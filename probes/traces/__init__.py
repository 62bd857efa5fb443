"""Trace readers: Nsight Systems SQLite / .nsys-rep, PyTorch profiler (Kineto) JSON.

``read_trace(path, request)`` sniffs the format from the file's first bytes (not its name) and
returns an :class:`~specpilot.probes.traces.model.Aggregate`: steps and per-step kernel groups.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
import zlib
from pathlib import Path
from typing import Callable

from specpilot.errors import EnvironmentMissing, InputError

from .model import Aggregate, GPUInfo, KernelGroup, Range, StepInfo, StepRequest

__all__ = ["read_trace", "read_trace_devices", "sniff", "Aggregate", "GPUInfo", "KernelGroup", "Range", "StepInfo", "StepRequest"]


SQLITE = b"SQLite format 3\x00"
NSYS_REP = b"NVIDIA Tegra Profiler Report"
COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ\x00": "xz", b"BZh": "bz2"}


def _compression(head: bytes) -> str | None:
    return next((c for magic, c in COMPRESSED.items() if head.startswith(magic)), None)


def _kind(head: bytes, path, suffix: str) -> str | None:
    if head.startswith(SQLITE):
        return "nsys-sqlite"
    if head.startswith(NSYS_REP):
        return "nsys-rep"
    if suffix in (".nsys-rep", ".qdrep", ".qdstrm"):
        if suffix == ".qdstrm":
            raise InputError(f"{path}: a raw .qdstrm stream; import it first (QdstrmImporter -i {Path(path).name}) "
                             "to get an .nsys-rep")
        return "nsys-rep"
    if head.lstrip()[:1] in (b"{", b"["):
        return "kineto"
    return None


def _open_compressed(path, compression: str):
    """A binary stream of the decompressed content (zstd through the ``zstd`` command)."""
    if compression == "gzip":
        import gzip

        return gzip.open(path, "rb")
    if compression == "xz":
        import lzma

        return lzma.open(path, "rb")
    if compression == "bz2":
        import bz2

        return bz2.open(path, "rb")
    exe = shutil.which("zstd")
    if exe is None:
        raise EnvironmentMissing(f"{path}: zstd-compressed; decompress it first (zstd -d {Path(path).name}) or put "
                                 "the zstd command on PATH")
    return _Zstd(exe, path)


class _Zstd:
    """``zstd -dc``'s output as a binary stream; :meth:`finish` (after reading it all) raises
    OSError when zstd failed: the stream was corrupt or truncated, though what came out reads."""

    def __init__(self, exe: str, path):
        import subprocess

        self.proc = subprocess.Popen([exe, "-dc", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def read(self, n: int = -1) -> bytes:
        return self.proc.stdout.read(n)

    def finish(self) -> None:
        err = self.proc.stderr.read().decode("utf-8", "replace").strip()
        if self.proc.wait() != 0:
            raise OSError(err.splitlines()[-1] if err else f"zstd exited with {self.proc.returncode}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:   # closed before the end (a sniff of the first bytes)
            self.proc.kill()
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.proc.wait()


def sniff(path: str | os.PathLike) -> str:
    """What the file holds, from its first bytes (not its name): 'nsys-sqlite', 'nsys-rep',
    'kineto', or '<kind>+<compression>' for a compressed one (gzip, zstd, xz, bz2; a gzip Kineto
    trace is plain 'kineto', read as a stream); InputError for anything else."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if p.is_dir():
        raise InputError(f"{path}: is a folder, expected a trace file")
    with open(p, "rb") as fh:
        head = fh.read(64)
    if not head:
        raise InputError(f"{path}: empty file")
    comp = _compression(head)
    if comp is None:
        kind = _kind(head, path, p.suffix)
    else:
        try:
            with _open_compressed(p, comp) as fh:
                inner = fh.read(64)
        except (OSError, EOFError, ValueError, zlib.error) as e:
            raise InputError(f"{path}: {comp} stream is corrupt or truncated ({str(e)[:80]})") from None
        if not inner:
            raise InputError(f"{path}: {comp}-compressed but empty (or corrupt)")
        kind = _kind(inner, path, Path(p.stem).suffix)
        if kind is not None and not (kind == "kineto" and comp == "gzip"):
            kind = f"{kind}+{comp}"
    if kind is None:
        what = f"{comp}-compressed, but not " if comp else ""
        raise InputError(f"{path}: unknown trace format ({what}an Nsight Systems .sqlite/.nsys-rep export "
                         "or a PyTorch profiler .json/.json.gz)")
    return kind


def _decompressed(path, comp: str, kind: str) -> Path:
    """The decompressed content in a new temporary folder (SQLite and nsys need a file)."""
    from specpilot.signals import deferred, register_temp

    with deferred():   # made and registered as one step: a signal while it fills removes it
        tmp = Path(tempfile.mkdtemp(prefix="specpilot-trace-"))
        register_temp(tmp)
    suffix = {"nsys-sqlite": ".sqlite", "nsys-rep": ".nsys-rep", "kineto": ".json"}[kind]
    out = tmp / (Path(path).name.split(".")[0] + suffix)
    try:
        with _open_compressed(path, comp) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                try:
                    dst.write(chunk)
                except OSError as e:   # the copy's folder is full or limited: not the trace's fault
                    raise EnvironmentMissing(f"{path}: cannot decompress it into {tmp} ({e.strerror}); free space "
                                             "there (TMPDIR) or decompress it yourself") from None
            if isinstance(src, _Zstd):
                src.finish()
    except (OSError, EOFError, ValueError, zlib.error) as e:
        _remove_temp(tmp)
        raise InputError(f"{path}: {comp} stream is corrupt or truncated ({str(e)[:80]})") from None
    except BaseException:
        _remove_temp(tmp)
        raise
    return out


def _remove_temp(folder: Path) -> None:
    from specpilot.signals import forget_temp

    shutil.rmtree(folder, ignore_errors=True)
    forget_temp(folder)


class _TempFolder:
    """Held by every Aggregate read from one decompressed copy: the copy is deleted once all are
    gone (or at exit), as their ``locate_last`` reads the file again after the reader returned."""

    def __init__(self, folder: Path):
        weakref.finalize(self, _remove_temp, folder)


def _read_compressed(path, kind: str, read: Callable[[Path], list[Aggregate]]) -> list[Aggregate]:
    """``read`` the decompressed copy of ``path``; errors and the aggregates name ``path``, not the copy."""
    kind, comp = kind.split("+")
    plain = _decompressed(path, comp, kind)
    try:
        aggs = read(plain)
    except InputError as e:
        _remove_temp(plain.parent)
        raise InputError(str(e).replace(str(plain), str(path))) from None
    except BaseException:
        _remove_temp(plain.parent)
        raise
    holder = _TempFolder(plain.parent)
    for agg in aggs:
        agg.temp_folder = holder
        agg.path = str(path)
        agg.notes.append(f"{comp}-compressed {kind} trace, decompressed to a temporary file")
    return aggs


def read_trace(path: str | os.PathLike, request: StepRequest | None = None,
               on_read: Callable[[int], None] | None = None) -> Aggregate:
    """``on_read(n)`` is called as work proceeds: bytes of JSON read, or SQLite progress ticks."""
    kind = sniff(path)
    if "+" in kind:
        return _read_compressed(path, kind, lambda plain: [read_trace(plain, request, on_read)])[0]
    if kind == "nsys-sqlite":
        from .nsys_sqlite import read_nsys_sqlite

        return read_nsys_sqlite(path, request, on_read)
    if kind == "nsys-rep":
        from .nsys_rep import export_sqlite
        from .nsys_sqlite import read_nsys_sqlite

        db, temporary, reused = export_sqlite(path)
        try:
            agg = read_nsys_sqlite(db, request, on_read)
        except BaseException:
            if temporary:
                shutil.rmtree(db.parent, ignore_errors=True)
            raise
        if temporary:
            agg.temp_folder = _TempFolder(db.parent)
        agg.path = str(path)
        agg.notes.append(f"read the export beside it, {db} (newer than the report)" if reused
                         else f"exported with nsys to {'a temporary file' if temporary else db}")
        return agg
    from .kineto import read_kineto

    return read_kineto(path, request, on_read)


def read_trace_devices(path: str | os.PathLike, request: StepRequest | None = None,
                       on_read: Callable[[int], None] | None = None) -> list[tuple[int, Aggregate]]:
    """One Aggregate per GPU with kernels in the trace (the ranks of a multi-GPU capture)."""
    from dataclasses import replace

    request = request or StepRequest()
    kind = sniff(path)
    if "+" in kind:
        pairs: list[tuple[int, Aggregate]] = []

        def read(plain: Path) -> list[Aggregate]:
            pairs.extend(read_trace_devices(plain, request, on_read))
            return [a for _, a in pairs]

        _read_compressed(path, kind, read)
        return pairs
    if kind == "kineto":
        from .kineto import KinetoTrace, aggregate_kineto

        tr = KinetoTrace(path, on_read)
        devices = sorted({int(d) for d in tr.cols["device"].tolist() if d >= 0})
        return [(d, aggregate_kineto(tr, replace(request, device=d))) for d in devices]
    if kind == "nsys-sqlite":
        from .nsys_export import NsysExport

        ex = NsysExport(path)
        try:
            devices = sorted(ex.kernel_devices())
        finally:
            ex.close()
        return [(d, read_trace(path, replace(request, device=d), on_read)) for d in devices]
    raise InputError(f"{path}: --ranks reads one multi-GPU trace (an Nsight .sqlite export or a Kineto JSON); "
                     "export it first, or give one trace file per rank")
