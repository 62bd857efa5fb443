"""Static inspection of an installed SGLang: do the hook targets exist with the signatures the
bundles rely on? Reads the installed source files with ``ast``; imports nothing from SGLang (so it
needs neither torch nor a GPU, and works on an environment SpecPilot does not run in).
"""

from __future__ import annotations

import ast
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .memory import Hook, Symbol

# Parsed files by (path, content hash), across checks in one process: a round applies bundles
# for each SGLang candidate, and parsing the target files is most of a check's time. Nothing
# here changes a tree.
_PARSED: OrderedDict[tuple[str, bytes], ast.Module] = OrderedDict()
_PARSED_MAX = 64


class Unparsable(Exception):
    """A target file that cannot be read as Python source; the message says why."""


@dataclass
class TargetCheck:
    target: str
    kind: str              # hook type, or "symbol"
    ok: bool
    found: str | None      # what was found: "function", "method", "class", "name"
    signature: str | None  # the installed signature, rendered
    expected: str | None
    file: str | None
    file_sha256: str | None
    problem: str | None = None


def render_params(params) -> str:
    return "(" + ", ".join(params) + ")"


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, bool]]:
    """[(token, has_default)]: names, '/' after positional-only, '*' before keyword-only,
    '*args' and '**kwargs' spelled as such."""
    a = fn.args
    out: list[tuple[str, bool]] = []
    positional = list(a.posonlyargs) + list(a.args)
    defaults_from = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        out.append((arg.arg, i >= defaults_from))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            out.append(("/", True))
    if a.vararg is not None:
        out.append(("*" + a.vararg.arg, True))
    elif a.kwonlyargs:
        out.append(("*", True))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, default is not None))
    if a.kwarg is not None:
        out.append(("**" + a.kwarg.arg, True))
    return out


def params_compatible(actual: list[tuple[str, bool]], expected: tuple[str, ...], match: str) -> bool:
    names = [n for n, _ in actual]
    if match == "exact":
        return names == list(expected)
    if names[: len(expected)] != list(expected):
        return False
    return all(has_default for _, has_default in actual[len(expected):])


