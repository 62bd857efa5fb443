"""``specpilot round``'s checks of what it reads: the prompts against the engine's cache before the
round starts, and the numbers of its own JSON files (decisions, measure, candidates) when a report
or a resume reads them again."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import one_error

TINY = "engine:model=tiny,mode=ar,threads=1"
TIGHT = "engine:model=tiny,mode=ar,threads=1,ctx=256"


def _prompts(path, rows):
    path.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", **r}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("long_prompt", [{"id": "long", "text": "x" * 200},   # the tiny model's tokens are bytes
                                         {"id": "long", "prompt_ids": [5] * 200}])
def test_a_prompt_that_leaves_no_room_for_the_draft_rows_is_refused_before_the_round(run_cli, tmp_path,
                                                                                      long_prompt):
    """200 tokens + 32 new tokens fit ctx=256 alone, not with the 43 cache slots the largest tree a
    round runs reserves (32 nodes + the pending token, depth 8, two), text prompts counted too."""
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "short", "text": "hello"}, long_prompt])
    for extra in (["--dry-run"], ["--out-dir", tmp_path / "r", "--no-remember"]):
        code, _, err = run_cli("round", TIGHT, "--prompts", prompts, "--max-new-tokens", "32", *extra)
        assert code == 2, err
        assert (f"{prompts}: prompt 'long': 200 tokens + 32 new tokens + 43 cache slots for draft rows do not fit the "
                "engine's cache (ctx=256); shorten it, give --max-new-tokens 13 or fewer, or raise ctx= in the "
                "deployment" in one_error(err))
    assert not (tmp_path / "r").exists()
    code, _, err = run_cli("round", TIGHT, "--prompts", prompts, "--max-new-tokens", "13", "--dry-run")
    assert code == 0, err


@pytest.mark.parametrize("current, room", [("mode=tree,nodes=63", 74), ("mode=tlv,nodes=32", 44),
                                           ("mode=chain,depth=32", 67)])
def test_the_room_is_the_largest_the_rounds_engines_reserve(run_cli, tmp_path, current, room):
    """A current system that drafts more than the candidates: its own decoder's reservation is the
    room (a 63-node tree's 74 slots), so a round that fits the check runs."""
    from specpilot.auditors.round.inputs import draft_room
    from specpilot.engine.spec import EngineSpec

    assert draft_room(EngineSpec.parse(f"engine:model=tiny,{current}")) == room
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "long", "prompt_ids": [5] * 150}])
    spec = f"engine:model=tiny,{current},threads=1,ctx=256"
    fits = 256 - 150 - room
    code, _, err = run_cli("round", spec, "--prompts", prompts, "--max-new-tokens", str(fits + 1), "--dry-run")
    assert code == 2 and f"give --max-new-tokens {fits} or fewer" in one_error(err), err
    code, _, err = run_cli("round", spec, "--prompts", prompts, "--max-new-tokens", str(fits), "--dry-run")
    assert code == 0, err


def test_the_built_in_prompts_are_measured_with_the_planned_new_tokens(run_cli, tmp_path):
    code, _, err = run_cli("round", "engine:model=tiny,mode=ar,threads=1,ctx=64", "--dry-run")
    line = one_error(err)
    assert code == 2 and "the round's built-in prompt 'p" in line and "48 new tokens + 43 cache slots for draft rows" in line
    assert "(ctx=64); give shorter prompts (--prompts)" in line


def test_text_prompts_for_a_model_without_a_tokenizer_are_refused_before_the_round(run_cli, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "a", "text": "hello"}])
    code, _, err = run_cli("round", "engine:model=smollm2,random=1,mode=ar,threads=1", "--prompts", prompts,
                           "--out-dir", tmp_path / "r", "--no-remember")
    assert code == 2 and f"{prompts}: model smollm2-135m has no tokenizer" in one_error(err)
    assert not (tmp_path / "r").exists()


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
    """The approve stage with nothing to judge writes an empty decisions.json, so the finished round
    reads back whole and its baseline serves `check`."""
    assert json.loads((finished / "approve" / "decisions.json").read_text())["decisions"] == []
    code, out, err = run_cli("check", "--baseline", finished, "--no-timing")
    assert code == 0 and "gate: PASS" in out, err


DECISION = {"id": "chain", "memory": None, "system": "engine:model=tiny,mode=chain,threads=1", "base": TINY,
            "verdict": "refused", "reason": "could not run: test", "seconds": 1.5}


