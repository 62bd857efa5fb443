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




@pytest.mark.parametrize("policy, best", [("best-first:32", 1.7), ("chain", 1.7), ("tlv:8", 2.8)])
def test_tlv_tau_is_no_trees_best_reachable(run_cli, tmp_path, policy, best):
    """A TLV recording's replay holds tlv:N, whose tau is per exact pass of a two-pass cycle: the
    tree factor of another policy takes the best of the trees (it took TLV's, a 1.7x 'tree'
    factor no tree reaches); TLV's own is the best reachable only when it is the policy."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "positions": 8, "policies": [
        {"policy": "chain", "tau": 1.6}, {"policy": "best-first:32", "tau": 1.7}, {"policy": "tlv:8", "tau": 2.8},
        {"policy": "oracle:1", "tau": 1.7}]}))
    code, out, err = run_cli("ceiling", "--replay", replay, "--policy", policy, "--rows", "33", "--step-ms", "10",
                             "--ar-ms", "8", "--format", "json")
    assert code == 0, err
    cost = json.loads(out)["cost_model"]
    assert cost["inputs"]["tau_best"] == best and cost["factors"]["tree"] == pytest.approx(best / cost["tau"])


def test_the_best_reachable_tau_takes_the_replays_curves_too(run_cli, tmp_path):
    """`replay --policy chain,best-first:8 --nodes 8,16,32` holds tau(32) only in its curves: the
    tree factor took the best policy (best-first:8), not the file's best tree."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "positions": 8, "policies": [
        {"policy": "chain", "tau": 1.5}, {"policy": "best-first:8", "tau": 1.59}],
        "curves": {"chain": {"8": 1.5}, "best-first": {"8": 1.59, "16": 1.64, "32": 1.68}, "tlv": {"8": 3.0}}}))
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows", "9", "--step-ms", "10", "--ar-ms", "8",
                             "--format", "json")
    assert code == 0, err
    cost = json.loads(out)["cost_model"]
    assert cost["inputs"]["tau_best"] == 1.68 and cost["factors"]["tree"] == pytest.approx(1.68 / 1.5)
    assert cost["sources"]["tau_best"] == f"replay {replay} (best-first:32)"


@pytest.mark.parametrize("doc, words", [
    ({"policies": [{"policy": "chain", "tau": 1.7}, {"policy": "chain", "tau": 3.0}]},
     "policy 'chain' is listed twice"),
    ({"positions": -1, "policies": [{"policy": "chain", "tau": 1.7}]}, "'positions' must be null or a whole number"),
    ({"positions": True, "policies": [{"policy": "chain", "tau": 1.7}]}, "'positions' must be null or a whole number"),
])
def test_a_damaged_replay_is_refused(run_cli, tmp_path, doc, words):
    """Two taus for one policy (the last was taken), or positions out of range (taken as absent)."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", **doc}))
    code, out, err = run_cli("ceiling", "--replay", replay, "--step-ms", "10", "--ar-ms", "8")
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err


def test_a_rows_probes_step_says_it_leaves_drafting_out(run_cli, tmp_path):
    """Paper 3.2's T_step includes drafting; a rows probe times the verify forward alone: the
    speedup it gives reads high by the drafting's share, and a note says so (TLV's cycle did)."""
    ex = ROUNDS / "smollm2-cpu" / "measure"
    base = ("ceiling", "--replay", ex / "replay.json", "--rows-probe", ex / "rows.json", "--policy", "chain",
            "--rows", "9", "--format", "json")
    code, out, err = run_cli(*base)
    assert code == 0, err
    assert any("verify forward alone: drafting" in n for n in json.loads(out)["cost_model"]["notes"])
    code, out, err = run_cli(*base, "--step-ms", "60")
    assert code == 0 and not any("drafting" in n for n in json.loads(out)["cost_model"]["notes"]), out
    # a TLV cycle from the probe is its two passes, not a verify forward alone: its own note says the rest
    tlv = tmp_path / "tlv.replay.json"
    code, _, err = run_cli("replay", ex / "tlv.lattice.jsonl", "--policy", "tlv:16", "--format", "json", "--out", tlv)
    assert code == 0, err
    code, out, err = run_cli("ceiling", "--replay", tlv, "--policy", "tlv:16", "--rows-probe", ex / "rows.json",
                             "--format", "json")
    assert code == 0, err
    assert not any("verify forward alone" in n for n in json.loads(out)["cost_model"]["notes"]), out
