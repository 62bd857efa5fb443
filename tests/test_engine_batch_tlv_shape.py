"""A batched TLV run's JSON and table have the one-request run's shape, also where no request ran
a cycle (every token from a prefill): the top-level ``tlv`` block, ``batch.tlv``, each result's
``tlv`` and the ``TLV:`` line, with ``batch.tau`` the top-level tau."""

from __future__ import annotations

import json

import pytest

PROMPTS = {"a": "abcabcabcabc", "b": "x", "c": "the cat sat on the mat, the cat sat on the hat, the cat sat", "d": "zz",
           "e": "hello world hello world hello"}


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p5.jsonl"
    path.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": k, "text": v}) + "\n"
                            for k, v in PROMPTS.items()))
    return path


@pytest.mark.parametrize("new", [1, 3])
def test_a_batched_tlv_run_reports_its_cycles_as_a_one_request_run_does(run_cli, prompts, new):
    args = ("run", "--model", "tiny", "--mode", "tlv", "--prompts", prompts, "--max-new-tokens", new, "--threads", 1)
    runs = {}
    for batch in (1, 3):
        code, out, err = run_cli(*args, "--batch", batch, "--format", "json")
        assert code == 0, err
        runs[batch] = json.loads(out)
        code, out, err = run_cli(*args, "--batch", batch)
        assert code == 0 and "\nTLV: tau " in out, out
    one, many = runs[1], runs[3]
    assert many["tlv"] is not None and set(many["tlv"]) == set(one["tlv"]) | {"steps"}
    assert many["batch"]["tlv"]["cycles"] == many["tlv"]["cycles"] == one["tlv"]["cycles"] == (0 if new == 1 else 5)
    assert all("tlv" in r for r in many["results"]) and many["tau"] == one["tau"]
    assert many["batch"]["tau"] == pytest.approx(many["tau"])
