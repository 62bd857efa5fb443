"""Outputs and prompts files: what a system produced for each prompt, and what to ask it.

outputs (JSONL, ``specpilot.outputs/1``), one row per prompt::

    {"schema": "specpilot.outputs/1", "id": "p0", "prompt_ids": [1, 9690, 28], "output_ids": [504, 3]}

prompts (JSONL, ``specpilot.prompts/1``), one row per prompt, token ids or text::

    {"schema": "specpilot.prompts/1", "id": "p0", "prompt_ids": [1, 9690, 28]}
    {"schema": "specpilot.prompts/1", "id": "p1", "text": "Why is the sky blue?"}

An outputs file is also accepted wherever prompts are read (its prompt_ids are used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from specpilot.errors import InputError
from specpilot.fileio import iter_jsonl_numbered, open_text, reading, unicode_text, write_jsonl_atomic
from specpilot.limits import MAX_TOKEN_ID

OUTPUTS_SCHEMA = "specpilot.outputs/1"
PROMPTS_SCHEMA = "specpilot.prompts/1"


@dataclass
class Prompt:
    id: str | int
    prompt_ids: list[int]


@dataclass
class OutputRow:
    id: str | int
    prompt_ids: list[int]
    output_ids: list[int]
    # where known (audit collect): the limit it was generated under and the system that generated it
    max_new_tokens: int | None = None
    system: str | None = None
    line: int | None = field(default=None, compare=False, repr=False)   # its line in the file read (messages)

    def to_json(self) -> dict:
        row = {"schema": OUTPUTS_SCHEMA, "id": self.id, "prompt_ids": self.prompt_ids, "output_ids": self.output_ids}
        if self.max_new_tokens is not None:
            row["max_new_tokens"] = self.max_new_tokens
        if self.system is not None:
            row["system"] = self.system
        return row


@dataclass
class Outputs:
    """One system's outputs, in file order, with a lookup by id."""

    name: str
    rows: list[OutputRow]
    source: str = ""
    by_id: dict = field(init=False, repr=False)

    def __post_init__(self):
        self.by_id = {key(r.id): r for r in self.rows}

    @property
    def tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.rows)


def key(id_) -> str:
    """Ids match across files by their text: 3 and "3" are the same prompt."""
    return str(id_)


def _token_list(value, what: str, where: str, allow_empty: bool) -> list[int]:
    if not isinstance(value, list):
        raise InputError(f"{where}: {what} must be a list of token ids, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InputError(f"{where}: {what} is empty; a prompt needs at least one token (e.g. BOS): generation "
                         "and scoring start from it")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise InputError(f"{where}: {what} must hold token ids in [0, {MAX_TOKEN_ID}], found {_short(t)}")
    return value


