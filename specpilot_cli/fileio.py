"""Atomic file output and schema-checked JSON/JSONL input.

Every file SpecPilot writes goes to a temporary name in the same folder and is renamed into
place, so an interrupted run never leaves a half-written file; the file gets the mode a plain
``open`` would give it and a symlink's target is written. Writers refuse to overwrite one of the
run's inputs. Verbs write files only through these functions.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import math
import os
import stat
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .errors import SOURCE_ATTR, InputError
from .limits import MAX_JSON_BYTES, MAX_JSONL_LINE_BYTES


def _umask() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def output_target(path: str | os.PathLike) -> Path:
    """Where writing ``path`` lands: a symlink's target (the link itself stays), else ``path``."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def is_special(path: str | os.PathLike) -> bool:
    """Whether ``path`` (symlinks followed) is an existing file that is neither a regular file nor a
    folder - a device such as ``/dev/null``, a named pipe, ``/dev/stdout``: written in place, since
    renaming a file onto it would replace the device instead of writing to it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_output_path(path: str | os.PathLike, option: str = "--out",
                      protect: Iterable[str | os.PathLike] = ()) -> Path:
    """Fail early (InputError naming ``option``) when ``path`` cannot be written or is an input;
    returns where the write will land (:func:`output_target`; a device or pipe: ``path`` itself)."""
    if str(path).endswith(("/", os.sep)):   # Path() drops the slash: "f/" would write over the file f
        raise InputError(f"{option} {path}: ends in '/', a folder; give a file name")
    shown = Path(path)
    if is_special(shown):
        return shown
    target = output_target(shown)
    for p in protect:
        try:
            if p and Path(p).exists() and target.exists() and os.path.samefile(p, target):
                raise InputError(f"{option} {shown}: refusing to overwrite input file {p}; choose another {option}")
            # a file inside an input folder (a checkpoint's weights, a model's config) is an input too
            # (by where it leads, or by its name: through a linked folder too)
            if p and Path(p).is_dir() and target.exists() and (
                    target.resolve().is_relative_to(Path(p).resolve())
                    or Path(os.path.abspath(shown)).is_relative_to(os.path.abspath(p))):
                raise InputError(f"{option} {shown}: refusing to overwrite a file of input folder {p}; choose "
                                 f"another {option}")
        except (FileNotFoundError, NotADirectoryError):
            pass
    if target.is_dir():
        raise InputError(f"{option} {shown}: is a folder; give a file name")
    if _is_program(target):   # an interpreter or a script (a link into a venv's bin/): never a report to replace
        raise InputError(f"{option} {shown}: {target} is a program, not a file to write a report over; choose "
                         f"another {option}")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise InputError(f"{option} {shown}: {parent} {what}")
    _probe_write(parent, option, shown, name=target.name)
    return target


def refuse_inside(out, folder, what: str, why: str, option: str = "--out") -> None:
    """InputError when ``out`` lies in ``folder`` (existing or not), a folder the command writes or
    reads whole: a report there would replace one of its files or sit among them as one."""
    if out and folder and Path(out).resolve().is_relative_to(Path(folder).resolve()):
        raise InputError(f"{option} {out}: inside {what} {folder}, {why}; write the report elsewhere")


def _is_program(path: Path) -> bool:
    """An executable file that starts as a program does (an ELF binary, a ``#!`` script)."""
    try:
        if not (path.is_file() and os.access(path, os.X_OK)):
            return False
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return False
    return head == b"\x7fELF" or head.startswith(b"#!")


def _probe_write(folder: Path, option: str, shown: Path, missing: Path | None = None, name: str | None = None) -> None:
    """InputError unless a file can be made in ``folder`` (permissions, a read-only or virtual file
    system); the probe is removed at once. ``missing``: the folder that would be made in ``folder``,
    named as the one at fault. ``name``: the output's name, whose temporary ``.NAME.XXXX.part`` the
    probe is (a name the file system takes, temporary suffix included, before any work)."""
    from .signals import deferred

    with deferred():
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{name}." if name else ".specpilot-",
                                         suffix=".part" if name else ".probe", dir=folder)
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                raise InputError(f"{option} {shown}: the name is too long for the file system (the output is "
                                 "written as .NAME.XXXXXXXX.part first); choose a shorter one") from None
            if missing is not None:
                raise InputError(f"{option} {shown}: {missing} does not exist and cannot be made in {folder} "
                                 f"({e.strerror})") from None
            raise InputError(f"{option} {shown}: cannot write in folder {folder} ({e.strerror})") from None
        os.close(fd)
        os.unlink(probe)


