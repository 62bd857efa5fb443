"""``specpilot compare`` with real shell commands through the CLI."""

import json
import sys

import pytest

from conftest import one_error
from specpilot.auditors.pairing import ShellSystem, run_pairs

PY = sys.executable

pytestmark = pytest.mark.usefixtures("own_folder")   # compare's default partial file: each test its own


def emit_cmd(value, key="tokens_per_s"):
    return f"echo '{{\"{key}\": {value}}}'"


def test_throughput_metric_approved(tmp_path, run_cli):
    out = tmp_path / "t.json"
    code, stdout, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(150),
                                "--metric", "tokens_per_s", "--runs", "6", "--warmup", "0",
                                "--out", out, "--format", "json")
    assert code == 0, err
    d = json.loads(out.read_text())
    assert d["schema"] == "specpilot.timing/1"
    assert d["gain"] == pytest.approx(1.5) and d["ci_low"] == pytest.approx(1.5)
    assert d["approved"] is True and d["verdict"] == "approved"
    assert d["noise"] == 0.0 and d["threshold"] == pytest.approx(0.01)
    assert len(d["samples"]) == 6 and [s["order"] for s in d["samples"][:2]] == ["AB", "BA"]
    assert all(s["ratio"] == pytest.approx(1.5) for s in d["samples"])
    assert len(d["aa"]) == 3 and d["t_ci"][0] == pytest.approx(1.5)


def test_same_command_not_approved_exit_1(tmp_path, run_cli):
    code, stdout, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(100),
                                "--metric", "tokens_per_s", "--runs", "4", "--warmup", "0")
    assert code == 1
    assert "NOT APPROVED" in stdout and "+0.00%" in stdout


def test_changes_output_needs_3_percent(run_cli):
    args = ["compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(102), "--metric", "tokens_per_s",
            "--runs", "4", "--warmup", "0", "--format", "json"]
    code, out, _ = run_cli(*args)
    assert code == 0 and json.loads(out)["approved"]
    code, out, _ = run_cli(*args, "--changes-output")
    assert code == 1 and json.loads(out)["threshold"] == pytest.approx(0.03)


def test_given_noise(run_cli):
    code, out, _ = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(102),
                           "--metric", "tokens_per_s", "--runs", "4", "--warmup", "0", "--noise", "0.01",
                           "--format", "json")
    d = json.loads(out)
    assert code == 1 and d["noise"] == 0.01 and d["noise_source"] == "given" and d["threshold"] == pytest.approx(0.03)


def test_wall_time_of_real_commands(run_cli):
    # a 40x slower command is slower however loaded the machine is
    code, out, err = run_cli("compare", "--base-cmd", "sleep 0.2", "--candidate-cmd", "sleep 0.005",
                             "--runs", "2", "--warmup", "0", "--format", "json")
    d = json.loads(out)
    assert d["unit"] == "s" and d["higher_is_better"] is False
    assert all(s["base"] >= 0.2 for s in d["samples"])
    assert d["gain"] > 2


def test_auto_runs_plans_from_pilot(run_cli):
    code, out, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(100),
                             "--metric", "tokens_per_s", "--warmup", "0", "--format", "json")
    d = json.loads(out)
    assert code == 1
    assert d["plan"]["pairs"] == 8 and d["runs"] == 8      # zero spread: the pilot is enough


def test_gpu_swap_schedule():
    a = ShellSystem(f"{PY} -c \"import os,json; print(json.dumps({{'t': 100 + int(os.environ['CUDA_VISIBLE_DEVICES'])}}))\"",
                    "base", metric="t")
    b = ShellSystem("echo '{\"t\": 1{gpu}0}'", "candidate", metric="t")   # {gpu} substituted
    r = run_pairs(a, b, 4, gpus=("0", "1"))
    assert [(s.gpu_base, s.gpu_candidate) for s in r.samples] == [("0", "1"), ("1", "0")] * 2
    assert [s.order for s in r.samples] == ["||"] * 4
    assert [(s.base, s.candidate) for s in r.samples[:2]] == [(100.0, 110.0), (101.0, 100.0)]
    assert r.aa == [(100.0, 101.0)] * 2


