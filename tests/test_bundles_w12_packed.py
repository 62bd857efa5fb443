"""The w12 bundle loads checkpoints packed by ``specpilot w12 pack``: restored bit for bit, not re-encoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpilot.bundles import w12_quantization as core
from specpilot.bundles import w12_quantization_sglang as sgl
from specpilot.kernels.w12 import decode, encode
from specpilot.kernels.w12.checkpoint import pack, read_file

P = "model.layers.0"


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(n, k):
        t = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        t[0, :3] = torch.tensor([0.0, float("inf"), 1e-40])  # escapes: zero, inf, a denormal
        t[1, 5] = 300.0                                      # out of the row's window
        return t

    return {f"{P}.self_attn.q_proj.weight": w(256, 192), f"{P}.self_attn.k_proj.weight": w(128, 192),
            f"{P}.self_attn.v_proj.weight": w(40, 192), f"{P}.mlp.down_proj.weight": w(96, 128),
            f"{P}.input_layernorm.weight": torch.ones(192, dtype=torch.bfloat16)}


@pytest.fixture()
def packed(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    src = tmp_path / "model.safetensors"
    weights = _weights()
    save_file(weights, str(src))
    dst = tmp_path / "model.w12.safetensors"
    pack(str(src), str(dst))
    return dst, weights


def _stream(path: Path):
    tensors, _ = read_file(path)
    return iter(sorted(tensors.items()))


def _layer(weight: torch.Tensor):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return layer


def test_stream_restores_packed_weights_bit_for_bit(packed):
    path, weights = packed
    tables = core.packed_tables([str(path)])
    assert set(tables) == {n for n in weights if n.endswith("proj.weight")}
    registry: dict = {}
    out = dict(core.restore_stream(_stream(path), tables, registry))
    assert set(out) == set(weights)  # the four parts became one weight; other tensors pass through
    for name, w in weights.items():
        assert torch.equal(out[name].view(torch.int16), w.view(torch.int16)), name
    assert set(registry) == set(tables)


def test_fused_layer_takes_the_shards_records_without_encoding(packed, monkeypatch):
    path, weights = packed
    registry: dict = {}
    dict(core.restore_stream(_stream(path), core.packed_tables([str(path)]), registry))
    qkv = torch.cat([weights[f"{P}.self_attn.{s}_proj.weight"] for s in "qkv"])
    ref = encode(qkv)

    def no_encoding(*a, **k):
        raise AssertionError("a packed layer must not be re-encoded")

    monkeypatch.setattr(core, "convert_weight", no_encoding)
    layer = _layer(qkv)
    stats = core.process_weights_after_loading(layer, registry, f"{P}.self_attn.qkv_proj")
    assert stats.source == "packed checkpoint" and not hasattr(layer, "weight")
    t = layer.w12
    assert t.shape == ref.shape and t.rows_stored == ref.rows_stored
    for f in ("records", "low_exp", "esc_pos", "esc_bits"):
        assert torch.equal(getattr(t, f), getattr(ref, f)), f
    assert torch.equal(decode(t).view(torch.int16), qkv.view(torch.int16))
    assert not any(k.startswith(f"{P}.self_attn") for k in registry)  # taken out of the registry
    x = torch.randn(3, 192, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    # apply's CPU path accumulates in fp32 (a bf16 F.linear may sum in another order and round differently)
    assert torch.equal(core.apply(layer, x), (x.float() @ qkv.float().T).to(torch.bfloat16))


def test_layers_without_packed_shards_are_encoded_at_load(packed):
    path, weights = packed
    registry: dict = {}
    dict(core.restore_stream(_stream(path), core.packed_tables([str(path)]), registry))
    # a weight the loader filled with something else than the packed shards: encoded, not trusted
    other = _layer(weights[f"{P}.mlp.down_proj.weight"] * 2)
    assert core.process_weights_after_loading(other, registry, f"{P}.mlp.down_proj").source == "encoded at load"
    plain = _layer(weights[f"{P}.mlp.down_proj.weight"])
    assert core.process_weights_after_loading(plain, {}, f"{P}.mlp.down_proj").source == "encoded at load"


def test_concat_needs_whole_row_tiles_before_the_last_shard():
    a, b = encode(torch.randn(40, 64).to(torch.bfloat16)), encode(torch.randn(128, 64).to(torch.bfloat16))
    assert core.concat_rows([a, b]) is None
    assert core.concat_rows([b, a]) is not None


def _rewrite_meta(path: Path, change) -> None:
    from safetensors.torch import save_file

    tensors, meta = read_file(path)
    doc = json.loads(meta["specpilot.w12"])
    change(doc["tensors"], tensors)
    meta["specpilot.w12"] = json.dumps(doc)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("change, msg", [
    (lambda info, t: info[f"{P}.self_attn.k_proj.weight"].update(sha256="0" * 64), "differs from the checkpoint"),
    (lambda info, t: info[f"{P}.self_attn.k_proj.weight"].pop("sha256"), "field sha256 must be 64"),
    (lambda info, t: t[f"{P}.self_attn.k_proj.weight.w12.records"].__setitem__(7, 1), "CRC-32 mismatch"),
    (lambda info, t: t.pop(f"{P}.self_attn.k_proj.weight.w12.esc_bits"), "missing part"),
])
def test_a_restore_that_is_not_exact_refuses_to_load(packed, change, msg):
    path, _ = packed
    _rewrite_meta(path, change)
    with pytest.raises(core.W12LoadError, match=msg):
        dict(core.restore_stream(_stream(path), core.packed_tables([str(path)]), {}))


class _Loader:
    """Stands in for SGLang's DefaultModelLoader: what the hook calls on it."""

    def __init__(self, files):
        self.files = files

    def _prepare_weights(self, model_or_path, revision, fall_back_to_pt, allow_patterns_overrides):
        return "folder", list(self.files), True


class _Source:
    model_or_path, revision, fall_back_to_pt, allow_patterns_overrides = "folder", None, True, None


def test_the_sglang_hook_wraps_the_loader_stream(packed, tmp_path):
    path, weights = packed
    sgl.PACKED.clear()
    out = dict(sgl.around_get_weights_iterator(lambda self, source, **kw: _stream(path), _Loader([str(path)]),
                                               _Source()))
    assert set(out) == set(weights) and len(sgl.PACKED) == 4
    sgl.PACKED.clear()
    # a plain bf16 checkpoint streams as stock
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file(weights, str(plain))
    stock = list(sorted(weights.items()))
    assert dict(sgl.around_get_weights_iterator(lambda self, source, **kw: iter(stock), _Loader([str(plain)]),
                                                _Source())).keys() == weights.keys()
    assert sgl.PACKED == {}
