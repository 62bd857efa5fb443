"""`audit` refuses what it can tell is wrong before any system runs (tiny engines, CPU)."""

from __future__ import annotations

import json

import pytest

TREE = "engine:model=tiny,mode=tree,nodes=8,ctx=64"
STOCK = "engine:model=tiny,mode=ar,ctx=64"


@pytest.fixture
def prompts(tmp_path):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "prompt_ids": [1, 2, 3 + i]})
                          + "\n" for i in range(3)))
    return pf


def test_a_tree_whose_draft_rows_do_not_fit_is_refused_before_stock_runs(run_cli, prompts, tmp_path):
    """3 prompt tokens + 45 new tokens fit ctx=64 for AR stock (its 11 reserved rows) but not for a
    tree of 8 nodes (19): refused up front, with nothing run and nothing saved."""
    saved = tmp_path / "outs"
    code, out, err = run_cli("audit", TREE, "--against", STOCK, "--scorer", "tiny", "--prompts", prompts,
                             "--max-new-tokens", "45", "--save-outputs", saved)
    assert code == 2 and out == "", err
    assert err.startswith("specpilot: error: ") and err.count("\n") == 1, err
    assert TREE in err and "'p0'" in err and "67 cache slots" in err and "ctx=64" in err, err
    assert "loading model" not in err and not saved.exists()
