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
from . import entry, signals
from .errors import EXIT_INTERNAL, EXIT_USAGE, as_user_error
from .output import progress_seconds, status_lines


class _Stopped(Exception):
    """An interrupt or end of input raised inside a verb, carried past ``click``'s ``main``, which
    would print a blank line before re-raising it (to close a terminal's ``^C`` echo) and break the
    one-line contract when stderr is a log."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


def _carried(call, *args, **kwargs):
    """``call``, an interrupt or end of input in it carried past click's ``main`` as :class:`_Stopped`."""
    try:
        return call(*args, **kwargs)
    except (KeyboardInterrupt, EOFError) as e:
        raise _Stopped(e) from e


class LazyGroup(click.Group):
    def make_context(self, *args, **kwargs):   # the top command's arguments are parsed here, outside invoke
        return _carried(super().make_context, *args, **kwargs)

    def invoke(self, ctx):
        return _carried(super().invoke, ctx)

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

    def resolve_command(self, ctx, args):
        # the environment is checked before any verb runs (a bad value would otherwise show only once
        # long work reports progress), except for a verb's help, which runs nothing
        if ctx.parent is None and not {"-h", "--help"} & set(args):
            progress_seconds()
        return super().resolve_command(ctx, args)


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
      the whole procedure, judged        specpilot round (report, check)

    \b
    Words the helps use ("paper 4.3" is a section of the SpecPilot paper, whose procedure this is):
      stock        the published implementation a deployment starts from
      tau          tokens accepted per verification pass; c(N) = T_step(N rows) / T_AR
      lattice      a step's draft: top-K candidates and scores per position (replay's input)
      W12          lossless 12-bit weights; its 8-bit view is what TLV's Q pass reads
      TLV          two-stage verification: a cheap Q pass over the draft tree picks a commit
                   chain C, a second draft grows from its end, one exact pass verifies both
      GDN          Gated DeltaNet, the linear-attention layers of hybrid targets

    Exit codes: 0 done/pass, 1 negative verdict, 2 bad input, 3 missing environment,
    4 a bug in SpecPilot, 128+N stopped by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129).
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _debug_requested(argv) -> bool:
    """``specpilot --debug VERB ...`` (the group's own flags all come before the verb; a verb's
    argument or option value that reads ``--debug`` is not the flag), or ``SPECPILOT_DEBUG=1``."""
    if os.environ.get("SPECPILOT_DEBUG") == "1":
        return True
    for arg in argv:
        if arg == "--debug":
            return True
        if arg == "--" or not arg.startswith("-"):
            return False
    return False


def main(argv=None) -> None:
    """Run one verb; every way out is an exit code and at most one ``specpilot: ...`` line.

    The error boundary: SpecPilot's own errors keep their code; decoding, range and I/O errors
    from any library are bad input (2) or a missing environment (3) naming the file
    (:func:`specpilot.errors.as_user_error`); SIGINT/SIGTERM/SIGHUP end the run cleanly with
    128 + the signal number (:mod:`specpilot.signals`); anything else is a bug (4).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    with signals.installed(), status_lines():
        try:
            code = _run(argv, debug)
        finally:
            signals.cleanup()
        signals.ended()   # a signal from here on keeps this status (specpilot.entry)
        entry.finished(code)
    sys.exit(code)


# click 8.2+ raises it; click 8.1 prints the help itself and exits 0
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _run(argv, debug: bool) -> int:
    try:
        rv = cli.main(args=argv, prog_name="specpilot", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except _Stopped as e:
        if isinstance(e.original, KeyboardInterrupt):
            return _interrupted(e.original)
        return _error(e.original, debug)
    except _NO_ARGS_IS_HELP as e:
        # a group given no subcommand (specpilot, specpilot probe): its help on stdout and 0, as --help
        # and audit give it; the handler below would squeeze the help into one error line
        click.echo(e.ctx.get_help(), color=e.ctx.color)
        return 0
    except click.Abort as e:
        # click turns EOFError and KeyboardInterrupt into Abort; an EOFError is a truncated input
        cause = e.__cause__ or e.__context__
        if isinstance(cause, KeyboardInterrupt):
            return _interrupted(cause)
        if cause is not None:
            return _error(cause, debug)
        click.echo("specpilot: interrupted", err=True)
        return 130
    except click.ClickException as e:
        if debug:
            traceback.print_exc()
        hint = ""
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            hint = f" (see '{ctx.command_path} --help')"
        click.echo(f"specpilot: error: {_one_line(e.format_message())}{hint}", err=True)
        return e.exit_code if e.exit_code not in (None, 1) else EXIT_USAGE
    except KeyboardInterrupt as e:
        return _interrupted(e)
    except BrokenPipeError:
        return 0
    except Exception as e:
        return _error(e, debug)


def _error(e: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(e)
    signum = signals.stopped_by()
    if signum is not None:   # raised while a signal unwound the run: a library turned the interrupt into its error
        return _interrupted(signals.Interrupted(signum))
    user = as_user_error(e)
    if user is None:  # a bug: say so in one line, traceback with --debug
        click.echo(f"specpilot: internal error: {type(e).__name__}: {_one_line(e)} (rerun with --debug)", err=True)
        return EXIT_INTERNAL
    click.echo(f"specpilot: error: {_one_line(user)}{_notes(e)}", err=True)
    return user.exit_code


def _interrupted(e: KeyboardInterrupt) -> int:
    if sys.stderr.isatty():   # the terminal echoed ^C where the cursor was
        click.echo(err=True)
    if isinstance(e, signals.Interrupted):
        click.echo(f"specpilot: interrupted by {e.name}{_notes(e)}", err=True)
        return e.exit_code
    click.echo(f"specpilot: interrupted{_notes(e)}", err=True)
    return 130


def _notes(e: BaseException) -> str:
    """What a verb added on the way out (e.g. where its resumable state is), as '; ...'."""
    return "".join(f"; {_one_line(n)}" for n in getattr(e, "__notes__", ()) or ())


def _one_line(e) -> str:
    text = str(e).strip()
    return " ".join(text.split()) if text else type(e).__name__


if __name__ == "__main__":
    main()
