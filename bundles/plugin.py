"""SpecPilot's SGLang plugin: entry point ``specpilot = specpilot.bundles.plugin:register`` in
group ``sglang.srt.plugins``.

SGLang 0.5.23 calls ``load_plugins()`` early in every process (launcher, scheduler, detokenizer,
data-parallel controller) and honours ``SGLANG_PLUGINS=specpilot``. ``register`` reads the
activation ``specpilot apply`` wrote into this environment and registers exactly the hooks it lists
with ``sglang.srt.plugins.hook_registry.HookRegistry`` (SGLang applies them right after). With no
activation it does nothing, so an installed SpecPilot never changes a stock server by itself.

Registration is all or nothing: every handler is resolved before the first hook is registered.
It refuses (raises, which SGLang logs as a failed plugin, and the server runs stock) when the
installed SGLang is not the version the activation was checked against (unless applied with
``--force``) or when this SpecPilot's bundles no longer produce the hook set that was applied.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sysconfig
from pathlib import Path

from .contract import ACTIVATION_ENV, ACTIVATION_NAME, ACTIVATION_SCHEMA, hook_key

logger = logging.getLogger("specpilot.plugin")

_settings: dict = {}
_registered: list[str] = []


class ActivationError(RuntimeError):
    pass


def activation_file() -> Path:
    env = os.environ.get(ACTIVATION_ENV)
    return Path(env) if env else Path(sysconfig.get_paths()["purelib"]) / ACTIVATION_NAME


def current_settings() -> dict:
    """Variant values of the active bundles (``specpilot apply --set NAME=VALUE``)."""
    return _settings


def registered() -> list[str]:
    """Hooks this process registered (``type target <- handler``)."""
    return list(_registered)


def resolve(handler: str):
    module, _, attr = handler.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def installed_sglang_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("sglang")
    except md.PackageNotFoundError:
        return None


def plan(activation: dict, sglang_version: str | None, memory_dir=None):
    """Check an activation against this process; returns (hooks, setups) with resolved callables."""
    from . import memory as mem

    if activation.get("schema") != ACTIVATION_SCHEMA:
        raise ActivationError(f"unknown activation schema {activation.get('schema')!r}; run 'specpilot apply' again")
    recorded = activation.get("sglang", {}).get("version")
    if sglang_version != recorded and not activation.get("sglang", {}).get("forced"):
        raise ActivationError(f"SGLang is {sglang_version}, but the activation was checked against {recorded}; "
                              "run 'specpilot apply' again (or 'specpilot revert')")
    entries = mem.load_memory(memory_dir)
    ids = activation.get("closure", [])
    state = mem.compose(entries, ids)
    listed = sorted(hook_key(h["type"], h["target"], h["handler"]) for h in activation.get("hooks", []))
    if listed != state.hooks:
        raise ActivationError("the installed SpecPilot bundles produce a different hook set than the one applied; "
                              "run 'specpilot apply' again")
    wrong = mem.activation_problems(activation, entries)
    if wrong:   # its setup functions run in every SGLang process: only what apply writes (status says the same)
        raise ActivationError(f"{'; '.join(wrong)}; run 'specpilot apply' again")
    settings = activation.get("settings") or {}
    if not isinstance(settings, dict):
        raise ActivationError("the activation's settings are not a mapping; run 'specpilot apply' again")
    bad = mem.settings_problems(entries, ids, settings, activation.get("drafter"))
    if bad:   # the handlers would run on values apply refuses
        raise ActivationError(f"{'; '.join(bad)}; run 'specpilot apply' again")
    changed = sorted(m for m, fp in activation.get("fingerprints", {}).items() if state.fingerprints.get(m) != fp)
    if changed:
        raise ActivationError(f"bundle module(s) {', '.join(changed)} changed since 'specpilot apply' "
                              "(not the applied system); run 'specpilot apply' again")
    hooks = [(h["target"], h["type"], resolve(h["handler"]), h["handler"]) for h in activation["hooks"]]
    setups = [(s, resolve(s)) for s in activation.get("setup", [])]
    return hooks, setups


def register(registry=None, hook_type=None, path: str | Path | None = None) -> list[str]:
    """Entry point SGLang calls. ``registry``/``hook_type``/``path`` are for tests; SGLang passes none."""
    path = Path(path) if path else activation_file()
    if path.is_symlink():   # apply writes a regular file; status refuses a link, and so does the plugin
        raise ActivationError(f"{path} is a symbolic link, which SpecPilot did not write; remove it by hand "
                              "and run 'specpilot apply' again")
    if not path.is_file():
        logger.info("SpecPilot: no activation at %s; nothing to install", path)
        return []
    activation = json.loads(path.read_text(encoding="utf-8"))
    hooks, setups = plan(activation, installed_sglang_version())
    if registry is None or hook_type is None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        registry, hook_type = registry or HookRegistry, hook_type or HookType
    _settings.clear()
    _settings.update(activation.get("settings", {}))
    _registered.clear()   # what this registration installs (a test may register twice in one process)
    for name, fn in setups:
        fn()
        _registered.append(f"setup {name}")
    for target, kind, fn, handler in hooks:
        registry.register(target, fn, getattr(hook_type, kind.upper()))
        _registered.append(hook_key(kind, target, handler))
    logger.info("SpecPilot: bundles %s active (%d hooks)", ", ".join(activation.get("closure", [])), len(hooks))
    return registered()
