"""What --resume and report accept from a round's folder, and what a refused resume leaves alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from round_support import TINY, small_round


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    small_round(d / "r", "--records", str(d / "rec"))
    return d


def _copy(done, tmp_path, **changes):
    r = tmp_path / "r"
    shutil.copytree(done / "r", r)
    state = json.loads((r / "round.json").read_text())
    for k, v in changes.items():
        if k.startswith("stage_"):
            state["stages"]["measure"][k[6:]] = v
        elif k.startswith("config_"):
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
    ({"load_average_start": "abc"}, "round.json: load_average_start must be a number or null"),
    ({"stage_status": "weird"}, "round.json: stages.measure.status must be one of pending, running, done, not run, "
                                "interrupted, failed;"),
    # no round writes it (a round out of budget marks its stages "not run"); read as done, it hid a stage
    ({"stage_status": "stopped"}, "round.json: stages.measure.status must be one of pending, running, done,"),
    ({"stage_seconds": "1.2"}, "round.json: stages.measure.seconds must be a number of seconds"),
    ({"stage_skipped": [None]}, "round.json: stages.measure.skipped must be a list of text"),
    ({"notes": [1]}, "round.json: notes must be a list of text"),
    ({"round_id": 7}, "round.json: round_id must be text or null"),
    ({"shape": {"prompts": -1, "max_new_tokens": 8}}, "round.json: shape must be null or {prompts, max_new_tokens}"),
    ({"shape": "2x8"}, "round.json: shape must be null or {prompts, max_new_tokens}"),
    ({"final_samples": {"system": TINY, "samples": ["x"], "noise": 0.01, "outputs": None}},
     "round.json: final_samples.samples must be a list of tokens/s"),
    ({"final_samples": {"system": TINY, "samples": [1.0], "noise": 0.01, "outputs": 3}},
     "round.json: final_samples.outputs must be"),
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
    for current, words in (("engine:model=tiny,bogus=1", "current: engine spec"),
                           # another model's system: the round measured SmolLM2 for a tiny deployment
                           ("engine:model=smollm2,mode=ar,threads=1", "current: engine:model=smollm2,mode=ar,threads=1"
                                                                       " is not a system of this deployment (model "
                                                                       "smollm2 against tiny)")):
        doc["current"] = current
        path.write_text(yaml.safe_dump(doc))
        for extra in (["--dry-run"], ["--out-dir", tmp_path / "o"]):
            code, _, err = run_cli("round", TINY, "--records", tmp_path / "rec", *extra)
            assert code == 2 and f"{path.name}: {words}" in err and err.count("\n") == 1, err
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [[], ["--fresh"], ["--fresh", "--no-remember"]])
def test_a_new_round_refuses_a_damaged_record_before_it_runs(done, tmp_path, run_cli, extra):
    """A new round reads the record for its start and its plan (the last round's rate, --fresh too)
    and adds to it at its end: a damaged one is named before the round's folder is made (it ran the
    whole round and crashed at its remember stage, or crashed planning)."""
    import yaml

    shutil.copytree(done / "rec", tmp_path / "rec")
    path = next((tmp_path / "rec").glob("*.yaml"))
    doc = yaml.safe_load(path.read_text())
    doc["rounds"] = 5
    path.write_text(yaml.safe_dump(doc))
    for mode in (["--dry-run"], ["--out-dir", tmp_path / "o"]):
        code, _, err = run_cli("round", TINY, "--records", tmp_path / "rec", *extra, *mode)
        assert code == 2 and f"{path}: malformed deployment-record (rounds must be a list of rounds, not 5)" in err, err
        assert err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def _cut_round(folder, stop, budget_min: float = 1.0, exc=KeyboardInterrupt):
    """A tiny round (chain, 2 prompts of 8 tokens) in ``folder / "r"``, cut by ``exc`` where
    ``stop(stage, msg)`` says, as a signal or a kill leaves it."""
    from specpilot.auditors.round import RoundConfig, run_round

    def notify(stage, msg):
        if stop(stage, msg):
            raise exc

    cfg = RoundConfig(deployment=TINY, out_dir=str(folder / "r"), budget_min=budget_min,
                      records_dir=str(folder / "rec"), candidates=["chain"], n_prompts=2, max_new_tokens=8)
    with pytest.raises(exc):
        run_round(cfg, notify=notify)
    return folder / "r"


def test_a_round_resumed_in_its_measure_stage_lists_a_skip_once(tmp_path):
    from specpilot.auditors.round import RoundConfig, run_round

    class Stop(Exception):
        pass

    _cut_round(tmp_path, lambda stage, msg: stage == "measure" and msg.startswith("skipped: profile"), 0.1, Stop)
    res = run_round(RoundConfig(out_dir=str(tmp_path / "r")), resume=True)
    skipped = res.state["stages"]["measure"]["skipped"]
    assert sum(s.startswith("profile: no GPU kernels") for s in skipped) == 1, skipped


def test_an_interrupted_round_reports_itself_unfinished_and_check_says_how_to_finish_it(tmp_path, run_cli):
    """An interrupt mid-approve: the stage keeps its time and says it was interrupted; the report
    says the round stopped, what is left and how to continue, not a final system; check says the
    round is unfinished, not only that baseline.json is missing; a resume finishes it."""
    from specpilot.auditors.round import RoundConfig, run_round

    timed = []

    def interrupt_at_the_second_candidate(stage, msg):
        if stage == "approve" and "paired runs against" in msg:
            timed.append(msg)
            if len(timed) == 2:
                raise KeyboardInterrupt

    r = tmp_path / "r"
    # the interrupt comes from the second candidate's start, not the clock: a budget no loaded machine runs out of
    cfg = RoundConfig(deployment=TINY, out_dir=str(r), budget_min=2.0, records_dir=str(tmp_path / "rec"),
                      candidates=["chain", "tree"], n_prompts=2, max_new_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        run_round(cfg, notify=interrupt_at_the_second_candidate)
    state = json.loads((r / "round.json").read_text())
    approve = state["stages"]["approve"]
    assert approve["status"] == "interrupted" and approve["seconds"] > 0, approve
    assert state["final"] is None and state["stages"]["remember"]["status"] == "pending"
    judged = timed[0].split(":")[0]
    left = timed[1].split(":")[0]

    code, _, err = run_cli("report", r)
    assert code == 0, err
    md = (r / "report.md").read_text()
    html = (r / "report.html").read_text()
    assert "The round stopped before it finished" in md and "approve was interrupted after" in md, md[:800]
    assert f"Stages left: approve, remember; continue it with `specpilot round --resume {r}`" in md, md[:800]
    assert "1 of 2 candidates judged" in md and f"not judged yet: {left}." in md, md
    assert "and ends with" not in md and "no final system yet" in md
    assert "<b>The round stopped before it finished</b>" in html
    code, _, err = run_cli("check", "--baseline", r, "--runs", "2")
    assert code == 2 and err.count("\n") == 1 and "the round is unfinished (stages left: approve, remember)" in err \
        and f"specpilot round --resume {r}" in err, err

    res = run_round(RoundConfig(out_dir=str(r)), resume=True)
    assert res.state["stages"]["approve"]["status"] == "done" and res.state["final"], res.state["stages"]
    assert [d.id for d in res.decisions] == [judged, left] and (r / "baseline.json").is_file()


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A tiny round interrupted in approve, as a kill would leave it."""
    d = tmp_path_factory.mktemp("interrupted")
    _cut_round(d, lambda stage, msg: stage == "approve" and "paired runs against" in msg)
    return d


