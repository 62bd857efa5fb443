"""Where a checkpoint's safetensors files are, and what their headers say: no torch, so a command
refuses a missing, malformed or unpacked input at once, before its heavy imports."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

META_KEY = "specpilot.w12"
SCHEMA = "specpilot.w12/1"


class W12FormatError(ValueError):
    """The file is not a valid W12 checkpoint (or a part of it is corrupted)."""


@dataclass
class Checkpoint:
    root: Path                  # the file, or the folder
    files: list[Path]           # safetensors files
    index: Path | None = None   # model.safetensors.index.json, if sharded
    is_folder: bool = False
    unindexed: list[Path] = field(default_factory=list)   # safetensors files beside an index that it does not name
    weight_map: dict[str, str] = field(default_factory=dict)   # the index's tensor -> shard file name


def find_checkpoint(path: str | os.PathLike) -> Checkpoint:
    p = Path(path)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _from_index(p)
        if p.suffix != ".safetensors":
            raise FileNotFoundError(f"{p}: expected a .safetensors file, an index .json or a model folder")
        return Checkpoint(p, [p])
    if p.is_dir():
        idx = sorted(p.glob("*.safetensors.index.json"))
        if idx:
            return _from_index(idx[0])
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p}: no *.safetensors files in this folder")
        return Checkpoint(p, files, None, True)
    if p.exists():   # a device, a pipe: it exists, but holds no checkpoint
        raise FileNotFoundError(f"{p}: not a regular file or folder")
    raise FileNotFoundError(f"{p}: no such file or folder")


def _from_index(index: Path) -> Checkpoint:
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise FileNotFoundError(f"{index}: not a safetensors index ({type(e).__name__})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise FileNotFoundError(f"{index}: not a safetensors index (weight_map is not an object of "
                                "tensor name -> shard file name)")
    if not isinstance(doc.get("metadata", {}), (dict, type(None))):
        raise FileNotFoundError(f"{index}: not a safetensors index (metadata is not an object)")
    shards = sorted(set(weight_map.values()))
    # a shard elsewhere (a subfolder, ../) is no part of this folder's checkpoint, and two of them
    # with one file name would be written over each other in a packed copy
    outside = next((s for s in shards if s != Path(s).name or s == ".."), None)
    if outside is not None:
        raise FileNotFoundError(f"{index}: names shard {outside}, which is not a file name in the index's folder "
                                "(a checkpoint's shards sit beside its index)")
    files = [index.parent / s for s in shards]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index}: shard {missing[0]} is missing")
    named = {f.name for f in files}
    unindexed = [f for f in sorted(index.parent.glob("*.safetensors")) if f.name not in named]
    return Checkpoint(index.parent, files, index, True, unindexed, weight_map)


def unreadable(path: Path, e: Exception) -> W12FormatError:
    return W12FormatError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:160]})")


def header(path: Path) -> tuple[dict[str, str], list[str]]:
    """The metadata and tensor names of one safetensors file, its header checked by safetensors
    (numpy framework: no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {}), list(f.keys())
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise unreadable(path, e) from None


def check_checkpoint(path: str, packed: bool = False, original: str | None = None) -> Checkpoint:
    """The checkpoint at ``path`` with every file's header readable and no tensor name in two of its
    files (which one a reader takes would be chance); ``packed``: at least one file carries W12
    metadata; ``original`` (the option that names it): none does. What the readers would refuse
    after loading torch, refused first."""
    ck = find_checkpoint(path)
    metas, owner = [], {}
    for f in ck.files:
        meta, names = header(f)
        metas.append(meta)
        for n in names:
            if n in owner:
                raise W12FormatError(f"{path}: tensor {n} is in both {owner[n].name} and {f.name}; a checkpoint "
                                     "names each tensor once")
            owner[n] = f
    if packed and not any(META_KEY in m for m in metas):
        raise no_w12(path)
    if original and any(META_KEY in m for m in metas):
        raise W12FormatError(f"{original} {path}: a W12 checkpoint; give the original (unpacked) checkpoint its "
                             "tensors are compared with")
    # tensors the index puts in a shard that lacks them
    wrong = {n: s for n, s in ck.weight_map.items() if owner.get(n) is None or owner[n].name != s}
    for n, s in wrong.items():   # ... held by another of its shards
        if n in owner and owner[n] not in ck.unindexed:
            raise W12FormatError(f"{ck.index}: names {s} for {n}, which {owner[n].name} holds; fix the index")
    if ck.unindexed:   # ... held by a file the index does not name
        for f in ck.unindexed:
            stray = [n for n in header(f)[1] if n in wrong]
            if stray:
                raise W12FormatError(f"{ck.index}: names {wrong[stray[0]]} for {stray[0]}, which {f.name} holds and "
                                     f"the index does not name; fix the index (or move {f.name} out of the folder)")
    return ck


def no_w12(path: str, metadata: bool = False) -> W12FormatError:
    """No W12 tensor in ``path``: no metadata at all (a plain checkpoint), or ``metadata`` whose
    tensor tables are empty (a damaged or hand-made file)."""
    if metadata:
        return W12FormatError(f"{path}: no W12 tensors found ({META_KEY} metadata with an empty tensor table); "
                              "pack the original checkpoint again")
    return W12FormatError(f"{path}: no W12 tensors found (no {META_KEY} metadata); pack it first")
