"""Helpers of the fuzz suite: seeded mutations of an input file, and the CLI contract.

The contract every run of the real ``specpilot`` command keeps, whatever the input: an exit
code in {0, 1, 2, 3} (never 4, never killed), no traceback, at most one ``specpilot: error:``
line on stderr (exactly one for 2 and 3, and it names the file at fault), the inputs unchanged,
and no debris (no ``.part`` file or folder, no file the command was not asked to write).
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KINDS = ("truncated", "bitflip", "binary", "huge", "empty", "retyped")
HUGE = ("1" + "0" * 30, "1e999", "-1e999", "NaN", "Infinity", "18446744073709551617", "-9" * 25)
OTHER_VALUES = (None, True, 0, -1, 10**30, 1e308, -1e-308, "", "x", [], {}, [[]], {"a": 1}, [None], "1,2")


def mutate(data: bytes, kind: str, rng: random.Random) -> bytes:
    """One variant of ``data``: truncated, a few bits flipped, random binary, a number made huge, empty."""
    if kind == "empty":
        return b""
    if kind == "binary":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096)))
    if kind == "truncated":
        return data[:rng.randint(1, max(1, len(data) - 1))]
    if kind == "bitflip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == "retyped":
        return retyped(data, rng)
    if kind == "huge":
        numbers = [m for m in re.finditer(rb"(?<![A-Za-z_])-?\d+(\.\d+)?", data)]
        if not numbers:
            return data + b"\n" + rng.choice(HUGE).encode()
        out = data
        for m in sorted(rng.sample(numbers, min(len(numbers), rng.randint(1, 3))), key=lambda m: -m.start()):
            out = out[:m.start()] + rng.choice(HUGE).encode() + out[m.end():]
        return out
    raise ValueError(kind)


def retyped(data: bytes, rng: random.Random) -> bytes:
    """A JSON, JSONL or YAML document with one to three values replaced by values of other types
    (or their keys dropped); other files get bits flipped."""
    import json

    import yaml

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return mutate(data, "bitflip", rng)
    try:
        docs, form = [json.loads(text)], "json"
    except ValueError:
        try:
            docs, form = [json.loads(line) for line in text.splitlines() if line.strip()], "jsonl"
        except ValueError:
            try:
                docs, form = [yaml.safe_load(text)], "yaml"
            except yaml.YAMLError:
                return mutate(data, "bitflip", rng)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(docs)) if docs else 0
        if docs:
            docs[i] = _retype_one(docs[i], rng)
    if form == "json":
        return json.dumps(docs[0]).encode()
    if form == "jsonl":
        return "".join(json.dumps(d) + "\n" for d in docs).encode()
    return yaml.safe_dump(docs[0], sort_keys=False).encode()


def _retype_one(doc, rng: random.Random):
    """``doc`` with one node (picked uniformly among all) replaced or, in a mapping, dropped."""
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [k])
        elif isinstance(node, list):
            for j, v in enumerate(node):
                walk(v, path + [j])

    walk(doc, [])
    path = rng.choice(paths)
    value = copy.deepcopy(rng.choice(OTHER_VALUES))
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def debris(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.endswith(".part")]


@dataclass
class Case:
    """One command run on one variant of one input file (``{in}`` in ``args`` is its path)."""

    name: str
    args: list[str]
    folder: Path
    target: str           # the mutated file, relative to folder
    outputs: tuple = ()   # files the command may write, relative to folder
    kind: str = ""
    names_file: bool = True  # exit 2/3 must name the target in the error line


def specpilot_cmd() -> list[str]:
    return [sys.executable, "-m", "specpilot"]


def prepare(seed_folder: Path, work: Path, target: str, kind: str, seed: int) -> Path:
    """A copy of ``seed_folder`` under ``work`` with ``target`` mutated."""
    folder = work / f"{Path(target).name}-{kind}-{seed}"
    shutil.copytree(seed_folder, folder)
    p = folder / target
    p.write_bytes(mutate(p.read_bytes(), kind, random.Random(f"{target}/{kind}/{seed}")))
    return folder


def run_case(case: Case, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    before = digest(case.folder)
    args = [a.replace("{in}", case.target) for a in case.args]
    run_env = dict(os.environ, **(env or {}))
    run_env.pop("SPECPILOT_DEBUG", None)
    proc = subprocess.run(specpilot_cmd() + args, cwd=case.folder, capture_output=True, text=True, timeout=timeout,
                          env=run_env)
    check_contract(case, proc, before)
    return proc


def check_contract(case: Case, proc: subprocess.CompletedProcess, before: dict[str, str]) -> None:
    where = f"{case.name} [{case.kind}] specpilot {' '.join(case.args)}\nexit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert proc.returncode in (0, 1, 2, 3), where
    assert "Traceback" not in proc.stderr, where
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("specpilot: error:")]
    assert len(errors) <= 1, where
    if proc.returncode in (2, 3):
        assert len(errors) == 1, where
        if case.names_file:
            assert Path(case.target).name in errors[0], where
    after = digest(case.folder)
    for name, h in before.items():
        assert after.get(name) == h, f"input {name} changed or vanished\n{where}"
    new = set(after) - set(before) - set(case.outputs)
    assert not new, f"unexpected files {sorted(new)}\n{where}"
    assert not debris(case.folder), f"debris {debris(case.folder)}\n{where}"
