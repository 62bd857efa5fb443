"""What --resume and report accept from a round's folder, and what a refused resume leaves alone."""

from __future__ import annotations

import json
import shutil

import pytest

TINY = "engine:model=tiny,mode=ar,threads=1"


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    from specpilot.cli import main

    d = tmp_path_factory.mktemp("resume")
    with pytest.raises(SystemExit) as e:
        main(["round", TINY, "--budget", "0.1", "--candidates", "chain", "--n-prompts", "2", "--max-new-tokens", "8",
              "--out-dir", str(d / "r"), "--records", str(d / "rec")])
    assert e.value.code == 0
    return d


def _copy(done, tmp_path, **changes):
    r = tmp_path / "r"
    shutil.copytree(done / "r", r)
    state = json.loads((r / "round.json").read_text())
    for k, v in changes.items():
        if k.startswith("config_"):
            state["config"][k[7:]] = v
        else:
            state[k] = v
    (r / "round.json").write_text(json.dumps(state))
    return r


@pytest.mark.parametrize("change, words", [
    ({"current": "engine:model=tiny,bogus=1"}, "round.json: current: engine spec"),
    ({"final": "engine:model=tiny,mode=warp"}, "round.json: final: "),
    ({"config_candidates": 5}, "round.json: config.candidates must be a list of candidate names"),
    ({"config_candidates": "chain"}, "round.json: config.candidates must be a list"),
    ({"config_n_prompts": 0}, "round.json: config.n_prompts must be a whole number"),
    ({"config_control": "yes"}, "round.json: config.control must be true or false"),
    ({"config_colour": 1}, "round.json: config.colour must be one of the round's settings"),
    ({"kind": "vllm"}, "round.json: kind must be engine or sglang"),
])
def test_a_damaged_round_json_is_refused_by_resume_and_report_before_anything_is_written(
        done, tmp_path, run_cli, change, words):
    r = _copy(done, tmp_path, **change)
    state = json.loads((r / "round.json").read_text())
    state["stages"]["approve"]["status"] = state["stages"]["remember"]["status"] = "pending"
    (r / "round.json").write_text(json.dumps(state))
    before = (r / "round.json").read_text()
    record = next((done / "rec").glob("*.yaml")).read_text()
    for args in (("round", "--resume", r, "--budget", "0.1"), ("report", r)):
        code, _, err = run_cli(*args)
        assert code == 2 and words in err and err.count("\n") == 1 and "internal error" not in err, (args, err)
    assert (r / "round.json").read_text() == before
    assert next((done / "rec").glob("*.yaml")).read_text() == record


def test_a_refused_resume_leaves_round_json_as_it_was(done, tmp_path, run_cli):
    r = _copy(done, tmp_path)
    state = json.loads((r / "round.json").read_text())
    state["stages"]["approve"]["status"] = state["stages"]["remember"]["status"] = "pending"
    (r / "round.json").write_text(json.dumps(state))
    f = r / "approve" / "decisions.json"
    f.write_text(f.read_text()[:40])
    before = (r / "round.json").read_text()
    code, _, err = run_cli("round", "--resume", r)
    assert code == 2 and "decisions.json" in err, err
    assert (r / "round.json").read_text() == before


def test_resuming_a_finished_round_says_it_is_complete_and_writes_nothing(done, tmp_path, run_cli):
    r = _copy(done, tmp_path)
    before = {p: p.read_bytes() for p in r.rglob("*") if p.is_file()}
    code, _, err = run_cli("round", "--resume", r)
    assert code == 0 and "is complete: nothing to resume" in err, err
    assert {p: p.read_bytes() for p in r.rglob("*") if p.is_file()} == before


def test_a_record_whose_current_system_does_not_parse_is_named(done, tmp_path, run_cli):
    import yaml

    shutil.copytree(done / "rec", tmp_path / "rec")
    path = next((tmp_path / "rec").glob("*.yaml"))
    doc = yaml.safe_load(path.read_text())
    doc["current"] = "engine:model=tiny,bogus=1"
    path.write_text(yaml.safe_dump(doc))
    for extra in (["--dry-run"], ["--out-dir", tmp_path / "o"]):
        code, _, err = run_cli("round", TINY, "--records", tmp_path / "rec", *extra)
        assert code == 2 and f"{path.name}: current: engine spec" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_round_resumed_in_its_measure_stage_lists_a_skip_once(tmp_path):
    from specpilot.auditors.round import RoundConfig, run_round

    class Stop(Exception):
        pass

    def stop_after_the_skip(stage, msg):
        if stage == "measure" and msg.startswith("skipped: profile"):
            raise Stop

    cfg = RoundConfig(deployment=TINY, out_dir=str(tmp_path / "r"), budget_min=0.1, records_dir=str(tmp_path / "rec"),
                      candidates=["chain"], n_prompts=2, max_new_tokens=8)
    with pytest.raises(Stop):
        run_round(cfg, notify=stop_after_the_skip)
    res = run_round(RoundConfig(out_dir=str(tmp_path / "r")), resume=True)
    skipped = res.state["stages"]["measure"]["skipped"]
    assert sum(s.startswith("profile: no GPU kernels") for s in skipped) == 1, skipped
