"""The engine's built-in models (tiny, tiny-hybrid) as the scorer wherever --scorer is taken:
``audit check`` and the CI gate ``check``."""

from __future__ import annotations

import json

import pytest

AR, CHAIN = "engine:model=tiny,mode=ar", "engine:model=tiny,mode=chain"


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "text": t}) + "\n"
                         for i, t in enumerate(["hello world", "the cat sat on"])))
    return p


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_audit_check_and_the_ci_gate_take_a_builtin_scorer(run_cli, tmp_path, prompts):
    saved = tmp_path / "outs"
    code, out, err = run_cli("audit", "check", CHAIN, "--against", AR, "--ar", AR, "--scorer", "tiny",
                             "--prompts", prompts, "--max-new-tokens", 12, "--save-outputs", saved, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["scorer"]["name"] == "tiny" and doc["scorer"]["vocab_size"] == 256
    # the scorer is the very model the engine runs: its own greedy AR tokens are never mismatches
    assert {s["role"]: s["mismatches"] for s in doc["systems"]} == {"stock": 0, "ar": 0, "system": 0}
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"schema": "specpilot.baseline/1", "kind": "engine", "system": CHAIN, "stock": AR,
                                "max_new_tokens": 12, "samples": [],
                                "outputs": {"stock": _rows(saved / "stock.outputs.jsonl"),
                                            "ar": _rows(saved / "ar.outputs.jsonl"),
                                            "system": _rows(saved / "system.outputs.jsonl")}}))
    code, out, err = run_cli("check", "--baseline", base, "--no-timing", "--scorer", "tiny", "--format", "json")
    assert code == 0, err
    res = json.loads(out)
    assert res["audit_verdict"] == "pass" and res["audit"]["scorer"]["name"] == "tiny", res


def test_a_builtin_scorer_refuses_tokens_outside_its_vocabulary(run_cli, tmp_path):
    rows = [{"schema": "specpilot.outputs/1", "id": "a", "prompt_ids": [1, 2, 3], "output_ids": [4, 300]}]
    f, stock = tmp_path / "o.jsonl", tmp_path / "stock.jsonl"
    for p in (f, stock):
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli("audit", "check", f, "--against", stock, "--scorer", "tiny")
    errors = [x for x in err.splitlines() if x.startswith("specpilot: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "token id 300 is outside the scorer's vocabulary (256)" in errors[0]


def test_an_unknown_scorer_names_the_builtin_models(run_cli, tmp_path):
    f = tmp_path / "o.jsonl"
    f.write_text(json.dumps({"schema": "specpilot.outputs/1", "id": "a", "prompt_ids": [1], "output_ids": [2]}) + "\n")
    code, _, err = run_cli("audit", "check", f, "--against", f, "--scorer", "tinyy")
    assert code == 2 and "one of the engine's models (smollm2, tiny, tiny-hybrid)" in err, err
