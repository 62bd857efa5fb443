"""ModelSpec and GPUSpec: parsing real config shapes, hand-computed parameter counts, bad input."""

import json

import pytest

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.gpus import get_gpu, match_gpu_name, nvml_bandwidth_tbs, with_overrides
from specpilot.models import catalog_names, load_model_spec, spec_from_config

from model_configs import HYBRID, LLAMA_8B



def test_llama_8b_hand_counts():
    m = spec_from_config(LLAMA_8B)
    # q 4096x4096, k/v 4096x1024, o 4096x4096, MLP 3 x 4096 x 14336, times 32 layers
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert m.linear_params() == 32 * per_layer
    assert round(m.linear_params() / 1e9, 2) == 6.98
    assert m.linear_params() * 2 / 1e9 == pytest.approx(13.96, abs=0.005)
    assert m.lm_head_params() == 128256 * 4096
    assert round(m.lm_head_params() / 1e9, 3) == 0.525
    assert m.head_dim == 128  # derived: hidden / heads
    # KV cache: 32 layers x (K+V) x 8 heads x 128 x 2 bytes = 131072 bytes per token
    assert m.kv_bytes_per_token() == 131072


def test_hybrid_layer_layout_and_state():
    m = spec_from_config(HYBRID)
    assert m.layer_types.count("full_attention") == 2 and m.num_gdn_layers == 6
    assert m.layer_types[3] == "full_attention" and m.layer_types[0] == "linear_attention"
    # fp32 state [value_heads, key_dim, value_dim] per layer and request
    assert m.gdn.state_elems() == 32 * 128 * 128
    assert m.gdn.state_elems() * 4 == 2_097_152
    assert m.attn_output_gate  # qwen3_next gates the attention output: q_proj is doubled
    assert m.attention_proj_params() == 2048 * 16 * 256 * 2 + 2 * 2048 * 2 * 256 + 16 * 256 * 2048


def test_layer_types_list_and_text_config_nesting():
    inner = dict(HYBRID)
    inner.pop("full_attention_interval")
    inner["layer_types"] = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    outer = {"model_type": "qwen3_5", "text_config": {**inner, "model_type": "qwen3_5_text"}, "tie_word_embeddings": False}
    m = spec_from_config(outer)
    assert m.num_gdn_layers == 6 and m.num_full_attention_layers == 2


def test_moe_touched_experts():
    m = spec_from_config(HYBRID)
    assert m.moe.expected_touched(1) == pytest.approx(10)  # top-k at one row
    # grows sub-linearly and saturates at num_experts
    assert 10 < m.moe.expected_touched(8) < 80
    assert m.moe.expected_touched(100000) == pytest.approx(512)
    # the shared expert is dense: always read (counted in linear), routed experts in moe
    from specpilot.probes.floors import class_costs

    c1 = class_costs(m, rows=1)
    per_expert = 3 * 2048 * 512 * 2  # bf16 bytes of one routed expert
    routed_weight_bytes = 8 * 10 * per_expert
    assert c1["moe"].bytes == pytest.approx(routed_weight_bytes, rel=0.01)


def test_tied_embeddings_and_head_dim_given():
    cfg = dict(LLAMA_8B, tie_word_embeddings=True, head_dim=64)
    m = spec_from_config(cfg)
    assert m.tie_word_embeddings and m.head_dim == 64
    assert m.total_params() == m.linear_params() + 128256 * 4096


@pytest.mark.parametrize("bad,msg", [
    ({**LLAMA_8B, "hidden_size": 0}, "hidden_size"),
    ({k: v for k, v in LLAMA_8B.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({**LLAMA_8B, "model_type": "whisper"}, "unsupported model_type"),
    ({**LLAMA_8B, "num_key_value_heads": 7}, "multiple"),
    ({**HYBRID, "linear_num_key_heads": None}, "linear_num_key_heads"),
    ({**HYBRID, "num_experts_per_tok": 1000}, "exceeds"),
    ({**LLAMA_8B, "layer_types": ["full_attention"]}, "layer_types"),
])
def test_bad_configs(bad, msg):
    with pytest.raises(InputError, match=msg):
        spec_from_config(bad)


def test_load_from_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert load_model_spec(str(tmp_path)).linear_params() == spec_from_config(LLAMA_8B).linear_params()
    assert load_model_spec(str(tmp_path / "config.json")).num_layers == 32
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_model_spec(str(tmp_path / "broken.json"))
    with pytest.raises(InputError, match="no config.json"):
        load_model_spec(str(_empty_dir(tmp_path)))
    with pytest.raises(InputError, match="unknown model"):
        load_model_spec("no-such-model-xyz")


def _empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_catalog_models_parse():
    names = catalog_names()
    for required in ("llama-3.1-8b", "qwen3-8b", "qwen3-32b", "smollm2-135m"):
        assert required in names
    for n in names:
        m = load_model_spec(n)
        assert m.linear_params() > 0 and m.vocab_size > 0
    assert any(load_model_spec(n).is_hybrid for n in names)
    assert any(load_model_spec(n).moe is not None for n in names)
    ll = load_model_spec("llama-3.1-8b")
    assert round(ll.linear_params() / 1e9, 2) == 6.98


def test_gpu_catalog_and_names():
    h100 = get_gpu("h100")
    assert h100.bandwidth_tbs == pytest.approx(3.35, rel=0.01)
    assert match_gpu_name("NVIDIA H200").key.startswith("h200")
    assert match_gpu_name("NVIDIA H100 80GB HBM3").key == h100.key
    assert match_gpu_name("Some Unknown Accelerator") is None
    assert match_gpu_name("NVIDIA H200 NVL") is None  # a different, lower-power SKU
    assert get_gpu("rtx-pro-6000").key == "rtx-pro-6000-blackwell-server"
    with pytest.raises(InputError, match="unknown GPU"):
        get_gpu("tpu-v5")
    g = with_overrides(h100, bandwidth_tbs=3.0)
    assert g.bandwidth_tbs == 3.0 and "bandwidth" in g.measured
    with pytest.raises(InputError):
        with_overrides(h100, bandwidth_tbs=-1)


def test_nvml_bandwidth_formula():
    # H100 SXM: 5120-bit HBM3 at 2619 MHz -> 3.35 TB/s
    assert nvml_bandwidth_tbs(5120, 2619) == pytest.approx(3.35, rel=0.01)


def test_auto_gpu_without_nvidia(monkeypatch):
    import specpilot.gpus as gpus

    monkeypatch.setattr(gpus, "detect_gpu", lambda index=0: None)
    with pytest.raises(EnvironmentMissing):
        gpus.get_gpu("auto")
