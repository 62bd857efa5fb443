"""W12 checkpoints: pack a safetensors file/folder, verify it bit for bit, report its size.

A converted weight ``NAME`` (bf16 ``[N, K]``) is stored as four tensors (format version 2)

    NAME.w12.records   uint8  the 12 KB records (last row tile cut to the rows present)
    NAME.w12.low_exp   uint8  window low end per output channel: 4-bit offsets from ``low_base``
                              (two per byte) when the windows span <= 16 binades, else [N] bytes
    NAME.w12.esc_pos   int16  flat positions n*K + k of escapes as 16-bit delta codes
                              (format.pack_positions; 0xFFFF = skip 65535)
    NAME.w12.esc_bits  int16  [nnz] their bf16 bit patterns

and described in the safetensors metadata key ``specpilot.w12`` (JSON, schema ``specpilot.w12/1``):
format version, tile, row padding, per tensor its shape, stored rows, padded K, ``low_base`` (null
for the byte form), the escape count, a CRC-32 of each stored part (so ``verify`` catches a
corrupted record even without the original) and the sha256 of the original bf16 bytes (so a
loader checks the restored tensor bit for bit without the original checkpoint). Format 1 files (windows as bytes, positions as
int32/int64) are still read. Every other
tensor is copied unchanged; other metadata keys are kept.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from .format import (FORMAT_VERSION, ROW_ALIGN_FILE, TILE_K, TILE_N, W12Tensor, check, decode, encode,
                     expected_record_bytes, pack_positions, pack_windows, unpack_positions, unpack_windows)
from .files import META_KEY, SCHEMA, W12FormatError, find_checkpoint, no_w12, unreadable

PARTS = ("records", "low_exp", "esc_pos", "esc_bits")
DEFAULT_INCLUDE = ("*proj.weight", "*fc1.weight", "*fc2.weight", "*c_fc.weight", "*c_proj.weight",
                   "*query_key_value.weight", "*dense*.weight", "*experts*.weight")
DEFAULT_EXCLUDE = ("*embed*", "lm_head.weight", "*norm*")


class W12TableError(W12FormatError):
    """A W12 tensor's metadata entry is malformed or does not describe its stored parts: the file is
    bad input, not a tensor that failed to restore (``verify`` says the latter)."""


# ----------------------------------------------------------------------------------------------
# reading a file's tensors
# ----------------------------------------------------------------------------------------------

def read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise unreadable(path, e) from None
    return tensors, meta


# ----------------------------------------------------------------------------------------------
# pack
# ----------------------------------------------------------------------------------------------

@dataclass
class TensorStat:
    name: str
    shape: tuple[int, int]
    bits_per_weight: float
    escapes: int
    escape_rate: float
    stored_bytes: int


class _Totals:
    """Whole-checkpoint figures over the W12 tensors of ``_stats()``."""

    def _stats(self) -> list[TensorStat]:
        raise NotImplementedError

    @property
    def weights(self) -> int:
        return sum(t.shape[0] * t.shape[1] for t in self._stats())

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self._stats())

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.stored_bytes / self.weights if self.weights else 0.0

    @property
    def escape_rate(self) -> float:
        return sum(t.escapes for t in self._stats()) / self.weights if self.weights else 0.0


@dataclass
class PackResult(_Totals):
    output: str
    converted: list[TensorStat] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)               # every tensor stored as it was
    skipped_not_bf16: list[str] = field(default_factory=list)   # those of ``kept`` that matched but are not bf16
    excluded: list[str] = field(default_factory=list)           # 2-D, matched the includes, dropped by the excludes
    skipped_empty: list[str] = field(default_factory=list)      # those of ``kept`` that matched but have no weights
    skipped_not_2d: list[str] = field(default_factory=list)     # those of ``kept`` the patterns pick that are not 2-D
    warnings: list[str] = field(default_factory=list)           # what the input gets wrong that the output does not carry
    already: list[str] = field(default_factory=list)            # W12 tensors of the input, carried over as packed

    def _stats(self) -> list[TensorStat]:
        return self.converted


def picked(name: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """A tensor name the patterns pick, whatever its shape."""
    return any(fnmatch.fnmatch(name, p) for p in include) and not any(fnmatch.fnmatch(name, p) for p in exclude)


def matched(name: str, t: torch.Tensor, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """A 2-D tensor the patterns pick, empty or not."""
    return t.dim() == 2 and picked(name, include, exclude)


def selected(name: str, t: torch.Tensor, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """A tensor ``pack`` converts (if bf16): 2-D, picked by the patterns, not empty (a [0, K] or
    [N, 0] weight has nothing to encode and no W12 shape)."""
    return t.numel() > 0 and matched(name, t, include, exclude)


def patterns(include: Iterable[str] | None, exclude: Iterable[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The include and exclude patterns ``pack`` applies: None means the defaults. The default
    excludes guard the default includes only: a user's include names what to convert, so a tensor
    it matches (``lm_head.weight``) is converted unless the user's own excludes drop it."""
    inc = tuple(include) if include else DEFAULT_INCLUDE
    exc = tuple(exclude) if exclude else (() if include else DEFAULT_EXCLUDE)
    return inc, exc


