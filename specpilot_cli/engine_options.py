"""The engine's command line flags, generated from :class:`~specpilot.engine.spec.EngineSpec`.

Every spec field becomes one flag (``draft_layers`` -> ``--draft-layers``; a bool is a flag, or a
``--x/--no-x`` pair when it defaults to on) with the field's help, default and choices; adding an
engine option is adding a field. ``--engine SPEC`` takes the same options serialized
(``engine:model=tiny,mode=ar``, what ``str(spec)`` writes) and replaces the flags.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import click

from specpilot.engine.spec import INT_TEXT, EngineSpec, OptionInfo
from specpilot.errors import InputError

ENGINE_HELP = ("The engine options as one spec, engine:key=value,... (keys are the option names: "
               "engine:model=tiny,mode=ar,w12=1; the run JSON's 'engine' field is one) instead of the flags above; "
               "what it leaves out takes the command's defaults.")


class _SpecInt(click.ParamType):
    """An integer flag read as the ``--engine`` spec reads the same option (ASCII digits only:
    Python's ``int`` also takes "1_0" and other scripts' digits)."""

    name = "integer"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        if not re.fullmatch(INT_TEXT, str(value)):
            self.fail(f"{value!r} is not an integer", param, ctx)
        return int(value)


def _click_option(o: OptionInfo, default, help_text: str, default_text: str | None):
    if o.kind is bool:
        decl = f"{o.flag}/--no-{o.flag[2:]}" if default else o.flag
        return click.option(decl, o.name, is_flag=True, default=bool(default), show_default=bool(default),
                            help=help_text)
    if o.range is not None:
        help_text = f"{help_text}  [{o.range[0]}<=x<={o.range[1]}]"
    if default is None and default_text:
        help_text = f"{help_text}  [default: {default_text}]"
    kind = click.Choice(o.choices) if o.choices else _SpecInt() if o.kind is int else o.kind
    return click.option(o.flag, o.name, type=kind, default=default, show_default=default is not None,
                        help=help_text)


def engine_options(only: Iterable[str] | None = None, defaults: Mapping | None = None,
                   help_texts: Mapping[str, str] | None = None, default_texts: Mapping[str, str] | None = None,
                   spec_option: bool = True):
    """Decorator adding the engine flags to a click command (``only``: these fields, in spec
    order; ``defaults``/``help_texts``/``default_texts``: a command's own default, help, or text
    of a ``None`` default for some fields; ``spec_option``: add ``--engine SPEC``). The command
    gets every flag's value as a keyword named after the field; :func:`spec_from_cli` takes them
    back."""
    keep = set(only) if only is not None else None
    defaults, help_texts, default_texts = dict(defaults or {}), dict(help_texts or {}), dict(default_texts or {})

    def decorate(f):
        opts = []
        for o in EngineSpec.options():
            if keep is not None and o.name not in keep:
                continue
            opts.append(_click_option(o, defaults.get(o.name, o.default), help_texts.get(o.name, o.help),
                                      default_texts.get(o.name, o.default_text)))
        if spec_option:
            opts.append(click.option("--engine", "engine_spec", metavar="SPEC", default=None, help=ENGINE_HELP))
        for opt in reversed(opts):
            f = opt(f)
        return f

    return decorate


def spec_from_cli(kw: dict) -> EngineSpec:
    """Pop the engine flags (and ``--engine``) from a command's keywords; the checked spec."""
    text = kw.pop("engine_spec", None)
    values = {o.name: kw.pop(o.name) for o in EngineSpec.options() if o.name in kw}
    ctx = click.get_current_context(silent=True)
    source = (lambda name: ctx.get_parameter_source(name)) if ctx is not None else (lambda name: None)
    given = [o for o in EngineSpec.options() if o.name in values
             and source(o.name) is click.core.ParameterSource.COMMANDLINE]
    if text is not None and not text.strip():
        raise InputError("--engine is empty; give a spec (engine:model=tiny,mode=ar) or leave it out")
    if text:
        if given:   # a flag beside the spec would be dropped without a word
            raise InputError(f"--engine replaces the engine flags; give {given[0].name}=... inside it instead of "
                             f"{given[0].flag}")
        fields = EngineSpec.parse_fields(text)
        # the command's own defaults (serve's batch) hold for what the spec leaves out
        own = {o.name: values[o.name] for o in EngineSpec.options()
               if o.name in values and o.name not in fields and values[o.name] != o.default}
        spec = EngineSpec.from_options(**own, **fields)
        spec.check_used(fields)
        spec.warn_idle(fields)
        return spec
    spec = EngineSpec.from_options(as_flags=True, **values)   # typed as flags: errors name the flag
    spec.check_used([o.name for o in given], as_flags=True)
    spec.warn_idle([o.name for o in given], as_flags=True)
    return spec