@pytest.mark.parametrize("args,msg", [
    (["--base-cmd", "exit 3", "--candidate-cmd", "true"], "base command failed (exit 3)"),
    (["--base-cmd", "echo hi", "--candidate-cmd", "true", "--metric", "tps"], "not JSON"),
    (["--base-cmd", "echo hi", "--candidate-cmd", "true", "--metric", "m.tps"],   # a dotted key: nested objects
     "--metric m.tps expects {\"m\": {\"tps\": number}}"),
    (["--base-cmd", "python3 -c \"print('[' * 100000 + ']' * 100000)\"", "--candidate-cmd", "true", "--metric", "tps"],
     "last stdout line is not JSON"),
    (["--base-cmd", emit_cmd(1, "x"), "--candidate-cmd", "true", "--metric", "tps"], "no 'tps'"),
    (["--base-cmd", emit_cmd(-1), "--candidate-cmd", "true", "--metric", "tokens_per_s"], "positive"),
    (["--base-cmd", "sleep 5", "--candidate-cmd", "true", "--timeout", "0.2"], "--timeout"),
    (["--base-cmd", "true"], "--candidate"),
    (["--base-cmd", "true", "--candidate", "engine:model=x"], "like with like"),
    (["--base", "engine:model=tiny", "--candidate", "engine:model=tiny,mode=ar"], "--prompts"),
    (["--base", "engine:model=x", "--candidate", "engine:model=tiny"], "--base engine:model=x: unknown model 'x'"),
    (["--base", "engine:model=tiny", "--candidate", "engine:model=smollm2"], "they must share the tokenizer"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--runs", "1"], "at least 2"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--runs", "200000"], "at most 100000"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--runs", "5"], "--runs 5: pairs come in blocks of 2"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--max-runs", "9"], "--max-runs 9: pairs come in blocks"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--noise", "2"], "--noise"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--gpus", "0"], "two different GPU ids"),
    (["--base-cmd", "true", "--candidate-cmd", "true", "--concurrency", "2"], "--concurrency sets how many requests servers"),
])
def test_bad_input_exit_2(tmp_path, run_cli, args, msg):
    out = tmp_path / "t.json"
    code, stdout, err = run_cli("compare", *args, "--warmup", "0", "--out", out)
    assert code == 2, (code, err)
    assert err.startswith("specpilot: error: ") and msg in err, err
    assert not out.exists()


def test_prompts_file_errors(tmp_path, run_cli):
    p = tmp_path / "p.jsonl"
    p.write_text('{"schema": "specpilot.prompts/1", "id": 0}\n')
    code, _, err = run_cli("compare", "--base", "http://127.0.0.1:9", "--candidate", "http://127.0.0.1:9",
                           "--prompts", p)
    assert code == 2 and "prompt_ids" in err


def test_unreachable_server_exit_3(tmp_path, run_cli):
    p = tmp_path / "p.jsonl"
    p.write_text('{"schema": "specpilot.prompts/1", "id": 0, "prompt_ids": [1, 2, 3]}\n')
    code, _, err = run_cli("compare", "--base", "http://127.0.0.1:9", "--candidate", "http://127.0.0.1:9",
                           "--prompts", p, "--timeout", "2")
    assert code == 3 and "connection refused" in err, err


def _serve_tiny():
    """``specpilot serve`` (tiny random model) on a free loopback port; returns (proc, url)."""
    import os
    import re
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", "--model", "tiny", "--mode", "ar",
                             "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    for line in proc.stderr:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1)
        if time.time() > deadline:
            break
    proc.kill()
    pytest.fail("specpilot serve did not start")


def test_http_server_a_a(tmp_path, run_cli):
    """The same loopback server as base and candidate: same requests each run, outputs identical,
    not approved; then the server dies and compare says so (exit 3)."""
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [5 + i, 9, 77]}) + "\n"
                         for i in range(3)))
    proc, url = _serve_tiny()
    try:
        code, out, err = run_cli("compare", "--base", url, "--candidate", url, "--prompts", p, "--max-new-tokens", "6",
                                 "--runs", "2", "--warmup", "0", "--format", "json", "--concurrency", "3")
        assert code == 1, err
        d = json.loads(out)
        assert d["unit"] == "tok/s" and d["outputs_identical"] is True and d["outputs_stable"] is True
        assert d["prompts"] == 3 and d["concurrency"] == 3
        assert len(d["samples"]) == 2 and d["approved"] is False
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    code, _, err = run_cli("compare", "--base", url, "--candidate", url, "--prompts", p, "--runs", "2",
                           "--warmup", "0", "--timeout", "5")
    assert code == 3 and "connection refused" in err, err


def test_gpu_swap_through_cli(run_cli, monkeypatch):
    from specpilot import machine

    # no GPU: a swap would time the CPU twice and call it two GPUs
    monkeypatch.setattr(machine, "gpu_count", lambda: 0)
    code, _, err = run_cli("compare", "--base-cmd", "true", "--candidate-cmd", "true", "--gpus", "0,1", "--runs", "4")
    assert code == 3 and "no GPU is visible" in err.strip().splitlines()[-1]
    monkeypatch.setattr(machine, "gpu_count", lambda: 2)
    # the candidate is faster on GPU "1" only: swapping GPUs exposes it in the A/A split and the pairs
    code, out, err = run_cli("compare", "--base-cmd", "echo '{\"t\": 100}'", "--candidate-cmd", "echo '{\"t\": 10{gpu}}'",
                             "--metric", "t", "--gpus", "0,1", "--runs", "4", "--warmup", "0", "--format", "json")
    d = json.loads(out)
    assert d["schedule"] == "GPU swap on 0,1"
    assert [(s["gpu_base"], s["gpu_candidate"], s["candidate"]) for s in d["samples"]] == \
        [("0", "1", 101.0), ("1", "0", 100.0)] * 2
    assert code == 1 and d["gain"] == pytest.approx(1.005, abs=1e-3)


