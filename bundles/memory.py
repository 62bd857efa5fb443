"""The memory of verified mechanisms (paper 3.5): one YAML entry per mechanism.

An entry holds its code delta relative to the entries it ``requires`` (modules it adds, SGLang hook
targets it patches, quantization methods it registers), a variant registry (tunables with ranges),
correctness contracts, evidence with the deployment and hardware it came from, limits and what is
``unverified``. It also records ``system``: the hook set and module fingerprints that applying it
with its requirements to stock produced when it was verified. An entry survives only while
applying it to stock with its requirements reproduces that recorded system exactly.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from specpilot.errors import InputError

from .contract import BATCH_SHAPES, DRAFTERS, ENTRY_SCHEMA, FACTORS, HOOK_TYPES, STATUSES, TARGET_KINDS, hook_key

MEMORY_DIR = Path(__file__).resolve().parent / "memory_entries"
_REQUIRED = ("id", "summary", "status", "requires", "sglang", "code", "variants", "contracts",
             "evidence", "limits", "unverified", "system")


@dataclass(frozen=True)
class Hook:
    """One SGLang hook: ``type`` on ``target`` (a dotted path) by ``handler`` ("module:attr").

    ``params`` is the parameter list the handler relies on; ``match`` says how the installed
    function must agree: ``exact`` (same names, order and kinds) or ``prefix`` (these first, any
    further parameters must have defaults).
    """

    target: str
    type: str
    handler: str
    params: tuple[str, ...] = ()
    match: str = "exact"
    returns: tuple[str, ...] = ()  # names every `return` must give, in order (AFTER hooks index results)

    def key(self) -> str:
        return hook_key(self.type, self.target, self.handler)


@dataclass(frozen=True)
class Symbol:
    """A module-level name or class method the bundle uses without hooking it (static check)."""

    path: str
    kind: str = "name"  # name | function | class | method
    params: tuple[str, ...] = ()
    match: str = "prefix"


@dataclass
class Variant:
    """A tunable of an entry. ``range`` bounds a number, or each item of a list variant;
    ``order: descending`` asks a list variant for its items largest first, each once."""

    name: str
    default: Any
    range: list | None = None
    choices: list | None = None
    doc: str = ""
    order: str | None = None
    drafters: tuple[str, ...] = ()   # the drafter families the setting acts on (empty: any)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not a valid setting of this variant (None when it is)."""
        if self.choices is not None:
            return None if value in self.choices else f"must be one of {self.choices}"
        if isinstance(self.default, str) and self.range is None:
            return None if isinstance(value, str) and value.strip() else "must not be empty"
        if isinstance(self.default, list):
            kinds = {type(x) for x in self.default}
            if not isinstance(value, list) or not value or any(type(x) not in kinds for x in value):
                return f"must be a non-empty list like {self.default}"
            items = value
        else:
            items = [value]
        if self.range is not None:
            lo, hi = self.range
            for x in items:
                if not isinstance(x, (int, float)) or isinstance(x, bool) or not lo <= x <= hi:
                    return f"must be a number in [{lo}, {hi}]" if items is not value else \
                        f"each item must be a number in [{lo}, {hi}]"
                if isinstance(self.default, int) and not isinstance(self.default, bool) and not isinstance(x, int):
                    return "must be an integer"
        if self.order == "descending" and any(a <= b for a, b in zip(items, items[1:])):
            return "must list its items largest first, each once"
        return None


@dataclass(frozen=True)
class Fits:
    """The deployments a mechanism applies to (``fits`` of an entry); an empty tuple means any.

    ``attacks`` is the cost-model factor it reduces (tree, kernel, outside; None for an
    observer), ``batch`` the serving shape it is for (single, batched, any) and ``changes_output``
    whether its outputs may differ from stock's (the 3% approval rule then applies)."""

    attacks: str | None = None
    drafters: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    batch: str = "any"
    changes_output: bool = False

    def drafter_text(self) -> str:
        return " or ".join(DRAFTERS[d] for d in self.drafters)

    def misfits(self, *, drafter: str | None = None, target: str | None = None, dtype: str | None = None,
                batch: int | None = None) -> list[str]:
        """Why a deployment with these facts (None: unknown, not checked) is outside the fit."""
        out = []
        if drafter is not None and self.drafters and drafter not in self.drafters:
            out.append(f"needs {self.drafter_text()}, the deployment has {DRAFTERS.get(drafter, drafter)}")
        if target is not None and self.targets and target not in self.targets:
            out.append(f"needs a {' or '.join(self.targets)} target, the deployment's is {target}")
        if dtype is not None and self.dtypes and dtype not in self.dtypes:
            out.append(f"needs {' or '.join(self.dtypes)} weights, the deployment's are {dtype}")
        if batch is not None:
            if self.batch == "single" and batch > 1:
                out.append(f"is for single-request serving, the deployment batches {batch} requests")
            elif self.batch == "batched" and batch <= 1:
                out.append("is for batched serving, the deployment serves one request at a time")
        return out


