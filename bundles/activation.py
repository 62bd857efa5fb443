"""``apply`` / ``revert`` / ``status``: the activation file inside a target environment.

``apply`` never edits SGLang's files. It writes one file, ``<site-packages>/specpilot_activation.json``
(schema ``specpilot.activation/1``), atomically: a temporary file in the same folder, fsync, rename.
A kill at any point leaves the old activation (or none) or the new one; a leftover temporary file
is swept by the next apply/revert/status. SpecPilot's SGLang plugin (entry point ``specpilot`` in
group ``sglang.srt.plugins``) reads that file in every SGLang process and installs only the hooks
it lists. ``revert`` removes the file, so the environment's files are byte-identical to before.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import re
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot import __version__, signals
from specpilot.errors import EnvironmentMissing, InputError
from specpilot.fileio import atomic_open, check_schema

from . import memory as mem
from .contract import (ACTIVATION_NAME, ACTIVATION_SCHEMA, DRAFTERS, ENTRY_POINT, PLUGIN_NAME, SUPPORTED_SGLANG,
                       hook_key)
from .inspect_sglang import TargetCheck, check_targets
from .sglang_env import TargetEnv, probe


def mismatch_words(bad: list[TargetCheck], most: int = 3) -> str:
    """The targets that do not match, each problem once with every target it hits (a file that does
    not parse fails all of its targets), the first ``most`` problems named."""
    by_problem: dict[str, list[str]] = {}
    for c in bad:
        by_problem.setdefault(c.problem or "does not match", []).append(c.target)
    hooks = sum(1 for c in bad if c.kind != "symbol")
    what = " and ".join(x for x in (f"{hooks} hook target(s)" if hooks else "",
                                    f"{len(bad) - hooks} symbol(s)" if len(bad) > hooks else "") if x)
    parts = [f"{', '.join(targets)}: {problem}" for problem, targets in list(by_problem.items())[:most]]
    more = len(by_problem) - most
    return f"{what} do not match: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def activation_path(purelib: str | Path) -> Path:
    return Path(purelib) / ACTIVATION_NAME


@contextlib.contextmanager
def locked(purelib: str | Path, timeout: float = 30.0):
    """Serialize apply/revert/status on one environment: an advisory lock on the site-packages
    folder itself (no lock file is created, so nothing is left behind; a killed holder releases it)."""
    import fcntl
    import time

    fd = os.open(str(purelib), os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EnvironmentMissing(f"another specpilot apply/revert holds {purelib}; try again") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def not_writable(purelib: str | Path, why: str | None = None) -> EnvironmentMissing:
    return EnvironmentMissing(f"{purelib} is not writable{f' ({why})' if why else ''}; run as the environment's owner")


def not_replaceable(path: Path, purelib: str | Path, e: OSError, verb: str) -> EnvironmentMissing:
    """The error of a ``path`` in ``purelib`` that cannot be replaced or removed (``verb``): EPERM where
    the folder takes files is the file itself (immutable: chattr +i), so it is named; else the folder."""
    if e.errno != errno.EPERM or not os.access(purelib, os.W_OK):
        return not_writable(purelib, e.strerror)
    return EnvironmentMissing(f"{path} cannot be {verb} ({e.strerror}), though {purelib} is writable; is it "
                              "immutable (lsattr)? run as the environment's owner")


def require_writable(purelib: str | Path) -> None:
    if not os.access(purelib, os.W_OK):
        raise not_writable(purelib)


def remove(path: Path, purelib: str | Path) -> None:
    """Unlink ``path`` (in ``purelib``); a folder that refuses it is a missing environment (exit 3)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise not_replaceable(path, purelib, e, "removed") from None
        raise


def sweep_partial(purelib: str | Path) -> list[str]:
    """Remove temporary files an interrupted apply left behind (exit 3 when the folder is not writable)."""
    leftovers = sorted(Path(purelib).glob(f".{ACTIVATION_NAME}.*.part"))
    if leftovers:
        require_writable(purelib)
    removed = []
    for p in leftovers:
        remove(p, purelib)
        removed.append(str(p))
    return removed