def test_engines_with_different_outputs_get_the_3_percent_rule(tmp_path, run_cli):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [5 + i, 9, 77]}) + "\n"
                         for i in range(2)))
    code, out, err = run_cli("compare", "--base", "engine:model=tiny,mode=ar", "--candidate",
                             "engine:model=tiny,mode=ar,seed=1", "--prompts", p, "--max-new-tokens", "4",
                             "--runs", "2", "--warmup", "0", "--format", "json")
    d = json.loads(out)
    assert d["outputs_identical"] is False and d["changes_output"] is True
    assert d["threshold"] >= 0.03 and "differ" in d["changes_output_reason"]
    assert d["unit"] == "tok/s" and len(d["samples"]) == 2


def test_a_damaged_stored_run_cannot_loosen_the_rule(tmp_path, run_cli):
    """--from can only make the rule stricter: a noise that is no number (or none), an A/A pair that
    is not its block's base runs, or two samples of one pair number made it looser (exit 0 at a 1.2%
    threshold for a run judged at 7.8%)."""
    t = tmp_path / "t.json"
    code, _, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(102),
                           "--metric", "tokens_per_s", "--runs", "4", "--warmup", "0", "--out", t, "--format", "json")
    assert code == 0, err
    stored = json.loads(t.read_text())
    bad = tmp_path / "bad.json"
    aa = [dict(x, second=x["first"] + 1) for x in stored["aa"]]
    twins = [dict(x, pair=0) for x in stored["samples"]]
    three = [dict(x, block=0) if i == 2 else x for i, x in enumerate(stored["samples"])]
    for change, words in (({"noise": "x"}, "'noise' must be the finite noise >= 0"),
                          ({"noise": -0.5}, "'noise' must be the finite noise >= 0"),
                          ({"noise": None}, "'noise' must be the finite noise >= 0"),
                          ({"aa": aa}, "the A/A pair of block 0 (100, 101) is not its base's two runs (100, 100)"),
                          ({"samples": twins}, "two samples have one pair number"),
                          ({"samples": three}, "block 0 holds 3 samples (every block has two)"),
                          ({"samples": [dict(stored["samples"][0], pair=-1)] + stored["samples"][1:]},
                           "sample 0 needs whole numbers 'pair' and 'block' (>= 0)"),
                          # a slower candidate read the other way round was approved
                          ({"higher_is_better": False}, "metric 'tokens_per_s' is higher is better, but the file "
                                                        "says 'higher_is_better': false"),
                          ({"metric": "wall", "unit": "s"}, "metric 'wall' is lower is better")):
        bad.write_text(json.dumps({**stored, **change}).replace('"x"', "NaN") if change.get("noise") == "x"
                       else json.dumps({**stored, **change}))
        code, _, err = run_cli("compare", "--from", bad, "--noise", "0.001")
        assert code == 2 and words in err and err.count("\n") == 1, (change, err)


def test_rejudge_from_stored_file(tmp_path, run_cli):
    t = tmp_path / "t.json"
    code, _, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(102),
                           "--metric", "tokens_per_s", "--runs", "4", "--warmup", "0", "--out", t, "--format", "json")
    assert code == 0, err
    code, out, _ = run_cli("compare", "--from", t, "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["gain"] == pytest.approx(1.02) and d["rejudged_from"] == str(t)
    code, out, _ = run_cli("compare", "--from", t, "--changes-output", "--format", "json")
    assert code == 1 and json.loads(out)["threshold"] == pytest.approx(0.03)
    code, out, _ = run_cli("compare", "--from", t, "--noise", "0.01", "--format", "json")
    assert code == 1 and json.loads(out)["noise_source"] == "given"
    # a noise below the stored run's would loosen the rule
    stored = json.loads(t.read_text())
    stored["noise"] = 0.02
    t.write_text(json.dumps(stored))
    code, _, err = run_cli("compare", "--from", t, "--noise", "0.01")
    assert code == 2 and "--from can only make the rule stricter" in err
    # a run judged by a given noise keeps it when --noise is left out (its A/A estimate could loosen it)
    stored.update(noise=0.3, noise_source="given")
    t.write_text(json.dumps(stored))
    code, out, _ = run_cli("compare", "--from", t, "--format", "json")
    assert code == 1 and json.loads(out)["noise"] == pytest.approx(0.3) and json.loads(out)["noise_source"] == "given"
    # bad inputs: another schema, a mangled sample, systems besides --from, overwriting the input
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "specpilot.replay/1"}))
    code, _, err = run_cli("compare", "--from", bad)
    assert code == 2 and "unknown schema" in err
    for value in ("fast", True, "1.5"):   # numbers only: true is not 1, nor a string of digits a number
        d["samples"][0]["base"] = value
        bad.write_text(json.dumps(d))
        code, _, err = run_cli("compare", "--from", bad)
        assert code == 2 and "bad.json: sample 0 needs whole numbers 'pair' and 'block'" in err, (value, err)
    d["samples"][0]["base"] = 0
    bad.write_text(json.dumps(d))
    code, _, err = run_cli("compare", "--from", bad)
    assert code == 2 and "every measurement must be a positive finite number (sample 0)" in err
    for damage, needle in (({"higher_is_better": "yes"}, "'higher_is_better' true or false"),
                           ({"metric": None}, "'metric' must be a string"), ({"samples": []}, "0 paired samples"),
                           ({"samples": 3}, "must be lists"), ({"changes_output": "no"}, "'changes_output' must be")):
        bad.write_text(json.dumps(dict(json.loads(t.read_text()), **damage)))
        code, _, err = run_cli("compare", "--from", bad)
        assert code == 2 and needle in err and err.count("\n") == 1, err
    bad.write_text(json.dumps({k: v for k, v in json.loads(t.read_text()).items() if k != "metric"}))
    assert "lacks 'metric'" in run_cli("compare", "--from", bad)[2]
    code, _, err = run_cli("compare", "--from", t, "--base-cmd", "true")
    assert code == 2 and "--from" in err
    code, _, err = run_cli("compare", "--from", t, "--out", t)
    assert code == 2 and "refusing to overwrite" in err


