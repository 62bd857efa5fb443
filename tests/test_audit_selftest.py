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
