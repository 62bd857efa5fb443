"""`specpilot ceiling --replay` reads every file `specpilot replay` writes."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROUNDS = REPO / "examples" / "rounds"


@pytest.mark.parametrize("mode", ["ar", "tree"])
def test_ceiling_reads_what_replay_writes(run_cli, tmp_path, mode):
    """A lattice of 0 draft positions (an AR run) writes a chain of 0 nodes; one of a tree run, a
    chain of its depth: ceiling reads both, written by the real run and replay."""
    lattice, replay = tmp_path / "lattice.jsonl", tmp_path / "replay.json"
    code, _, err = run_cli("run", "--model", "tiny", "--mode", mode, "--prompt", "abcabcabcabc", "--max-new-tokens",
                           "12", "--lattice-out", lattice, "--format", "json", "--out", tmp_path / "run.json")
    assert code == 0, err
    code, _, err = run_cli("replay", lattice, "--policy", "chain", "--policy", "chain:2", "--policy", "best-first:8",
                           "--policy", "eagle2:2,2,8", "--policy", "sequoia:8", "--policy", "oracle:2",
                           "--nodes", "4,8", "--format", "json", "--out", replay)
    assert code == 0, err
    doc = json.loads(replay.read_text())
    chain = next(p for p in doc["policies"] if p["policy"] == "chain")
    assert (doc["positions"] == 0 and chain["nodes"] == 0) if mode == "ar" else chain["nodes"] >= 1
    code, out, err = run_cli("ceiling", "--replay", replay, "--step-ms", "4", "--ar-ms", "3.9", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["cost_model"]["tau"] == chain["tau"]
    code, out, err = run_cli("ceiling", "--replay", replay, "--model", "llama-3.1-8b", "--gpu", "h200")
    assert code == 0 and "Predicted speedup by node budget" in out, err


def test_the_round_example_replay_is_read(run_cli):
    replay = ROUNDS / "llama8b-h200" / "measure" / "replay.json"
    code, out, err = run_cli("ceiling", "--replay", replay, "--step-ms", "4", "--ar-ms", "3.9", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []   # a chain of 0 nodes verifies 1 row: the default --rows


