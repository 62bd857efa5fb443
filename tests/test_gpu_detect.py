"""NVML detection of the local GPU (runs on the device machine: -m gpu)."""

import pytest


@pytest.mark.gpu
def test_detect_local_gpu_matches_catalog():
    import torch

    from specpilot.gpus import detect_gpu

    g = detect_gpu()
    assert g is not None
    assert torch.cuda.get_device_name(0).split()[-1].lower() in g.name.lower()
    # NVML's bus width x memory clock gives the peak bandwidth; for catalog GPUs it is within 10%
    if g.key != "detected":
        from specpilot.gpus import catalog

        assert g.bandwidth_tbs == pytest.approx(catalog()[g.key][0].bandwidth_tbs, rel=0.10)


@pytest.mark.gpu
def test_ceiling_auto_gpu(run_cli):
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--rows", "1,32", "--format", "json")
    assert code == 0, err
    import json

    doc = json.loads(out)
    assert doc["gpu"]["bandwidth_tbs"] > 1.0