def w12_parts(name: str, t: W12Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """The four stored tensors of a W12 weight (format 2) and the metadata entries they need."""
    low, base = pack_windows(t.low_exp.cpu())
    parts = {f"{name}.w12.records": t.records.contiguous(), f"{name}.w12.low_exp": low,
             f"{name}.w12.esc_pos": pack_positions(t.esc_pos), f"{name}.w12.esc_bits": t.esc_bits.contiguous()}
    return parts, {"low_base": base, "escapes": t.num_escapes}


def bf16_sha256(t: torch.Tensor) -> str:
    """sha256 of a bf16 tensor's bytes (row-major, little-endian), the digest ``pack`` records."""
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.int16).numpy().tobytes()).hexdigest()


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _carried_table(tensors: dict[str, torch.Tensor], meta: dict[str, str], source: str) -> dict[str, dict]:
    """The W12 entries of an already packed input, to carry over into the output as they are: each
    checked first (structure, stored parts, CRC-32), so a table is merged only when it describes its
    parts. A format 1 table is refused: one file holds one format version."""
    info = w12_info(meta, source, tensors)
    if not info:
        return {}
    doc = json.loads(meta[META_KEY])
    if doc["version"] != FORMAT_VERSION:
        raise W12FormatError(f"{source}: its W12 tensors are format {doc['version']}, new ones would be format "
                             f"{FORMAT_VERSION}; pack the original bf16 checkpoint instead")
    for name, entry in info.items():
        if name in tensors:
            raise W12TableError(f"{source}: {name} is both a W12 entry and a plain tensor")
        load_w12(tensors, name, entry, source)
    return {name: dict(entry) for name, entry in doc["tensors"].items()}