def _noisy_timing(seed: int) -> dict:
    """A stored timing of 12 ABBA blocks with a noisy gain near the threshold, judged with ``seed``."""
    import numpy as np

    from specpilot.auditors.timing import Sample, TimingResult, judge

    rng = np.random.default_rng(1)
    samples, aa = [], []
    for b in range(12):
        pair = [Sample(2 * b + i, b, 100 * (1 + rng.normal(0, 0.002)), 101.5 * (1 + rng.normal(0, 0.002)), order)
                for i, order in enumerate(("AB", "BA"))]
        samples += pair
        aa.append((pair[0].base, pair[1].base))
    v = judge(samples, higher_is_better=True, aa_pairs=aa, seed=seed)
    return TimingResult("./emit.sh 100", "./emit.sh 101.5", "m.tps", "", True, "ABBA", False, samples, aa,
                        v).to_json()


def test_rejudge_uses_the_stored_seed(tmp_path, run_cli):
    """--from re-judges with the run's own bootstrap seed (another seed moves the interval, which can
    flip a borderline verdict); --seed overrides it; a file without one was judged with seed 0."""
    t = tmp_path / "t.json"
    stored = _noisy_timing(7)
    assert stored["seed"] == 7
    t.write_text(json.dumps(stored))
    code, out, err = run_cli("compare", "--from", t, "--format", "json")
    d = json.loads(out)
    assert d["seed"] == 7 and (d["ci_low"], d["ci_high"]) == (stored["ci_low"], stored["ci_high"]), err
    seed0 = _noisy_timing(0)
    assert seed0["ci_low"] != stored["ci_low"]   # the seed matters for these samples
    code, out, _ = run_cli("compare", "--from", t, "--seed", "0", "--format", "json")
    assert json.loads(out)["seed"] == 0 and json.loads(out)["ci_low"] == seed0["ci_low"]
    t.write_text(json.dumps({k: v for k, v in stored.items() if k != "seed"}))
    code, out, _ = run_cli("compare", "--from", t, "--format", "json")
    assert json.loads(out)["seed"] == 0 and json.loads(out)["ci_low"] == seed0["ci_low"]
    for bad in ("7", True, -1, 2**32, 7.5):
        t.write_text(json.dumps(dict(stored, seed=bad)))
        code, _, err = run_cli("compare", "--from", t)
        assert code == 2 and "'seed' must be the whole number" in one_error(err), (bad, err)
    # a live run stores the seed it was judged with
    code, _, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(102), "--metric",
                           "tokens_per_s", "--runs", "4", "--warmup", "0", "--seed", "5", "--out", t, "--format", "json")
    assert json.loads(t.read_text())["seed"] == 5, err


def test_gpu_swap_failure_stops_the_other_run(tmp_path):
    from specpilot.errors import InputError

    marker = tmp_path / "finished"
    a = ShellSystem("exit 3", "base")
    b = ShellSystem(f"sleep 1 && touch {marker}", "candidate")
    with pytest.raises(InputError, match="base command failed"):
        run_pairs(a, b, 2, gpus=("0", "1"))
    import time

    time.sleep(1.5)
    assert not marker.exists()


def test_text_prompts_use_the_base_engines_tokenizer(tmp_path, run_cli):
    # the tiny byte-vocabulary engines read text as its UTF-8 bytes
    from specpilot.auditors.outputs import read_prompts_tokenized

    p = tmp_path / "text.jsonl"
    p.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "text": "héllo"}) + "\n")
    assert read_prompts_tokenized(p, "tiny")[0].prompt_ids == list("héllo".encode())
    code, out, err = run_cli("compare", "--base", "engine:model=tiny,mode=ar", "--candidate", "engine:model=tiny,mode=ar",
                             "--prompts", p, "--runs", "2", "--warmup", "0", "--max-new-tokens", "2", "--format", "json")
    assert code in (0, 1) and json.loads(out)["runs"] == 2, err