def _short(v) -> str:
    """A value from a JSON file as JSON writes it (true, null, "3"), cut to 40 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_short(v) -> str:
    """``v`` as the file spells it (``true``, ``"3"``), cut to 40 characters."""
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _id(obj: dict, where: str):
    if "id" not in obj:
        raise InputError(f"{where}: row has no \"id\"")
    v = obj["id"]
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise InputError(f"{where}: \"id\" must be a string or an integer, got {_short(v)}")
    return v


def read_outputs(path, name: str | None = None) -> Outputs:
    """Read and validate an outputs JSONL file (ids unique, token ids non-negative ints)."""
    path = Path(path)
    rows: list[OutputRow] = []
    seen: set[str] = set()
    for n, obj in iter_jsonl_numbered(path, kind="outputs"):
        where = f"{path}:{n}"
        id_ = _id(obj, where)
        if key(id_) in seen:
            raise InputError(f"{where}: duplicate id {id_!r}")
        seen.add(key(id_))
        for k in ("prompt_ids", "output_ids"):
            if k not in obj:
                raise InputError(f"{where}: row has no \"{k}\"")
        limit, system = obj.get("max_new_tokens"), obj.get("system")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise InputError(f"{where}: \"max_new_tokens\" must be a positive integer, got {_json_short(limit)}")
        if system is not None and not (isinstance(system, str) and system):
            raise InputError(f"{where}: \"system\" must be a non-empty string, got {_json_short(system)}")
        out = _token_list(obj["output_ids"], "output_ids", where, True)
        if limit is not None and len(out) > limit:
            raise InputError(f"{where}: {len(out)} output_ids, more than its \"max_new_tokens\" {limit}")
        rows.append(OutputRow(id_, _token_list(obj["prompt_ids"], "prompt_ids", where, False), out, limit, system, n))
    if not rows:
        raise InputError(f"{path}: no outputs rows")
    return Outputs(name or path.name, rows, str(path))


def write_outputs(path, rows: Iterable[OutputRow], protect: Sequence = (), option: str = "--out") -> None:
    write_jsonl_atomic(path, (r.to_json() for r in rows), protect=protect, option=option)


@dataclass
class PromptRow:
    """One prompt as a file gives it: token ids, or text still to be tokenized."""

    id: str | int
    prompt_ids: list[int] | None = None
    text: str | None = None


def _jsonl_row(line: str) -> bool:
    """Whether a prompts file's first line makes it JSONL: a JSON object, or a line meant as one
    (a lone bracket, or a broken row with a prompts file's keys, reported as such) - not text that
    starts with "{"."""
    text = line.strip()
    if text in ("{", "["):
        return True
    if not text.startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return any(f'"{k}"' in text for k in ("schema", "id", "prompt_ids", "text", "output_ids"))


def _json_document(path: Path) -> bool:
    """Whether the whole file is one JSON object or array (a run's ``--format json``, say): read
    as text it would be one prompt per line of JSON."""
    try:
        with open_text(path, "utf-8-sig") as fh:
            return isinstance(json.loads(fh.read()), (dict, list))
    except (ValueError, RecursionError):
        return False


def read_prompt_rows(path) -> list[PromptRow]:
    """Read prompts: ``specpilot.prompts/1`` JSONL (ids or text), an outputs file (its prompts), or
    a plain text file with one prompt per line (ids ``p0``, ``p1``, ...). A decoding error (a
    truncated or corrupt ``.gz``) names the file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: " + ("not a file of prompts (a folder or device)" if path.exists()
                                        else "no such prompts file"))
    with reading(path):
        return _prompt_rows(path)


def _prompt_rows(path: Path) -> list[PromptRow]:
    try:
        with open_text(path, "utf-8-sig") as fh:
            first = next((line for line in fh if line.strip()), "")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    if first.strip() in ("{", "[") and _json_document(path):
        raise InputError(f"{path}: one JSON document, not prompts: give JSONL (one specpilot.prompts/1 object "
                         "a line, or an outputs file) or plain text, one prompt a line")
    if first and not _jsonl_row(first):
        if path.name.lower().endswith((".jsonl", ".jsonl.gz")):   # named JSONL: not read as text prompts
            raise InputError(f"{path}: its first line is not a JSON object ({first.strip()[:40]!r}); a .jsonl "
                             "prompts file holds one specpilot.prompts/1 object a line (a file of plain-text "
                             "prompts, one a line, takes another suffix such as .txt)")
        with open_text(path, "utf-8-sig") as fh:
            text = fh.read()
        if "\x00" in text:   # UTF-8 that decodes but holds NULs is a binary file, not prompts
            line = text[:text.index("\x00")].count("\n") + 1
            raise InputError(f"{path}:{line}: a NUL byte in a text prompts file (a binary file?)")
        lines = [line for line in text.splitlines() if line.strip()]
        return [PromptRow(f"p{i}", text=line) for i, line in enumerate(lines)]
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for n, obj in iter_jsonl_numbered(path):
        where = f"{path}:{n}"
        schema = obj.get("schema") if isinstance(obj, dict) else None
        if schema not in (PROMPTS_SCHEMA, OUTPUTS_SCHEMA):
            what = "no \"schema\" field" if schema is None else f"unknown schema {schema!r}"
            raise InputError(f"{where}: {what}; expected {PROMPTS_SCHEMA} or {OUTPUTS_SCHEMA} (see docs/formats.md)")
        id_ = _id(obj, where)
        if key(id_) in seen:
            raise InputError(f"{where}: duplicate id {id_!r}")
        seen.add(key(id_))
        if schema == PROMPTS_SCHEMA and "prompt_ids" in obj and "text" in obj:
            raise InputError(f"{where}: a prompt row has \"prompt_ids\" or \"text\", not both")
        if "prompt_ids" in obj:
            rows.append(PromptRow(id_, prompt_ids=_token_list(obj["prompt_ids"], "prompt_ids", where, False)))
        elif "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"]:
                raise InputError(f"{where}: \"text\" must be a non-empty string")
            rows.append(PromptRow(id_, text=unicode_text(obj["text"], where)))
        else:
            raise InputError(f"{where}: row needs \"prompt_ids\" or \"text\"")
    if not rows:
        raise InputError(f"{path}: no prompts")
    return rows