def _report_and_resume_refuse(run_cli, r, words):
    """``report`` and ``round --resume`` of the damaged round ``r`` each exit 2 with one line holding
    ``words`` (not the generic type message), and the folder stays as it was."""
    before = _files(r)
    for args in (("report", r), ("round", "--resume", r)):
        code, _, err = run_cli(*args)
        assert code == 2 and words in err and err.count("\n") == 1 and "wrong type" not in err, (args, err)
    assert _files(r) == before


def _files(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "-2", "0"])
def test_resume_refuses_a_budget_that_is_not_positive_minutes_before_anything_is_written(
        interrupted, tmp_path, run_cli, budget):
    r = tmp_path / "r"
    shutil.copytree(interrupted / "r", r)
    before, rec = _files(r), _files(interrupted / "rec")
    code, out, err = run_cli("round", "--resume", r, "--budget", budget)
    assert code == 2 and err.count("\n") == 1 and "give the minutes the round may take (> 0)" in err, err
    assert f"--budget {float(budget)}: give" in err and "internal error" not in err, err
    assert _files(r) == before and _files(interrupted / "rec") == rec
    assert not (r / "baseline.json").exists()


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"


GONE = object()   # _set's value that deletes the field
TLV = {"spec": "engine:model=tiny,mode=tlv,nodes=16,threads=1", "nodes": 16, "tau": 2.0,
       "time_ms": {"qpass": 1.0, "exact": 2.0}}


def _set(doc, path, value):
    *head, last = path
    for k in head:
        doc = doc[k]
    if value is GONE:
        del doc[last]
    else:
        doc[last] = value