def check_output_folder(path: str | os.PathLike, option: str) -> Path:
    """Fail early (InputError naming ``option``) when folder ``path`` cannot be made or written
    (its nearest existing ancestor must be a folder that takes files); returns ``path``."""
    shown = Path(path)
    anc, missing = shown, None
    while not anc.exists() and anc != anc.parent:
        anc, missing = anc.parent, anc
    if not anc.is_dir():
        raise InputError(f"{option} {shown}: {anc} is not a folder")
    _probe_write(anc, option, shown, missing, name=missing.name if missing is not None else None)
    return shown


# errors of a write the machine refuses (space, quota, a file size limit, the device)
_WRITE_LIMITS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", protect: Iterable[str | os.PathLike] = (),
                option: str = "--out", on_commit: Callable[[], None] | None = None):
    """Open a temporary file beside ``path``; rename it onto ``path`` only on success.

    ``on_commit()`` runs right after the rename with signals held back from the rename to its
    end, so a caller that a signal stops after it knows the output is complete.

    The file gets the mode an ordinary ``open`` would give it: an existing file keeps its mode,
    a new one gets ``0o666`` less the umask. A symlink is followed: its target is replaced and the
    link kept. The temporary ``.NAME.XXXX.part`` is removed on any failure or signal.
    A device or a pipe (:func:`is_special`) is written in place. ``option`` names the option that
    chose ``path`` in error messages.
    """
    shown = Path(path)
    target = check_output_path(path, option, protect)
    if is_special(target):
        binary = "b" in mode
        try:
            fh = open(target, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"}))
        except OSError as e:
            raise InputError(f"{option} {shown}: cannot write ({e.strerror})") from None
        try:
            with fh:
                yield fh
            if on_commit:
                on_commit()
        except OSError as e:   # a full device or a closed pipe: say which output
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror, str(shown)) from None
        return
    parent = target.parent if str(target.parent) else Path(".")
    try:
        file_mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        file_mode = 0o666 & ~_umask()
    from .signals import deferred, forget_temp, register_temp

    with deferred():   # created and registered as one step: a signal cannot leave it behind
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=parent)
        except OSError as e:
            raise InputError(f"{option} {shown}: cannot write in folder {parent} ({e.strerror})") from None
        register_temp(tmp)
    try:
        os.fchmod(fd, file_mode)
        binary = "b" in mode
        try:
            with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as e:   # a full disk or a file size limit while writing: name the output
            if e.filename is not None or e.errno not in _WRITE_LIMITS:
                raise
            raise OSError(e.errno, e.strerror, str(shown)) from None
        with deferred() if on_commit else contextlib.nullcontext():
            try:
                os.replace(tmp, target)
            except OSError as e:   # name the output, not the temporary beside it
                raise OSError(e.errno, e.strerror, str(shown)) from None
            if on_commit:
                on_commit()
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        forget_temp(tmp)


def temp_dir_beside(dst: str | os.PathLike) -> Path:
    """A new hidden ``.NAME.XXXX.part`` folder beside ``dst`` to build a folder output in, then
    ``os.replace`` onto ``dst``; it has the mode a plain ``mkdir`` gives and a signal removes it."""
    from .signals import deferred, register_temp

    dst = Path(dst)
    parent = dst.parent if str(dst.parent) else Path(".")
    with deferred():   # created and registered as one step: a signal cannot leave it behind
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".part", dir=parent))
        register_temp(tmp)
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def write_text_atomic(path, text: str, protect=(), option: str = "--out") -> None:
    """``text`` to ``path`` atomically; gzip-compressed where ``path`` ends in ``.gz`` (the readers
    take a ``.gz`` name as compressed)."""
    if str(path).endswith(".gz"):
        with atomic_open(path, "wb", protect=protect, option=option) as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                gz.write(text.encode("utf-8"))
        return
    with atomic_open(path, "w", protect=protect, option=option) as fh:
        fh.write(text)


def plain_data(obj: Any) -> Any:
    """``obj`` as plain JSON values: dataclasses and arrays as dicts and lists, and a number that
    is not finite (an overflow, a 0/0) as None, never the NaN/Infinity that Python's json writes
    and strict readers refuse."""
    return _finite(json.loads(json.dumps(obj, default=_json_default)))


