"""``specpilot round``'s checks of what it reads: the prompts against the engine's cache before the
round starts, and the numbers of its own JSON files (decisions, measure, candidates) when a report
or a resume reads them again."""

from __future__ import annotations

import json

import pytest

TINY = "engine:model=tiny,mode=ar,threads=1"


# ---------------------------------------------------------------------------- the round's own files
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny round whose propose stage proposed nothing (its approve stage judged no candidate)."""
    from specpilot.auditors.round import run as round_run
    from specpilot.auditors.round.propose import Proposal
    from specpilot.cli import main

    out = tmp_path_factory.mktemp("inputs") / "r"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(round_run, "propose_engine", lambda *a, **kw: Proposal([], [], "none proposed", None))
        with pytest.raises(SystemExit) as e:
            main(["round", TINY, "--budget", "0.5", "--n-prompts", "2", "--max-new-tokens", "8", "--out-dir", str(out),
                  "--no-remember"])
    assert e.value.code == 0
    return out


def test_a_round_that_judges_no_candidate_finishes_with_its_decisions_file(finished, run_cli):
    """The approve stage with nothing to judge wrote no decisions.json, so the round ended in 'missing,
    though round.json says the approve stage is done' (exit 2) and left no baseline."""
    assert json.loads((finished / "approve" / "decisions.json").read_text())["decisions"] == []
    code, out, err = run_cli("check", "--baseline", finished, "--no-timing")
    assert code == 0 and "gate: PASS" in out, err
