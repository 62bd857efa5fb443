"""``.nsys-rep`` (and older ``.qdrep``) reports: exported to SQLite with the ``nsys`` CLI.

The export lands beside the report as ``<name>.sqlite`` when that folder is writable and no such
file exists (so a second profile of the same report reuses it, without needing ``nsys``, while it
is newer than the report and reads as an Nsight Systems export), else in a temporary folder. The
export is written to a temporary name, checked to read as an Nsight Systems export, then renamed:
what ``nsys`` wrote that is not one is deleted and named as the report's failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.fileio import require_file

REPORT_SUFFIXES = (".nsys-rep", ".qdrep")


def find_nsys() -> str | None:
    exe = shutil.which("nsys")
    if exe:
        return exe
    for root in ("/opt/nvidia/nsight-systems", "/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for p in sorted(Path(root).glob("**/target-linux-x64/nsys")) if Path(root).is_dir() else []:
            return str(p)
    return None


def _readable(db: Path) -> str | None:
    """None when ``db`` opens as an Nsight Systems export (the checks the reader makes before
    reading: SQLite, its metadata table, a supported schema, StringIds), else why not."""
    from .nsys_export import NsysExport

    try:
        NsysExport(db).close()
    except InputError as e:
        msg = str(e)
        return msg[len(f"{db}: "):] if msg.startswith(f"{db}: ") else msg
    return None


def export_sqlite(report: str | os.PathLike, timeout_s: float = 1800) -> tuple[Path, bool, bool]:
    """Export ``report`` to SQLite; returns (path, is_temporary, reused): ``reused`` where an export
    beside the report, newer than it, is read instead of exporting again."""
    report = Path(report)
    require_file(report)
    if report.stat().st_size == 0:
        raise InputError(f"{report}: empty file")
    beside = report.with_suffix(".sqlite")
    # an export made before needs no nsys (checked first: it may be all there is where nsys is not)
    if beside.is_file() and beside.stat().st_mtime >= report.stat().st_mtime and _readable(beside) is None:
        return beside, False, True
    nsys = find_nsys()
    if nsys is None:
        raise EnvironmentMissing(f"{report}: reading an .nsys-rep needs the Nsight Systems 'nsys' command on PATH; "
                                 f"or export it where nsys exists (nsys export --type sqlite {report.name}) "
                                 "and pass the .sqlite file")
    temporary = not os.access(report.parent, os.W_OK) or beside.exists()
    out = Path(tempfile.mkdtemp(prefix="specpilot-nsys-")) / beside.name if temporary else beside
    tmp_out = out.with_name(f".{out.name}.part")
    from specpilot.signals import track_temp

    def discard():
        tmp_out.unlink(missing_ok=True)
        if temporary:
            shutil.rmtree(out.parent, ignore_errors=True)

    with track_temp(tmp_out):
        try:
            proc = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o",
                                   str(tmp_out), str(report)], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            discard()
            raise InputError(f"{report}: nsys export took longer than {timeout_s:.0f} s") from None
        except BaseException:
            discard()
            raise
        if proc.returncode != 0 or not tmp_out.is_file():
            discard()
            msg = (proc.stderr or proc.stdout or "").strip().splitlines()
            raise InputError(f"{report}: nsys export failed ({msg[-1] if msg else f'exit {proc.returncode}'})")
        why = _readable(tmp_out)
        if why is not None:
            discard()
            raise InputError(f"{report}: nsys export wrote no readable Nsight Systems export ({why}); check the "
                             f"report with nsys stats {report.name}, or export it yourself and pass the .sqlite file")
        os.replace(tmp_out, out)
    return out, temporary, False