@pytest.mark.parametrize("rel, path, value, words", [
    ("model/model.json", ("factors", "tree"), "big", "model.json: malformed round-model (factors.tree must be"),
    ("model/model.json", ("by_nodes", 0, "c"), None, "model.json: malformed round-model (by_nodes[0].c must be"),
    ("model/model.json", ("current", "speedup"), float("nan"), "model.json: malformed round-model (current.speedup"),
    ("model/model.json", ("current", "speedup"), -3, "model.json: malformed round-model (current.speedup must be a "
                                                     "number > 0 or null"),
    ("model/model.json", ("cost_model", "ceiling"), -7, "model.json: malformed round-model (cost_model.ceiling must be "
                                                        "a number > 0"),
    ("approve/decisions.json", ("decisions", 0, "timing", "gain"), "x",
     "decisions.json: malformed round-decisions (decisions[0] (chain): timing.gain must be a number"),
    ("approve/decisions.json", ("decisions", 0, "audit", "systems", 0, "tokens"), "x",
     "decisions.json: malformed round-decisions (decisions[0] (chain): audit.systems[0].tokens must be"),
    ("measure/measure.json", ("replay", "policies", 0, "tau"), "x",
     "measure.json: malformed round-measure (replay.policies[0].tau must be a number >= 1"),
    ("measure/measure.json", ("replay", "curves", "chain", "1"), float("inf"),
     "measure.json: malformed round-measure (replay.curves.chain['1'] must be"),
    # the replay's counts the report prints, and what the model and propose stages read
    ("measure/measure.json", ("replay", "steps"), GONE, "measure.json: malformed round-measure (replay.steps must be"),
    ("measure/measure.json", ("replay", "policies", 0, "nodes"), GONE,
     "measure.json: malformed round-measure (replay.policies[0].nodes must be"),
    ("measure/measure.json", ("verify_rows", "chain", "8"), {"9": -1},
     "measure.json: malformed round-measure (verify_rows.chain['8']['9'] must be a whole number of steps >= 1"),
    ("measure/measure.json", ("lattice", "m"), -1, "measure.json: malformed round-measure (lattice.m must be"),
    ("measure/measure.json", ("current_policy",), None,
     "measure.json: malformed round-measure (current_policy must be a policy name"),
    ("measure/measure.json", ("skipped",), "x", "measure.json: malformed round-measure (skipped must be a list"),
    ("measure/measure.json", ("tlv",), dict(TLV, time_ms={"qpass": "x", "exact": 2.0}),
     "measure.json: malformed round-measure (tlv.time_ms.qpass must be"),
    ("measure/measure.json", ("tlv",), dict(TLV, spec="engine:model=tiny,bogus=1"),
     "measure.json: malformed round-measure (tlv.spec: engine spec"),
    ("measure/measure.json", ("tlv",), dict(TLV, tau=None), "measure.json: malformed round-measure (tlv.tau must be"),
    ("measure/measure.json", ("profile",), {"steps": 4, "classes": "linear"},
     "measure.json: malformed round-measure (profile.classes must be"),
    ("measure/measure.json", ("calibration",), None, "measure.json: malformed round-measure (calibration must be"),
    ("measure/measure.json", ("calibration", "prefill_s"), GONE,
     "measure.json: malformed round-measure (calibration.prefill_s must be a number >= 0, not missing"),
    ("approve/decisions.json", ("decisions", 0, "timing", "gain"), -1.0,
     "decisions.json: malformed round-decisions (decisions[0] (chain): timing.gain must be a number > 0"),
    ("approve/decisions.json", ("decisions", 0, "timing", "load_average"), "x",
     "decisions.json: malformed round-decisions (decisions[0] (chain): timing.load_average must be"),
    ("approve/decisions.json", ("decisions", 0, "audit", "systems", 0, "mismatch_rate"), GONE,
     "decisions.json: malformed round-decisions (decisions[0] (chain): audit.systems[0].mismatch_rate must be"),
    ("approve/decisions.json", ("decisions", 0, "audit", "verdict"), "maybe",
     "decisions.json: malformed round-decisions (decisions[0] (chain): audit.verdict must be pass or reject"),
    ("approve/decisions.json", ("decisions", 0, "timing", "changes_output"), "no",
     "decisions.json: malformed round-decisions (decisions[0] (chain): timing.changes_output must be"),
    ("propose/candidates.json", ("not_proposed",), "x",
     "candidates.json: malformed round-candidates (not_proposed must be a list"),
    ("propose/candidates.json", ("candidates",), [{"id": "chain", "memory": None, "what": "w", "attacks": None,
                                                   "system": "engine:model=tiny,bogus=1"}],
     "candidates.json: malformed round-candidates (candidates[0] (chain).system: engine spec"),
    ("propose/candidates.json", ("candidates",), [{"id": ["chain"], "memory": None, "what": "w", "attacks": None}],
     "candidates.json: malformed round-candidates (candidates[0].id must be a candidate name"),
    ("remember/changes.json", ("after", "rounds"), "x", "changes.json: malformed round-memory (after.rounds must be"),
    ("remember/changes.json", ("before",), GONE, "changes.json: malformed round-memory (before must be"),
])
def test_a_damaged_stage_file_is_refused_by_report_and_resume_alike_naming_file_and_field(
        done, tmp_path, run_cli, rel, path, value, words):
    r = _copy(done, tmp_path)
    doc = json.loads((r / rel).read_text())
    if rel == "approve/decisions.json":   # the tiny round's candidate may be skipped for time: the shipped one's runs
        shipped = json.loads((EXAMPLE / rel).read_text())["decisions"][0]
        doc["decisions"][0].update(timing=shipped["timing"], audit=shipped["audit"])
    _set(doc, path, value)
    (r / rel).write_text(json.dumps(doc))
    _report_and_resume_refuse(run_cli, r, words)