def _text(x) -> bool:
    return isinstance(x, str)


def _names(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, str) for i in x)


def _sglang_field(x) -> bool:
    return (isinstance(x, dict) and isinstance(x.get("version"), (str, type(None)))
            and isinstance(x.get("package"), (str, type(None))) and isinstance(x.get("forced"), bool))


def _hooks_field(x) -> bool:
    return isinstance(x, list) and all(isinstance(h, dict) and all(isinstance(h.get(f), str)
                                                                   for f in ("target", "type", "handler")) for h in x)


def _drafter_field(x) -> bool:
    from .contract import DRAFTERS

    return x is None or x in DRAFTERS


# every field apply writes, with the test its value must pass (status, revert and the plugin rely on them)
_FIELDS = {
    "bundles": _names, "closure": _names, "settings": lambda x: isinstance(x, dict), "sglang": _sglang_field,
    "hooks": _hooks_field, "setup": _names, "quantization": _names,
    "fingerprints": lambda x: isinstance(x, dict) and all(_text(v) for v in x.values()),
    "targets": lambda x: isinstance(x, dict) and all(v is None or _text(v) for v in x.values()),
    "specpilot_version": _text, "applied_at": _text, "launch": _text, "drafter": _drafter_field,
}


# fields an older apply did not write: checked when present
_OPTIONAL = {"model": _text, "experimental": lambda x: isinstance(x, bool)}


def not_a_file(path: Path) -> str:
    if path.is_symlink():
        what = f"a symbolic link (to {os.readlink(path)})"
    else:
        what = "a folder" if path.is_dir() else "not a regular file"
    return f"{path}: the activation file is {what}; SpecPilot did not write it, remove it by hand"


def check_activation_path(path: Path) -> None:
    """InputError unless ``path`` is absent or a regular file: SpecPilot neither writes through nor
    removes a symbolic link, a folder or a device it finds there."""
    if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
        raise InputError(not_a_file(path))


def read_activation(path: Path) -> dict | None:
    if not os.path.lexists(path):
        return None
    check_activation_path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); run 'specpilot revert' to remove it") from None
    except RecursionError:
        raise InputError(f"{path}: malformed activation (nested too deeply); run 'specpilot revert' to remove "
                         "it") from None
    check_schema(obj, "activation", str(path))
    bad = [k for k, ok in _FIELDS.items() if k not in obj or not ok(obj[k])] \
        + [k for k, ok in _OPTIONAL.items() if k in obj and not ok(obj[k])]
    fix = "run 'specpilot revert' to remove it, then apply again"
    if bad:
        raise InputError(f"{path}: malformed activation ({', '.join(bad)} missing or of the wrong type); {fix}")
    # apply records the bundles asked for within their closure (requirements first); anything else was edited
    stray = [b for b in obj["bundles"] if b not in obj["closure"]]
    if stray or not obj["bundles"]:
        what = f"{', '.join(map(repr, stray))} not in closure" if stray else "empty"
        raise InputError(f"{path}: malformed activation (bundles: {what}); {fix}")
    return obj


def parse_bundle_list(text: str) -> list[str]:
    names = [n.strip() for n in str(text).split(",")]
    if not any(names):
        raise InputError("name at least one bundle, e.g. 'specpilot apply w12,tree'")
    if not all(names):
        raise InputError(f"an empty bundle name between commas in {text!r}")
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise InputError(f"bundle {twice} given twice ({text}); give it once")
    return names


def check_setting(name: str, value: Any, owner: str, var: mem.Variant, shown: str) -> None:
    """Refuse (InputError, led by ``shown``) a value that is not a valid setting of variant ``var``."""
    problem = var.problem(value)
    if problem:
        raise InputError(f"{shown}: {problem} ({owner})")


_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?")


def setting_scalar(text: str) -> Any:
    """One ``--set`` value: a decimal integer, a decimal number (``2.5``, ``2.4e1``), ``true`` or
    ``false``, else the text itself (no hex, octal, binary, ``1_000``, ``yes``/``on``: they stay text
    and the variant's check refuses them)."""
    t = text.strip()
    if _INT.fullmatch(t):
        return int(t)
    if _FLOAT.fullmatch(t):
        return float(t)
    return {"true": True, "false": False}.get(t, t)


