"""The dry run plans what the round will do, and the round refuses at its start what a later stage would fail on."""

from __future__ import annotations

import json
import re

import pytest
import yaml

TINY = "engine:model=tiny,mode=ar,threads=1"


def _plan(run_cli, *args):
    code, out, err = run_cli("round", *args, "--dry-run", "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_the_dry_run_takes_the_fixed_run_shape_and_no_remember(run_cli, tmp_path):
    plan = _plan(run_cli, TINY, "--n-prompts", "2", "--max-new-tokens", "16", "--no-remember",
                 "--records", tmp_path / "rec")
    assert plan["shape"] == {"prompts": 2, "max_new_tokens": 16}
    stages = {s["stage"]: s["work"] for s in plan["stages"]}
    assert "2 prompts x 16 tokens" in stages["approve"] and "--no-remember" in stages["remember"]


def test_new_tokens_beyond_the_engine_cache_are_refused_before_anything_is_written(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for extra in (["--dry-run"], ["--out-dir", "r", "--no-remember"]):
        code, _, err = run_cli("round", TINY, "--max-new-tokens", "5000", *extra)
        assert code == 2 and "5000 new tokens" in err and "ctx=2048" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
    # the limit it names fits the round's longest prompt too: following it, the round runs
    fewer = int(re.search(r"give --max-new-tokens (\d+) or fewer", err)[1])
    code, _, err = run_cli("round", TINY, "--max-new-tokens", str(fewer), "--dry-run")
    assert code == 0, err
    code, _, err = run_cli("round", TINY, "--max-new-tokens", str(fewer + 1), "--dry-run")
    assert code == 2 and f"give --max-new-tokens {fewer} or fewer" in err, err


def test_the_dry_run_leaves_out_the_current_systems_family_as_the_round_does(run_cli, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    ident = __import__("specpilot.auditors.round.deployment", fromlist=["x"]).parse_deployment(TINY).facts.identity()
    (rec / f"{ident}.yaml").write_text(yaml.safe_dump({"schema": "specpilot.deployment-record/1", "rounds": [],
                                                       "current": "engine:model=tiny,mode=chain,threads=1"}))
    plan = _plan(run_cli, TINY, "--records", rec)
    assert plan["start"].startswith("engine:model=tiny,mode=chain") 
    assert "chain" not in plan["stages"][2]["work"] and plan["current_family"] == ["chain"]




@pytest.mark.parametrize("cands, words", [
    ("w12", "--candidates w12: cannot run here: needs a CUDA GPU"),
    ("batching", "--candidates batching: cannot run here: a round judges one-request"),
    ("no-op", "--candidates no-op: the control runs with --control"),
    ("chain,chain", "'chain' is named twice"),
])
def test_a_typed_candidate_that_cannot_run_here_is_refused(run_cli, tmp_path, cands, words):
    for extra in (["--dry-run"], ["--out-dir", tmp_path / "r", "--no-remember"]):
        code, _, err = run_cli("round", TINY, "--candidates", cands, *extra)
        assert code == 2 and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
