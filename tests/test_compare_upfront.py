"""`compare` refuses what it can tell is wrong before any system runs or loads."""

from __future__ import annotations

import pytest


def _refused_before_running(run_cli, tmp_path, *args):
    """Run compare with shell commands that leave a mark when run; (exit code, stderr)."""
    mark = tmp_path / "ran"
    partial = tmp_path / "t.partial.json"
    code, out, err = run_cli("compare", "--base-cmd", f"touch {mark}", "--candidate-cmd", f"touch {mark}",
                             "--runs", "4", "--warmup", "0", "--partial", partial, *args)
    assert code == 2 and out == "" and err.startswith("specpilot: error: ") and err.count("\n") == 1, err
    assert not mark.exists() and not partial.exists()
    return err


@pytest.mark.parametrize("args, named", [
    (["--max-new-tokens", "64"], "--max-new-tokens sets"),
    (["--max-new-tokens", "128", "--tokenizer", "tiny"], "--max-new-tokens, --tokenizer set"),
])
def test_shell_commands_refuse_the_options_of_engines(run_cli, tmp_path, args, named):
    """--max-new-tokens (even at its default value) does nothing to a shell command: refused."""
    err = _refused_before_running(run_cli, tmp_path, *args)
    assert named in err and "would change nothing" in err, err


@pytest.mark.parametrize("metric, words", [
    ("", "--metric '': empty"),
    ("  ", "empty"),
    ("stats..tps", "an empty key in the dotted path"),
])
def test_a_metric_no_output_can_carry_is_refused_before_the_base_runs(run_cli, tmp_path, metric, words):
    err = _refused_before_running(run_cli, tmp_path, "--metric", metric)
    assert words in err, err