def test_read_prompts_tokenized_with_a_real_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specpilot.auditors.outputs import read_prompts_tokenized

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    p = tmp_path / "text.jsonl"
    p.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "text": "hello world"}) + "\n"
                 + json.dumps({"schema": "specpilot.prompts/1", "id": "b", "prompt_ids": [2, 1]}) + "\n")
    rows = read_prompts_tokenized(p, str(folder))
    assert [r.prompt_ids for r in rows] == [[1, 2], [2, 1]]


def test_runs_take_even_numbers_and_the_help_says_so(tmp_path, run_cli):
    # ABBA measures two pairs a block: an odd --runs is refused, not rounded up
    code, _, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(110),
                           "--metric", "tokens_per_s", "--runs", "5", "--warmup", "0")
    assert code == 2 and "give an even number, e.g. 4 or 6" in err and err.count("\n") == 1, err
    # an odd --max-runs capped --runs auto below what it ran (3 ran 4 pairs)
    code, _, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(110),
                           "--metric", "tokens_per_s", "--max-runs", "3", "--warmup", "0")
    assert code == 2 and "e.g. 2 or 4" in err, err
    code, out, _ = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(110),
                           "--metric", "tokens_per_s", "--runs", "6", "--warmup", "0", "--format", "json")
    assert code == 0 and json.loads(out)["runs"] == 6
    # the cap is the auto plan's: beside a fixed --runs an odd one is not in the way
    code, out, err = run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(110),
                             "--metric", "tokens_per_s", "--runs", "2", "--max-runs", "3", "--warmup", "0",
                             "--format", "json")
    assert code in (0, 1) and json.loads(out)["runs"] == 2, err
    code, out, _ = run_cli("compare", "--help")
    assert "an even number" in " ".join(out.split())


def _partial(base, candidate, blocks):
    samples = [{"pair": 2 * b + i, "block": b, "base": 100.0, "candidate": 110.0, "order": o}
               for b in range(blocks) for i, o in enumerate(("AB", "BA"))]
    return {"schema": "specpilot.timing-partial/1", "base": base, "candidate": candidate, "metric": "t", "unit": "t",
            "higher_is_better": True, "schedule": "ABBA", "runs": len(samples), "samples": samples,
            "aa": [{"block": b, "first": 100.0, "second": 100.0} for b in range(blocks)]}


def test_resume_never_reports_more_pairs_than_asked(tmp_path, run_cli):
    ran = tmp_path / "ran"
    base, cand = f"echo x >> {ran}; " + emit_cmd(100, "t"), f"echo x >> {ran}; " + emit_cmd(110, "t")
    part = tmp_path / "p.json"
    part.write_text(json.dumps(_partial(base, cand, 4)))   # 8 pairs kept
    before = part.read_text()
    out = tmp_path / "t.json"
    common = ("compare", "--base-cmd", base, "--candidate-cmd", cand, "--metric", "t", "--warmup", "0",
              "--resume", part, "--out", out)
    # a partial file with more pairs than asked is refused, its samples left as they are
    code, _, err = run_cli(*common, "--runs", "4")
    assert code == 2 and err.count("\n") == 1, err
    assert "it already holds 8 paired samples, more than --runs 4; resume with --runs 8 or more" in err
    code, _, err = run_cli(*common, "--max-runs", "6")
    assert code == 2 and "more than --max-runs 6; resume with --max-runs 8 or more" in err, err
    assert part.read_text() == before and not out.exists() and not ran.exists()
    # engines: refused before either model loads
    prompts = tmp_path / "pr.jsonl"
    prompts.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": 0, "prompt_ids": [1, 2, 3]}) + "\n")
    code, _, err = run_cli("compare", "--base", "engine:model=tiny,mode=ar", "--candidate", "engine:model=tiny,mode=chain",
                           "--prompts", prompts, "--max-new-tokens", "4", "--runs", "4", "--resume", part)
    assert code == 2 and "more than --runs 4" in err and "loading model" not in err, err
    code, _, err = run_cli(*common, "--runs", "8", "--format", "json")
    assert code == 0, err
    assert json.loads(out.read_text())["runs"] == 8 and not ran.exists()   # judged, nothing more run
    part.write_text(before)
    code, _, err = run_cli(*common, "--runs", "10", "--format", "json")
    assert code == 0 and json.loads(out.read_text())["runs"] == 10 and len(ran.read_text().split()) == 4, err


@pytest.mark.parametrize("kw, msg", [({"runs": 5}, "--runs 5: pairs come in blocks of 2"),
                                     ({"runs": None, "max_runs": 7}, "--max-runs 7: pairs come in blocks of 2")])
def test_the_library_refuses_an_odd_pair_count_before_running_anything(kw, msg, tmp_path):
    # callers other than the command (the round) get the same rule: a half block is not rounded up
    from specpilot.auditors.pairing import paired_compare
    from specpilot.errors import InputError

    marker = tmp_path / "ran"
    a, b = ShellSystem(f"touch {marker}", "base"), ShellSystem(f"touch {marker}", "candidate")
    with pytest.raises(InputError, match=msg):
        paired_compare(a, b, **kw)
    assert not marker.exists()