def test_the_report_of_a_copied_unfinished_round_says_to_resume_the_copy(interrupted, tmp_path, run_cli):
    r = tmp_path / "copy"
    shutil.copytree(interrupted / "r", r)
    code, _, err = run_cli("report", r)
    assert code == 0, err
    md = (r / "report.md").read_text()
    assert f"continue it with `specpilot round --resume {r}`" in md, md[:800]
    summary = next(p for p in md.split("\n\n") if "The round stopped before it finished" in p)
    assert str(interrupted / "r") not in summary, summary


def test_round_json_keeps_the_measure_stage_time_after_each_step(tmp_path):
    """A round killed mid-measure (kill -9: no handler runs) shows the time it had spent in the
    stage: round.json is saved after each step, not only at the stage's start."""
    from specpilot.auditors.round import RoundConfig, run_round

    import time

    r = tmp_path / "r"
    seen, t = {}, {}

    def snapshot(stage, msg):
        if stage == "measure" and msg.startswith("loading the current system"):
            t["loading"] = time.perf_counter()
        if stage == "measure" and msg.startswith("T_AR"):
            t["rows"] = time.perf_counter()
            seen.update(json.loads((r / "round.json").read_text()))
            raise SystemExit(137)   # what is on disk now is all a killed round leaves

    cfg = RoundConfig(deployment=TINY, out_dir=str(r), budget_min=0.1, records_dir=str(tmp_path / "rec"),
                      candidates=["chain"], n_prompts=2, max_new_tokens=8)
    with pytest.raises(SystemExit):
        run_round(cfg, notify=snapshot)
    measure = seen["stages"]["measure"]
    # the calibration and the rows probe ran after the load notice: the stage's seconds include them
    # (saved just before the notice: a little less than the test's own clock says, never the ~0 s of the start)
    assert measure["status"] == "running" and measure["seconds"] >= 0.5 * (t["rows"] - t["loading"]) > 0, (measure, t)


def test_an_interrupted_round_says_how_to_continue_it(tmp_path):
    from specpilot.auditors.round import RoundConfig, run_round

    def interrupt_in_approve(stage, msg):
        if stage == "approve" and "paired runs against" in msg:
            raise KeyboardInterrupt

    r = tmp_path / "r"
    cfg = RoundConfig(deployment=TINY, out_dir=str(r), budget_min=1.0, records_dir=str(tmp_path / "rec"),
                      candidates=["chain"], n_prompts=2, max_new_tokens=8)
    with pytest.raises(KeyboardInterrupt) as e:
        run_round(cfg, notify=interrupt_in_approve)
    assert e.value.__notes__ == [f"the round's files are in {r}; continue it with specpilot round --resume {r}"]


def _remember_pending(done, tmp_path):
    """A copy of the finished round whose remember stage is pending, its records in a copy of them."""
    r = _copy(done, tmp_path)
    shutil.copytree(done / "rec", tmp_path / "rec")
    state = json.loads((r / "round.json").read_text())
    state["config"]["records_dir"] = str(tmp_path / "rec")
    state["stages"]["remember"]["status"] = "pending"
    (r / "round.json").write_text(json.dumps(state))
    return r


def test_a_round_stopped_while_it_renders_its_report_says_how_to_write_it(done, tmp_path, run_cli, monkeypatch):
    """SIGTERM after the last stage, in the report: the last line says that 'specpilot report DIR'
    writes it (it said only 'interrupted by SIGTERM', and a resume then finds the round complete)."""
    import signal

    from specpilot import signals
    from specpilot.reports import round_report

    r = _remember_pending(done, tmp_path)
    (r / "report.md").unlink(missing_ok=True)

    def stopped(_dir):
        raise signals.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(round_report, "write_report", stopped)
    code, _, err = run_cli("round", "--resume", r)
    assert code == 143, err
    assert err.splitlines()[-1] == (f"specpilot: interrupted by SIGTERM; the round's files are in {r}; its report is "
                                    f"not written: specpilot report {r} writes it"), err
    assert not (r / "report.md").exists()


def test_resuming_a_finished_round_prints_its_summary_in_json(done, tmp_path, run_cli):
    r = _copy(done, tmp_path)
    before = _files(r)
    code, out, err = run_cli("round", "--resume", r, "--format", "json")
    assert code == 0 and "is complete: nothing to resume" in err, err
    data = json.loads(out)
    assert data["schema"] == "specpilot.round-summary/1" and data["dir"] == str(r) and data["final"], data
    assert [d["id"] for d in data["decisions"]] == ["chain"]
    assert _files(r) == before


