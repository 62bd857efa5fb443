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
    """``"1,8,32"``; ``"1,2,4,...,256"`` continues a doubling (or constant-step) series to its end;
    where both fit the first two values (``1,2``), the one that lands on the end (``1,2,...,17``
    counts by one).

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
        if p in ("...", "…"):
            if len(values) < 2 or i + 1 >= len(parts):
                raise InputError(f"{name}: '...' needs two values before it and one after, e.g. 1,2,4,...,256")
            a, b = values[-2], values[-1]
            end = _to_int(parts[i + 1], name, minimum, maximum)
            doubling = a > 0 and b % a == 0 and b // a > 1
            if doubling and not _on_series(b, end, lambda v: v * (b // a)) \
                    and _on_series(b, end, lambda v: v + (b - a)):
                doubling = False   # 1,2,...,17: only counting by one reaches 17
            if doubling:
                r = b // a
                v = b * r
                while v < end:
                    values.append(v)
                    v *= r
            elif b > a:
                v = b + (b - a)
                while v < end:
                    values.append(v)
                    v += b - a
            else:
                raise InputError(f"{name}: cannot continue the series {a},{b},...")
            i += 1
            continue
        values.append(_to_int(p, name, minimum, maximum))
        i += 1
    return list(dict.fromkeys(values))


def _on_series(v: int, end: int, step) -> bool:
    """Whether stepping from ``v`` with ``step`` lands on ``end``."""
    while v < end:
        v = step(v)
    return v == end


def _to_int(p: str, name: str, minimum: int, maximum: int) -> int:
    try:
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
