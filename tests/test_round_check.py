"""``specpilot check``'s refusals before any timed run: what the baseline and the options must be."""

from __future__ import annotations

import json

import pytest

from round_support import small_round


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return small_round(tmp_path_factory.mktemp("check") / "r", "--no-remember")


@pytest.mark.parametrize("extra", [[], ["--scorer", "tiny"]])
def test_a_system_of_another_vocabulary_than_the_scorer_is_refused_before_any_run(base, run_cli, extra):
    code, _, err = run_cli("check", "--baseline", base, "--system", "engine:model=smollm2,mode=ar,threads=1",
                           "--no-timing", *extra)
    assert code == 2 and "vocabulary (49152 tokens)" in err and "256 tokens" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, words", [
    (["--system", ""], "--system: give an engine spec"),
    (["--scorer", "tiny", "--no-audit"], "--scorer does nothing with --no-audit"),
    (["--runs", "3", "--no-timing"], "--runs does nothing with --no-timing"),
    (["--tolerance", "0.3", "--no-timing"], "--tolerance does nothing with --no-timing"),
])
def test_options_that_conflict_or_do_nothing_are_refused(base, run_cli, args, words):
    code, _, err = run_cli("check", "--baseline", base, *args)
    assert code == 2 and words in err and err.count("\n") == 1, err


def _scorer_folder(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 16, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, **config}))
    return path


def _gguf(path, vocab: int):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["folder", "gguf"])
def test_a_scorer_file_of_another_vocabulary_is_refused_before_any_run(base, run_cli, tmp_path, kind):
    """A model folder the engine has no spec for (gpt2) and a .gguf are read through transformers'
    config (the GGUF's metadata) before the system runs."""
    scorer = (_scorer_folder(tmp_path / "gpt2", model_type="gpt2", vocab_size=300, n_embd=16, n_layer=1, n_head=2)
              if kind == "folder" else _gguf(tmp_path / "s.gguf", 300))
    code, _, err = run_cli("check", "--baseline", base, "--no-timing", "--scorer", scorer)
    assert code == 2 and err.count("\n") == 1 and "[check]" not in err, err
    assert f"--scorer {scorer}: its vocabulary (300 tokens) is not that of the baseline's system" in err, err
    assert "(256 tokens)" in err, err


def test_recorded_tokens_outside_a_scorer_folders_vocabulary_are_refused_before_any_run(base, run_cli, tmp_path):
    doc = json.loads((base / "baseline.json").read_text())
    row = doc["outputs"]["stock"][0]
    row["output_ids"] = row["output_ids"][:2] + [300]
    f = tmp_path / "baseline.json"
    f.write_text(json.dumps(doc))
    scorer = _scorer_folder(tmp_path / "llama", model_type="llama", vocab_size=256, intermediate_size=32)
    code, _, err = run_cli("check", "--baseline", f, "--no-timing", "--scorer", scorer)
    assert code == 2 and err.count("\n") == 1 and "[check]" not in err, err
    assert (f"outputs.stock row {row['id']!r}: token id 300 is outside the vocabulary of --scorer {scorer} (0..255)"
            in err)


def test_the_scorer_vocabulary_is_unknown_only_when_it_cannot_be_read(tmp_path, monkeypatch):
    """No transformers (or gguf): not known (the load says so later). A file transformers' readers
    cannot parse, whatever they raise for it: bad input now, naming the scorer."""
    import struct

    import transformers

    from specpilot.auditors.scorer import scorer_vocab_size
    from specpilot.errors import InputError

    folder = _scorer_folder(tmp_path / "m", model_type="llama", vocab_size=256)
    assert scorer_vocab_size(str(folder)) == 256 and scorer_vocab_size("tiny") == 256
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUFgarbage")
    try:
        import gguf  # noqa: F401
    except ImportError:
        assert scorer_vocab_size(str(bad)) is None
    else:
        with pytest.raises(InputError, match=f"--scorer {bad}: transformers cannot load it"):
            scorer_vocab_size(str(bad))
    for exc, outcome in ((ImportError("no gguf"), None), (OSError("unreadable"), InputError),
                         (struct.error("unpack_from requires a buffer"), InputError),
                         (TypeError("vocab_size must be an int"), InputError)):
        def boom(*a, exc=exc, **kw):
            raise exc

        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", boom)
        if outcome is None:
            assert scorer_vocab_size(str(folder)) is None
        else:
            with pytest.raises(outcome):
                scorer_vocab_size(str(folder))