def json_text(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as JSON text that any reader takes (:func:`plain_data`)."""
    return json.dumps(plain_data(obj), indent=indent, allow_nan=False)


def _finite(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def write_json_atomic(path, obj: Any, protect=(), option: str = "--out") -> None:
    write_text_atomic(path, json_text(obj) + "\n", protect, option)


def write_jsonl_atomic(path, rows: Iterable[dict], protect=(), option: str = "--out") -> None:
    """One JSON object a line, gzip-compressed when ``path`` ends in ``.gz`` (the readers take both)."""
    if str(path).endswith(".gz"):
        import gzip
        import io

        with atomic_open(path, "wb", protect=protect, option=option) as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, io.TextIOWrapper(gz, encoding="utf-8") as fh:
                for row in rows:
                    fh.write(json.dumps(row, default=_json_default) + "\n")
        return
    with atomic_open(path, "w", protect=protect, option=option) as fh:
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


def is_int(x) -> bool:
    """A JSON integer (``true`` is an int to Python, not to a reader of the file)."""
    return isinstance(x, int) and not isinstance(x, bool)


def same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file (a link, a hard link, another spelling); a path
    that cannot be read is no match (its reader says what is wrong with it)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def is_num(x) -> bool:
    """A finite JSON number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def need(ok: bool, name: str, want: str, v) -> None:
    """A field check of a file being read: a ValueError ``<name> must be <want>, not <v>`` unless
    ``ok`` (the reader adds the file's name)."""
    if not ok:
        raise ValueError(f"{name} must be {want}, not {v!r:.40}")


def need_fields(d: dict, cls, name: str = "") -> None:
    """The fields of a file's object ``d`` that builds the dataclass ``cls`` (its ``schema`` aside):
    a ValueError naming one it does not know or one it misses (the reader adds the file's name),
    where the constructor would say it in Python's words."""
    import dataclasses

    from .errors import did_you_mean

    fields = dataclasses.fields(cls)
    at = f"{name}: " if name else ""
    for key in d:
        if key != "schema" and key not in {f.name for f in fields}:
            raise ValueError(f"{at}unknown field {key!r}{did_you_mean(key, [f.name for f in fields])}")
    for f in fields:
        if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{at}no field {f.name!r}")


def check_schema(obj: Any, kind: str, source: str, versions: Iterable[int] = (1,)) -> None:
    """Reject objects whose ``schema`` is not ``specpilot.<kind>/<v>`` for a known v."""
    if not isinstance(obj, dict):
        raise InputError(f"{source}: expected a JSON object with \"schema\": \"specpilot.{kind}/1\"")
    schema = obj.get("schema")
    allowed = {f"specpilot.{kind}/{v}" for v in versions}
    if not isinstance(schema, str) or schema not in allowed:
        want = " or ".join(sorted(allowed))
        shown = repr(schema) if len(repr(schema)) <= 60 else repr(schema)[:57] + "..."
        what = "no \"schema\" field" if schema is None else f"unknown schema {shown}"
        raise InputError(f"{source}: {what}; expected {want} (see docs/formats.md)")


def open_text(path: Path, encoding: str = "utf-8"):
    """``path`` as text, gzip-decompressed when it ends in ``.gz``."""
    if Path(path).suffix == ".gz":
        return gzip.open(path, "rt", encoding=encoding)
    return open(path, "r", encoding=encoding)


@contextlib.contextmanager
def reading(path: str | os.PathLike):
    """Name ``path`` on any exception that escapes the block (the CLI's error line shows it)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, SOURCE_ATTR, None) is None and not isinstance(e, (InputError, KeyboardInterrupt)):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(e, SOURCE_ATTR, str(path))
        raise


def unicode_text(text: str, where: str) -> str:
    """``text`` when UTF-8 can hold it; InputError naming ``where`` for a lone surrogate (JSON's
    ``"\\ud800"``, or bytes that are not UTF-8 in a command-line argument)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where}: the text is not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


def _check_size(path: Path, max_bytes: int | None) -> None:
    if max_bytes is not None and path.stat().st_size > max_bytes:
        raise InputError(f"{path}: {path.stat().st_size / 2**20:.1f} MiB is larger than the {max_bytes / 2**20:g} MiB "
                         "this file kind may have (see docs/formats.md, limits)")


