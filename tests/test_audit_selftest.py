"""The audit on the real SmolLM2-135M-Instruct (``-m slow``): the self-test, and a run of engine systems."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_selftest_rejects_planted_bias_and_passes_lossless(run_cli, tmp_path):
    out = tmp_path / "selftest.json"
    saved = tmp_path / "outs"
    code, stdout, err = run_cli("audit", "selftest", "--prompts", 6, "--max-new-tokens", 12, "--repeats", 2,
                                "--biases", "2,0.125", "--engine-prompts", 1, "--save-outputs", saved,
                                "--device", "cpu", "--format", "json", "--out", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["schema"] == "specpilot.audit-selftest/1" and data["ok"] is True
    full = {s["name"]: s for s in data["full_audit"]["systems"]}
    assert full["bias=2"]["verdict"] == "reject" and full["bias=2"]["unexplained_events"] > 0
    assert full["batch4"]["verdict"] == "pass" and full["eager-attention"]["verdict"] == "pass"
    assert data["detection_rate"]["2"] == 1.0
    lossless = [r for r in data["rows"] if r["kind"] == "lossless"]
    assert data["false_reject_audits"] == 2 * len(lossless) and all(r["audits"] == 2 for r in lossless)
    assert data["gpu"] == "cpu" and data["cpu"]
    if data["engine_systems"]:  # the engine is optional; when it ran, its lossless systems passed
        eng = {s["name"]: s["verdict"] for s in data["engine_audit"]["systems"]}
        assert all(eng[n] == "pass" for n in data["engine_systems"])
    # the saved outputs re-audit through the plain CLI with the same verdicts
    code, stdout, err = run_cli("audit", saved / "bias=2.jsonl", saved / "batch4.jsonl", "--against",
                                saved / "stock.jsonl", "--ar", saved / "ar.jsonl", "--scorer", "smollm2",
                                "--device", "cpu", "--format", "json")
    assert code == 1, err
    again = {s["name"]: s for s in json.loads(stdout)["systems"]}
    assert again["bias=2.jsonl"]["mismatch_rate"] == pytest.approx(full["bias=2"]["mismatch_rate"])
    assert again["batch4.jsonl"]["verdict"] == "pass"


def test_audit_runs_engine_systems_from_text_prompts(run_cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": i, "text": t}) + "\n"
                               for i, t in enumerate(["The capital of France is", "1, 2, 3, 4,"])))
    saved = tmp_path / "outs"
    code, out, err = run_cli("audit", "engine:model=smollm2,mode=tree,nodes=16,threads=1", "--against",
                             "engine:model=smollm2,mode=ar,threads=1", "--scorer", "smollm2", "--prompts", prompts,
                             "--max-new-tokens", 8, "--save-outputs", saved, "--device", "cpu", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["verdict"] == "pass"
    assert {p.name for p in saved.iterdir()} == {"stock.outputs.jsonl", "system.outputs.jsonl"}


def test_selftest_does_not_replace_outputs_that_answer_other_prompts(run_cli, tmp_path):
    """--save-outputs holding an earlier self-test's outputs of fewer prompts: refused before any
    system runs, as 'audit check' refuses a partial file (one check for both); the same prompts rewrite."""
    saved = tmp_path / "outs"
    args = ("audit", "selftest", "--repeats", 1, "--max-new-tokens", 2, "--biases", "2", "--engine-prompts", 0,
            "--device", "cpu", "--save-outputs", saved, "--format", "json")
    code, _, err = run_cli(*args, "--n-prompts", 1)
    assert code in (0, 1), err
    before = {p.name: p.read_text() for p in saved.iterdir()}
    assert "stock.jsonl" in before and all(t.count("\n") == 1 for t in before.values())
    code, out, err = run_cli(*args, "--n-prompts", 2)
    assert code == 2 and out == "", err
    last = err.strip().splitlines()[-1]
    assert last == (f"specpilot: error: --save-outputs {saved}: {saved / 'ar.jsonl'} holds an earlier run's outputs "
                    "for 1 of the 2 prompts of --n-prompts; remove it or give another --save-outputs"), err
    assert "Full audit" not in err and {p.name: p.read_text() for p in saved.iterdir()} == before
    (saved / "bias=2.jsonl").write_text("not json\n")   # not outputs at all: not replaced either
    code, out, err = run_cli(*args, "--n-prompts", 1)
    assert code == 2 and "bias=2.jsonl is not an outputs file this audit may replace" in err, err
    assert (saved / "bias=2.jsonl").read_text() == "not json\n"
    (saved / "bias=2.jsonl").unlink()
    code, out, err = run_cli(*args, "--n-prompts", 1)   # every file answers the prompts: a new run rewrites them
    assert code in (0, 1) and json.loads(out)["schema"] == "specpilot.audit-selftest/1", err


def test_a_save_outputs_file_of_more_prompts_is_not_cut_to_fewer(run_cli, tmp_path):
    """A second audit of a prompt subset into the same --save-outputs: refused (the other prompts'
    outputs were silently dropped from the files)."""
    rows = [{"schema": "specpilot.prompts/1", "id": f"q{i}", "prompt_ids": [5 + i, 9, 77, 3]} for i in range(3)]
    every, some = tmp_path / "p3.jsonl", tmp_path / "p2.jsonl"
    every.write_text("".join(json.dumps(r) + "\n" for r in rows))
    some.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    saved = tmp_path / "so"
    args = ("audit", "engine:model=tiny,mode=chain", "--against", "engine:model=tiny,mode=ar", "--scorer", "tiny",
            "--max-new-tokens", 6, "--save-outputs", saved)
    code, _, err = run_cli(*args, "--prompts", every)
    assert code == 0, err
    before = {p.name: p.read_text() for p in saved.iterdir()}
    code, _, err = run_cli(*args, "--prompts", some)
    assert code == 2 and "holds an earlier run's outputs for 2 of the 2 prompts of --prompts and 1 other prompt;" in err
    assert {p.name: p.read_text() for p in saved.iterdir()} == before


def test_a_system_collected_with_a_larger_limit_than_stock_is_warned_about(run_cli, tmp_path):
    from specpilot.engine.api import load_engine

    engine = load_engine("engine:model=tiny,mode=ar,threads=1")   # the scorer's own greedy outputs

    def rows(limit):
        return "".join(json.dumps({"schema": "specpilot.outputs/1", "id": f"q{i}", "prompt_ids": [5 + i, 9],
                                   "output_ids": engine.generate([5 + i, 9], limit).output_ids,
                                   "max_new_tokens": limit}) + "\n" for i in range(2))

    st, sysf = tmp_path / "stock.jsonl", tmp_path / "sys.jsonl"
    st.write_text(rows(4))
    sysf.write_text(rows(8))
    code, out, err = run_cli("audit", sysf, "--against", st, "--scorer", "tiny")
    assert code in (0, 1), err
    assert "collected with --max-new-tokens 8, stock with 4 (16 tokens vs stock's 8)" in out + err, out + err


@pytest.mark.parametrize("where", ["afile/sub", "/dev/null", "/proc/specpilot-outs"])
def test_selftest_refuses_a_save_outputs_that_is_no_folder_before_any_system_runs(run_cli, tmp_path, monkeypatch,
                                                                                   where):
    """It ran every system, then failed on the folder: the verdict and figures lost."""
    from specpilot.auditors import selftest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(selftest, "run_selftest", lambda **kw: pytest.fail("the self-test ran"))
    code, out, err = run_cli("audit", "selftest", "--n-prompts", 1, "--repeats", 1, "--engine-prompts", 0,
                             "--biases", "2", "--max-new-tokens", 4, "--save-outputs", where)
    assert code == 2 and out == "" and err.count("\n") == 1 and f"--save-outputs {where}:" in err, err