def test_n_prompts_above_the_prompt_file_warns_naming_both(run_cli, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("one\ntwo\nthree\n")
    code, _, err = run_cli("round", TINY, "--prompts", f, "--n-prompts", "50", "--dry-run", "--records", tmp_path / "rec")
    assert code == 0, err
    warns = [line for line in err.splitlines() if "warning" in line]
    assert warns == [f"specpilot: warning: --n-prompts 50: {f} holds 3 prompts; the round runs those 3"], err


def test_n_prompts_above_the_built_in_prompts_is_noted():
    """Without --prompts a model with a tokenizer runs the built-in chat prompts: more asked than
    there are is a note of the measure stage (the round ran fewer without a word)."""
    from specpilot.auditors.prompts_builtin import PROMPTS
    from specpilot.auditors.round.inputs import short_prompts_note
    from specpilot.auditors.round.run import RoundConfig

    cfg = RoundConfig(deployment=TINY, out_dir="r", n_prompts=len(PROMPTS) + 36)
    note = short_prompts_note(cfg, None, PROMPTS)
    assert note == (f"--n-prompts {len(PROMPTS) + 36}: the built-in prompts are {len(PROMPTS)}; the round runs "
                    "those (--prompts FILE for more)")
    assert short_prompts_note(RoundConfig(deployment=TINY, out_dir="r", n_prompts=3), None, PROMPTS[:3]) is None
    assert short_prompts_note(cfg, [object()], PROMPTS[:3]) is None   # a --prompts file: warned of at the start


def test_report_says_when_the_report_folder_is_a_file(done, tmp_path, run_cli):
    r = _copy(done, tmp_path)
    shutil.rmtree(r / "report", ignore_errors=True)
    (r / "report").write_text("not a folder")
    code, _, err = run_cli("report", r)
    assert code == 2 and err.count("\n") == 1 and f"{r / 'report'}: not a folder" in err, err


@pytest.mark.parametrize("name", ["report.md", "report.html"])
@pytest.mark.parametrize("first", [True, False])
def test_report_out_on_the_rounds_own_report_is_refused_as_such(done, tmp_path, run_cli, name, first):
    """--out writes the list of what report wrote: over report.md it would replace the report (which
    was refused as an 'input file', or, on a first render, after the report was written)."""
    r = _copy(done, tmp_path)
    if first:
        for n in ("report.md", "report.html"):
            (r / n).unlink(missing_ok=True)
    before = _files(r)
    code, _, err = run_cli("report", r, "--out", r / name)
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--out {r / name}: refusing to overwrite the round's own {name} (it is rewritten by `specpilot report "
            f"{r}`); choose another --out") in err, err
    assert _files(r) == before
    code, _, err = run_cli("report", r, "--out", r / "round.json")   # the round's real input files stay refused
    assert code == 2 and "refusing to overwrite input file" in err and _files(r) == before, err


def test_a_measure_stage_run_again_keeps_only_its_own_notes(tmp_path, run_cli):
    """A round cut short in measure (killed: round.json is saved after each step) runs the stage
    again on resume; the notes of the cut run go with it (a 'skipped' line the new run contradicts
    stayed in the report). The resume is recorded in round.json (with the minutes it gave) and
    named in the report beside the command that started the round."""
    r = _cut_round(tmp_path, lambda stage, msg: stage == "measure" and msg.startswith("T_AR"))
    state = json.loads((r / "round.json").read_text())
    assert not (r / "measure" / "measure.json").exists()
    state["stages"]["measure"]["skipped"].append("lattice recording: a note of the cut run")
    (r / "round.json").write_text(json.dumps(state))
    code, out, err = run_cli("round", "--resume", r, "--budget", "1")
    assert code == 0, err
    measure = json.loads((r / "round.json").read_text())["stages"]["measure"]
    assert "lattice recording: a note of the cut run" not in measure["skipped"], measure
    assert any(n.startswith("profile: no GPU kernels") for n in measure["skipped"]), measure
    assert json.loads((r / "round.json").read_text())["resumes"] == [{"budget_min": 1}]
    md = (r / "report.md").read_text()
    assert f"`, resumed with `specpilot round --resume {r} --budget 1` (" in md and "over its 2 sessions" in md, md[:900]