def test_the_partial_file_is_never_another_file(tmp_path, run_cli, monkeypatch):
    """--partial names a file this run writes and removes: an existing file (an earlier run's state,
    an input, anything) is refused before any run, and left as it is; --out is not it either."""
    monkeypatch.chdir(tmp_path)
    common = ("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(110), "--metric", "tokens_per_s",
              "--runs", "2", "--warmup", "0")
    keep = tmp_path / "keep.json"
    keep.write_text('{"keep": 1}')
    code, _, err = run_cli(*common, "--partial", keep)
    # no state in it: nothing to resume, so --resume is not advised
    assert code == 2 and "exists and holds no earlier run's state; remove it or give another --partial" in err, err
    assert "--resume" not in err and keep.read_text() == '{"keep": 1}'
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1, 2]}) + "\n")
    code, _, err = run_cli("compare", "--base", "engine:model=tiny,mode=ar", "--candidate", "engine:model=tiny,mode=tree",
                           "--prompts", prompts, "--runs", "2", "--warmup", "0", "--partial", prompts)
    assert code == 2 and "--partial " + str(prompts) + ": is also --prompts" in err and "--resume" not in err, err
    code, _, err = run_cli(*common, "--partial", tmp_path / "same.json", "--out", tmp_path / "same.json")
    assert code == 2 and "is also --out" in err and not (tmp_path / "same.json").exists()
    # the default partial file of an interrupted run: pointed at, not replaced
    default = tmp_path / "specpilot-compare.partial.json"
    default.write_text(json.dumps(_partial("a", "b", 1)))
    code, _, err = run_cli(*common)
    assert code == 2 and "--resume specpilot-compare.partial.json" in err and json.loads(default.read_text())["runs"] == 2
    default.unlink()
    code, _, err = run_cli(*common, "--out", tmp_path / "t.json")
    assert code in (0, 1) and not (tmp_path / "t.partial.json").exists(), err   # its own is removed


def test_a_resume_on_another_request_set_is_refused(tmp_path, run_cli):
    def prompts(name, rows):
        f = tmp_path / name
        f.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "prompt_ids": r}) + "\n"
                             for i, r in enumerate(rows)))
        return f

    a, b = prompts("a.jsonl", [[1, 2, 3]]), prompts("b.jsonl", [[4, 5, 6]])
    sysargs = ("compare", "--base", "engine:model=tiny,mode=ar", "--candidate", "engine:model=tiny,mode=chain",
               "--warmup", "0")
    out = tmp_path / "t.json"
    code, _, err = run_cli(*sysargs, "--prompts", a, "--max-new-tokens", "4", "--runs", "2", "--out", out,
                           "--format", "json")
    assert code in (0, 1), err
    # the samples of that run as a partial file (as an interrupted run leaves them)
    from specpilot.auditors.timing import partial_doc, read_timing, workload_of
    from specpilot.auditors.outputs import read_prompts_tokenized
    from specpilot.auditors.timing import parse_samples

    d = read_timing(out)
    samples, aa = parse_samples(d, out)
    part = tmp_path / "p.json"
    part.write_text(json.dumps(partial_doc(d["base"], d["candidate"], d["metric"], d["unit"], True, d["schedule"],
                                           samples, aa, workload_of(read_prompts_tokenized(a, "tiny"), 4, 1))))
    for other in (("--prompts", b, "--max-new-tokens", "4"), ("--prompts", a, "--max-new-tokens", "8")):
        code, _, err = run_cli(*sysargs, *other, "--runs", "4", "--resume", part)
        assert code == 2 and "measured on another request set" in err and "loading model" not in err, err


@pytest.mark.parametrize("args, words", [(["--runs", "8"], "--runs go with a live run"),
                                         (["--warmup", "2"], "--warmup go with a live run")])
def test_from_refuses_live_run_options_and_half_blocks(tmp_path, run_cli, args, words):
    out = tmp_path / "t.json"
    assert run_cli("compare", "--base-cmd", emit_cmd(100), "--candidate-cmd", emit_cmd(150), "--metric",
                   "tokens_per_s", "--runs", "4", "--warmup", "0", "--out", out, "--format", "json")[0] == 0
    code, _, err = run_cli("compare", "--from", out, *args)
    assert code == 2 and words in err, err
    d = json.loads(out.read_text())
    d["samples"] = d["samples"][:3]
    (tmp_path / "three.json").write_text(json.dumps(d))
    code, _, err = run_cli("compare", "--from", tmp_path / "three.json")
    assert code == 2 and "3 samples in 2 blocks do not match its 2 A/A pairs" in err, err


def test_gpu_ids_that_are_not_ids_are_bad_input(run_cli):
    code, _, err = run_cli("compare", "--base-cmd", "true", "--candidate-cmd", "true", "--gpus", "a,b")
    assert code == 2 and "'a' is not a GPU id" in err, err