def pack_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, str], include, exclude,
                 result: PackResult, device: str = "cpu", on_tensor: Callable[[str], None] | None = None,
                 source: str = "input"):
    """Convert the selected bf16 tensors of one file; returns (tensors, metadata) to save.

    A file that is already packed keeps its W12 tensors as they are (parts and table entries):
    the output's table lists them and the newly converted ones."""
    out: dict[str, torch.Tensor] = {}
    info: dict[str, dict] = _carried_table(tensors, meta, source)
    carried_parts = {f"{n}.w12.{p}": n for n in info for p in PARTS}
    result.already.extend(info)
    for name, t in tensors.items():
        if on_tensor:
            on_tensor(name)
        if name in carried_parts:
            out[name] = t
            continue
        if not selected(name, t, include, exclude):
            out[name] = t
            result.kept.append(name)
            if matched(name, t, include, exclude):           # picked, but an empty tensor
                result.skipped_empty.append(name)
            elif matched(name, t, include, ()):   # an exclude the user or the defaults chose dropped it
                result.excluded.append(name)
            elif t.dim() != 2 and picked(name, include, exclude):   # a stacked (3-D) or scalar tensor
                result.skipped_not_2d.append(name)
            continue
        if t.dtype != torch.bfloat16:
            out[name] = t
            result.kept.append(name)
            result.skipped_not_bf16.append(name)
            continue
        taken = [f"{name}.w12.{p}" for p in PARTS if f"{name}.w12.{p}" in tensors]
        if taken:
            raise W12FormatError(f"{source}: converting {name} would overwrite tensor {taken[0]} of the file")
        w12 = encode(t.to(device)).to("cpu")
        parts, extra = w12_parts(name, w12)
        out.update(parts)
        info[name] = {"shape": list(w12.shape), "rows_stored": w12.rows_stored, "k_pad": w12.k_pad,
                      "dtype": "bfloat16", **extra, "crc32": {p: _crc(parts[f"{name}.w12.{p}"]) for p in PARTS},
                      "sha256": bf16_sha256(t)}
        result.converted.append(TensorStat(name, w12.shape, w12.bits_per_weight(), w12.num_escapes,
                                           w12.escape_rate(), w12.stored_bytes()))
    new_meta = dict(meta)
    new_meta.pop(META_KEY, None)
    if info:
        new_meta[META_KEY] = json.dumps({"schema": SCHEMA, "version": FORMAT_VERSION, "tile": [TILE_N, TILE_K],
                                         "row_align": ROW_ALIGN_FILE, "tensors": info}, separators=(",", ":"))
    return out, new_meta


def _save_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta or None)


def pack(src: str, dst: str, include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
         device: str = "cpu", progress: Callable | None = None,
         on_commit: Callable[[PackResult], None] | None = None) -> PackResult:
    """Pack a checkpoint (file, sharded folder or folder of files) into ``dst`` atomically.

    ``include``/``exclude``: the user's name patterns, None for the defaults (see ``patterns``).

    ``on_commit(result)`` is called as soon as ``dst`` is renamed into place, with signals held back
    from the rename to the call: a caller whose run a signal ends after that knows the output is
    complete, and the result."""
    from specpilot.signals import deferred

    user_exclude = bool(exclude)
    include, exclude = patterns(include, exclude)
    ck = find_checkpoint(src)
    dst_p = Path(dst)
    res = PackResult(str(dst_p))
    if ck.is_folder:
        if dst_p.is_symlink():   # the folder is renamed into place: a link would be replaced, not followed
            raise FileExistsError(f"{dst_p} is a symbolic link; give the folder's own path")
        if dst_p.exists() and (not dst_p.is_dir() or any(dst_p.iterdir())):
            raise FileExistsError(f"{dst_p} exists and is not an empty folder")
        if dst_p.resolve() == ck.root.resolve():
            raise FileExistsError("the output folder is the input folder")
        parent = dst_p.parent if str(dst_p.parent) else Path(".")
        if not parent.is_dir():
            raise FileNotFoundError(f"folder {parent} does not exist")
        from specpilot.fileio import temp_dir_beside

        tmp = temp_dir_beside(dst_p)
        try:
            weight_map: dict[str, str] = {}
            total_size = 0
            held: set[str] = set()
            for f in ck.files:
                tensors, meta = read_file(f)
                held.update(tensors)
                bar = progress(total=len(tensors), desc=f.name) if progress else None
                out, new_meta = pack_tensors(tensors, meta, include, exclude, res, device,
                                             (lambda _n: bar.update(1)) if bar else None, str(f))
                if bar:
                    bar.close()
                (tmp / f.name).write_bytes(_save_bytes(out, new_meta))
                weight_map.update({k: f.name for k in out})
                total_size += sum(v.numel() * v.element_size() for v in out.values())
            # config, tokenizer, ... copied as they are; the contents only: a new file's mode is
            # the umask's, as for the shards beside it
            # an output inside the input folder: its own folder and the one being written are not the model's
            ours = {tmp.resolve(), dst_p.resolve()}
            for other in sorted(ck.root.iterdir()):
                if other.resolve() in ours:
                    continue
                if other.is_file() and other.suffix != ".safetensors" and not other.name.endswith(".index.json"):
                    shutil.copyfile(other, tmp / other.name)
                elif other.is_dir():   # e.g. a Hugging Face repo's original/ (consolidated .pth weights)
                    res.warnings.append(f"{other.name}/ is a subfolder: not copied (copy it beside the output if "
                                        "the model needs it)")
            for other in ck.unindexed:   # not part of the checkpoint a loader reads; kept, not lost
                shutil.copyfile(other, tmp / other.name)
                res.warnings.append(f"{other.name} is not named by {ck.index.name}: copied as it is, not packed")
            if ck.index is not None:
                doc = json.loads(ck.index.read_text())
                absent = sorted(set(doc["weight_map"]) - held)
                if absent:   # a loader of the input would miss them too; the output's index lists what is there
                    res.warnings.append(f"{ck.index.name} names {len(absent)} tensor{'s' if len(absent) > 1 else ''} "
                                        f"no shard holds (first: {absent[0]}); the output's index lists only the "
                                        "tensors its shards hold")
                doc["weight_map"] = dict(sorted(weight_map.items()))
                index_meta = doc["metadata"] = dict(doc.get("metadata") or {})
                # the byte size of the tensors listed, as transformers writes it (the input's is the bf16 one)
                index_meta["total_size"] = total_size
                index_meta["specpilot.w12"] = SCHEMA
                (tmp / ck.index.name).write_text(json.dumps(doc, indent=2) + "\n")
            _require_converted(res, src, include, exclude, user_exclude)
            if dst_p.exists():
                dst_p.rmdir()
            with deferred():
                os.replace(tmp, dst_p)
                if on_commit:
                    on_commit(res)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    else:
        if dst_p.exists() and dst_p.resolve() == ck.root.resolve():
            raise FileExistsError("the output file is the input file")
        tensors, meta = read_file(ck.files[0])
        bar = progress(total=len(tensors), desc=ck.files[0].name) if progress else None
        out, new_meta = pack_tensors(tensors, meta, include, exclude, res, device,
                                     (lambda _n: bar.update(1)) if bar else None, str(ck.files[0]))
        if bar:
            bar.close()
        _require_converted(res, src, include, exclude, user_exclude)
        from specpilot.fileio import atomic_open

        with atomic_open(dst_p, "wb", protect=[src], option="--output",
                         on_commit=(lambda: on_commit(res)) if on_commit else None) as fh:
            fh.write(_save_bytes(out, new_meta))
    return res