@pytest.mark.parametrize("damage, words", [
    (lambda t: t.replace("rounds:", "rounds: [", 1), "record.yaml: not valid YAML"),
    (lambda t: "- a list\n", "record.yaml: unknown schema"),
    ("gain", "record.yaml: malformed deployment-record (rounds[0].approved[0].gain must be a number > 0"),
    ("unverified", "record.yaml: malformed deployment-record (rounds[0].approved[0].unverified must be a list of text"),
])
def test_a_damaged_record_copy_is_refused_by_report_and_resume_naming_file_and_field(
        done, tmp_path, run_cli, damage, words):
    """remember/record.yaml is the record the report quotes the approved mechanisms from."""
    import yaml

    r = _copy(done, tmp_path)
    f = r / "remember" / "record.yaml"
    if callable(damage):
        f.write_text(damage(f.read_text()))
    else:
        doc = yaml.safe_load(f.read_text())
        doc["rounds"][-1]["approved"] = [{"id": "chain", "gain": "fast" if damage == "gain" else 1.1,
                                          "unverified": "all" if damage == "unverified" else []}]
        f.write_text(yaml.safe_dump(doc))
    _report_and_resume_refuse(run_cli, r, words)


def test_a_truncated_changes_file_is_named_by_the_report(done, tmp_path, run_cli):
    r = _copy(done, tmp_path)
    f = r / "remember" / "changes.json"
    f.write_text(f.read_text()[:60])
    before = _files(r)
    code, _, err = run_cli("report", r)
    assert code == 2 and f"{f}:" in err and "not valid JSON" in err and err.count("\n") == 1, err
    assert _files(r) == before


def _reopen(r, *stages):
    state = json.loads((r / "round.json").read_text())
    for s in stages:
        state["stages"][s]["status"] = "pending"
    (r / "round.json").write_text(json.dumps(state))


@pytest.mark.parametrize("rel, edit, words", [
    ("prompts.jsonl", lambda row: row.pop("id"), 'prompts.jsonl:1: row has no "id"'),
    ("prompts.jsonl", lambda row: row.update(prompt_ids="12"), "prompts.jsonl:1: prompt_ids must be a list of token ids"),
    ("prompts.jsonl", lambda row: row.update(prompt_ids=[1.5]), "prompts.jsonl:1: prompt_ids must hold token ids"),
    ("prompts.jsonl", lambda row: row.update(prompt_ids=[10 ** 6]), "token id 1000000 is outside the vocabulary"),
    ("approve/stock.outputs.jsonl", lambda row: row.update(output_ids="x"),
     "stock.outputs.jsonl:1: output_ids must be a list of token ids"),
    # the scorer indexed its logits with it: the resume crashed (IndexError) after the paired runs
    ("approve/stock.outputs.jsonl", lambda row: row.update(output_ids=[t + 1000 for t in row["output_ids"]]),
     "stock.outputs.jsonl:1: prompt 'p0': token id "),
    ("approve/stock.outputs.jsonl", lambda row: row.update(id="p99"),
     "stock.outputs.jsonl:1: prompt 'p99' is not one of the round's prompts (prompts.jsonl)"),
])
def test_a_resume_refuses_damaged_prompts_or_outputs_before_its_stages_write(done, tmp_path, run_cli, rel, edit, words):
    """The prompts and reference outputs a resumed approve stage reads are checked before it starts
    (it crashed on a prompt without an id, or marked the stage failed in round.json)."""
    r = _copy(done, tmp_path)
    _reopen(r, "approve", "remember")
    rows = [json.loads(line) for line in (r / rel).read_text().splitlines()]
    edit(rows[0])
    (r / rel).write_text("".join(json.dumps(x) + "\n" for x in rows))
    before, rec = _files(r), _files(done / "rec")
    code, _, err = run_cli("round", "--resume", r)
    assert code == 2 and words in err and err.count("\n") == 1 and "internal error" not in err, err
    assert _files(r) == before and _files(done / "rec") == rec