@pytest.mark.parametrize("base, cand, words", [
    ("1e-320", "5", "'tokens_per_s' must be a positive number, got 1e-320 (below the normal floats"),
    ("1e-300", "1e300", "too far apart for their ratio to be a number"),
    ("1e300", "1e-300", "too far apart for their ratio to be a number"),   # a ratio that underflows to 0
])
def test_measurements_whose_ratio_is_no_number_are_refused(tmp_path, run_cli, base, cand, words):
    """A subnormal metric, or two whose ratio overflows, gave Infinity and NaN in the JSON (which
    strict readers refuse) and numpy warnings; now one line, exit 2."""
    code, out, err = run_cli("compare", "--base-cmd", emit_cmd(base), "--candidate-cmd", emit_cmd(cand),
                             "--metric", "tokens_per_s", "--runs", "2", "--warmup", "0", "--format", "json",
                             "--partial", tmp_path / "p.json")
    assert code == 2 and out == "" and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("runs", ["1", "100000000"])
def test_check_runs_out_of_range_is_refused_before_anything_runs(run_cli, runs):
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"
    code, _, err = run_cli("check", "--baseline", example, "--runs", runs)
    assert code == 2 and f"{runs} is not in the range 2<=x<=100000" in err, err


def test_the_medians_printed_are_the_samples_medians(tmp_path, run_cli):
    """An even number of pairs: the median is the mean of the two middle samples, not the upper one."""
    def counting(name, values):
        script = tmp_path / f"{name}.py"
        script.write_text(f"import json, pathlib\nf = pathlib.Path({str(tmp_path / name)!r})\n"
                          "i = int(f.read_text()) if f.exists() else 0\nf.write_text(str(i + 1))\n"
                          f"print(json.dumps({{'tps': {values}[i % {len(values)}]}}))\n")
        return f"{PY} {script}"

    out = tmp_path / "t.json"
    code, stdout, err = run_cli("compare", "--base-cmd", counting("b", [97, 100, 103, 99, 101, 98]),
                                "--candidate-cmd", counting("c", [105, 104, 108, 103, 106, 102, 107]),
                                "--metric", "tps", "--runs", "8", "--warmup", "0", "--out", out, "--format", "json")
    assert code in (0, 1), err
    samples = json.loads(out.read_text())["samples"]
    code, stdout, err = run_cli("compare", "--from", out)   # the stored samples judged again, as a table
    assert code in (0, 1), err
    med_b = sorted(s["base"] for s in samples)
    med_c = sorted(s["candidate"] for s in samples)
    want = (f"{(med_b[3] + med_b[4]) / 2:.6g} / {(med_c[3] + med_c[4]) / 2:.6g} tps")
    line = next(x for x in stdout.splitlines() if x.startswith("median base / candidate"))
    assert line.split(None, 4)[-1].strip() == want, (line, want)


def test_medians_of_measurements_near_the_largest_float_are_theirs(tmp_path, run_cli):
    """The two middle samples' midpoint without their sum: 1e308 samples printed 'inf / inf'."""
    samples = [{"pair": 2 * k + i, "block": k, "base": 1e308, "candidate": 1.5e308, "order": "AB" if i == 0 else "BA"}
               for k in range(2) for i in range(2)]
    doc = {"schema": "specpilot.timing/1", "base": "A", "candidate": "B", "metric": "tok_s", "unit": "tok/s",
           "higher_is_better": True, "schedule": "ABBA", "warmup": 1, "samples": samples,
           "aa": [{"block": k, "first": 1e308, "second": 1e308} for k in range(2)], "gain": 1.5, "ci_low": 1.5,
           "approved": True, "noise": 0.0, "noise_source": "A/A split (base first vs second run per block)",
           "changes_output": False}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    code, out, err = run_cli("compare", "--from", tmp_path / "t.json")
    assert code in (0, 1) and "warning" not in err.lower(), err
    line = next(x for x in out.splitlines() if x.startswith("median base / candidate"))
    assert line.split(None, 4)[-1].strip() == "1e+308 / 1.5e+308 tok/s", line


class _Gen:
    """A generator whose answers change after ``change_after`` requests (a server that changed mid-run)."""

    def __init__(self, change_after=None):
        self.served, self.change_after = 0, change_after

    def generate(self, ids, n):
        shift = 7 if self.change_after is not None and self.served >= self.change_after else 0
        self.served += 1
        return [(ids[-1] + 1 + i + shift) % 200 for i in range(n)]

    def close(self):
        pass


def _generate_system(label, gen):
    from types import SimpleNamespace

    from specpilot.auditors.pairing import GenerateSystem

    s = GenerateSystem.__new__(GenerateSystem)
    s.label, s.metric, s.unit, s.higher_is_better = label, "throughput", "tok/s", True
    s.prompts = [SimpleNamespace(prompt_ids=[10 + i, 20 + i]) for i in range(4)]
    s.max_new_tokens, s.concurrency, s.gen = 4, 1, gen
    s.reset_outputs()
    return s


def test_outputs_are_compared_on_every_run_not_the_first_alone():
    """A candidate whose answers equal the base's in the warm-up run and differ in every timed run
    was judged by the 1% rule ("outputs identical"): only the first run's outputs were compared."""
    from specpilot.auditors.pairing import paired_compare

    for change_after, identical in ((None, True), (4, True), (0, False)):
        a, b = _generate_system("a", _Gen()), _generate_system("b", _Gen(change_after))
        res = paired_compare(a, b, runs=2, warmup=1, noise=0.001)
        assert res.extra["outputs_identical"] is identical
        assert res.extra["outputs_stable"] is (change_after != 4)
        assert res.changes_output is (change_after is not None), res.extra
        if change_after == 4:
            assert res.extra["changes_output_reason"].startswith("the candidate's outputs changed from run to run")


