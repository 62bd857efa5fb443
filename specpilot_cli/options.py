"""Parsing of option values shared by several verbs."""

from __future__ import annotations

import math

import click

from .errors import InputError
from .limits import MAX_ROWS


def typed(*names: str) -> list[str]:
    """The options among ``names`` (parameter names) that the user typed on the command line, as
    their flags (defaults left out: what a refusal of an option that does not apply names)."""
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    return [params[n].opts[0] for n in names
            if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]


def them(given) -> str:
    """'it' for one option named, 'them' for several: what a refusal asks to leave out."""
    return "it" if len(given) == 1 else "them"


def refuse_draft_shape_without_drafter(drafter_name: str | None) -> None:
    """Refuse the drafter floor's shape options (``--draft-rows``, ``--draft-passes``) typed without
    a drafter (``--drafter``, or one a file brought): they shape a floor that is not set. Used by
    ``profile`` and ``ceiling`` alike, where --model sets floors."""
    given = typed("draft_rows", "draft_passes")
    if given and not drafter_name:
        raise InputError(f"{', '.join(given)}: {'it shapes' if len(given) == 1 else 'they shape'} the drafter's "
                         f"floor, which needs --drafter MODEL; give it, or leave {them(given)} out")


class NonEmptyPath(click.Path):
    """A path option or argument that refuses an empty value: ``--check "$RUN"`` with RUN unset
    must not read as no option at all (a check that checked nothing), nor ``""`` as this folder."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            opt = param.opts[0] if param is not None and param.opts else "it"
            self.fail(f"an empty path; give one, or leave {opt} out" if param is not None and not
                      param.required and param.param_type_name == "option" else "an empty path; give one", param, ctx)
        return super().convert(value, param, ctx)


def not_blank(ctx, param, value):
    """Click callback for a text option (a model name, a system, GPU ids): an empty value is not the
    option left out."""
    if value is not None and not str(value).strip():
        if param.required:
            raise click.BadParameter("empty; give a value")
        left = f"leave {param.opts[0]} out" if param.param_type_name == "option" else "leave it out"
        raise click.BadParameter(f"empty; give a value, or {left}")
    return value


class FiniteRange(click.FloatRange):
    """A float option in a range that is also finite (``inf`` and ``nan`` are refused)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if rv is not None and not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number; give one from {self.min:g} to {self.max:g}.", param, ctx)
        return rv


def seed_option(what: str):
    """``--seed``: the seed of ``what`` (a whole number in 0..2^32-1, numpy's range)."""
    return click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
                        help=f"Seed of {what}: the same seed, the same result.")


def device_option(help: str):
    """``--device``: cpu, cuda or cuda:N, checked when parsed (:func:`specpilot.machine.check_device`)."""
    def check(ctx, param, value):
        if value is None:
            return None
        from .machine import check_device

        return check_device(value)

    return click.option("--device", default=None, callback=check, help=help)


def positive(hi: float) -> FiniteRange:
    """A finite float in (0, hi]."""
    return FiniteRange(0, hi, min_open=True)