def test_a_resume_refuses_reference_outputs_that_miss_a_run_prompt(done, tmp_path, run_cli):
    """The approve stage pairs every run prompt against the stock outputs it reuses: one missing is
    named with the file before anything runs (the paired runs ran first, then the stage failed with
    'systems were not run on the same prompts')."""
    r = _copy(done, tmp_path)
    _reopen(r, "approve", "remember")
    (r / "approve" / "decisions.json").unlink()
    f = r / "approve" / "stock.outputs.jsonl"
    f.write_text(f.read_text().splitlines()[0] + "\n")
    before, rec = _files(r), _files(done / "rec")
    code, _, err = run_cli("round", "--resume", r)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{f}: no output for prompt 'p1' (1 of the round's 2 run prompts)" in err, err
    assert _files(r) == before and _files(done / "rec") == rec


def test_a_resume_refuses_reference_outputs_of_other_prompts_naming_file_and_line(done, tmp_path, run_cli):
    """Stock's rows given to other prompts (each id another prompt's row): named before any run (the
    paired runs ran first, then the stage failed naming neither the file nor the line)."""
    r = _copy(done, tmp_path)
    _reopen(r, "approve", "remember")
    (r / "approve" / "decisions.json").unlink()
    f = r / "approve" / "stock.outputs.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    assert len(rows) >= 2 and rows[0]["prompt_ids"] != rows[1]["prompt_ids"]
    ids = [x["id"] for x in rows]
    f.write_text("".join(json.dumps(dict(x, id=i)) + "\n" for x, i in zip(rows, ids[1:] + ids[:1])))
    before, rec = _files(r), _files(done / "rec")
    code, _, err = run_cli("round", "--resume", r)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{f}:1: prompt {ids[1]!r}: prompt_ids differ from those of the prompt in prompts.jsonl" in err, err
    assert _files(r) == before and _files(done / "rec") == rec


@pytest.mark.parametrize("edit, words", [
    (lambda doc: doc.update(rounds=5), "malformed deployment-record (rounds must be a list of rounds, not 5)"),
    (lambda doc: doc.update(current=["a"]), "malformed deployment-record (current must be a system (text) or null"),
])
def test_a_resume_refuses_a_damaged_deployment_record_before_its_remember_stage(done, tmp_path, run_cli, edit, words):
    """The remember stage appends to the record in --records: a damaged one is named before the
    resume writes anything (it crashed there, or wrote the round's record copy and changes first)."""
    import yaml

    r = _remember_pending(done, tmp_path)
    f = next((tmp_path / "rec").glob("*.yaml"))
    doc = yaml.safe_load(f.read_text())
    edit(doc)
    f.write_text(yaml.safe_dump(doc))
    before, rec = _files(r), _files(tmp_path / "rec")
    code, _, err = run_cli("round", "--resume", r)
    assert code == 2 and f"{f}: {words}" in err and err.count("\n") == 1, err
    assert _files(r) == before and _files(tmp_path / "rec") == rec


def test_a_resume_with_more_minutes_checks_the_prompts_before_it_reopens_skipped_candidates(done, tmp_path, run_cli):
    r = _copy(done, tmp_path)
    d = r / "approve" / "decisions.json"
    doc = json.loads(d.read_text())
    doc["decisions"][0].update(verdict="skipped", reason="budget: 5 s left", timing=None, audit=None, files={}, pairs=0)
    d.write_text(json.dumps(doc))
    f = r / "prompts.jsonl"
    f.write_text(f.read_text().replace('"prompt_ids"', '"ids"', 1))
    before = _files(r)
    code, _, err = run_cli("round", "--resume", r, "--budget", "1")
    assert code == 2 and "prompts.jsonl:1: row needs" in err and err.count("\n") == 1, err
    assert _files(r) == before


def test_a_round_folder_in_use_is_refused_by_a_second_resume(done, tmp_path, run_cli):
    """Two sessions of one round would judge its candidates twice and rewrite each other's files:
    while one holds the folder's lock a resume there is refused (exit 2, one line, nothing written);
    once it is released the resume goes on."""
    import os

    from specpilot.auditors.round.state import LOCK_FILE, hold_folder

    r = _copy(done, tmp_path)
    fd = hold_folder(r)   # what a running session holds (flock: another open of the file is another holder)
    try:
        before = _files(r)
        code, out, err = run_cli("round", "--resume", r)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert "another specpilot round is running in this folder" in err and _files(r) == before, err
    finally:
        os.close(fd)
    code, out, err = run_cli("round", "--resume", r)
    assert code == 0 and "complete" in err + out, err
    fresh = tmp_path / "fresh"   # a folder holding nothing but a lock file takes a new round
    fresh.mkdir()
    (fresh / LOCK_FILE).touch()
    code, out, err = run_cli("round", "engine:model=tiny,mode=ar", "--out-dir", fresh, "--dry-run")
    assert code == 0, err


def test_a_damaged_record_of_resumes_is_refused(done, tmp_path, run_cli):
    _report_and_resume_refuse(run_cli, _copy(done, tmp_path, resumes=[{"budget_min": "x"}]), "resumes must be")


def test_a_budget_of_zero_in_round_json_is_damage(done, tmp_path, run_cli):
    """round --budget takes minutes > 0: a round.json with 0 was edited, not written by a round."""
    _report_and_resume_refuse(run_cli, _copy(done, tmp_path, budget_s=0), "budget_s must be a number of seconds > 0")


def test_a_round_cut_for_time_in_measure_says_so_and_a_resume_does_not_pretend(done, tmp_path, run_cli):
    """A round whose measure stage skipped its lattice for want of time finished as if whole, and
    '--resume --budget' answered 'complete: nothing to resume' (exit 0): more time never measured it.
    The summary and the report say what was cut; a resume with more time is refused, saying why."""
    r = _copy(done, tmp_path)
    state = json.loads((r / "round.json").read_text())
    state["stages"]["measure"]["skipped"].append("budget: lattice recording: needs ~3 s, 1 s left in the stage: "
                                                 "tau(N) unknown")
    (r / "round.json").write_text(json.dumps(state))
    code, _, err = run_cli("round", "--resume", r, "--budget", "1")
    assert code == 2 and "its measure stage skipped lattice recording for want of time" in err, err
    assert "start a new round with a larger --budget" in err
    code, out, err = run_cli("round", "--resume", r)
    assert code == 0, err
    assert "cut for time: the measure stage skipped lattice recording: needs ~3 s" in out, out
    code, _, err = run_cli("report", r)
    assert code == 0, err
    assert "**Cut for time**: the measure stage skipped lattice recording" in (r / "report.md").read_text()


def test_a_round_out_of_budget_in_approve_says_how_to_judge_the_rest(done, tmp_path, run_cli):
    """Candidates the approve stage skipped for want of time: the finished round's report opened
    'Approved: nothing; refused: ...' and neither it nor the summary said a resume with --budget
    judges them."""
    r = _copy(done, tmp_path)
    dpath = r / "approve" / "decisions.json"
    doc = json.loads(dpath.read_text())
    doc["decisions"][0].update(verdict="skipped", reason="budget: 0 s left, not enough for 4 paired runs")
    dpath.write_text(json.dumps(doc))
    name = doc["decisions"][0]["id"]
    code, out, err = run_cli("round", "--resume", r)
    assert code == 0, err
    assert f"out of budget: not judged {name} (specpilot round --resume {r} --budget MINUTES judges them)" in out
    code, _, err = run_cli("report", r)
    assert code == 0, err
    assert (f"**Out of budget**: the approve stage did not judge {name}; `specpilot round --resume {r} --budget "
            "MINUTES` judges them.") in (r / "report.md").read_text()
    # cut for time in measure too: both said (the cut line hid the candidates left unjudged)
    state = json.loads((r / "round.json").read_text())
    state["stages"]["measure"]["skipped"].append("budget: TLV recording: needs ~3 s, 1 s left in the stage")
    (r / "round.json").write_text(json.dumps(state))
    code, out, err = run_cli("round", "--resume", r)
    assert code == 0 and "cut for time: the measure stage skipped TLV recording" in out and f"not judged {name}" in out


def test_a_noisy_rows_probe_is_probed_again_and_its_warning_kept(tmp_path, monkeypatch):
    """A rows probe whose steps of more rows timed faster than one row (a busy machine) warned in
    rows.json only: the round built its cost model on it and said nothing."""
    from specpilot.auditors.round import measure as ms

    real, calls = ms.rows_probe, []

    def noisy(*a, **k):
        doc, _, ar = real(*a, **k)
        calls.append(1)
        for p in doc["points"]:
            if p["rows"] > 1:
                p["c"], p["step_ms"] = 0.5, ar * 0.5
        doc["warnings"] = ["c(N) below 0.95 at 2 rows (0.5): noise"]
        return doc, {p["rows"]: p["step_ms"] for p in doc["points"]}, ar

    monkeypatch.setattr(ms, "rows_probe", noisy)
    r = small_round(tmp_path / "r", "--budget", "2", "--records", str(tmp_path / "rec"))
    assert len(calls) == 2
    notes = json.loads((r / "round.json").read_text())["stages"]["measure"]["notes"]
    assert "rows probe: c(N) below 0.95 at 2 rows (0.5): noise" in notes
    assert "rows probe: c(N) below 0.95 at 2 rows (0.5): noise" in (r / "report.md").read_text()


def test_the_measure_stage_counts_the_recording_engines_load(tmp_path, monkeypatch):
    """The lattice and TLV recordings were sized by their decoding alone: the engines they load
    (seconds each on SmolLM2) took the stage past its share of the budget."""
    from specpilot.auditors.round import engines

    monkeypatch.setattr(engines.EnginePool, "typical_load_s", lambda self, default: 1000.0)
    r = small_round(tmp_path / "r", "--budget", "2", "--records", str(tmp_path / "rec"))
    skipped = json.loads((r / "round.json").read_text())["stages"]["measure"]["skipped"]
    assert any(s.startswith("budget: lattice recording: needs ~1e+03 s") for s in skipped), skipped


def test_the_json_summary_carries_the_gain_and_audit_verdict_the_table_shows(done, tmp_path, run_cli):
    """--format json gave every decision timing and audit null: no gain, no verdict for a tool."""
    r = _copy(done, tmp_path)
    code, out, err = run_cli("round", "--resume", r, "--format", "json")
    assert code == 0, err
    doc = json.loads((r / "approve" / "decisions.json").read_text())
    judged = {d["id"]: d for d in doc["decisions"] if d.get("timing")}
    assert judged
    for d in json.loads(out)["decisions"]:
        if d["id"] in judged:
            assert d["gain"] == judged[d["id"]]["timing"]["gain"]
            assert d["audit_verdict"] == (judged[d["id"]].get("audit") or {}).get("verdict")
