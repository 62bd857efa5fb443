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


def test_a_partial_outputs_file_an_earlier_run_kept_is_not_replaced(run_cli, prompts, tmp_path):
    """A run that stops keeps its outputs in --save-outputs; the next audit with that folder refuses
    to overwrite them (before anything runs) and says how to finish them."""
    saved = tmp_path / "outs"
    saved.mkdir()
    kept = saved / "stock.outputs.jsonl"
    kept.write_text(json.dumps({"schema": "specpilot.outputs/1", "id": "p0", "prompt_ids": [1, 2, 3],
                                "output_ids": [5, 6], "max_new_tokens": 2, "system": STOCK}) + "\n")
    before = kept.read_text()
    code, out, err = run_cli("audit", TREE, "--against", STOCK, "--scorer", "tiny", "--prompts", prompts,
                             "--max-new-tokens", "4", "--save-outputs", saved)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert str(kept) in err and "1 of the 3 prompts" in err and "--resume" in err and "--max-new-tokens 2" in err, err
    assert "loading model" not in err and kept.read_text() == before
    assert sorted(p.name for p in saved.iterdir()) == ["stock.outputs.jsonl"]
    kept.write_text("not json\n")   # not outputs at all: not replaced either
    code, out, err = run_cli("audit", TREE, "--against", STOCK, "--scorer", "tiny", "--prompts", prompts,
                             "--max-new-tokens", "4", "--save-outputs", saved)
    assert code == 2 and "not an outputs file this audit may replace" in err and kept.read_text() == "not json\n", err


def test_outputs_that_would_replace_an_input_file_are_refused_before_anything_runs(run_cli, prompts, tmp_path):
    """A SYSTEM file inside --save-outputs under the name a running system saves to (its stock
    outputs, audited against a new stock run): refused up front, not after the stock run (whose
    outputs were then lost)."""
    saved = tmp_path / "outs"
    saved.mkdir()
    kept = saved / "stock.outputs.jsonl"
    kept.write_text("".join(json.dumps({"schema": "specpilot.outputs/1", "id": f"p{i}", "prompt_ids": [1, 2, 3 + i],
                                        "output_ids": [5, 6]}) + "\n" for i in range(3)))
    before = kept.read_text()
    code, out, err = run_cli("audit", kept, "--against", STOCK, "--scorer", "tiny", "--prompts", prompts,
                             "--max-new-tokens", "4", "--save-outputs", saved)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"the stock system's outputs would replace input file {kept}" in err, err
    assert "loading model" not in err and kept.read_text() == before


