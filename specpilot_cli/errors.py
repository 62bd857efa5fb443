"""Errors that map to SpecPilot's exit codes.

0 done/pass, 1 a negative verdict, 2 bad input or usage, 3 missing environment, 4 a bug in
SpecPilot. Library code raises these; the CLI turns them into one ``specpilot: error: ...`` line.
Exceptions from decoding a file (JSON, YAML, gzip/zstd/xz, safetensors, SQLite, UTF-8), from
numbers out of range and from the operating system are bad input too: :func:`as_user_error`
turns them into an :class:`InputError` that names the file (``file:line`` where there is one).
"""

from __future__ import annotations

import contextlib

EXIT_OK = 0
EXIT_VERDICT = 1
EXIT_USAGE = 2
EXIT_ENV = 3
EXIT_INTERNAL = 4


class SpecPilotError(Exception):
    """A user-facing error: one line, with what to do."""

    exit_code = EXIT_USAGE


class InputError(SpecPilotError):
    """Bad input: malformed file, unknown name, out-of-range option (exit 2)."""

    exit_code = EXIT_USAGE


@contextlib.contextmanager
def about_prompt(prompt_id, prefix: str = ""):
    """An InputError raised inside, about one of several prompts, names the prompt (after
    ``prefix``, e.g. the system's name)."""
    try:
        yield
    except InputError as e:
        raise InputError(f"{prefix}prompt {prompt_id!r}: {e}") from None


def did_you_mean(word, choices) -> str:
    """The hint ``" (did you mean 'x'?)"`` for the choice closest to a misspelt ``word``, "" where none
    is close: a hint, not the list of choices (a long list would be cut off in a one-line error)."""
    import difflib

    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class EnvironmentMissing(SpecPilotError):
    """Missing environment: no GPU, no nsys, no SGLang (exit 3)."""

    exit_code = EXIT_ENV


class NegativeVerdict(SpecPilotError):
    """A gate said no (exit 1). Raised only where there is no result to render."""

    exit_code = EXIT_VERDICT


# ------------------------------------------------------------------------------ the boundary

SOURCE_ATTR = "specpilot_source"  # set on an exception by specpilot.fileio.reading(path)

# (qualified class name anywhere in the exception's MRO, what it means)
_DECODE = (
    ("json.decoder.JSONDecodeError", "not valid JSON"),
    ("yaml.error.YAMLError", "not valid YAML"),
    ("safetensors._safetensors_rust.SafetensorError", "not a readable safetensors file"),
    ("sqlite3.DatabaseError", "not a readable SQLite database"),
    ("gzip.BadGzipFile", "corrupt gzip data"),
    ("zlib.error", "corrupt compressed data"),
    ("_lzma.LZMAError", "corrupt xz data"),
    ("zstandard.backend_c.ZstdError", "corrupt zstd data"),
    ("compression.zstd.ZstdError", "corrupt zstd data"),
    ("builtins.EOFError", "truncated (the data ends early)"),
    ("builtins.UnicodeError", "not UTF-8 text (a binary file?)"),
    ("builtins.OverflowError", "a number is out of range"),
    ("builtins.RecursionError", "nested too deeply"),
    ("builtins.MemoryError", "too large to hold in memory"),
)


# what a library's own error says when the disk, not the input, stopped it
_FULL = ("No space left on device", "Disk quota exceeded", "File too large")


def _names(exc: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}


def _detail(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__


def _position(exc: BaseException) -> str:
    """``:line[:col]`` for exceptions that know where they happened."""
    line = getattr(exc, "lineno", None)
    col = getattr(exc, "colno", None)
    mark = getattr(exc, "problem_mark", None)  # YAML
    if mark is not None and getattr(mark, "line", None) is not None:
        line, col = mark.line + 1, mark.column + 1
    if isinstance(line, int) and line > 0:
        return f":{line}" + (f":{col}" if isinstance(col, int) and col > 0 else "")
    return ""


def as_user_error(exc: BaseException) -> SpecPilotError | None:
    """The user-facing error for a decoding, range or I/O exception; None for anything else (a bug)."""
    if isinstance(exc, SpecPilotError):
        return exc
    source = getattr(exc, SOURCE_ATTR, None)
    names = _names(exc)
    if isinstance(exc, OSError) and not any(n in names for n, _ in _DECODE):
        import errno

        where = exc.filename if exc.filename is not None else source
        what = exc.strerror or _detail(exc)
        if isinstance(exc, (ConnectionError, TimeoutError)) or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
                                                                             errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            return EnvironmentMissing(f"{where}: {what}" if where else what)
        return InputError(f"{where}: {what}" if where else f"{what} ({_detail(exc)})")
    if isinstance(exc, MemoryError) or any(n.endswith(".OutOfMemoryError") for n in names) or (
            isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))):
        # the machine's limit, not the input's nor a bug: a smaller --context, --batch or model fits
        return EnvironmentMissing(f"not enough memory for this run ({_detail(exc)[:160]}); try a smaller context, "
                                  "batch or model")
    full = next((m for m in _FULL if m in str(exc)), None)
    if full:   # a library that wrote (a converted checkpoint into the cache) and met a full disk: the machine's
        return EnvironmentMissing(f"{source + ': ' if source else ''}{full} while writing ({_detail(exc)[:160]})")
    for name, meaning in _DECODE:
        if name in names:
            head = f"{source}{_position(exc)}: " if source else ""
            detail = _detail(exc)
            if not source:
                return InputError(f"input {meaning} ({type(exc).__name__}: {detail})")
            return InputError(f"{head}{meaning} ({detail})")
    return None
