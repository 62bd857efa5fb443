"""An empty value (an unset shell variable: ``--check "$RUN"``) is refused, exit 2 and one line: it
was taken as the option left out (a gate that checked nothing passed), or as the current folder."""

import pytest

from conftest import refused


@pytest.mark.parametrize("args, words", [
    (["ceiling", "--check", ""], "Invalid value for '--check': an empty path; give one, or leave --check out"),
    (["ceiling", "--model", "llama-3.1-8b", "--replay", ""], "Invalid value for '--replay': an empty path"),
    (["ceiling", "--model", "llama-3.1-8b", "--drafter", ""], "Invalid value for '--drafter': empty; give a value"),
    (["w12", "verify", "x.safetensors", "--against", ""], "Invalid value for '--against': an empty path"),
    (["w12", "stats", ""], "Invalid value for 'FILE': an empty path; give one"),
    (["w12", "pack", "", "-o", "out"], "an empty path; give one"),
    (["profile", ""], "Invalid value for 'TRACES...': an empty path"),
    (["replay", ""], "Invalid value for 'LATTICE': an empty path"),
    (["check", "--baseline", ""], "Invalid value for '--baseline': an empty path"),
    (["run", "--model", "tiny", "--prompts", ""], "Invalid value for '--prompts': an empty path"),
    (["audit", "check", "engine:model=tiny", "--against", "engine:model=tiny,mode=ar", "--ar", ""],
     "Invalid value for '--ar': empty; give a value, or leave --ar out"),
    (["compare", "--base-cmd", "true", "--candidate-cmd", "true", "--gpus", ""], "Invalid value for '--gpus': empty"),
    (["audit", "selftest", "--biases", "2,,1"], "--biases 2,,1: an empty value between commas"),
    (["ceiling", "--model", "", "--tau", "3", "--step-ms", "10", "--ar-ms", "5"], "Invalid value for '--model': empty"),
    (["profile", "t.json", "--model", ""], "Invalid value for '--model': empty"),
    (["round", "", "--dry-run"], "Invalid value for '[DEPLOYMENT]': empty; give a value, or leave it out"),
])
def test_an_empty_value_is_refused(run_cli, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(*args)
    refused(code, err, words)


def test_refusals_name_what_was_given(run_cli, tmp_path):
    """compare --from with --resume said 'do not also give systems, commands or prompts' (--resume is
    none of them); ceiling's advice to leave out --model for a CPU probe led to the next refusal
    (--gpu needs --model)."""
    from pathlib import Path

    code, _, err = run_cli("compare", "--from", tmp_path / "t.json", "--resume", tmp_path / "p.json")
    refused(code, err, "--from judges a stored timing file; leave out --resume")
    probe = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu" / "measure" / "rows.json"
    code, _, err = run_cli("ceiling", "--model", "smollm2-135m", "--gpu", "h100", "--rows-probe", probe, "--tau", "2")
    refused(code, err, "leave out --model and the GPU (--gpu, --bandwidth, --flops) for the measured figures alone")
    code, _, err = run_cli("ceiling", "--rows-probe", probe, "--tau", "2")
    assert code == 0, err