@pytest.mark.parametrize("stage_file, edit, words", [
    ("approve/decisions.json", lambda d: d["decisions"].append(dict(DECISION, seconds="Infinity")),
     "decisions[0] (chain): seconds must be a number of seconds, not inf"),
    ("approve/decisions.json", lambda d: d["decisions"].append(dict(DECISION, seconds="NaN")),
     "decisions[0] (chain): seconds must be a number of seconds, not nan"),
    ("approve/decisions.json", lambda d: d["decisions"].append(dict(DECISION, audit={"weird": 1})),
     "decisions[0] (chain): audit.verdict must be pass or reject, not None"),
    ("approve/decisions.json", lambda d: d["decisions"].append(dict(DECISION, audit={"verdict": "pass", "systems": []})),
     "decisions[0] (chain): audit.systems must be a list of the audited systems, not []"),
    ("measure/measure.json", lambda d: d.update(tokens_per_s="NaN"), "tokens_per_s must be a number >= 0, not nan"),
    ("measure/measure.json", lambda d: d["step_ms"].update({"9": "-Infinity"}),
     "step_ms['9'] must be a number of milliseconds above 0, not -inf"),
    ("measure/measure.json", lambda d: d["step_ms"].update({"9": 0}),
     "step_ms['9'] must be a number of milliseconds above 0, not 0"),
    ("measure/measure.json", lambda d: d.update(ar_ms=-3.0),
     "ar_ms must be a number of milliseconds above 0, or null, not -3.0"),
    ("measure/measure.json", lambda d: d.update(context=0), "context must be a whole number >= 1 or null, not 0"),
    ("measure/measure.json", lambda d: d["calibration"].update(prefill_s="Infinity"),
     "calibration.prefill_s must be a number >= 0, not inf"),
    ("propose/candidates.json", lambda d: d["candidates"].append(
        {"id": "chain", "memory": None, "what": "w", "attacks": "tree", "predicted_gain": "Infinity"}),
     "candidates[0] (chain).predicted_gain must be a number > 0 or null, not inf"),
])
def test_non_finite_numbers_in_the_rounds_files_are_refused(finished, run_cli, tmp_path, stage_file, edit, words):
    """Python's json reads NaN and Infinity (the strings stand for them here); a report or a resume
    refuses them naming the file and the field, as it does a number of the wrong type."""
    d = tmp_path / "r"
    shutil.copytree(finished, d)
    f = d / stage_file
    doc = json.loads(f.read_text())
    edit(doc)
    text = json.dumps(doc, indent=1)
    for name in ("Infinity", "-Infinity", "NaN"):   # the bare JSON tokens, as a file could hold them
        text = text.replace(f'"{name}"', name)
    f.write_text(text)
    for args in (["report", d], ["round", "--resume", d]):
        code, _, err = run_cli(*args)
        line = one_error(err)
        assert code == 2 and f"{f}: malformed" in line and words in line, err


def test_the_dry_run_plans_the_built_in_prompts_the_round_runs(run_cli, tmp_path):
    """--n-prompts above the 64 built-in prompts: the plan is of 64 (what the round runs), with its note."""
    code, out, err = run_cli("round", "engine:model=tiny,mode=ar,threads=1", "--dry-run", "--n-prompts", "80",
                             "--budget", "200", "--records", tmp_path / "rec", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["shape"]["prompts"] == 64
    assert d["notes"] == ["--n-prompts 80: the built-in prompts are 64; the round runs those (--prompts FILE for more)"]


def test_one_new_token_is_refused_before_the_round(run_cli, tmp_path):
    """--max-new-tokens 1 passed the checks and the dry run, then failed in the measure stage
    ('lattice.jsonl: no lattice rows': the one token is the prefill's) with a resume that could
    never succeed."""
    for extra in (("--dry-run",), ("--out-dir", tmp_path / "r", "--budget", "0.2")):
        code, _, err = run_cli("round", TINY, "--n-prompts", "1", "--max-new-tokens", "1", *extra)
        assert code == 2 and "--max-new-tokens 1: a round needs at least 2" in one_error(err), err
    assert not (tmp_path / "r").exists()


def test_out_inside_the_new_rounds_folder_or_records_is_refused_before_the_round(run_cli, tmp_path):
    """--out into the round's folder or the records folder, at a file the round had not written yet:
    refused after the whole round ran (its summary lost)."""
    (tmp_path / "r").mkdir()
    (tmp_path / "rec").mkdir()
    for out in (tmp_path / "r" / "report.md", tmp_path / "rec" / "x.yaml"):
        code, _, err = run_cli("round", TINY, "--n-prompts", "1", "--max-new-tokens", "4", "--budget", "0.2",
                               "--out-dir", tmp_path / "r", "--records", tmp_path / "rec", "--out", out)
        assert code == 2 and f"--out {out}: inside the " in one_error(err), err
    assert list((tmp_path / "r").iterdir()) == [] and list((tmp_path / "rec").iterdir()) == []
    # with --no-remember the round writes no record: the records folder is not its to keep --out from
    code, _, err = run_cli("round", TINY, "--n-prompts", "1", "--max-new-tokens", "4", "--budget", "0.2",
                           "--candidates", "chain", "--out-dir", tmp_path / "r2", "--records", tmp_path / "rec",
                           "--no-remember", "--out", tmp_path / "rec" / "summary.txt")
    assert code == 0 and (tmp_path / "rec" / "summary.txt").is_file(), err
