"""``.nsys-rep`` (and older ``.qdrep``) reports: exported to SQLite with the ``nsys`` CLI.

The export lands beside the report as ``<name>.sqlite`` when that folder is writable and no such
file exists (so a second profile of the same report reuses it), else in a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specpilot.errors import EnvironmentMissing, InputError

REPORT_SUFFIXES = (".nsys-rep", ".qdrep")


def find_nsys() -> str | None:
    exe = shutil.which("nsys")
    if exe:
        return exe
    for root in ("/opt/nvidia/nsight-systems", "/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for p in sorted(Path(root).glob("**/target-linux-x64/nsys")) if Path(root).is_dir() else []:
            return str(p)
    return None


def export_sqlite(report: str | os.PathLike, timeout_s: float = 1800) -> tuple[Path, bool]:
    """Export ``report`` to SQLite; returns (path, is_temporary)."""
    report = Path(report)
    if not report.is_file():
        raise InputError(f"{report}: no such file")
    if report.stat().st_size == 0:
        raise InputError(f"{report}: empty file")
    nsys = find_nsys()
    if nsys is None:
        raise EnvironmentMissing(f"{report}: reading an .nsys-rep needs the Nsight Systems 'nsys' command on PATH; "
                                 f"or export it where nsys exists (nsys export --type sqlite {report.name}) "
                                 "and pass the .sqlite file")
    beside = report.with_suffix(".sqlite")
    if beside.is_file() and beside.stat().st_mtime >= report.stat().st_mtime:
        return beside, False
    temporary = not os.access(report.parent, os.W_OK) or beside.exists()
    out = Path(tempfile.mkdtemp(prefix="specpilot-nsys-")) / beside.name if temporary else beside
    tmp_out = out.with_name(f".{out.name}.part")
    from specpilot.signals import track_temp

    with track_temp(tmp_out):
        try:
            proc = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o",
                                   str(tmp_out), str(report)], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            tmp_out.unlink(missing_ok=True)
            raise InputError(f"{report}: nsys export took longer than {timeout_s:.0f} s") from None
        except BaseException:
            tmp_out.unlink(missing_ok=True)
            if temporary:
                shutil.rmtree(out.parent, ignore_errors=True)
            raise
        if proc.returncode != 0 or not tmp_out.is_file():
            tmp_out.unlink(missing_ok=True)
            msg = (proc.stderr or proc.stdout or "").strip().splitlines()
            raise InputError(f"{report}: nsys export failed ({msg[-1] if msg else f'exit {proc.returncode}'})")
        os.replace(tmp_out, out)
    return out, temporary