def read_prompts(path, tokenize: Callable[[str], list[int]] | None = None) -> list[Prompt]:
    """Prompts as token ids (see :func:`read_prompt_rows`).

    Rows with ``text`` instead of ``prompt_ids`` are tokenized with ``tokenize`` (the scorer's
    tokenizer); without one they are an error.
    """
    prompts: list[Prompt] = []
    for r in read_prompt_rows(path):
        if r.prompt_ids is not None:
            prompts.append(Prompt(r.id, r.prompt_ids))
            continue
        if tokenize is None:
            raise InputError(f"{path}: text prompts need a tokenizer; give --scorer/--tokenizer, or token ids")
        ids = list(tokenize(r.text))
        if not ids:
            raise InputError(f"{path}: prompt {r.id!r}: text tokenizes to nothing")
        prompts.append(Prompt(r.id, ids))
    return prompts


def read_prompts_tokenized(path, tokenizer_spec: str | None) -> list[Prompt]:
    """:func:`read_prompts`, turning text rows into ids with ``tokenizer_spec``'s tokenizer.

    ``tokenizer_spec`` names a model (``smollm2``, a HF folder, a ``.gguf``); it is loaded only
    when the file has text rows. Text is tokenized as it is (no chat template).
    """
    tok: dict = {}

    def tokenize(text):
        if "t" not in tok:
            if not tokenizer_spec:
                raise InputError(f"{path}: text prompts need a tokenizer; give --tokenizer MODEL or token ids")
            from .scorer import load_tokenizer

            tok["t"] = load_tokenizer(tokenizer_spec)
        return tok["t"](text)["input_ids"]

    return read_prompts(path, tokenize)


def align(reference: Outputs, other: Outputs) -> list[tuple[OutputRow, OutputRow]]:
    """Pair rows of two systems by id; both must cover the same prompts with the same prompt_ids."""
    missing = [r.id for r in reference.rows if key(r.id) not in other.by_id]
    extra = [r.id for r in other.rows if key(r.id) not in reference.by_id]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} prompt(s) of {reference.name} missing from {other.name} "
                         f"(first: {missing[0]!r})")
        if extra:
            parts.append(f"{len(extra)} prompt(s) of {other.name} not in {reference.name} (first: {extra[0]!r})")
        raise InputError("systems were not run on the same prompts: " + "; ".join(parts))
    pairs = []
    for r in reference.rows:
        o = other.by_id[key(r.id)]
        if o.prompt_ids != r.prompt_ids:
            raise InputError(f"prompt {r.id!r}: prompt_ids differ between {reference.name} and {other.name}; "
                             "both must be run on the same token ids")
        pairs.append((r, o))
    return pairs