class SGLangSource:
    """The installed ``sglang`` package under ``root`` (the folder holding ``sglang/``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._trees: dict[Path, ast.Module] = {}
        self._digests: dict[Path, bytes] = {}   # SHA-256 of each file's bytes as read here

    def module_path(self, dotted: str) -> Path | None:
        rel = Path(*dotted.split("."))
        for cand in (self.root / rel.with_suffix(".py"), self.root / rel / "__init__.py"):
            if cand.is_file():
                return cand
        return None

    def tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise Unparsable(f"{path} cannot be read ({e.strerror or e})") from None
            self._digests[path] = hashlib.sha256(data).digest()
            key = (str(path), self._digests[path])
            if key in _PARSED:
                _PARSED.move_to_end(key)
            else:
                try:
                    _PARSED[key] = ast.parse(data, filename=str(path))
                except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
                    where = f", line {e.lineno}" if isinstance(e, SyntaxError) and e.lineno else ""
                    msg = e.msg if isinstance(e, SyntaxError) else str(e) or type(e).__name__
                    raise Unparsable(f"{path} does not parse ({msg}{where})") from None
                if len(_PARSED) > _PARSED_MAX:
                    _PARSED.popitem(last=False)
            self._trees[path] = _PARSED[key]
        return self._trees[path]

    def sha256(self, path: Path | None) -> str | None:
        """``sha256:<hex>`` of the file's bytes as this source read them; None without a file or
        where it cannot be read (:meth:`resolve` reports that)."""
        if path is None:
            return None
        if path not in self._digests:
            try:
                self._digests[path] = hashlib.sha256(path.read_bytes()).digest()
            except OSError:
                return None
        return "sha256:" + self._digests[path].hex()

    def split(self, target: str) -> tuple[str, Path, list[str]] | None:
        """Longest module prefix of ``target`` that is an installed file, and the attribute path."""
        parts = target.split(".")
        for i in range(len(parts), 0, -1):
            path = self.module_path(".".join(parts[:i]))
            if path is not None:
                return ".".join(parts[:i]), path, parts[i:]
        return None

    @staticmethod
    def _find_all(body, name) -> list:
        """Every binding of ``name`` in a body, in source order, looking into if/else and try
        branches (which one runs is decided at import time, so all must be acceptable)."""
        found = []
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found.append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found.append(node)
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                if any((al.asname or al.name.split(".")[0]) == name for al in node.names):
                    found.append(node)
            elif isinstance(node, ast.If):
                found += SGLangSource._find_all(node.body, name) + SGLangSource._find_all(node.orelse, name)
            elif isinstance(node, ast.Try):
                found += SGLangSource._find_all(node.body, name)
                for h in node.handlers:
                    found += SGLangSource._find_all(h.body, name)
                found += SGLangSource._find_all(node.orelse, name) + SGLangSource._find_all(node.finalbody, name)
        return found

    @staticmethod
    def _find(body, name):
        found = SGLangSource._find_all(body, name)
        return found[-1] if found else None

    def resolve(self, target: str):
        """(kind, node, file) for a dotted target, or (None, reason, file)."""
        split = self.split(target)
        if split is None:
            return None, "module not found", None
        _mod, path, attrs = split
        if not attrs:
            return "module", None, path
        node = None
        try:
            body = self.tree(path).body
        except Unparsable as e:
            return None, f"target {e}", path
        kind = None
        for depth, name in enumerate(attrs):
            node = self._find(body, name)
            if node is None and depth == 0 and path.name == "__init__.py":
                missing = self._missing_module(path.parent, _mod, attrs)
                if missing:
                    return None, missing, path
            if node is None:
                where = "module" if depth == 0 else f"class {attrs[depth - 1]}"
                where = f"module {_mod}" if depth == 0 else where
                return None, f"{name} not defined in {where} (no such name or submodule)", path
            if isinstance(node, ast.ClassDef):
                kind, body = "class", node.body
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "method" if depth > 0 else "function"
                if depth != len(attrs) - 1:
                    return None, f"{name} is a function, not a class", path
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                kind = "import"
                if depth != len(attrs) - 1:
                    return None, f"{name} is imported here; hook it where it is defined", path
            else:
                kind = "name"
                if depth != len(attrs) - 1:
                    return None, f"{name} is a value, not a class", path
        return kind, node, path

    def _missing_module(self, folder: Path, module: str, attrs: list[str]) -> str | None:
        """Where ``attrs`` walks down subfolders of the package ``module`` (in ``folder``; namespace
        packages, no ``__init__.py``) to a module file that is not there: which one."""
        i = 0
        while i < len(attrs) - 1 and (folder / attrs[i]).is_dir():
            folder, i = folder / attrs[i], i + 1
        if i == 0:
            return None
        gone = folder / f"{attrs[i]}.py"
        return f"module {'.'.join([module] + attrs[:i + 1])} not found (no file {gone.relative_to(self.root)})"

    def alternatives(self, target: str) -> list:
        """All function definitions bound to ``target``'s last name (see ``_find_all``)."""
        split = self.split(target)
        if split is None or not split[2]:
            return []
        _mod, path, attrs = split
        body = self.tree(path).body  # resolve() has parsed this file already
        for name in attrs[:-1]:
            node = self._find(body, name)
            if not isinstance(node, ast.ClassDef):
                return []
            body = node.body
        return [n for n in self._find_all(body, attrs[-1]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def check_hook(src: SGLangSource, hook: Hook) -> TargetCheck:
    kind, node, path = src.resolve(hook.target)
    expected = render_params(hook.params) if hook.params else None
    base = dict(target=hook.target, kind=hook.type, file=str(path) if path else None, file_sha256=src.sha256(path),
                expected=expected)
    if kind is None:
        return TargetCheck(ok=False, found=None, signature=None, problem=node, **base)
    if kind not in ("function", "method"):
        return TargetCheck(ok=False, found=kind, signature=None,
                           problem=f"is a {kind}; the hook wraps a function", **base)
    sig = _signature(node)
    rendered = render_params(n for n, _ in sig)
    problem = None
    if hook.params:
        for alt in src.alternatives(hook.target) or [node]:
            alt_sig = _signature(alt)
            if not params_compatible(alt_sig, hook.params, hook.match):
                alt_r = render_params(n for n, _ in alt_sig)
                problem = f"signature {alt_r} (line {alt.lineno}) is not compatible with {expected} ({hook.match})"
                break
    if problem is None and hook.returns:
        problem = _check_returns(node, hook.returns)
    return TargetCheck(ok=problem is None, found=kind, signature=rendered, problem=problem, **base)


def _returns(fn) -> list[ast.Return]:
    out, todo = [], list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # a nested function's returns are not this function's
        if isinstance(node, ast.Return):
            out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _check_returns(fn, names: tuple[str, ...]) -> str | None:
    rets = _returns(fn)
    if not rets:
        return f"returns nothing; the hook expects ({', '.join(names)})"
    for r in rets:
        got = [e.id if isinstance(e, ast.Name) else ast.unparse(e) for e in r.value.elts] \
            if isinstance(r.value, ast.Tuple) else [ast.unparse(r.value) if r.value is not None else "None"]
        if got != list(names):
            return f"line {r.lineno} returns ({', '.join(got)}); the hook expects ({', '.join(names)})"
    return None


def check_symbol(src: SGLangSource, sym: Symbol) -> TargetCheck:
    kind, node, path = src.resolve(sym.path)
    expected = render_params(sym.params) if sym.params else None
    base = dict(target=sym.path, kind="symbol", file=str(path) if path else None, file_sha256=src.sha256(path),
                expected=expected)
    if kind is None:
        return TargetCheck(ok=False, found=None, signature=None, problem=node, **base)
    want = {"name": ("name", "import", "class", "function"), "function": ("function",),
            "class": ("class",), "method": ("method",)}.get(sym.kind, (sym.kind,))
    if kind not in want:
        return TargetCheck(ok=False, found=kind, signature=None, problem=f"is a {kind}, expected a {sym.kind}", **base)
    if kind in ("function", "method"):
        sig = _signature(node)
        rendered = render_params(n for n, _ in sig)
        ok = not sym.params or params_compatible(sig, sym.params, sym.match)
        return TargetCheck(ok=ok, found=kind, signature=rendered,
                           problem=None if ok else f"signature {rendered} is not compatible with {expected}", **base)
    return TargetCheck(ok=True, found=kind, signature=None, **base)


def check_targets(root: str | Path, hooks, symbols=()) -> list[TargetCheck]:
    src = SGLangSource(root)
    hooked = {h.target for h in hooks}
    seen: set[str] = set()
    syms = []
    for s in symbols:  # a symbol already checked as a hook target, or listed twice, is checked once
        if s.path not in hooked and s.path not in seen:
            seen.add(s.path)
            syms.append(s)
    return [check_hook(src, h) for h in hooks] + [check_symbol(src, s) for s in syms]