def _require_converted(res: PackResult, src: str, include, exclude, user_exclude: bool) -> None:
    if not res.converted:
        extra = (f"; {len(res.skipped_not_bf16)} matching tensors are not bf16 (W12 is exact for bf16 only)"
                 if res.skipped_not_bf16 else "")
        if res.skipped_empty:
            extra += f"; {len(res.skipped_empty)} matching tensors are empty (kept as they are)"
        if res.skipped_not_2d:
            extra += (f"; {len(res.skipped_not_2d)} tensors it matches are not 2-D (first: {res.skipped_not_2d[0]}, "
                      "kept as they are)")
        already = [n for n in res.already if picked(n, include, exclude)]
        if already:
            extra += f"; {len(already)} matching tensors are already W12"
        if res.excluded:
            shown = ", ".join(res.excluded[:3]) + (f" and {len(res.excluded) - 3} more" if len(res.excluded) > 3 else "")
            pats = ", ".join(exclude)
            who = f"--exclude ({pats}) drops" if user_exclude else f"the default excludes ({pats}) drop"
            extra += f"; {shown} matched --include but {who} {'it' if len(res.excluded) == 1 else 'them'}"
        raise W12FormatError(f"{src}: no tensor matched --include ({', '.join(include)}) among bf16 2-D "
                             f"weights{extra}; nothing written")


# ----------------------------------------------------------------------------------------------
# read back, verify, stats
# ----------------------------------------------------------------------------------------------

