"""The engine's logits and greedy tokens match transformers' for the same weights (fp32, CPU)."""

import pytest
import torch

from specpilot.engine.api import load_engine
from specpilot.engine.step_input import StepInput


def _hf_tiny(tmp_path, kind):
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-5)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=50000.0)
        cls = tf.LlamaForCausalLM
    elif kind == "llama3-rope":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=False)
        cls = tf.Qwen2ForCausalLM
    else:
        cfg = tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init so logits are far from uniform
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "qwen3"])
def test_logits_match_transformers(tmp_path, kind):
    hf, folder = _hf_tiny(tmp_path, kind)
    eng = load_engine(f"engine:model={folder},dtype=float32,ctx=256,threads=1")
    ids = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        pos = torch.arange(len(ids))
        mask = pos[None, :] <= pos[:, None]
        mask = torch.cat([mask, torch.zeros(len(ids), 256 - len(ids), dtype=torch.bool)], 1)
        eng.model.reset()
        got = eng.model(StepInput(ids, pos, pos, mask, "seq"))
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_equals_transformers_generate(tmp_path, kind):
    hf, folder = _hf_tiny(tmp_path, kind)
    prompt = [5, 17, 99, 3, 250, 17, 99]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    for mode in ("ar", "chain", "tree"):
        eng = load_engine(f"engine:model={folder},mode={mode},dtype=float32,ctx=256,threads=1")
        eng.decoder.eos_ids = set()
        assert eng.generate(prompt, 24).output_ids == ref, mode


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the real model on a shared 2-core CPU
def test_smollm2_greedy_equals_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpilot.engine.weights import smollm2_dir

    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eng = load_engine("engine:model=smollm2,dtype=float32,ctx=512")
    prompt = eng.encode("Write a short poem about the sea.", chat=True)
    ref_prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt == list(ref_prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    for mode in ("ar", "tree"):
        got = load_engine(f"engine:model=smollm2,mode={mode},dtype=float32,ctx=512,threads=1").generate(prompt, 32)
        assert got.output_ids == ref, mode