def test_a_round_refuses_a_scorer_of_another_vocabulary_before_it_starts(run_cli, tmp_path):
    """round --scorer: the scorer forces the engine's outputs, so a vocabulary that is not the
    model's is refused at the start (dry run included), not by the approve stage's audit."""
    scorer = _scorer_folder(tmp_path / "gpt2", model_type="gpt2", vocab_size=300, n_embd=16, n_layer=1, n_head=2)
    for extra in (["--dry-run"], ["--out-dir", tmp_path / "r", "--no-remember"]):
        code, _, err = run_cli("round", "engine:model=tiny,mode=ar,threads=1", "--scorer", scorer, *extra)
        assert code == 2 and (f"--scorer {scorer}: its vocabulary (300 tokens) is not that of the deployment's model "
                              "tiny (256 tokens)") in err, err
    assert not (tmp_path / "r").exists()
    same = _scorer_folder(tmp_path / "same", model_type="gpt2", vocab_size=256, n_embd=16, n_layer=1, n_head=2)
    code, _, err = run_cli("round", "engine:model=tiny,mode=ar,threads=1", "--scorer", same, "--dry-run")
    assert code == 0, err


def _baseline(base, tmp_path, change):
    doc = json.loads((base / "baseline.json").read_text())
    change(doc)
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    return tmp_path / "baseline.json"


@pytest.mark.parametrize("role", ["system", "ar"])
def test_a_baseline_role_that_is_there_but_empty_is_refused(base, run_cli, tmp_path, role):
    b = _baseline(base, tmp_path, lambda d: d["outputs"].update({role: []}))
    code, _, err = run_cli("check", "--baseline", b, "--runs", "2")
    assert code == 2 and f"baseline field 'outputs.{role}' is empty" in err and err.count("\n") == 1, err


def test_check_warns_without_none_when_the_baseline_has_no_facts_and_when_timing_cannot_fail(base, run_cli, tmp_path):
    def change(d):
        d.pop("facts", None)
        d["noise"] = 0.6   # 1% + 2 x 60% + tolerance: the threshold passes 100%
        d["samples"] = [500.0, 520.0, 510.0, 505.0]   # the module's round may have had no time to time a candidate
    b = _baseline(base, tmp_path, change)
    code, out, err = run_cli("check", "--baseline", b, "--runs", "2", "--no-audit", "--tolerance", "0.1")
    assert code == 0, err
    assert "measured on None" not in out and "does not say what machine it was measured on" in out, out
    assert "timing cannot fail" in out, out
    # with --no-timing no throughput is compared: no word about machines (it warned beside "timing not judged")
    d = json.loads(b.read_text())
    d["facts"] = {"cpu": "Another CPU 9000", "gpu": None}
    b.write_text(json.dumps(d))
    code, out, err = run_cli("check", "--baseline", b, "--no-timing")
    assert code == 0 and "timing not judged" in out and "not comparable" not in out + err, out + err


def test_check_runs_help_says_the_default_it_uses(run_cli):
    code, out, _ = run_cli("check", "--help")
    assert code == 0 and "as many as the baseline has samples, at least 4" in " ".join(out.split()), out


def test_check_prints_whether_the_outputs_are_identical_as_yes_or_no(base, run_cli):
    code, out, err = run_cli("check", "--baseline", base, "--no-timing")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("outputs identical to the baseline's"))
    assert row.split()[-1] == "yes", out


def test_a_round_a_resume_reopened_has_no_baseline_to_check(base, run_cli, tmp_path):
    """A resume stopped half way leaves the earlier session's baseline.json: the gate passed against
    it although the round has stages left (and may end with another system)."""
    import shutil

    r = tmp_path / "r"
    shutil.copytree(base, r)
    state = json.loads((r / "round.json").read_text())
    state["stages"]["approve"]["status"] = "interrupted"
    state["stages"]["remember"]["status"] = "pending"
    (r / "round.json").write_text(json.dumps(state))
    for where in (r, r / "baseline.json"):
        code, out, err = run_cli("check", "--baseline", where, "--runs", "2")
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert ("the round is unfinished (stages left: approve, remember), its baseline.json was written before the "
                "round stopped (or before a resume reopened it); finish it with specpilot round --resume "
                f"{r}") in err, err