@dataclass(frozen=True)
class OffWith:
    """An entry whose mechanism stays off when ``bundle`` is applied with it on one of ``drafters``
    (empty: any drafter); ``why`` says so in apply's warning."""

    bundle: str
    drafters: tuple[str, ...] = ()
    why: str = ""


@dataclass
class Entry:
    id: str
    summary: str
    status: str
    requires: list[str]
    sglang_checked: list[str]
    modules: list[str]
    uses: list[str]
    hooks: list[Hook]
    symbols: list[Symbol]
    quantization: list[str]
    setup: str | None
    launch: dict
    variants: list[Variant]
    contracts: list[str]
    evidence: list[dict]
    limits: list[str]
    unverified: list[str]
    system: dict
    path: Path
    raw: dict = field(repr=False, default_factory=dict)
    fits: Fits = field(default_factory=Fits)
    off_with: list[OffWith] = field(default_factory=list)
    # ``module:function`` of one of its own modules: (settings, drafter) -> why they cannot run together
    settings_check: str | None = None


@dataclass
class SystemState:
    """The system produced by applying entries to stock: hooks, modules and their fingerprints."""

    entries: list[str]
    hooks: list[str]
    fingerprints: dict[str, str]
    quantization: list[str]

    def as_record(self) -> dict:
        return {"hooks": list(self.hooks), "fingerprints": dict(self.fingerprints)}


@dataclass
class VerifyRow:
    id: str
    closure: list[str]
    hooks: int
    ok: bool
    problems: list[str]


# ---------------------------------------------------------------------------------------- loading

def _as_list(value, what: str, source: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InputError(f"{source}: '{what}' must be a list")
    return value


def _names(value, what: str, source: str) -> list[str]:
    """A list of names (module paths, entry ids, versions): strings, or numbers written bare."""
    items = _as_list(value, what, source)
    if not all(isinstance(x, str) or (isinstance(x, (int, float)) and not isinstance(x, bool)) for x in items):
        raise InputError(f"{source}: '{what}' must be a list of names")
    return [str(x) for x in items]


def _texts(value, what: str, source: str) -> list[str]:
    """A list of text items (contracts, limits, unverified)."""
    items = _as_list(value, what, source)
    if not all(isinstance(x, str) for x in items):
        raise InputError(f"{source}: '{what}' must be a list of text items")
    return [x.strip() for x in items]


def _str_tuple(value, what: str, source: str, allowed) -> tuple[str, ...]:
    items = tuple(str(x) for x in _as_list(value, what, source))
    bad = [x for x in items if x not in allowed]
    if bad:
        raise InputError(f"{source}: {what} {bad[0]!r} is not one of {', '.join(allowed)}")
    return items


def parse_fits(raw: Any, source: str) -> Fits:
    if raw is None:
        return Fits()
    if not isinstance(raw, dict):
        raise InputError(f"{source}: 'fits' must be a mapping")
    attacks = raw.get("attacks")
    if attacks is not None and attacks not in FACTORS:
        raise InputError(f"{source}: fits.attacks must be one of {', '.join(FACTORS)} or null")
    batch = raw.get("batch", "any")
    if batch not in BATCH_SHAPES:
        raise InputError(f"{source}: fits.batch must be one of {', '.join(BATCH_SHAPES)}")
    changes = raw.get("changes_output", False)
    if not isinstance(changes, bool):   # bool("false") is True: text would read as yes
        raise InputError(f"{source}: fits.changes_output must be true or false, not {changes!r}")
    return Fits(attacks=attacks, drafters=_str_tuple(raw.get("drafters"), "fits.drafters", source, tuple(DRAFTERS)),
                targets=_str_tuple(raw.get("targets"), "fits.targets", source, TARGET_KINDS),
                dtypes=tuple(str(x) for x in _as_list(raw.get("dtypes"), "fits.dtypes", source)),
                batch=batch, changes_output=changes)


def parse_variant(name: Any, v: Any, source: str) -> Variant:
    """One entry of ``variants``; its default must be a valid setting of it."""
    if not isinstance(v, dict) or "default" not in v:
        raise InputError(f"{source}: variant {name!r} needs a default")
    rng, choices, order = v.get("range"), v.get("choices"), v.get("order")
    if rng is not None and not (isinstance(rng, list) and len(rng) == 2
                                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in rng)
                                and rng[0] <= rng[1]):
        raise InputError(f"{source}: variant {name!r}: range must be [low, high] numbers with low <= high, not {rng!r}")
    if choices is not None and not (isinstance(choices, list) and choices):
        raise InputError(f"{source}: variant {name!r}: choices must be a non-empty list")
    if order not in (None, "descending"):
        raise InputError(f"{source}: variant {name!r}: order must be descending or absent, not {order!r}")
    var = Variant(name=str(name), default=v["default"], range=rng, choices=choices, doc=str(v.get("doc", "")),
                  order=order, drafters=_str_tuple(v.get("drafters"), f"variant {name!r}: drafters", source,
                                                   tuple(DRAFTERS)))
    if isinstance(var.default, list) and not var.default:
        raise InputError(f"{source}: variant {name!r}: default must not be an empty list")
    problem = var.problem(var.default)
    if problem:
        raise InputError(f"{source}: variant {name!r}: default {var.default!r} {problem}")
    return var