def setting_value(raw: str, var: mem.Variant) -> Any:
    """``raw`` read for variant ``var``: a text variant (a folder name) takes the text as written; a
    list variant ``[a, b, ...]`` of scalars; any other one scalar (:func:`setting_scalar`)."""
    if isinstance(var.default, str) and var.choices is None:
        return raw
    t = raw.strip()
    if isinstance(var.default, list) and t.startswith("[") and t.endswith("]"):
        inner = t[1:-1].strip()
        return [setting_scalar(x) for x in inner.split(",")] if inner else []
    return setting_scalar(t)


def parse_settings(pairs, entries: dict[str, mem.Entry], ids: list[str]) -> dict[str, Any]:
    """``--set name=value`` over the variant registries of ``ids``; each name once, each value
    read strictly (:func:`setting_value`) and checked against the variant's range."""
    registry = mem.variant_registry(entries, ids)
    values = mem.with_defaults(entries, ids, {})
    given: dict[str, str] = {}
    for pair in pairs or ():
        if "=" not in pair:
            raise InputError(f"--set {pair}: expected NAME=VALUE")
        name, raw = pair.split("=", 1)
        name = name.strip()
        if name not in registry:
            known = ", ".join(sorted(registry)) or "none"
            raise InputError(f"--set {name}: not a variant of the applied bundles (known: {known})")
        if name in given:
            raise InputError(f"--set {name} given twice ({name}={given[name]} and {name}={raw}); give it once")
        given[name] = raw
        owner, var = registry[name]
        value = setting_value(raw, var)
        check_setting(name, value, owner, var, f"--set {name}={raw}")
        values[name] = value
    return values


@dataclass
class ApplyResult:
    activation: dict
    path: str
    env: TargetEnv
    checks: list[TargetCheck]
    previous: list[str] | None
    launch: str
    swept: list[str] = field(default_factory=list)
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # applied, but something asked for will not act
    interrupted: str | None = None   # the signal that came once the activation was in place


@dataclass
class RevertResult:
    path: str
    removed: list[str] | None  # the bundles that were active, None when nothing was
    swept: list[str]


@dataclass
class StatusResult:
    path: str
    env: TargetEnv
    activation: dict | None
    checks: list[TargetCheck]
    problems: list[str]
    swept: list[str]
    launch: str | None = None   # the launch line of the activation as it matches (built again, not read)
    # this SpecPilot's bundle modules the environment's SpecPilot has otherwise: apply run here would refuse it
    differs: list[str] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return self.activation is None or not self.problems


def require_sglang(env: TargetEnv) -> None:
    if env.sglang_package is None:
        raise EnvironmentMissing(f"SGLang is not installed for {env.executable}; install sglang=="
                                 f"{SUPPORTED_SGLANG[-1]} there or pass --python /path/to/env/bin/python")


def _require_specpilot(env: TargetEnv) -> None:
    fix = f"run '{env.executable} -m pip install specpilot' (or 'pip install -e' of this checkout) there"
    if env.specpilot_version is None:
        raise EnvironmentMissing(f"SpecPilot is not installed in {env.prefix}, so SGLang cannot load its plugin; {fix}")
    ep = (env.specpilot_entry_point or {}).get(PLUGIN_NAME)
    if ep != ENTRY_POINT:
        raise EnvironmentMissing(f"SpecPilot in {env.prefix} does not declare the SGLang plugin entry point "
                                 f"({PLUGIN_NAME} = {ENTRY_POINT}); {fix}")


