"""A round's identity in the deployment record, and the checks a resumed or reported round.json gets."""

from __future__ import annotations

import json

import pytest
import yaml

TINY = "engine:model=tiny,mode=ar,threads=1"


def _round(run_cli, *extra):
    code, _, err = run_cli("round", TINY, "--budget", "0.1", "--candidates", "chain", "--n-prompts", "2",
                           "--max-new-tokens", "4", *extra)
    assert code == 0, err


def test_two_rounds_in_folders_of_the_same_name_are_two_entries(run_cli, tmp_path, monkeypatch):
    rec = tmp_path / "rec"
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        monkeypatch.chdir(tmp_path / sub)
        _round(run_cli, "--records", rec)   # the default --out-dir, specpilot-round, in both
    doc = yaml.safe_load(next(rec.glob("*.yaml")).read_text())
    rounds = doc["rounds"]
    assert len(rounds) == 2, rounds
    assert [r["round"] for r in rounds] == [str(tmp_path / s / "specpilot-round") for s in ("a", "b")]
    ids = [json.loads((tmp_path / s / "specpilot-round" / "round.json").read_text())["round_id"] for s in ("a", "b")]
    assert [r["round_id"] for r in rounds] == ids and ids[0] != ids[1]


def test_a_record_written_before_rounds_had_ids_is_read_and_kept(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = tmp_path / "rec"
    _round(run_cli, "--records", rec, "--out-dir", "r1")
    path = next(rec.glob("*.yaml"))
    doc = yaml.safe_load(path.read_text())
    old = doc["rounds"][0]
    del old["round_id"]
    old["round"] = "r2"    # as typed, the way an earlier version keyed it
    path.write_text(yaml.safe_dump(doc))
    _round(run_cli, "--records", rec, "--out-dir", "r2")
    rounds = yaml.safe_load(path.read_text())["rounds"]
    assert len(rounds) == 2 and rounds[0]["round"] == "r2" and rounds[1]["round"] == str(tmp_path / "r2")


@pytest.mark.parametrize("where", ["afile/sub", "/proc/specpilot-records"])
def test_a_records_folder_that_cannot_be_written_is_refused_at_the_start(run_cli, tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    code, _, err = run_cli("round", TINY, "--records", where, "--out-dir", "r", "--budget", "0.1")
    assert code == 2 and f"--records {where}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
    code, _, err = run_cli("round", TINY, "--out-dir", "afile/r", "--no-remember")
    assert code == 2 and "--out-dir afile/r" in err, err


def test_the_records_folder_is_stored_absolute_and_a_resume_elsewhere_writes_it(run_cli, tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _round(run_cli, "--records", "rec", "--out-dir", "r")
    state = json.loads((tmp_path / "a" / "r" / "round.json").read_text())
    assert state["config"]["records_dir"] == str(tmp_path / "a" / "rec")
    state["stages"]["remember"]["status"] = "pending"
    (tmp_path / "a" / "r" / "round.json").write_text(json.dumps(state))
    monkeypatch.chdir(tmp_path / "b")
    code, _, err = run_cli("round", "--resume", tmp_path / "a" / "r")
    assert code == 0, err
    assert not (tmp_path / "b" / "rec").exists()
    assert len(yaml.safe_load(next((tmp_path / "a" / "rec").glob("*.yaml")).read_text())["rounds"]) == 1


def test_a_resumed_rounds_before_is_the_record_without_its_own_entry(tmp_path):
    """A resume that replaces the round's entry: 'before' is the record as the round found it (it was
    the record with the round's own first entry, so changes.json read 'ar -> ar' for a first round)."""
    from types import SimpleNamespace

    from specpilot.auditors.round import remember as rm

    facts = SimpleNamespace(identity=lambda: "dep", to_json=lambda: {"model": "m"})
    path = tmp_path / "rec.yaml"

    def entry(rid, final):
        return {"round": str(tmp_path / rid), "round_id": rid, "final": final}

    doc, before = rm.remember(path, facts, "stock", entry("r1", "chain"))
    assert before is None and doc["current"] == "chain"
    doc, before = rm.remember(path, facts, "stock", entry("r1", "tree"))          # r1 resumed
    assert before is None and doc["current"] == "tree" and len(doc["rounds"]) == 1
    doc, before = rm.remember(path, facts, "stock", entry("r2", "tlv"))
    assert before["current"] == "tree" and len(before["rounds"]) == 1
    doc, before = rm.remember(path, facts, "stock", entry("r2", "tlv+w12"))       # r2 resumed
    assert before["current"] == "tree" and [r["round_id"] for r in before["rounds"]] == ["r1"]
    assert doc["current"] == "tlv+w12" and len(doc["rounds"]) == 2
    doc, before = rm.remember(path, facts, "stock", entry("r1", "chain"))         # r1 again, r2 after it
    assert before["current"] == "tlv+w12" and doc["current"] == "tlv+w12"
