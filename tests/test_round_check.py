"""``specpilot check``'s refusals before any timed run: what the baseline and the options must be."""

from __future__ import annotations

import json

import pytest

from round_support import small_round


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return small_round(tmp_path_factory.mktemp("check") / "r", "--no-remember")


@pytest.mark.parametrize("extra", [[], ["--scorer", "tiny"]])
def test_a_system_of_another_vocabulary_than_the_scorer_is_refused_before_any_run(base, run_cli, extra):
    code, _, err = run_cli("check", "--baseline", base, "--system", "engine:model=smollm2,mode=ar,threads=1",
                           "--no-timing", *extra)
    assert code == 2 and "vocabulary (49152 tokens)" in err and "256 tokens" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, words", [
    (["--system", ""], "--system: give an engine spec"),
    (["--scorer", "tiny", "--no-audit"], "--scorer does nothing with --no-audit"),
    (["--runs", "3", "--no-timing"], "--runs does nothing with --no-timing"),
    (["--tolerance", "0.3", "--no-timing"], "--tolerance does nothing with --no-timing"),
])
def test_options_that_conflict_or_do_nothing_are_refused(base, run_cli, args, words):
    code, _, err = run_cli("check", "--baseline", base, *args)
    assert code == 2 and words in err and err.count("\n") == 1, err