def launch_parts(entries: dict[str, mem.Entry], ids: list[str], settings: dict,
                 drafter: str | None) -> tuple[dict[str, str], list[str], list[str]]:
    """(environment, server arguments, notes) the entries ``ids`` need on ``drafter`` (None:
    unknown; arguments only some drafters take are then left out and a note says so)."""
    env: dict[str, str] = {}
    args: list[str] = []
    notes: list[str] = []
    for i in ids:
        launch = entries[i].launch
        per = (launch.get("by_drafter") or {})
        own = per.get(drafter) or {} if drafter else {}
        for k, v in {**(launch.get("env") or {}), **(own.get("env") or {})}.items():
            env[k] = str(v).format(**settings)
        for a in list(launch.get("args") or []) + list(own.get("args") or []):
            args.append(str(a).format(**settings))
        note = own.get("note") or launch.get("note")
        if note:   # a note may hold a shell command: text settings (a folder) quoted as the launch line quotes them,
            # and one starting with '-' as ./-x, which a command cannot take for an option
            quoted = {k: shlex.quote("./" + v if v.startswith("-") else v) if isinstance(v, str) else v
                      for k, v in settings.items()}
            notes.append(f"{i}: " + str(note).format(**quoted))
        if drafter is None and any((v or {}).get("args") for v in per.values()):
            which = ", ".join(d for d, v in per.items() if (v or {}).get("args"))
            notes.append(f"{i}: drafter-specific flags left out ({which}); give --drafter to get them")
    return env, args, notes


