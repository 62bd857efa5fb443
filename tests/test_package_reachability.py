"""The installed package holds what runs: every module of ``specpilot`` is reachable by imports
(function-level ones included) from what users run - the ``specpilot`` command and its verbs, and
the SGLang plugin with the bundle modules its memory entries name - not only from tests,
benchmarks or ``lab/``. Plain references (``naive.py``, the torch reference a fast kernel is tested
against) are the one exception the layout asks for."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"specpilot": "specpilot_cli", "specpilot.probes": "probes", "specpilot.kernels": "kernels",
         "specpilot.auditors": "auditors", "specpilot.reports": "reports", "specpilot.engine": "engine",
         "specpilot.bundles": "bundles"}


def _modules() -> dict[str, Path]:
    mods = {}
    for name, folder in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([name, *parts])] = path
    return mods


def _imports(mod: str, path: Path, mods: dict) -> set[str]:
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                first = ".".join(base) + (f".{node.module}" if node.module else "")
            else:
                first = node.module or ""
            names.add(first)
            names.update(f"{first}.{a.name}" for a in node.names)
    return {m for n in names for m in _known_prefixes(n, mods)}


def _known_prefixes(name: str, mods: dict) -> set[str]:
    """The longest module ``name`` names, and the packages above it (their ``__init__`` runs)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return {".".join(parts[:j]) for j in range(1, i + 1) if ".".join(parts[:j]) in mods}
    return set()


def _named_in_memory_entries(mods: dict) -> set[str]:
    """Bundle modules the plugin loads by name (memory entries and the bundle contract)."""
    text = "".join(p.read_text() for p in (REPO / "bundles").rglob("*.yaml"))
    text += (REPO / "bundles" / "contract.py").read_text()
    found = set(re.findall(r"specpilot\.[A-Za-z0-9_.]+", text))
    found |= {f"specpilot.bundles.{m}" for m in re.findall(r"\b([a-z0-9_]+):[a-z_]+\b", text)}
    return {m for n in found for m in _known_prefixes(n, mods)}


def test_every_package_module_is_reachable_from_the_command_or_the_plugin():
    mods = _modules()
    start = [m for m in mods if m.startswith("specpilot.commands.")]
    start += ["specpilot.cli", "specpilot.__main__", "specpilot.bundles.plugin"]
    start += sorted(_named_in_memory_entries(mods))
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(_imports(m, mods[m], mods) - seen)
    unreached = sorted(m for m in set(mods) - seen if not m.endswith(".naive"))
    assert not unreached, f"package modules only tests, benchmarks or lab/ reach: {unreached}"