def w12_info(meta: dict[str, str], source: str, stored: dict[str, torch.Tensor] | None = None) -> dict:
    """The file's W12 table (name -> entry; {} for a file without one). With the file's tensors
    (``stored``), a stored part (``X.w12.records`` ..., in its part's dtype) of a weight the table
    does not name is refused: the table is damaged or missing, and the weight would be lost."""
    table = _w12_table(meta, source)
    if stored is not None:
        for name, t in stored.items():
            base, sep, part = name.rpartition(".w12.")
            if sep and part in PARTS and base not in table and t.dtype in (torch.uint8, torch.int16):
                raise W12TableError(f"{source}: {name} is a stored part of a W12 weight {base} that the file's W12 "
                                    "table does not name (the table is damaged or missing): the weight cannot be "
                                    "restored; pack the original bf16 checkpoint again")
    return table


def _w12_table(meta: dict[str, str], source: str) -> dict:
    raw = meta.get(META_KEY)
    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        raise W12FormatError(f"{source}: the {META_KEY} metadata is not valid JSON") from None
    except RecursionError:
        raise W12FormatError(f"{source}: the {META_KEY} metadata is nested too deeply for a W12 table") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise W12FormatError(f"{source}: unknown W12 schema {doc.get('schema') if isinstance(doc, dict) else doc!r}; "
                             f"this SpecPilot reads {SCHEMA}")
    version = doc.get("version")
    if isinstance(version, bool) or version not in (1, FORMAT_VERSION) or doc.get("tile") != [TILE_N, TILE_K]:
        raise W12FormatError(f"{source}: W12 version {doc.get('version')!r} tile {doc.get('tile')!r} is not supported "
                             f"(this SpecPilot reads version 1 or {FORMAT_VERSION}, tile [{TILE_N}, {TILE_K}], "
                             "as JSON numbers)")
    tensors = doc.get("tensors", {})
    if not isinstance(tensors, dict):
        raise W12FormatError(f"{source}: the {META_KEY} metadata has no tensor table")
    for name, entry in tensors.items():
        if isinstance(entry, dict):
            if entry.get("dtype") != "bfloat16":   # the codec restores bf16 bit patterns, nothing else
                got = f"is {entry['dtype']!r}" if "dtype" in entry else "is missing"
                raise W12FormatError(f"{source}: {name}: W12 metadata field dtype {got}; "
                                     "W12 holds bfloat16 weights only")
            entry["_version"] = doc["version"]
    return tensors