def require_file(path) -> None:
    """InputError unless ``path`` is a regular file: "no such file", or "not a regular file" for a
    folder or a device (``/dev/null``), which exist."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a regular file")


def read_json(path, kind: str | None = None, versions: Iterable[int] = (1,),
              max_bytes: int | None = MAX_JSON_BYTES, build=None) -> Any:
    """A whole JSON file (``.gz`` too), schema-checked when ``kind`` is given; with ``build``, what
    ``build(obj)`` makes of it, a field it misses or has of the wrong type being bad input."""
    path = Path(path)
    require_file(path)
    _check_size(path, max_bytes)
    try:
        with open_text(path) as fh:
            obj = json.load(fh)
    except json.JSONDecodeError as e:
        rows = _jsonl_schema(path) if e.msg == "Extra data" else None
        if rows:   # JSON Lines where one document is wanted: say what the file is
            made = {"specpilot.lattice": "; `specpilot replay` reads it (its --format json output is a replay)"}
            raise InputError(f"{path}: JSON Lines of {rows} rows, where one JSON document"
                             f"{f' ({kind})' if kind else ''} is wanted{made.get(rows.split('/')[0], '')}") from None
        raise InputError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    except (UnicodeDecodeError, EOFError, OSError, zlib.error) as e:
        raise InputError(f"{path}: not valid JSON ({_short(e)})") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply") from None
    if kind is not None:
        check_schema(obj, kind, str(path), versions)
    if build is None:
        return obj
    try:
        return build(obj)
    except KeyError as e:
        raise InputError(f"{path}: malformed {kind or 'document'} (no field {e.args[0]!r})") from None
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise InputError(f"{path}: malformed {kind or 'document'} ({_short(e)})") from None


def _jsonl_schema(path) -> str | None:
    """The ``schema`` of the first line of ``path`` when that line alone is a JSON object with one."""
    try:
        with open_text(path) as fh:
            first = json.loads(fh.readline())
    except (ValueError, UnicodeDecodeError, EOFError, OSError, zlib.error, RecursionError):
        return None
    schema = first.get("schema") if isinstance(first, dict) else None
    return schema if isinstance(schema, str) else None


def document_schema(path) -> str | None:
    """For a file that is one JSON document: its ``schema`` ('' when it has none); else None."""
    try:
        with open_text(path) as fh:
            obj = json.loads(fh.read(MAX_JSON_BYTES or -1))
    except (ValueError, UnicodeDecodeError, EOFError, OSError, zlib.error, RecursionError):
        return None
    schema = obj.get("schema") if isinstance(obj, dict) else None
    return schema if isinstance(schema, str) else ""


def iter_jsonl(path, kind: str | None = None, versions: Iterable[int] = (1,)) -> Iterator[dict]:
    """Yield JSON objects, one per non-blank line, with ``file:line`` in every error.

    When ``kind`` is given every row must carry ``"schema": "specpilot.<kind>/<v>"``.
    """
    for _, obj in iter_jsonl_numbered(path, kind, versions):
        yield obj


def iter_jsonl_numbered(path, kind: str | None = None, versions: Iterable[int] = (1,)) -> Iterator[tuple[int, Any]]:
    """:func:`iter_jsonl` with each object's line number: ``(line, obj)``."""
    path = Path(path)
    require_file(path)
    lineno = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as fh:
            for lineno, raw in enumerate(fh, 1):
                if len(raw) > MAX_JSONL_LINE_BYTES:
                    raise InputError(f"{path}:{lineno}: a line of {len(raw)} bytes is longer than the "
                                     f"{MAX_JSONL_LINE_BYTES} a row may have (see docs/formats.md, limits)")
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")   # a byte order mark some editors write
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    doc = document_schema(path) if line.strip() in ("{", "[") else None
                    if doc is not None:   # one pretty-printed JSON document where JSON Lines are wanted
                        raise InputError(f"{path}: one JSON document{f' ({doc})' if doc else ''}, where JSON Lines"
                                         f"{f' of {kind} rows' if kind else ''} are wanted") from None
                    raise InputError(f"{path}:{lineno}: not valid JSON ({_short(e)})") from None
                except RecursionError:
                    raise InputError(f"{path}:{lineno}: JSON nested too deeply") from None
                if kind is not None:
                    check_schema(obj, kind, f"{path}:{lineno}", versions)
                yield lineno, obj
    except UnicodeDecodeError:
        raise InputError(f"{path}:{lineno}: not UTF-8 text (a binary file?)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"{path}:{lineno + 1}: truncated or corrupt gzip data ({_short(e)})") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a folder, expected a file") from None


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def load_yaml(text: str):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (yaml.YAMLError naming both
    lines): a file a person writes, where the second value would silently win. A key a merge
    (``<<: *anchor``) brings in may be given again: that is how a merge is overridden."""
    import yaml

    class _UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:   # the mapping's own keys: a '<<' merge's may be overridden (YAML 1.1)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (lines {seen[key]} and {line})", key_node.start_mark)
                if isinstance(key, (str, int, float, bool)):
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=_UniqueKeys)