def parse_int_list(text: str, name: str = "--rows", minimum: int = 1, maximum: int = MAX_ROWS) -> list[int]:
    """``"1,8,32"``; ``...`` continues the series the values before it show and must end on it:
    ``1,2,4,...,256`` doubles, ``8,16,24,...,64`` steps by 8; of two values that could do either,
    the rule that reaches the end (``1,2,...,6`` steps by one). An end off the series
    (``1,2,4,...,100``) or one both rules reach (``1,2,...,16``: give a third value) is refused: a
    sweep of counts no one asked for can cost minutes on a GPU.

    Values must be in [``minimum``, ``maximum``]; duplicates are dropped, order kept.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise InputError(f"{name}: give at least one value, e.g. {name} 1,8,32")
    if not all(parts):
        raise InputError(f"{name}: an empty value between commas in {str(text)[:60]!r}")
    values: list[int] = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p in ("...", "\u2026"):
            if len(values) < 2 or i + 1 >= len(parts):
                raise InputError(f"{name}: '...' needs two values before it and one after, e.g. 1,2,4,...,256")
            values.extend(_series(values, _to_int(parts[i + 1], name, minimum, maximum), name))
            i += 1
            continue
        values.append(_to_int(p, name, minimum, maximum))
        i += 1
    return list(dict.fromkeys(values))


def _series(before: list[int], end: int, name: str) -> list[int]:
    """The values strictly between ``before[-1]`` and ``end`` of the series ``before`` shows (a
    ratio where the last value is a whole multiple of the one before, a step where it is larger;
    a third value picks between them, else the one that lands on ``end``)."""
    a, b = before[-2], before[-1]
    shown = ",".join(map(str, before[-3:]))
    if end <= b:
        raise InputError(f"{name}: the series {shown},... must end above {b}, got {end}")
    rules = {}
    if a > 0 and b % a == 0 and b // a > 1:
        rules[f"times {b // a}"] = lambda v, r=b // a: v * r
    if b > a:
        rules[f"steps of {b - a}"] = lambda v, d=b - a: v + d
    if not rules:
        raise InputError(f"{name}: cannot continue the series {a},{b},...")
    if len(before) >= 3 and len(rules) > 1:
        rules = {k: f for k, f in rules.items() if f(before[-3]) == a} or rules
    walks = {}
    for k, f in rules.items():
        out, v = [], f(b)
        while v < end:
            out.append(v)
            v = f(v)
        walks[k] = (out, v)
    landing = [k for k, (_, v) in walks.items() if v == end]
    if len(landing) == 1:
        return walks[landing[0]][0]
    if landing:
        ratio, step = landing

        def written(rule: str) -> str:   # a series whose third value is its end is the list itself
            nxt = rules[rule](b)
            return f"{a},{b},{nxt}" if nxt == end else f"{a},{b},{nxt},...,{end}"

        raise InputError(f"{name}: {a},{b},...,{end} reaches {end} both in {ratio} and in {step}; give a third value "
                         f"({written(ratio)} or {written(step)})")
    near = "; ".join(f"{k}: ...,{(out or [b])[-1]},{v}" for k, (out, v) in walks.items())
    raise InputError(f"{name}: {end} is not on the series {shown},... ({near}); end it on the series or list the "
                     "values")


def _to_int(p: str, name: str, minimum: int, maximum: int) -> int:
    try:
        if not p.isascii():   # int() reads other scripts' digits too
            raise ValueError
        v = int(p)
    except ValueError:
        raise InputError(f"{name}: {p[:40]!r} is not a whole number") from None
    if not minimum <= v <= maximum:
        raise InputError(f"{name}: values must be in [{minimum}, {maximum}], got {v}")
    return v


def dtype_options(f):
    """``--weight-dtype``, ``--lm-head-dtype``, ``--kv-dtype``, ``--flops-fraction``, ``--bw-fraction``:
    what the byte and FLOP floors of ``ceiling`` and ``profile`` assume."""
    from .models import KV_DTYPES, WEIGHT_DTYPES

    opts = [
        click.option("--weight-dtype", type=click.Choice(WEIGHT_DTYPES), default="bf16", show_default=True,
                     help="Storage of projection and expert weights (w12 = 12.02 bits/weight)."),
        click.option("--lm-head-dtype", type=click.Choice(WEIGHT_DTYPES), default=None,
                     help="LM head storage [default: bf16 with w12 weights, else the weight dtype]."),
        click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="bf16", show_default=True,
                     help="Storage of the KV cache the attention reads."),
        click.option("--flops-fraction", type=positive(1.0), default=0.60, show_default=True,
                     help="Share of the GPU's peak FLOP/s a step can reach (the floors' compute rate)."),
        click.option("--bw-fraction", type=positive(1.0), default=0.90, show_default=True,
                     help="Share of the GPU's peak bandwidth a step can reach (the floors' byte rate)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f