def test_a_resume_judges_the_outputs_of_the_runs_it_continues(tmp_path, run_cli):
    """A resumed comparison knew only its own runs' outputs: resumed with no runs left it called two
    engines of different outputs identical (the 1% rule). The partial file keeps each one's outputs;
    one that does not is judged as outputs not shown equal."""
    from specpilot.auditors.outputs import read_prompts_tokenized
    from specpilot.auditors.timing import parse_samples, partial_doc, read_timing, workload_of

    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "prompt_ids": [5 + i, 9, 77]}) + "\n"
                         for i in range(2)))
    sysargs = ("compare", "--base", "engine:model=tiny,mode=ar", "--candidate", "engine:model=tiny,mode=ar,seed=1",
               "--prompts", p, "--max-new-tokens", "4", "--warmup", "0", "--format", "json")
    out = tmp_path / "t.json"
    code, _, err = run_cli(*sysargs, "--runs", "2", "--out", out)
    assert code in (0, 1), err
    d = read_timing(out)
    samples, aa = parse_samples(d, out)
    work = workload_of(read_prompts_tokenized(p, "tiny"), 4, 1)

    def resumed(outputs, runs="2"):
        part = tmp_path / "part.json"
        part.write_text(json.dumps(partial_doc(d["base"], d["candidate"], d["metric"], d["unit"], True, d["schedule"],
                                               samples, aa, work, outputs)))
        code, got, err = run_cli(*sysargs, "--runs", runs, "--resume", part)
        assert code in (0, 1), err
        return json.loads(got)

    r = resumed(None)
    assert r["outputs_identical"] is None and r["changes_output"] is True
    assert "not recorded" in r["changes_output_reason"]
    rec = lambda x: {"sha256": x * 32, "stable": True}  # noqa: E731
    r = resumed({"base": rec("a"), "candidate": rec("b")})
    assert r["outputs_identical"] is False and r["changes_output"] is True
    r = resumed({"base": rec("a"), "candidate": rec("a")})
    assert r["outputs_identical"] is True and r["changes_output"] is False
    # more runs are compared with the recorded outputs: these engines' real ones are other tokens
    r = resumed({"base": rec("a"), "candidate": rec("a")}, runs="4")
    assert r["outputs_stable"] is False and r["changes_output"] is True
    part = tmp_path / "part.json"
    bad = partial_doc(d["base"], d["candidate"], d["metric"], d["unit"], True, d["schedule"], samples, aa, work,
                      {"base": {"sha256": 5}})
    part.write_text(json.dumps(bad))
    code, _, err = run_cli(*sysargs, "--runs", "2", "--resume", part)
    assert code == 2 and "its 'outputs' must be null" in err, err


@pytest.mark.parametrize("orders, schedule, words", [
    (("||", "BA"), "ABBA", "block 0's samples ran in the orders '||', 'BA'"),
    (("ZZ", "BA"), "ABBA", "block 0's samples ran in the orders 'ZZ', 'BA'"),
    (("||", "||"), "ABBA", "not those of its schedule 'ABBA'"),
    (("AB", "BA"), "GPU swap on 0,1", "not those of its schedule 'GPU swap on 0,1'")])
def test_a_stored_runs_orders_are_its_schedules(tmp_path, run_cli, orders, schedule, words):
    """One sample's order edited to '||' switched --from to the GPU swap's noise estimator: a run
    NOT APPROVED at a 19.6% threshold became APPROVED at 2.1%."""
    b, c = [100, 90, 101, 92, 99, 91, 100, 93], [110, 111, 112, 110, 109, 111, 112, 110]
    samples = [{"pair": i, "block": i // 2, "base": b[i], "candidate": c[i], "order": "AB" if i % 2 == 0 else "BA"}
               for i in range(8)]
    d = {"schema": "specpilot.timing/1", "base": "A", "candidate": "B", "metric": "tps", "unit": "tps",
         "higher_is_better": True, "schedule": "ABBA", "warmup": 1, "samples": samples,
         "aa": [{"block": k, "first": b[2 * k], "second": b[2 * k + 1]} for k in range(4)], "changes_output": False,
         "gain": 1, "ci_low": 1, "approved": False, "noise": 0.09295}
    good = tmp_path / "good.json"
    good.write_text(json.dumps(d))
    code, out, err = run_cli("compare", "--from", good)
    assert code == 1 and "NOT APPROVED" in out, err
    if orders == ("||", "||"):
        for s in samples:
            s["order"] = "||"
    else:
        samples[0]["order"], samples[1]["order"] = orders
    d["schedule"] = schedule
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    code, out, err = run_cli("compare", "--from", bad)
    assert code == 2 and not out and words in one_error(err) and "the file is damaged" in err, err
