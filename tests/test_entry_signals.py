"""The console script handles SIGINT/SIGTERM/SIGHUP from its first line (``specpilot.entry``):
a signal that lands while the CLI is still being imported ends the process with 128 + N and one
line, not a traceback, and one that lands as a finished command exits keeps what it printed."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_console_script_starts_at_the_early_handlers():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["specpilot"] == "specpilot.entry:main"
    assert "specpilot.entry import main" in (ROOT / "specpilot_cli" / "__main__.py").read_text()


def test_a_signal_before_the_cli_is_imported_is_one_line_and_its_exit_code():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        r = _run("import os, time; from specpilot import entry; entry.install(); "
                 f"os.kill(os.getpid(), {int(sig)}); time.sleep(30)")
        assert r.returncode == 128 + sig, (sig, r.returncode, r.stderr)
        assert r.stderr == f"specpilot: interrupted by {sig.name}\n"


def test_a_signal_as_a_finished_command_exits_keeps_its_output():
    r = _run("import os, signal, time; from specpilot import entry; entry.install(); print('the result'); "
             "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)")
    assert r.returncode == 130 and r.stdout == "the result\n", (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


def test_a_signal_while_the_real_entry_imports_the_cli_is_one_line_and_130():
    """The real entry point (``entry.main`` with arguments, as the console script runs it), with
    SIGINT delivered from inside the CLI's own import: an import hook sends it the first time
    ``click`` is imported, which happens only once main has begun importing the CLI."""
    r = _run("import builtins, os, signal, sys\n"
             "from specpilot import entry\n"
             "assert 'click' not in sys.modules\n"
             "real, sent = builtins.__import__, []\n"
             "def hook(name, *a, **k):\n"
             "    if name.split('.')[0] == 'click' and not sent:\n"
             "        sent.append(name)\n"
             "        os.kill(os.getpid(), signal.SIGINT)\n"
             "    return real(name, *a, **k)\n"
             "builtins.__import__ = hook\n"
             "sys.argv = ['specpilot', '--help']\n"
             "entry.main()\n"
             "print('main returned', sent)\n")
    assert r.returncode == 130, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == "specpilot: interrupted by SIGINT\n" and r.stdout == "", (r.stdout, r.stderr)


def test_a_signal_the_parent_ignores_stays_ignored():
    """`nohup specpilot ...`: a SIGHUP ignored by whoever started the process is not taken over,
    neither by the console script nor by the command's own handlers."""
    r = _run("import os, signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); from specpilot import entry, signals; "
             "entry.install(); os.kill(os.getpid(), signal.SIGHUP)\n"
             "with signals.installed():\n    os.kill(os.getpid(), signal.SIGHUP)\nprint('alive')")
    assert r.returncode == 0 and r.stdout == "alive\n", (r.returncode, r.stdout, r.stderr)


def test_an_interrupt_while_the_arguments_are_parsed_is_one_line(monkeypatch, capsys):
    """click's main prints a blank line for a terminal's ^C before its Abort; stderr here is a log."""
    import click

    from specpilot.cli import _run as run_cli_main

    def interrupted(self, ctx, args):
        raise KeyboardInterrupt

    monkeypatch.setattr(click.Group, "parse_args", interrupted)
    assert run_cli_main(["ceiling", "--help"], False) == 130
    assert capsys.readouterr().err == "specpilot: interrupted\n"


def test_a_signal_in_the_exit_handlers_after_the_command_ended_keeps_its_status():
    """The command ended with 0: a signal while the exit handlers run (here one of them sends it)
    ends the process at once with that 0 and no word (it said 'interrupted', 143)."""
    r = _run("import atexit, os, signal, time; from specpilot import entry; entry.install(); "
             "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))); "
             "print('the result'); entry.finished(0)")
    assert r.returncode == 0 and r.stdout == "the result\n" and r.stderr == "", (r.returncode, r.stdout, r.stderr)


def test_a_signal_in_the_interpreters_teardown_after_the_command_ended_keeps_its_status():
    """Past the exit handlers the interpreter puts the default action back for handlers of its own
    (SIGTERM: death by the signal, no word, -15); an ended command's signals are ignored from there.
    A global's finalizer, run as the modules are torn down, sends the signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        r = _run("import os, signal, time\nfrom specpilot import entry\nentry.install()\n"
                 "class Late:\n"
                 "    def __del__(self):\n"
                 f"        os.kill(os.getpid(), {int(sig)}); time.sleep(0.3)\n"
                 "late = Late()\nprint('the result')\nentry.finished(0)\n")
        assert r.returncode == 0 and r.stdout == "the result\n" and r.stderr == "", (sig, r.returncode, r.stderr)


def test_a_real_command_keeps_its_exit_status_through_a_signal_as_it_exits():
    """The real entry point: a signal sent by the last exit handler of a command that succeeded
    (``ceiling``, exit 0) leaves that 0; the one before ``entry.finished`` ran is still an
    interruption (the test above it)."""
    r = _run("import atexit, os, signal, sys, time\n"
             "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.3)))\n"
             "from specpilot import entry\n"
             "sys.argv = ['specpilot', 'ceiling', '--model', 'llama-3.1-8b', '--gpu', 'h200', '--rows', '1']\n"
             "entry.main()\n")
    assert r.returncode == 0 and "Byte floors" in r.stdout and "interrupted" not in r.stderr, (r.returncode, r.stderr)
