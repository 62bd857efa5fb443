"""`compare` refuses what it can tell is wrong before any system runs or loads."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("own_folder")   # compare's default partial file: each test its own


def _refused_before_running(run_cli, tmp_path, *args):
    """Run compare with shell commands that leave a mark when run; (exit code, stderr)."""
    mark = tmp_path / "ran"
    partial = tmp_path / "t.partial.json"
    code, out, err = run_cli("compare", "--base-cmd", f"touch {mark}", "--candidate-cmd", f"touch {mark}",
                             "--runs", "4", "--warmup", "0", "--partial", partial, *args)
    assert code == 2 and out == "" and err.startswith("specpilot: error: ") and err.count("\n") == 1, err
    assert not mark.exists() and not partial.exists()
    return err


@pytest.mark.parametrize("args, named, give", [
    (["--max-new-tokens", "64"], "--max-new-tokens sets", "give the limit in"),
    (["--max-new-tokens", "128", "--tokenizer", "tiny"], "--max-new-tokens, --tokenizer set",
     "give the limit and the request set in"),
    (["--concurrency", "1"], "--concurrency sets how many requests servers (--base/--candidate) are sent at once",
     "give the concurrency in"),
    (["--concurrency", "3", "--max-new-tokens", "64"], "--max-new-tokens, --concurrency set what engines and "
                                                       "servers (--base/--candidate) are sent and how many at once",
     "give the limit and the concurrency in"),
])
def test_shell_commands_refuse_the_options_of_engines(run_cli, tmp_path, args, named, give):
    """--max-new-tokens or --concurrency (even at its default value) does nothing to a shell command:
    refused, saying what to put in the commands instead (only what was given)."""
    err = _refused_before_running(run_cli, tmp_path, *args)
    assert named in err and "would change nothing" in err and give in err, err


@pytest.mark.parametrize("metric, words", [
    ("", "--metric '': empty"),
    ("  ", "empty"),
    ("stats..tps", "an empty key in the dotted path"),
])
def test_a_metric_no_output_can_carry_is_refused_before_the_base_runs(run_cli, tmp_path, metric, words):
    err = _refused_before_running(run_cli, tmp_path, "--metric", metric)
    assert words in err, err


def _partial(base, candidate, metric, workload=None):
    samples = [{"pair": i, "block": 0, "base": 100.0, "candidate": 110.0, "order": o} for i, o in enumerate(("AB", "BA"))]
    return {"schema": "specpilot.timing-partial/1", "base": base, "candidate": candidate, "metric": metric,
            "unit": "tok/s", "higher_is_better": True, "schedule": "ABBA", "runs": 2, "samples": samples,
            "aa": [{"block": 0, "first": 100.0, "second": 100.0}], "workload": workload}


def test_a_resume_of_other_systems_is_refused_before_either_model_loads(run_cli, tmp_path):
    import json

    from specpilot.auditors.outputs import read_prompts_tokenized
    from specpilot.auditors.timing import workload_of

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": 0, "prompt_ids": [1, 2, 3]}) + "\n")
    base, cand = "engine:model=tiny,mode=ar", "engine:model=tiny,mode=chain"
    common = ("compare", "--base", base, "--candidate", cand, "--prompts", prompts, "--max-new-tokens", "4",
              "--runs", "2", "--warmup", "0")
    part = tmp_path / "shell.partial.json"
    part.write_text(json.dumps(_partial("sleep 1", "sleep 2", "wall")))
    before = part.read_text()
    code, out, err = run_cli(*common, "--resume", part)
    assert code == 2 and err.count("\n") == 1 and "not of these systems" in err, err
    assert "loading model" not in err and part.read_text() == before
    # a workload that is no object, or none, of these systems: exit 2 (an object's .get crashed; none
    # let samples of another request set resume)
    for workload, words in (("x", "its 'workload' must be null or an object"),
                            (None, "it does not say which request set its samples were measured on")):
        other = tmp_path / "w.partial.json"
        other.write_text(json.dumps(_partial(base, cand, "throughput", workload)))
        code, _, err = run_cli(*common, "--resume", other)
        assert code == 2 and err.count("\n") == 1 and words in err and "loading model" not in err, err
    # the same systems' samples resume (the check reads what the systems record, before they start)
    mine = tmp_path / "mine.partial.json"
    mine.write_text(json.dumps(_partial(base, cand, "throughput", workload_of(read_prompts_tokenized(prompts, "tiny"),
                                                                             4, 1))))
    code, out, err = run_cli(*common, "--resume", mine, "--format", "json")
    assert code in (0, 1) and json.loads(out)["runs"] == 2, err


@pytest.mark.parametrize("candidate, extra, words", [
    ("bogus:thing", (), "bogus:thing: neither an engine: spec nor a server URL; a SYSTEM to time is an engine: spec"),
    ("{outs}", (), "an outputs file cannot be timed"),
    ("engine:model=tiny,mode=chain", ("--gpus", "0,1"), "--gpus runs shell commands on two GPUs"),
    ("engine:model=tiny,mode=chain", ("--out", "{prompts}"), "refusing to overwrite input file"),
])
def test_a_candidate_that_cannot_be_timed_is_refused_before_the_base_loads(run_cli, tmp_path, candidate, extra,
                                                                           words):
    """Either system's spec is checked before the base's model loads (seconds for a real model), and so
    are the options: --gpus (shell commands only; not "no GPU visible", exit 3), an --out naming the
    prompts file. A system to time is never said to be an outputs file."""
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": 0, "prompt_ids": [1, 2, 3]}) + "\n")
    outs = tmp_path / "outs.jsonl"
    outs.write_text(json.dumps({"schema": "specpilot.outputs/1", "id": 0, "prompt_ids": [1, 2, 3],
                                "output_ids": [4]}) + "\n")
    partial = tmp_path / "t.partial.json"
    code, out, err = run_cli("compare", "--base", "engine:model=tiny,mode=ar", "--candidate",
                             candidate.format(outs=outs), "--prompts", prompts, "--max-new-tokens", "4",
                             "--runs", "2", "--warmup", "0", "--partial", partial,
                             *(str(x).format(prompts=prompts) for x in extra))
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err, err
    assert "loading model" not in err and not partial.exists() and "outputs JSONL" not in err
    assert prompts.read_text().startswith('{"schema": "specpilot.prompts/1"')
