"""The ``specpilot`` command: a thin click group over the library.

Verbs live one per module in ``specpilot.commands`` and are discovered lazily, so ``specpilot
ceiling`` never imports torch. Each module exposes ``command`` (a click command or group); the
module name with ``_`` -> ``-`` is the verb.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import traceback

import click

from . import __version__
from .errors import EXIT_USAGE, SpecPilotError

EXIT_INTERNAL = 4


class LazyGroup(click.Group):
    def _package(self):
        from . import commands

        return commands

    def list_commands(self, ctx):
        pkg = self._package()
        names = [m.name.replace("_", "-") for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
        return sorted(names)

    def get_command(self, ctx, name):
        if name not in self.list_commands(ctx):
            return None
        mod = importlib.import_module(f"specpilot.commands.{name.replace('-', '_')}")
        return getattr(mod, "command")


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specpilot")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx, debug):
    """SpecPilot: measure, model, audit and apply speculative decoding for one deployment.

    \b
    Questions it answers for a deployment (target x drafter x GPU x serving shape):
      where does a step's time go?       specpilot profile, specpilot ceiling
      how much faster could it be?       specpilot ceiling, specpilot replay
      is a change really faster?         specpilot compare
      is it still lossless?              specpilot audit --against stock

    Exit codes: 0 done/pass, 1 negative verdict, 2 bad input, 3 missing environment.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _debug_requested(argv) -> bool:
    return "--debug" in argv or os.environ.get("SPECPILOT_DEBUG") == "1"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    try:
        rv = cli.main(args=argv, prog_name="specpilot", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except SpecPilotError as e:
        if debug:
            traceback.print_exc()
        click.echo(f"specpilot: error: {_one_line(e)}", err=True)
        code = e.exit_code
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.Abort:
        click.echo("specpilot: interrupted", err=True)
        code = 130
    except click.ClickException as e:
        if debug:
            traceback.print_exc()
        hint = ""
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            hint = f" (see '{ctx.command_path} --help')"
        click.echo(f"specpilot: error: {_one_line(e.format_message())}{hint}", err=True)
        code = e.exit_code if e.exit_code not in (None, 1) else EXIT_USAGE
    except KeyboardInterrupt:
        click.echo("specpilot: interrupted", err=True)
        code = 130
    except BrokenPipeError:
        code = 0
    except Exception as e:  # a bug: say so in one line, traceback with --debug
        if debug:
            traceback.print_exc()
        click.echo(f"specpilot: internal error: {type(e).__name__}: {_one_line(e)} (rerun with --debug)", err=True)
        code = EXIT_INTERNAL
    sys.exit(code)


def _one_line(e) -> str:
    text = str(e).strip()
    return " ".join(text.split()) if text else type(e).__name__


if __name__ == "__main__":
    main()