def launch_command(entries: dict[str, mem.Entry], ids: list[str], settings: dict, python: str,
                   model: str = "MODEL", drafter: str | None = None, plugins=()) -> str:
    """The server's launch line. ``SGLANG_PLUGINS`` names SpecPilot's plugin and the others SGLang
    would load there: those of this shell's ``SGLANG_PLUGINS`` where it is set, else every plugin
    of the environment (``plugins``), as SGLang loads them all when it is unset."""
    given = [p.strip() for p in os.environ.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    others = [p for p in (given or plugins) if p != PLUGIN_NAME]
    env = {"SGLANG_PLUGINS": ",".join([PLUGIN_NAME] + others)}
    extra_env, args, _ = launch_parts(entries, ids, settings, drafter)
    env.update(extra_env)
    head = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    tail = " ".join(shlex.quote(a) if "{" not in a else a for a in args)
    return f"{head} {shlex.quote(python)} -m sglang.launch_server --model-path {shlex.quote(model)} {tail}".rstrip()


def idle_warnings(entries: dict[str, mem.Entry], ids: list[str], settings, drafter: str | None) -> list[str]:
    """What the user asked for that will not act on ``drafter`` (None: unknown, nothing said): a
    bundle another bundle of ``ids`` turns off there (its ``off_with``), and each ``--set`` whose
    variant acts on other drafters only or belongs to such a bundle."""
    if drafter is None:
        return []
    out, off = [], {}
    for i in ids:
        for o in entries[i].off_with:
            if o.bundle in ids and (not o.drafters or drafter in o.drafters):
                off[i] = o.bundle
                out.append(f"{i} with {o.bundle} on {DRAFTERS[drafter]}: {o.why}")
    registry = mem.variant_registry(entries, ids)
    for pair in settings or ():
        name = pair.split("=", 1)[0].strip()
        owner, var = registry[name]   # parse_settings refused unknown names
        if var.drafters and drafter not in var.drafters:
            out.append(f"--set {pair.strip()} has no effect on {DRAFTERS[drafter]}: {owner}'s {name} acts on "
                       + " or ".join(DRAFTERS[d] for d in var.drafters) + " only")
        elif owner in off:
            out.append(f"--set {pair.strip()} has no effect: {owner} is off with {off[owner]}")
    return out


def check_composition(entries: dict[str, mem.Entry], ids: list[str], drafter: str | None) -> str | None:
    """Refuse (InputError) bundles that cannot run together or on ``drafter``; returns the drafter
    the launch command is written for (given, or the only one every bundle accepts)."""
    problems = mem.composition_problems(entries, ids, drafter)
    if problems:
        what = f"cannot be applied with --drafter {drafter}" if drafter else "cannot be applied together"
        raise InputError(f"{', '.join(ids)} {what}: " + "; ".join(problems))
    if drafter is None:
        common = mem.common_drafters(entries, ids)
        if len(common) == 1:
            return common[0]
    return drafter


def own_apply_command(executable: str, bundles: str, *, force: bool = False, experimental: bool = False,
                      settings=(), dry_run: bool = False, model: str = "MODEL", drafter: str | None = None,
                      fmt: str | None = None, out: str | None = None) -> str:
    """The ``apply`` with these options as the environment of ``executable`` runs it with its own SpecPilot
    (``EXE -m specpilot apply ...``, no --python: it applies to itself), every word shell-quoted."""
    words = [executable, "-m", "specpilot", "apply", bundles]
    if drafter:
        words += ["--drafter", drafter]
    for pair in settings or ():
        words += ["--set", pair]
    if model != "MODEL":
        words += ["--model", model]
    words += [flag for flag, on in (("--force", force), ("--experimental", experimental), ("--dry-run", dry_run)) if on]
    if fmt and fmt != "table":
        words += ["--format", fmt]
    if out:
        words += ["--out", out]
    return " ".join(shlex.quote(w) for w in words)


def apply(bundles: str, *, python: str | None = None, force: bool = False, experimental: bool = False,
          settings=(), dry_run: bool = False, memory_dir=None, model: str = "MODEL",
          drafter: str | None = None, out: str | None = None, fmt: str | None = None) -> ApplyResult:
    """Check and write the activation (``out``: the report file the caller will write, refused when
    it is the activation file itself; ``fmt``: its format, for the command a refusal suggests). A signal
    that comes once the activation is renamed into place does not undo it: the result says which
    signal (``interrupted``)."""
    entries = mem.load_memory(memory_dir)
    asked = parse_bundle_list(bundles)
    for name in asked:
        mem.get_entry(entries, name)
    ids = mem.closure(entries, asked)
    unwired = [i for i in ids if entries[i].status == "library"]
    if unwired:
        raise InputError(f"{', '.join(unwired)}: not wired into SGLang yet (status library; see "
                         f"'specpilot memory show {unwired[0]}'), so there is nothing to apply")
    risky = [i for i in ids if entries[i].status == "experimental"]
    if risky and not experimental:
        raise InputError(f"{', '.join(risky)} {'is' if len(risky) == 1 else 'are'} experimental "
                         f"(see 'specpilot memory show {risky[0]}'); pass --experimental to apply anyway")
    given = drafter
    drafter = check_composition(entries, ids, drafter)
    values = parse_settings(settings, entries, ids)
    together = mem.settings_problems(entries, ids, values, drafter)
    if together:
        raise InputError("; ".join(together))
    warnings = idle_warnings(entries, ids, settings, drafter)
    state = mem.compose(entries, ids)

    env = probe(python, modules=state.fingerprints)
    path = activation_path(env.purelib)
    refuse_report_on_target(out, path, env)   # before any check of the environment, as every verb does
    require_sglang(env)
    checked = sorted({v for i in ids for v in entries[i].sglang_checked})
    if not env.supported or env.sglang_version not in checked:
        if not force:
            raise EnvironmentMissing(
                f"SGLang {env.sglang_version or '(unknown version)'} in {env.prefix} is not supported; "
                f"the bundles were checked against {', '.join(checked) or 'no version'} "
                "(--force applies anyway, after the static target check)")
    hooks = mem.hooks_of(entries, ids)
    symbols = [s for i in ids for s in entries[i].symbols]
    checks = check_targets(env.sglang_root, hooks, symbols)
    bad = [c for c in checks if not c.ok]
    if bad:
        raise EnvironmentMissing(f"SGLang {env.sglang_version} in {env.prefix}: {mismatch_words(bad)}; nothing was "
                                 "applied (an activation already there stays as it was)")
    _require_specpilot(env)
    differ = sorted(m for m, fp in state.fingerprints.items() if env.fingerprints.get(m) != fp)
    if differ:
        own = own_apply_command(env.executable, bundles, force=force, experimental=experimental, settings=settings,
                                dry_run=dry_run, model=model, drafter=given, fmt=fmt, out=out)
        raise EnvironmentMissing(f"the SpecPilot installed in {env.prefix} differs from this one ({', '.join(differ)}); "
                                 f"run that environment's own: {own}")

    require_writable(env.purelib)   # a dry run too: it says whether apply would succeed
    launch = launch_command(entries, ids, values, env.executable, model, drafter, env.plugins)
    notes = launch_parts(entries, ids, values, drafter)[2]
    if given is None and drafter is not None:
        notes.insert(0, f"no --drafter given: the launch is for {drafter}, the only drafter "
                        f"{', '.join(ids)} {'all accept' if len(ids) > 1 else 'accepts'}")
    committed: list[bool] = []
    res: ApplyResult | None = None
    try:
        with locked(env.purelib):
            swept = [] if dry_run else sweep_partial(env.purelib)
            previous = read_activation(path)
            activation = {
                "schema": ACTIVATION_SCHEMA,
                "bundles": asked,
                "closure": ids,
                "settings": values,
                "sglang": {"version": env.sglang_version, "package": env.sglang_package,
                           "forced": bool(force and not (env.supported and env.sglang_version in checked))},
                "hooks": [{"target": h.target, "type": h.type, "handler": h.handler} for h in hooks],
                "setup": mem.setup_of(entries, ids),
                "quantization": state.quantization,
                "fingerprints": state.fingerprints,
                "targets": {c.target: c.file_sha256 for c in checks},
                "specpilot_version": __version__,
                "applied_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "launch": launch,
                "drafter": drafter,
                "model": model,
                "experimental": bool(risky),
            }
            res = ApplyResult(activation=activation, path=str(path), env=env, checks=checks,
                              previous=previous and previous.get("bundles"), launch=launch, swept=swept,
                              dry_run=dry_run, notes=notes, warnings=warnings)
            if not dry_run:
                try:
                    with atomic_open(path, "w", on_commit=lambda: committed.append(True)) as fh:
                        fh.write(json.dumps(activation, indent=2) + "\n")
                except PermissionError as e:   # an immutable activation (chattr +i): as revert says it
                    raise not_replaceable(path, env.purelib, e, "replaced") from None
    except signals.Interrupted as e:
        if not committed or res is None:
            raise
        res.interrupted = e.name   # the activation was renamed into place: it is applied
    return res


def refuse_report_on_target(out: str | None, path: Path, env: TargetEnv) -> None:
    """InputError when the report file ``out`` is the activation file (existing or not: a report
    written there is an activation SGLang's plugin cannot read), or the target's interpreter (as
    given or where a link leads) or a file of its site-packages or of SGLang (its package and its
    metadata, which may lie outside site-packages), which the verbs read."""
    if out is None:
        return
    if os.path.realpath(out) == os.path.realpath(path):
        raise InputError(f"--out {out}: that is the activation file ({path}); the report needs another name "
                         "(or leave --out out)")
    from specpilot.fileio import check_output_path

    check_output_path(out, "--out", protect=[env.python, env.executable, env.purelib, env.sglang_package,
                                              env.sglang_metadata])


def revert(python: str | None = None, out: str | None = None) -> RevertResult:
    """Remove the activation (``out``: the report file the caller will write, refused first when it
    is the activation file)."""
    env = probe(python)
    path = activation_path(env.purelib)
    refuse_report_on_target(out, path, env)
    with locked(env.purelib):
        check_activation_path(path)   # a link, a folder, a device: not SpecPilot's to remove
        if os.path.lexists(path):
            require_writable(env.purelib)
        swept = sweep_partial(env.purelib)
        removed = None
        if path.exists():
            try:
                removed = (read_activation(path) or {}).get("bundles")
            except InputError:   # malformed (a field, the JSON, its nesting): removed all the same
                removed = ["(unreadable activation)"]
            remove(path, env.purelib)
    return RevertResult(path=str(path), removed=removed, swept=swept)


def status(python: str | None = None, memory_dir=None, out: str | None = None) -> StatusResult:
    env = probe(python)
    path = activation_path(env.purelib)
    refuse_report_on_target(out, path, env)
    with locked(env.purelib):
        swept = sweep_partial(env.purelib) if os.access(env.purelib, os.W_OK) else []
        act = read_activation(path)
    if act is not None and act.get("fingerprints"):
        env = probe(python, modules=act["fingerprints"])
    problems: list[str] = []
    checks: list[TargetCheck] = []
    if act is None:
        return StatusResult(path=str(path), env=env, activation=None, checks=[], problems=[], swept=swept)
    recorded = act.get("sglang", {}).get("version")
    if env.sglang_package is None:
        problems.append("SGLang is no longer installed")
    else:
        if env.sglang_version != recorded:
            problems.append(f"SGLang is {env.sglang_version}, the activation was applied to {recorded}")
        entries = mem.load_memory(memory_dir)
        unknown = [i for i in act.get("closure", []) if i not in entries]
        if unknown:
            problems.append(f"this SpecPilot does not know bundle(s) {', '.join(unknown)}")
        else:
            hooks = mem.hooks_of(entries, act["closure"])
            symbols = [s for i in act["closure"] for s in entries[i].symbols]
            checks = check_targets(env.sglang_root, hooks, symbols)
            changed: dict[str, list[str]] = {}
            for c in checks:
                if not c.ok:
                    problems.append(f"{c.target}: {c.problem}")
                elif act.get("targets", {}).get(c.target) not in (None, c.file_sha256):
                    changed.setdefault(c.file, []).append(c.target.rsplit(".", 1)[-1])
            for file, names in changed.items():
                problems.append(f"{file} changed since apply (defines {', '.join(names)}); check and apply again")
            problems += [f"{p}; apply again" for p in mem.settings_problems(entries, act["closure"], act["settings"],
                                                                             act.get("drafter"))]
            now = mem.compose(entries, act["closure"])
            listed = sorted(hook_key(h["type"], h["target"], h["handler"]) for h in act.get("hooks", []))
            if listed != now.hooks:
                problems.append("the bundles' hook set changed since apply (SpecPilot was updated); apply again")
            # the plugin would run (or miss) what the bundles do not name
            problems += [f"{p}; apply again" for p in mem.activation_problems(act, entries)]
    differs: list[str] = []
    if env.specpilot_version is None:  # its modules are gone with it: this one problem says so
        problems.append("SpecPilot is no longer installed there: SGLang will not load the plugin")
    else:
        for m, fp in act["fingerprints"].items():
            if env.fingerprints.get(m) is None:
                problems.append(f"bundle module {m} is missing from that environment; apply again")
            elif env.fingerprints[m] != fp:
                problems.append(f"bundle module {m} in that environment changed since apply; apply again")
        differs = specpilot_differs(python, env, act["closure"], memory_dir)
    launch = None
    if not problems:   # from the activation's bundles and settings, as apply builds it (its text may be edited)
        ids = act["closure"]
        values = mem.with_defaults(entries, ids, act["settings"])
        launch = launch_command(entries, ids, values, env.executable, launch_model(act) or "MODEL",
                                act.get("drafter"), env.plugins)
    return StatusResult(path=str(path), env=env, activation=act, checks=checks, problems=problems, swept=swept,
                        launch=launch, differs=differs)


def specpilot_differs(python: str | None, env: TargetEnv, closure: list[str], memory_dir=None) -> list[str]:
    """The modules of bundles ``closure`` whose source in ``env`` is not this SpecPilot's, which apply
    run here refuses (none when this SpecPilot's memory cannot compose them: status says why)."""
    try:
        mine = mem.compose(mem.load_memory(memory_dir), closure).fingerprints
    except InputError:
        return []
    theirs = env.fingerprints
    if set(mine) - set(theirs):   # a module the activation does not name: fingerprinted there too
        theirs = probe(python, modules=mine).fingerprints
    return sorted(m for m, fp in mine.items() if theirs.get(m) != fp)


def launch_model(act: dict) -> str | None:
    """The --model apply was given: recorded, or (an activation from before it was) read back from
    the launch command apply wrote with it."""
    if isinstance(act.get("model"), str):
        return act["model"]
    try:
        words = shlex.split(act.get("launch") or "")
    except ValueError:
        return None
    i = words.index("--model-path") if "--model-path" in words else -1
    return words[i + 1] if 0 <= i < len(words) - 1 else None