def test_a_round_stopped_in_its_last_stage_is_not_said_to_be_resumed(base, run_cli, tmp_path):
    """A round interrupted in remember after writing baseline.json, never resumed: check said its
    baseline was 'from before it was resumed'."""
    import shutil

    r = tmp_path / "r"
    shutil.copytree(base, r)
    state = json.loads((r / "round.json").read_text())
    state["stages"]["remember"]["status"] = "interrupted"
    (r / "round.json").write_text(json.dumps(state))
    code, _, err = run_cli("check", "--baseline", r, "--runs", "2")
    assert code == 2 and "stages left: remember" in err and "resumed" not in err, err


@pytest.mark.parametrize("samples", [[3e-308, 3e-308], [2e9, 2e9]])
def test_baseline_samples_no_machine_gives_are_refused_before_any_run(base, run_cli, tmp_path, samples):
    """A throughput whose ratio to a real one overflows failed after the timed runs, naming nothing."""
    doc = json.loads((base / "baseline.json").read_text())
    doc["samples"] = samples
    p = tmp_path / "b.json"
    p.write_text(json.dumps(doc))
    code, _, err = run_cli("check", "--baseline", p, "--runs", "2", "--no-audit")
    assert code == 2 and err.count("\n") == 1 and "baseline field 'samples' must be a list" in err, err


def test_a_scorer_at_odds_with_the_baselines_system_is_the_one_named(base, run_cli):
    code, _, err = run_cli("check", "--baseline", base, "--scorer", "smollm2", "--no-timing")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("specpilot: error: --scorer smollm2: its vocabulary (49152 tokens) is not that of the "
                          "baseline's system") and "--system" not in err, err


def test_a_report_says_a_load_average_was_not_recorded(base, run_cli, tmp_path):
    """A round killed before its end has no end load average: the report printed 'None at the end'."""
    import shutil

    r = tmp_path / "r"
    shutil.copytree(base, r)
    state = json.loads((r / "round.json").read_text())
    state["load_average_end"] = None
    (r / "round.json").write_text(json.dumps(state))
    code, _, err = run_cli("report", r)
    assert code == 0, err
    md = (r / "report.md").read_text()
    assert "at the start, not recorded at the end)." in md and "None" not in md.split("## ")[0], md[:600]


def test_a_baseline_whose_outputs_are_longer_than_its_limit_is_refused(base, run_cli, tmp_path):
    """The check generates max_new_tokens and audits against rows four times as long: it passed on
    a quarter of the tokens, its warnings only in the JSON."""
    b = _baseline(base, tmp_path, lambda d: d.update(max_new_tokens=2))
    code, _, err = run_cli("check", "--baseline", b, "--no-timing")
    assert code == 2 and err.count("\n") == 1 and "more than the baseline's max_new_tokens 2" in err, err


def test_stock_outputs_without_tokens_are_refused_before_any_run(base, run_cli, tmp_path):
    def change(d):
        for role in d["outputs"].values():
            for r in role:
                r["output_ids"] = []
    b = _baseline(base, tmp_path, change)
    code, _, err = run_cli("check", "--baseline", b, "--runs", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{b}: outputs.stock holds no tokens" in err and "run the round again, or give --no-audit" in err, err


def test_a_stock_scorer_on_cuda_without_a_gpu_is_named_before_any_run(base, run_cli, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = _baseline(base, tmp_path, lambda d: d.update(stock=d["stock"] + ",device=cuda"))
    code, out, err = run_cli("check", "--baseline", b, "--runs", "40")
    assert code == 3 and "[check]" not in err and err.count("\n") == 1, err
    assert "the baseline's stock engine" in err and "give --scorer MODEL" in err, err


def test_the_audits_warnings_are_checks_warnings(base, run_cli, tmp_path):
    """A check on a few tokens says so where its gate is read (the table and the JSON's warnings)."""
    code, out, err = run_cli("check", "--baseline", base, "--no-timing", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["audit"]["warnings"] and all(f"audit: {w}" in doc["warnings"] for w in doc["audit"]["warnings"])


def test_a_system_on_cuda_without_a_gpu_is_named_first(base, run_cli, tmp_path, monkeypatch):
    """The committed H200 round's check said to give --scorer or --no-audit, neither of which helps:
    its system itself needs the GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = _baseline(base, tmp_path, lambda d: d.update(system=d["system"] + ",device=cuda",
                                                     stock=d["stock"] + ",device=cuda"))
    for extra in ([], ["--no-audit"]):
        code, _, err = run_cli("check", "--baseline", b, "--runs", "4", *extra)
        assert code == 3 and err.count("\n") == 1 and "the baseline's system" in err, err
        assert "runs on CUDA and no CUDA GPU is visible: run the check on a machine with a GPU" in err, err