def parse_off_with(raw: Any, source: str) -> list[OffWith]:
    out = []
    for item in _as_list(raw, "off_with", source):
        if not (isinstance(item, dict) and isinstance(item.get("bundle"), str) and isinstance(item.get("why", ""), str)):
            raise InputError(f"{source}: each off_with item needs a bundle (an entry id) and a why (text)")
        out.append(OffWith(bundle=item["bundle"], why=str(item.get("why", "")).strip(),
                           drafters=_str_tuple(item.get("drafters"), "off_with.drafters", source, tuple(DRAFTERS))))
    return out


def parse_entry(raw: Any, source: str, path: Path | None = None) -> Entry:
    if not isinstance(raw, dict):
        raise InputError(f"{source}: a memory entry must be a YAML mapping")
    if raw.get("schema") != ENTRY_SCHEMA:
        raise InputError(f"{source}: unknown schema {raw.get('schema')!r}; expected {ENTRY_SCHEMA}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise InputError(f"{source}: missing field(s) {', '.join(missing)}")
    if not isinstance(raw["summary"], str):
        raise InputError(f"{source}: 'summary' must be text")
    if raw["status"] not in STATUSES:
        raise InputError(f"{source}: status must be one of {', '.join(STATUSES)}")
    code = raw["code"] or {}
    if not isinstance(code, dict):
        raise InputError(f"{source}: 'code' must be a mapping")
    hooks = []
    for h in _as_list(code.get("hooks"), "code.hooks", source):
        try:
            hook = Hook(target=h["target"], type=h["type"], handler=h["handler"],
                        params=tuple(h.get("params") or ()), match=h.get("match", "exact"),
                        returns=tuple(h.get("returns") or ()))
        except (KeyError, TypeError, AttributeError):
            raise InputError(f"{source}: each hook needs target, type and handler") from None
        if not all(isinstance(x, str) for x in (hook.target, hook.type, hook.handler, hook.match,
                                                *hook.params, *hook.returns)):
            raise InputError(f"{source}: a hook's target, type, handler, match, params and returns must be names")
        if hook.type not in HOOK_TYPES:
            raise InputError(f"{source}: hook type {hook.type!r} is not one of {', '.join(HOOK_TYPES)}")
        if hook.match not in ("exact", "prefix"):
            raise InputError(f"{source}: hook match must be exact or prefix")
        if ":" not in hook.handler:
            raise InputError(f"{source}: hook handler {hook.handler!r} must be 'module:attr'")
        hooks.append(hook)
    symbols = []
    for s in _as_list(code.get("symbols"), "code.symbols", source):
        if not isinstance(s, dict) or "path" not in s:
            raise InputError(f"{source}: each symbol needs a path")
        try:
            sym = Symbol(path=s["path"], kind=s.get("kind", "name"), params=tuple(s.get("params") or ()),
                         match=s.get("match", "prefix"))
        except TypeError:
            sym = None
        if sym is None or not all(isinstance(x, str) for x in (sym.path, sym.kind, sym.match, *sym.params)):
            raise InputError(f"{source}: a symbol's path, kind, match and params must be names")
        symbols.append(sym)
    variants = []
    raw_variants = raw.get("variants") or {}
    if not isinstance(raw_variants, dict):
        raise InputError(f"{source}: 'variants' must be a mapping of name to variant")
    for name, v in raw_variants.items():
        variants.append(parse_variant(name, v, source))
    sglang = raw["sglang"] or {}
    if not isinstance(sglang, dict):
        raise InputError(f"{source}: 'sglang' must be a mapping (checked: [versions])")
    system = raw["system"] or {}
    rec_hooks, rec_fp = (system.get("hooks") or [], system.get("fingerprints") or {}) if isinstance(system, dict) \
        else (None, None)
    if (not isinstance(rec_hooks, list) or not all(isinstance(h, str) for h in rec_hooks)
            or not isinstance(rec_fp, dict) or not all(isinstance(v, str) for v in rec_fp.values())):
        raise InputError(f"{source}: 'system' must be a mapping with hooks (a list of names) and fingerprints "
                         "(module: sha256)")
    launch = raw.get("launch") or {}
    if not isinstance(launch, dict):
        raise InputError(f"{source}: 'launch' must be a mapping")
    setup = code.get("setup")
    if setup is not None and not isinstance(setup, str):
        raise InputError(f"{source}: 'code.setup' must be a 'module:function' name")
    modules = _names(code.get("modules"), "code.modules", source)
    check = code.get("settings_check")
    if check is not None and (not isinstance(check, str) or check.partition(":")[0] not in modules
                              or not check.partition(":")[2]):
        raise InputError(f"{source}: 'code.settings_check' must be a 'module:function' of the entry's own modules")
    return Entry(
        id=str(raw["id"]), summary=raw["summary"].strip(), status=raw["status"],
        requires=_names(raw["requires"], "requires", source),
        sglang_checked=_names(sglang.get("checked"), "sglang.checked", source),
        modules=modules,
        uses=_names(code.get("uses"), "code.uses", source),
        hooks=hooks, symbols=symbols,
        quantization=_names(code.get("quantization"), "code.quantization", source),
        setup=setup, launch=dict(launch),
        variants=variants,
        contracts=_texts(raw["contracts"], "contracts", source),
        evidence=_as_list(raw["evidence"], "evidence", source),
        limits=_texts(raw["limits"], "limits", source),
        unverified=_texts(raw["unverified"], "unverified", source),
        system={"hooks": list(rec_hooks), "fingerprints": {str(k): v for k, v in rec_fp.items()}},
        path=path or Path(source), raw=raw, fits=parse_fits(raw.get("fits"), source),
        off_with=parse_off_with(raw.get("off_with"), source), settings_check=check,
    )


def load_memory(directory: str | Path | None = None) -> dict[str, Entry]:
    """All entries in ``directory`` (default: the packaged ``bundles/memory_entries``), keyed by id."""
    directory = Path(directory) if directory else MEMORY_DIR
    if not directory.is_dir():
        raise InputError(f"{directory}: no such memory folder")
    entries: dict[str, Entry] = {}
    for path in sorted(directory.glob("*.yaml")):
        entry = _entry_of_file(read_yaml(path, "memory entry"), path)
        if entry.id in entries:
            raise InputError(f"{path}: duplicate memory id {entry.id!r} (also in {entries[entry.id].path})")
        entries[entry.id] = entry
    check_relations(entries)
    return entries


def parse_entry_text(text: str, path: Path) -> Entry:
    """The entry file ``path`` would hold with ``text`` (``memory verify --record``'s new text),
    checked as :func:`load_memory` checks a file: YAML, fields, and its id against the file name.
    What it names of other entries is checked across all entries by :func:`check_relations`."""
    return _entry_of_file(yaml_text(text, path, "memory entry"), path)


def _entry_of_file(raw: Any, path: Path) -> Entry:
    entry = parse_entry(raw, str(path), path)
    if entry.id != path.stem:
        raise InputError(f"{path}: id {entry.id!r} does not match the file name (expected id: {path.stem})")
    return entry


def check_relations(entries: dict[str, Entry]) -> None:
    """Refuse entries that relate wrongly to each other, for every verb that reads the memory (as
    ``memory verify`` does): a requirement that names no entry or comes round in a cycle, and an
    ``off_with`` that names no entry (a misspelt id would never warn)."""
    closure(entries, sorted(entries))
    for entry in entries.values():
        unknown = [o.bundle for o in entry.off_with if o.bundle not in entries]
        if unknown:
            raise InputError(f"{entry.path}: off_with names {unknown[0]!r}, not a memory entry")


def read_yaml(path: Path, what: str):
    """One YAML document; a binary, oversized or malformed file is an InputError naming it."""
    from specpilot.limits import MAX_YAML_BYTES

    if not path.is_file():
        raise InputError(f"{path}: {what} is not a regular file")
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise InputError(f"{path}: {what} of {size} bytes is larger than the {MAX_YAML_BYTES} bytes allowed")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: {what} is not UTF-8 text (a binary file?)") from None
    return yaml_text(text, path, what)


def yaml_text(text: str, path: Path, what: str):
    """One YAML document's ``text`` (of ``path``); a malformed one is an InputError naming it.
    Parsed by libyaml where PyYAML has it (about ten times faster than the pure-Python parser on
    the memory entries, which ``apply`` and ``round`` read several times each)."""
    import yaml

    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        if "maximum nesting depth" in str(e):   # libyaml's own limit on nesting
            raise InputError(f"{path}: {what} is nested too deeply") from None
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise InputError(f"{where}: {what} is not valid YAML ({' '.join(str(e).split())[:160]})") from None
    except RecursionError:
        raise InputError(f"{path}: {what} is nested too deeply") from None


def get_entry(entries: dict[str, Entry], name: str) -> Entry:
    if name not in entries:
        raise InputError(f"unknown mechanism {name!r}; known: {', '.join(sorted(entries))}")
    return entries[name]


# ---------------------------------------------------------------------------------- composition

def closure(entries: dict[str, Entry], ids: Iterable[str]) -> list[str]:
    """The ids with all their requirements, requirements first; a cycle or a missing one is an error."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: list[str]):
        if name not in entries:
            via = f" (required by {chain[-1]} in {entries[chain[-1]].path})" if chain else ""
            raise InputError(f"unknown mechanism {name!r}{via}; known: {', '.join(sorted(entries))}")
        if state.get(name) == "done":
            return
        if state.get(name) == "active":
            cycle = " -> ".join(chain[chain.index(name):] + [name])
            raise InputError(f"{entries[name].path}: requirement cycle in memory: {cycle}")
        state[name] = "active"
        for req in entries[name].requires:
            visit(req, chain + [name])
        state[name] = "done"
        order.append(name)

    for name in ids:
        visit(name, [])
    return order


def composition_problems(entries: dict[str, Entry], ids: Iterable[str], drafter: str | None = None) -> list[str]:
    """Why the entries ``ids`` (a closure) cannot run together, or on ``drafter``: each needs a
    drafter family its ``fits`` names, and a single-request mechanism cannot share a server with
    a batched one. Empty when they compose."""
    ids = list(ids)
    problems: list[str] = []
    if drafter is not None and drafter not in DRAFTERS:
        raise InputError(f"--drafter {drafter}: choose one of {', '.join(DRAFTERS)}")
    picky = [i for i in ids if entries[i].fits.drafters]
    if drafter is not None:
        for i in picky:
            if drafter not in entries[i].fits.drafters:
                problems.append(f"{i} needs {entries[i].fits.drafter_text()}, not {DRAFTERS[drafter]}")
    else:
        for a_i, a in enumerate(picky):
            for b in picky[a_i + 1:]:
                if not set(entries[a].fits.drafters) & set(entries[b].fits.drafters):
                    problems.append(f"{a} needs {entries[a].fits.drafter_text()}, {b} needs "
                                    f"{entries[b].fits.drafter_text()}: no drafter serves both")
    single = [i for i in ids if entries[i].fits.batch == "single"]
    batched = [i for i in ids if entries[i].fits.batch == "batched"]
    for s in single:
        for b in batched:
            problems.append(f"{s} is for single-request serving, {b} for batched serving: they cannot share a server")
    return problems


def common_drafters(entries: dict[str, Entry], ids: Iterable[str]) -> tuple[str, ...]:
    """The drafter families every entry of ``ids`` accepts (all families when none is picky)."""
    out = set(DRAFTERS)
    for i in ids:
        if entries[i].fits.drafters:
            out &= set(entries[i].fits.drafters)
    return tuple(d for d in DRAFTERS if d in out)


def module_file(module: str) -> Path:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise InputError(f"module {module} not found")
    return Path(spec.origin)


def handler_problem(handler: str) -> str | None:
    """Why hook ``handler`` ("module:attr") would not resolve, read from the module's source
    without importing it (its imports may need SGLang); None when it is defined there."""
    import ast

    module, _, attr = handler.partition(":")
    try:
        tree = ast.parse(module_file(module).read_text(encoding="utf-8"))
    except InputError:
        return f"handler {handler}: module {module} not found"
    except (SyntaxError, UnicodeDecodeError) as e:
        return f"handler {handler}: module {module} does not parse ({e})"
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    head = attr.split(".")[0]
    return None if head in names else f"handler {handler}: {module} defines no {head}"


def fingerprint(module: str) -> str:
    """sha256 of the module's source file (what the memory entry pins)."""
    return "sha256:" + hashlib.sha256(module_file(module).read_bytes()).hexdigest()


def compose(entries: dict[str, Entry], ids: Iterable[str]) -> SystemState:
    """Apply ``ids`` with their requirements to stock: the resulting hooks and module fingerprints.

    Two entries replacing the same target conflict (only one REPLACE can take effect).
    """
    order = closure(entries, ids)
    hooks: dict[str, Hook] = {}
    replaced: dict[str, str] = {}
    modules: list[str] = []
    owner: dict[str, Path] = {}
    quant: list[str] = []
    for name in order:
        e = entries[name]
        for h in e.hooks:
            if h.type == "replace":
                if h.target in replaced and replaced[h.target] != name:
                    raise InputError(f"{name} and {replaced[h.target]} both replace {h.target}")
                replaced[h.target] = name
            hooks[h.key()] = h
        for m in e.modules:
            if m not in owner:
                owner[m] = e.path
                modules.append(m)
        quant += [q for q in e.quantization if q not in quant]
    prints = {}
    for m in sorted(modules):
        try:
            prints[m] = fingerprint(m)
        except InputError as err:
            raise InputError(f"{owner[m]}: {err}") from None
    return SystemState(entries=order, hooks=sorted(hooks), quantization=quant, fingerprints=prints)


def hooks_of(entries: dict[str, Entry], ids: Iterable[str]) -> list[Hook]:
    out: dict[str, Hook] = {}
    for name in closure(entries, ids):
        for h in entries[name].hooks:
            out[h.key()] = h
    return [out[k] for k in sorted(out)]


def setup_of(entries: dict[str, Entry], ids: Iterable[str]) -> list[str]:
    """The setup functions (``module:function``) an activation of the closure ``ids`` runs, in order."""
    return [entries[i].setup for i in ids if entries[i].setup]


def variant_registry(entries: dict[str, Entry], ids: Iterable[str]) -> dict[str, tuple[str, Variant]]:
    """Variant name -> (owning bundle, variant) over the bundles ``ids``."""
    return {v.name: (i, v) for i in ids for v in entries[i].variants}


def with_defaults(entries: dict[str, Entry], ids: Iterable[str], settings: dict) -> dict:
    """``settings`` over every variant of the bundles ``ids`` at its default."""
    return {name: var.default for name, (_, var) in variant_registry(entries, ids).items()} | settings


def settings_problems(entries: dict[str, Entry], ids: Iterable[str], settings: dict,
                      drafter: str | None = None) -> list[str]:
    """Why the variant values ``settings`` of the closure ``ids`` cannot run (empty when they can):
    a name none of its bundles has, a value its variant refuses, and what each bundle's own
    ``settings_check`` finds in them together (on ``drafter``; None: unknown)."""
    ids = list(ids)
    registry = variant_registry(entries, ids)
    out = []
    for name, value in settings.items():
        if name not in registry:
            out.append(f"setting {name}: not a variant of the applied bundles")
            continue
        owner, var = registry[name]
        problem = var.problem(value)
        if problem:
            out.append(f"setting {name}={value!r}: {problem} ({owner})")
    if out:   # each check reads every value of its bundle: only once they are valid one by one
        return out
    values = with_defaults(entries, ids, settings)
    for i in ids:
        if entries[i].settings_check:
            module, _, attr = entries[i].settings_check.partition(":")
            problem = getattr(importlib.import_module(module), attr)(values, drafter)
            if problem:
                out.append(f"{i}: {problem}")
    return out


def applied_differs(activation: dict, entries: dict[str, Entry]) -> str | None:
    """What of an activation's setup list and quantization methods differs from what its bundles
    give (None where both match): the plugin runs the setup functions it names."""
    ids = activation.get("closure", [])
    if activation.get("setup", []) != setup_of(entries, ids):
        return "setup functions"
    if activation.get("quantization", []) != compose(entries, ids).quantization:
        return "quantization methods"
    return None


def activation_problems(activation: dict, entries: dict[str, Entry]) -> list[str]:
    """What in an activation (its closure's bundles all known) ``apply`` could not have written:
    setup functions or quantization methods that are not its bundles' (:func:`applied_differs`), a
    bundle listed twice, a closure that is not its bundles', module fingerprints that are not the
    bundles' modules (the plugin compares the ones it lists), a drafter the bundles refuse."""
    bundles, ids = activation.get("bundles") or [], activation.get("closure") or []
    differs = applied_differs(activation, entries)
    out = [f"the activation's {differs} are not its bundles'"] if differs else []
    twice = [b for names in (bundles, ids) for b in names if names.count(b) > 1]
    out += [f"bundle {b} is listed twice" for b in dict.fromkeys(twice)]
    try:
        theirs = closure(entries, bundles) if not twice and bundles else list(ids)
    except InputError as e:
        out.append(str(e))
    else:
        if theirs != list(ids):
            out.append(f"the closure ({', '.join(ids)}) is not its bundles' ({', '.join(theirs)})")
    fps = activation.get("fingerprints")
    mods = sorted(compose(entries, ids).fingerprints)
    if not isinstance(fps, dict) or sorted(fps) != mods:
        out.append(f"its module fingerprints do not name its bundles' modules ({', '.join(mods) or 'none'})")
    out += composition_problems(entries, ids, activation.get("drafter"))
    return out


def verify(entries: dict[str, Entry], ids: Iterable[str] | None = None) -> list[VerifyRow]:
    """The survival rule: each entry applied with its requirements to stock must reproduce the
    hook set and module fingerprints it recorded."""
    rows = []
    for name in (list(ids) if ids else sorted(entries)):
        e = get_entry(entries, name)
        state = compose(entries, [name])
        problems = []
        rec_hooks = sorted(e.system.get("hooks", []))
        if rec_hooks != state.hooks:
            extra = sorted(set(state.hooks) - set(rec_hooks))
            gone = sorted(set(rec_hooks) - set(state.hooks))
            if extra:
                problems.append("hooks not recorded: " + "; ".join(extra))
            if gone:
                problems.append("recorded hooks missing: " + "; ".join(gone))
        problems += [p for h in e.hooks if (p := handler_problem(h.handler)) is not None]
        rec_fp = e.system.get("fingerprints", {})
        for mod in sorted(set(rec_fp) | set(state.fingerprints)):
            if mod not in state.fingerprints:
                problems.append(f"recorded module {mod} is no longer part of the system")
            elif mod not in rec_fp:
                problems.append(f"module {mod} has no recorded fingerprint")
            elif rec_fp[mod] != state.fingerprints[mod]:
                problems.append(f"module {mod} changed since it was verified")
        rows.append(VerifyRow(id=name, closure=state.entries, hooks=len(state.hooks),
                              ok=not problems, problems=problems))
    return rows


def record_system(entry: Entry, entries: dict[str, Entry]) -> str:
    """The entry's YAML text with its ``system`` block (the file's last key) rewritten to what
    composing it produces now. Maintainers run it after re-verifying the mechanism; the caller
    writes the text back atomically."""
    import yaml

    text = entry.path.read_text(encoding="utf-8")
    marker = "\nsystem:"
    if marker not in text:
        raise InputError(f"{entry.path}: 'system' must be the last key of the entry")
    head = text[: text.index(marker) + 1]
    block = yaml.safe_dump({"system": compose(entries, [entry.id]).as_record()}, sort_keys=False, width=200)
    return head + block
