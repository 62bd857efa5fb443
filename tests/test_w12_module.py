"""W12Linear and convert_model on a tiny Llama (CPU path: bit-exact restore + F.linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specpilot.kernels.w12.module import W12Linear, convert_model


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_convert_model_keeps_logits_bit_for_bit_on_cpu():
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        before = model(ids).logits
        rep = convert_model(model)
        after = model(ids).logits
    assert len(rep.converted) == 14 and "lm_head" in rep.skipped
    assert isinstance(model.model.layers[0].mlp.down_proj, W12Linear)
    assert torch.equal(before, after)
    assert 12.0 < rep.bits_per_weight < 13.0


def test_w12linear_with_bias_and_include_filter():
    lin = nn.Linear(70, 33, bias=True).to(torch.bfloat16)
    mod = W12Linear.from_linear(lin)
    x = torch.randn(4, 70).bfloat16()
    assert torch.equal(mod(x), lin(x))
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).to(torch.bfloat16)
    rep = convert_model(net, include=("2",), exclude=())
    assert rep.converted == ["2"] and isinstance(net[2], W12Linear) and isinstance(net[0], nn.Linear)


def test_qpass_module_uses_the_8bit_view():
    lin = nn.Linear(64, 16, bias=False).to(torch.bfloat16)
    q = W12Linear.from_linear(lin, qpass=True)
    bits = q.restored_weight().view(torch.int16).to(torch.int32) & 0xF
    assert bool(((bits == 8) | (lin.weight.view(torch.int16).to(torch.int32) & 0x7F80 == 0)).all())


def test_pack_a_saved_model_then_load_it_back(tmp_path, run_cli):
    from specpilot.kernels.w12.checkpoint import load_into

    transformers = pytest.importorskip("transformers")
    model = tiny_llama()
    model.save_pretrained(tmp_path / "bf16")
    code, _, err = run_cli("w12", "pack", tmp_path / "bf16", "-o", tmp_path / "w12")
    assert code == 0, err
    fresh = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16).eval()
    res = load_into(fresh, str(tmp_path / "w12"))
    assert len(res.w12_modules) == 14
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


@pytest.mark.gpu
def test_converted_model_on_cuda_matches_cpu_restore():
    model = tiny_llama().cuda()
    ids = torch.randint(0, 256, (1, 12), device="cuda")
    with torch.no_grad():
        before = model(ids).logits.float()
        convert_model(model)
        after = model(ids).logits.float()
    assert float((after - before).abs().max()) < 0.05 * float(before.abs().max())