def _check_entry(entry, name: str, source: str, check_crc: bool) -> None:
    """Every field the reader uses has the type and range ``pack`` writes (W12TableError)."""
    def bad(field: str, want: str):
        raise W12TableError(f"{source}: {name}: W12 metadata field {field} must be {want}, got "
                            f"{json.dumps(entry.get(field))[:40]}")

    def whole(x, lo: int = 0) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= lo

    if not isinstance(entry, dict):
        raise W12TableError(f"{source}: {name}: its W12 metadata entry is not an object")
    if check_crc:
        crc = entry.get("crc32")
        if not isinstance(crc, dict) or not all(whole(crc.get(p)) for p in PARTS):
            bad("crc32", f"a CRC-32 per part ({', '.join(PARTS)})")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(whole(x, 1) for x in shape)):
        bad("shape", "[rows, columns] of positive whole numbers")
    if not whole(entry.get("rows_stored"), 1):
        bad("rows_stored", "a positive whole number")
    if "k_pad" in entry and entry["k_pad"] != -(-shape[1] // TILE_K) * TILE_K:
        bad("k_pad", f"the columns rounded up to {TILE_K} ({-(-shape[1] // TILE_K) * TILE_K})")
    if entry.get("_version", FORMAT_VERSION) != 1:
        base = entry.get("low_base")
        if base is not None and not whole(base, 1):
            bad("low_base", "a positive whole number or null")
        if not whole(entry.get("escapes")):
            bad("escapes", "a whole number")
    digest = entry.get("sha256")
    # format 1 recorded no digest of the original; format 2 always does
    needed = entry.get("_version", FORMAT_VERSION) != 1
    if (digest is not None or needed) and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        bad("sha256", "64 lowercase hex digits")


# the dtype each stored part has (format 1 stored the positions as int32 or int64)
_PART_DTYPES = {"records": (torch.uint8,), "low_exp": (torch.uint8,), "esc_bits": (torch.int16,)}
_POS_DTYPES = {1: (torch.int32, torch.int64), FORMAT_VERSION: (torch.int16,)}


def load_w12(tensors: dict[str, torch.Tensor], name: str, entry: dict, source: str,
             check_crc: bool = True) -> W12Tensor:
    _check_entry(entry, name, source, check_crc)
    if name in tensors:   # pack never writes both: which one a reader should take is not for it to guess
        raise W12TableError(f"{source}: {name} is stored twice, as a plain tensor and as W12 parts")
    parts = {}
    for p in PARTS:
        key = f"{name}.w12.{p}"
        if key not in tensors:
            raise W12TableError(f"{source}: {name}: part {key} is missing")
        parts[p] = tensors[key]
        dtypes = _PART_DTYPES.get(p) or _POS_DTYPES[1 if entry.get("_version", FORMAT_VERSION) == 1 else FORMAT_VERSION]
        if parts[p].dtype not in dtypes:
            raise W12TableError(f"{source}: {name}: part {key} is {str(parts[p].dtype).removeprefix('torch.')}, "
                                f"W12 stores it as {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")
        want = entry["crc32"].get(p) if check_crc else None
        if check_crc and (not isinstance(want, int) or _crc(parts[p]) != want):
            raise W12FormatError(f"{source}: {name}: {p} is corrupted (CRC-32 mismatch)")
    try:
        shape = tuple(int(x) for x in entry["shape"])
        if entry.get("_version", FORMAT_VERSION) == 1:
            low, pos = parts["low_exp"].to(torch.uint8), parts["esc_pos"].to(torch.int64)
        else:
            base = entry["low_base"]
            low = unpack_windows(parts["low_exp"], shape[0], None if base is None else int(base))
            pos = unpack_positions(parts["esc_pos"])
            if pos.numel() != int(entry["escapes"]):
                raise ValueError(f"{pos.numel()} escape positions, the metadata says {entry['escapes']}")
        t = W12Tensor(shape, int(entry["rows_stored"]), parts["records"].to(torch.uint8), low, pos,
                      parts["esc_bits"].to(torch.int16))
        check(t)
    except (KeyError, ValueError, TypeError) as e:   # parts intact (CRC), so the table does not describe them
        raise W12TableError(f"{source}: {name}: its W12 metadata does not describe its stored parts ({e})") from None
    if t.records.numel() != expected_record_bytes(t.shape, t.rows_stored):
        raise W12TableError(f"{source}: {name}: its W12 metadata does not describe its stored parts (record size)")
    return t


@dataclass
class VerifyResult:
    """Counts in ``pack``'s terms: ``converted`` W12 tensors and ``kept`` tensors stored as they were."""
    checked: list[str] = field(default_factory=list)   # converted tensors restored (and identical to the reference)
    mismatched: list[tuple[str, str]] = field(default_factory=list)   # (tensor, what)
    kept_checked: int = 0                              # kept tensors identical to the reference
    digests: int = 0                                   # converted tensors checked against pack's sha256
    converted: int = 0
    kept: int = 0
    missing: list[str] = field(default_factory=list)   # tensors of the reference the packed checkpoint lacks

    @property
    def ok(self) -> bool:
        return not self.mismatched


def verify(packed: str, against: str | None = None, progress: Callable | None = None,
           device: str = "cpu") -> VerifyResult:
    """Restore every W12 tensor and compare bit for bit with ``against``; CRC, structure and the
    restored bytes against the sha256 ``pack`` recorded of the original always."""
    ck = find_checkpoint(packed)
    ref_files: dict[str, Path] = {}
    if against is not None:
        ref = find_checkpoint(against)
        from safetensors import safe_open

        for f in ref.files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        ref_files[k] = f
            except Exception as e:
                raise unreadable(f, e) from None
    res = VerifyResult()
    cache: dict[Path, dict] = {}

    def ref_tensor(name):
        f = ref_files.get(name)
        if f is None:
            return None
        if f not in cache:
            cache.clear()
            cache[f] = read_file(f)[0]
        return cache[f][name]

    any_w12 = tables = False
    present: set[str] = set()
    for f in ck.files:
        tensors, meta = read_file(f)
        info = w12_info(meta, str(f), tensors)
        any_w12 = any_w12 or bool(info)
        tables = tables or META_KEY in (meta or {})
        w12_names = {f"{n}.w12.{p}" for n in info for p in PARTS}
        present.update(info)
        present.update(k for k in tensors if k not in w12_names)
        res.converted += len(info)
        res.kept += sum(k not in w12_names for k in tensors)
        items = list(info.items())
        bar = progress(total=len(items), desc=f"verify {f.name}") if progress else None
        for name, entry in items:
            if bar:
                bar.update(1)
            try:
                restored = restored_weight(tensors, name, entry, str(f), device)
            except W12TableError:         # a malformed table is bad input, not a failed restore
                raise
            except W12FormatError as e:   # "FILE: NAME: what" -> (NAME, what)
                res.mismatched.append((name, str(e).removeprefix(f"{f}: ").removeprefix(f"{name}: ")))
                continue
            if entry.get("sha256"):
                res.digests += 1
            if against is not None:
                r = ref_tensor(name)
                if r is None:
                    res.mismatched.append((name, "not in the reference checkpoint"))
                    continue
                if r.dtype != torch.bfloat16 or r.shape != restored.shape:
                    res.mismatched.append((name, f"reference is {r.dtype} {tuple(r.shape)}"))
                    continue
                diff = restored.view(torch.int16) != r.to(restored.device).view(torch.int16)
                if bool(diff.any()):
                    n = int(diff.sum())
                    first = diff.flatten().nonzero()[0].item()
                    res.mismatched.append((name, f"{n} weights differ (first at flat index {first})"))
                    continue
            res.checked.append(name)
        if bar:
            bar.close()
        if against is not None:   # tensors kept as they were must be identical too
            for k, v in tensors.items():
                if k in w12_names:
                    continue
                r = ref_tensor(k)
                if r is None:
                    res.mismatched.append((k, "kept tensor not in the reference checkpoint"))
                elif r.dtype != v.dtype or r.shape != v.shape or not torch.equal(   # bytes: a 0-D tensor flattened
                        r.reshape(-1).contiguous().view(torch.uint8), v.reshape(-1).contiguous().view(torch.uint8)):
                    res.mismatched.append((k, "kept tensor differs from the reference"))
                else:
                    res.kept_checked += 1
    if not any_w12:
        raise no_w12(packed, metadata=tables)
    res.missing = sorted(set(ref_files) - present)
    res.mismatched.extend((k, "missing from the packed checkpoint") for k in res.missing)
    return res


@dataclass
class StatsResult(_Totals):
    tensors: list[TensorStat]
    other_bytes: int

    def _stats(self) -> list[TensorStat]:
        return self.tensors


def stats(path: str) -> StatsResult:
    ck = find_checkpoint(path)
    out: list[TensorStat] = []
    other, tables = 0, False
    for f in ck.files:
        tensors, meta = read_file(f)
        tables = tables or META_KEY in (meta or {})
        info = w12_info(meta, str(f), tensors)
        names = set()
        for name, entry in info.items():
            t = load_w12(tensors, name, entry, str(f))
            keys = [f"{name}.w12.{p}" for p in PARTS]
            names.update(keys)
            # the parts as the file stores them (a format-1 file's are larger than format 2's)
            stored = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
            out.append(TensorStat(name, t.shape, 8.0 * stored / max(1, t.numel), t.num_escapes, t.escape_rate(),
                                  stored))
        other += sum(v.numel() * v.element_size() for k, v in tensors.items() if k not in names)
    if not out:
        raise no_w12(path, metadata=tables)
    return StatsResult(out, other)


# ----------------------------------------------------------------------------------------------
# load a packed checkpoint into a model
# ----------------------------------------------------------------------------------------------

def restored_weight(tensors: dict[str, torch.Tensor], name: str, entry: dict, source: str, device=None) -> torch.Tensor:
    """W12 weight ``name`` of a packed file's ``tensors`` decoded to its bf16 original (on ``device``,
    default where its parts are), checked against the sha256 ``pack`` recorded where it recorded one
    (W12FormatError where it differs, or where the parts are malformed)."""
    t = load_w12(tensors, name, entry, source)
    restored = decode(t if device is None else t.to(device))
    if entry.get("sha256") and bf16_sha256(restored) != entry["sha256"]:
        raise W12FormatError(f"{source}: {name}: restored weights differ from the original's sha256 that pack "
                             "recorded")
    return restored


def restore_bf16(tensors: dict[str, torch.Tensor], meta: dict[str, str], source: str) -> dict[str, torch.Tensor]:
    """A packed file's tensors with every W12 weight restored to its bf16 original (its parts
    dropped), each checked against the sha256 ``pack`` recorded (W12FormatError where it differs);
    a file without W12 weights comes back as it is."""
    info = w12_info(meta, source, tensors)
    if not info:
        return tensors
    parts = {f"{n}.w12.{p}" for n in info for p in PARTS}
    out = {k: v for k, v in tensors.items() if k not in parts}
    for name, entry in info.items():
        out[name] = restored_weight(tensors, name, entry, source)
    return out


@dataclass
class LoadResult:
    w12_modules: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def load_into(model: torch.nn.Module, path: str, qpass: bool = False, strict: bool = True) -> LoadResult:
    """Load a packed checkpoint into ``model`` (built from the same config): every W12 weight's
    ``nn.Linear`` becomes a ``W12Linear`` (CRC and structure checked), other tensors are copied."""
    from .module import W12Linear

    ck = find_checkpoint(path)
    res = LoadResult()
    plain: dict[str, torch.Tensor] = {}
    packed: dict[str, W12Tensor] = {}
    for f in ck.files:
        tensors, meta = read_file(f)
        info = w12_info(meta, str(f), tensors)
        parts = {f"{n}.w12.{p}" for n in info for p in PARTS}
        for name, entry in info.items():
            packed[name] = load_w12(tensors, name, entry, str(f))
        plain.update({k: v for k, v in tensors.items() if k not in parts})
    modules = dict(model.named_modules())
    for name, t in packed.items():
        mod_name = name[:-len(".weight")] if name.endswith(".weight") else None
        lin = modules.get(mod_name) if mod_name is not None else None
        if not isinstance(lin, torch.nn.Linear) or tuple(lin.weight.shape) != t.shape:
            raise W12FormatError(f"{path}: {name} does not match an nn.Linear of shape {t.shape} in the model")
        bias_key = f"{mod_name}.bias"
        bias = plain.pop(bias_key, None) if lin.bias is not None else None
        new = W12Linear(t, bias if bias is not None else (lin.bias.detach() if lin.bias is not None else None),
                        qpass=qpass).to(lin.weight.device)
        parent_name, _, child = mod_name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
        res.w12_modules.append(mod_name)
    state_keys = set(model.state_dict().keys())
    loadable = {k: v for k, v in plain.items() if k in state_keys}
    res.unexpected = sorted(k for k in plain if k not in state_keys)
    incompatible = model.load_state_dict(loadable, strict=False)
    tied = {k for k in incompatible.missing_keys if k.endswith("lm_head.weight")}   # tied embeddings
    res.missing = sorted(k for k in incompatible.missing_keys if k not in tied)
    if strict and (res.missing or res.unexpected):
        raise W12FormatError(f"{path}: tensors do not match the model: missing {res.missing[:3]}, "
                             f"unexpected {res.unexpected[:3]}")
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()
    return res
