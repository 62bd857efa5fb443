"""The bundle contract: what a bundle is, what its modules provide, how SGLang gets its hooks.

A **bundle** (a mechanism of the memory) is one YAML entry, ``memory_entries/<id>.yaml`` with
``schema: specpilot.memory-entry/1`` (fields: :func:`specpilot.bundles.memory.parse_entry`), and
the modules of ``specpilot.bundles`` it names:

* ``code.modules``: the modules the bundle adds. Their source sha256 is part of the entry's
  recorded ``system``; an entry survives only while its system is reproduced
  (``specpilot memory verify``; maintainers re-record with ``--record``).
* ``code.hooks``: ``{target, type, handler, params, match}``: SGLang's ``HookRegistry`` wraps the
  function, method or class at the dotted ``target`` with ``handler`` (``"module:attr"``), called
  as the stub of its ``type`` below says; ``params``/``match`` are what ``apply`` checks statically
  against the installed SGLang before it activates anything.
* ``code.setup``: ``"module:attr"``, :func:`setup`, run in every SGLang process before the hooks
  are registered (e.g. adding the quantization methods listed in ``code.quantization``).
* ``variants``: tunables with defaults and ranges; ``specpilot apply --set NAME=VALUE`` records
  the values and a handler reads them with :func:`specpilot.bundles.plugin.current_settings`.
* ``status``: one of :data:`STATUSES`; ``requires``: the bundles applied with it, first.

**Registration.** ``specpilot apply`` writes one file, :data:`ACTIVATION_NAME`, into the target
environment's site-packages (or the path in ``$SPECPILOT_ACTIVATION``). SGLang calls the entry
points of group :data:`PLUGIN_GROUP` in each of its processes; SpecPilot's (:data:`PLUGIN_NAME` =
:data:`ENTRY_POINT`; the launch command ``apply`` prints adds it to ``$SGLANG_PLUGINS``) reads that file and registers exactly the hooks it lists, or nothing.

This module is the one place of these names; the modules that load entries (``memory``), activate
them (``activation``) and register them (``plugin``) import them from here.
"""

from __future__ import annotations

ENTRY_SCHEMA = "specpilot.memory-entry/1"
# checked: hooks checked statically and contracts on CPU against SGLang's code; observe: changes no
# output; experimental: needs --experimental; library: no SGLang hooks yet (apply refuses it)
STATUSES = ("checked", "observe", "experimental", "library")
SUPPORTED_SGLANG = ("0.5.23",)

# The drafter families an entry's ``fits.drafters`` names (SGLang's speculative algorithms and the
# drafter kinds its DFLASH worker tells apart), with the words errors use for them.
DRAFTERS = {"eagle": "an EAGLE drafter", "eagle3": "an EAGLE-3 drafter",
            "dflash": "a plain DFlash drafter (no CandidateSelector)",
            "dflash2": "a DFlash2 drafter (CandidateSelector)", "dspark": "a DSpark drafter (confidence head)"}
TARGET_KINDS = ("dense", "hybrid")
BATCH_SHAPES = ("single", "batched", "any")
FACTORS = ("tree", "kernel", "outside")

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "specpilot"
ENTRY_POINT = "specpilot.bundles.plugin:register"
ACTIVATION_NAME = "specpilot_activation.json"
ACTIVATION_SCHEMA = "specpilot.activation/1"
ACTIVATION_ENV = "SPECPILOT_ACTIVATION"


# The hook types: a handler of each type is called like its stub (SGLang's HookRegistry).
def before(*args, **kwargs):
    """Runs before the target with its arguments; returns ``(args, kwargs)`` to replace them, or None."""


def after(result, *args, **kwargs):
    """Runs after the target with its result and arguments; returns a new result, or None to keep it."""


def around(original, *args, **kwargs):
    """Runs instead of the target and calls ``original(*args, **kwargs)`` when it wants stock behaviour."""


def replace(*args, **kwargs):
    """Replaces the target (a function, or a class for a class target) for good."""


def setup() -> None:
    """A bundle's ``code.setup``: no arguments, run once per SGLang process before the hooks."""


HOOK_TYPES = tuple(f.__name__ for f in (before, after, around, replace))


def hook_key(type: str, target: str, handler: str) -> str:
    """One hook as the activation, the memory's recorded systems and ``registered()`` name it."""
    return f"{type} {target} <- {handler}"