def test_a_system_that_is_the_stock_file_itself_is_refused(run_cli, tmp_path):
    """The same outputs file as SYSTEM and --against (by name or through a link) would pass
    whatever it holds: refused; the AR file may be the stock file (stock is AR)."""
    from specpilot.engine.api import load_engine

    outs = tmp_path / "stock.jsonl"
    greedy = load_engine("engine:model=tiny,mode=ar,threads=1").generate([1, 2, 3], 2).output_ids   # the scorer's own
    outs.write_text(json.dumps({"schema": "specpilot.outputs/1", "id": "p0", "prompt_ids": [1, 2, 3],
                                "output_ids": greedy}) + "\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(outs)
    for system in (outs, link):
        code, out, err = run_cli("audit", system, "--against", outs, "--scorer", "tiny")
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert f"SYSTEM {system} is the --against file {outs}" in err, err
    other = tmp_path / "tree.jsonl"
    other.write_text(outs.read_text())
    code, out, err = run_cli("audit", other, "--against", outs, "--ar", outs, "--scorer", "tiny", "--format", "json")
    assert code == 0 and json.loads(out)["verdict"] == "pass", err


@pytest.fixture
def selftest_args(monkeypatch):
    """What ``audit selftest`` would run with (the run itself, on SmolLM2, is the slow suite's)."""
    from specpilot.auditors import selftest
    from specpilot.errors import InputError

    seen = {}

    def run_selftest(**kw):
        seen.update(kw)
        raise InputError("the self-test would run here")

    monkeypatch.setattr(selftest, "run_selftest", run_selftest)
    return seen


def test_selftest_defaults_follow_a_small_n_prompts(run_cli, selftest_args):
    """--n-prompts 2 alone runs: --repeats and --engine-prompts default to at most 2."""
    code, out, err = run_cli("audit", "selftest", "--n-prompts", "2")
    assert "the self-test would run here" in err, err
    assert selftest_args["n_prompts"] == 2 and selftest_args["repeats"] == 2 and selftest_args["engine_prompts"] == 2


def test_selftest_names_every_option_that_does_not_fit_n_prompts_at_once(run_cli, selftest_args):
    code, out, err = run_cli("audit", "selftest", "--n-prompts", "2", "--repeats", "6", "--engine-prompts", "4",
                             "--max-new-tokens", "0")
    assert code == 2 and err.count("\n") == 1 and not selftest_args, err
    assert "--repeats 6" in err and "--engine-prompts 4: choose 0..2" in err and "--max-new-tokens 0" in err, err


def test_selftest_prompts_is_a_count_and_a_file_is_told_so(run_cli, selftest_args, prompts):
    """--prompts is the alias of --n-prompts here: a prompts file (what it is in every other verb)
    is refused saying the self-test runs its own prompts, not "not a valid integer range"."""
    code, out, err = run_cli("audit", "selftest", "--prompts", prompts)
    assert code == 2 and err.count("\n") == 1 and not selftest_args, err
    assert "the self-test runs on its built-in prompts; give how many of them to use (1-64)" in err, err
    code, out, err = run_cli("audit", "selftest", "--prompts", "2")   # a count passes to the run
    assert "the self-test would run here" in err and selftest_args["n_prompts"] == 2, err


def test_a_malformed_outputs_file_is_refused_before_the_scorer_is_read(tmp_path):
    """Reading a Hugging Face scorer's vocabulary imports transformers (seconds); a malformed
    outputs file is refused first, by a process that never imports it. The vocabulary is still
    checked where rows name the engine that wrote them (test below)."""
    from conftest import cli_imports, refused

    scorer = tmp_path / "scorer"
    scorer.mkdir()
    (scorer / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 96}))
    row = {"schema": "specpilot.outputs/1", "id": "p0", "prompt_ids": [1, 2], "output_ids": [3, 4]}
    (tmp_path / "stock.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "sys.jsonl").write_text(json.dumps(row)[:-9] + "\n")
    code, out, err, imported = cli_imports("audit", "sys.jsonl", "--against", "stock.jsonl", "--scorer", scorer,
                                           cwd=tmp_path)
    refused(code, err, "sys.jsonl:1: not valid JSON")
    assert out == "" and imported == [], imported


def test_outputs_of_an_engine_of_another_vocabulary_are_still_refused(run_cli, tmp_path):
    """Rows that name the engine that wrote them: its vocabulary against the scorer's (read when a
    row names one), refused before the scorer loads."""
    scorer = tmp_path / "scorer"
    scorer.mkdir()
    (scorer / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                                                    "num_hidden_layers": 1, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2}))
    row = {"schema": "specpilot.outputs/1", "id": "p0", "prompt_ids": [1, 2], "output_ids": [3, 4],
           "system": "engine:model=tiny,mode=ar"}
    for name in ("sys.jsonl", "stock.jsonl"):
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    code, out, err = run_cli("audit", tmp_path / "sys.jsonl", "--against", tmp_path / "stock.jsonl",
                             "--scorer", scorer)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "whose vocabulary (256 tokens) is not that of --scorer" in err and "(96 tokens)" in err, err
    assert "loading scorer" not in err


def test_the_collect_that_finishes_a_partial_run_of_text_prompts_names_the_tokenizer(run_cli, tmp_path):
    """The audit tokenized the text prompts with its scorer; the collect it names to finish a
    stopped run must too (a server system has no model to take a tokenizer from)."""
    import shlex

    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"q{i}", "text": f"Question {i}."}) + "\n"
                         for i in range(4)))
    so = tmp_path / "so"
    args = ("audit", "engine:model=tiny,mode=tree", "--against", "engine:model=tiny,mode=ar", "--scorer", "tiny",
            "--prompts", p, "--max-new-tokens", 8, "--save-outputs", so)
    assert run_cli(*args)[0] == 0
    kept = so / "system.outputs.jsonl"
    kept.write_text(kept.read_text().splitlines(keepends=True)[0])   # what a stopped run keeps
    code, _, err = run_cli(*args)
    assert code == 2 and "--tokenizer tiny" in err, err
    hint = shlex.split(err.split("finish it with '")[1].split("'")[0])
    assert hint[:3] == ["specpilot", "audit", "collect"]
    code, _, err = run_cli(*hint[1:])
    assert code == 0 and len(kept.read_text().splitlines()) == 4, err
