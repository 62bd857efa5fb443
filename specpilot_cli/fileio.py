"""Atomic file output and schema-checked JSON/JSONL input.

Every file SpecPilot writes goes to a temporary name in the same folder and is renamed into
place, so an interrupted run never leaves a half-written file. Writers refuse to overwrite one
of the run's inputs.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import InputError


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", protect: Iterable[str | os.PathLike] = ()):
    """Open a temporary file beside ``path``; rename it onto ``path`` only on success."""
    path = Path(path)
    for p in protect:
        try:
            if Path(p).exists() and path.exists() and os.path.samefile(p, path):
                raise InputError(f"refusing to overwrite input file {path}; choose another --out")
        except FileNotFoundError:
            pass
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"cannot write {path}: folder {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=parent)
    try:
        binary = "b" in mode
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path, text: str, protect=()) -> None:
    with atomic_open(path, "w", protect=protect) as fh:
        fh.write(text)


def write_json_atomic(path, obj: Any, protect=()) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n", protect)


def write_jsonl_atomic(path, rows: Iterable[dict], protect=()) -> None:
    with atomic_open(path, "w", protect=protect) as fh:
        for row in rows:
            fh.write(json.dumps(row, default=_json_default) + "\n")


def _json_default(o):
    import dataclasses

    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def check_schema(obj: Any, kind: str, source: str, versions: Iterable[int] = (1,)) -> None:
    """Reject objects whose ``schema`` is not ``specpilot.<kind>/<v>`` for a known v."""
    if not isinstance(obj, dict):
        raise InputError(f"{source}: expected a JSON object with \"schema\": \"specpilot.{kind}/1\"")
    schema = obj.get("schema")
    allowed = {f"specpilot.{kind}/{v}" for v in versions}
    if schema not in allowed:
        want = " or ".join(sorted(allowed))
        raise InputError(f"{source}: unknown schema {schema!r}; expected {want} (see docs/formats.md)")


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def read_json(path, kind: str | None = None, versions: Iterable[int] = (1,)) -> Any:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        with _open_text(path) as fh:
            obj = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, OSError) as e:
        raise InputError(f"{path}: not valid JSON ({_short(e)})") from None
    if kind is not None:
        check_schema(obj, kind, str(path), versions)
    return obj


def iter_jsonl(path, kind: str | None = None, versions: Iterable[int] = (1,)) -> Iterator[dict]:
    """Yield JSON objects, one per non-blank line, with ``file:line`` in every error.

    When ``kind`` is given every row must carry ``"schema": "specpilot.<kind>/<v>"``.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{lineno}: not valid JSON ({_short(e)})") from None
                if kind is not None:
                    check_schema(obj, kind, f"{path}:{lineno}", versions)
                yield obj
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: unreadable ({_short(e)})") from None


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
