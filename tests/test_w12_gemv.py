"""The streaming W12 GEMV (kernels/w12/gemv.py) against the fp32 reference and the general kernel."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import decode, encode  # noqa: E402
from specpilot.kernels.w12.gemv import GemvConfig, default_config, supported, tuned_config, w12_gemv  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.routing import route, w12_linear  # noqa: E402

from test_w12_gemm import DEV, check_close, make_weight  # noqa: E402


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 40, 200, GemvConfig(16, 2, 2)),                 # partial row tile, partial record, split-K
    (1, 130, 256, GemvConfig(64, 4, 1, prefetch=False)),  # two row tiles, one split, no prefetch
    (2, 40, 384, GemvConfig(32, 2, 3)),                 # two rows, three splits
    (16, 40, 256, GemvConfig(16, 2, 2)),                # all 16 rows decode the weights once
    (1, 130, 512, GemvConfig(32, 2, 2, stages=3)),      # the compiler's pipeline, split-K
    (3, 40, 256, GemvConfig(16, 1, 1, stages=2)),       # pipeline, one record per step, 3 rows
])
def test_w12_gemv_matches_fp32_reference(m, n, k, cfg):
    w = make_weight(n, k)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().to(DEV)
    y = w12_gemv(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = w12_gemv(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))      # bitwise run to run


def test_w12_gemv_qpass_matches_reference():
    w = make_weight(40, 128)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    y = w12_gemv(x, kp, qpass=True, config=GemvConfig(16, 2, 1), out_dtype=torch.float32).cpu()
    ref = x.cpu().float() @ decode(encode(w), qpass=True).float().T
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)


def _routes_to_gemv(m: int, n: int, kp) -> bool:
    """Whether the routing table sends ``m`` rows of an ``n``-output layer to this kernel (no Gluon)."""
    from dataclasses import replace

    return route(torch.zeros(m, 64, dtype=torch.bfloat16), replace(kp, shape=(n, 64))) == "gemv"


def test_w12_linear_routes_few_rows_to_gemv():
    w = make_weight(24, 64)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    for m in (1, 3):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).bfloat16().to(DEV)
        assert supported(x, kp) and (DEV == "cuda" or _routes_to_gemv(m, 24, kp))
        assert torch.equal(w12_linear(x, kp, out_dtype=torch.float32), w12_gemv(x, kp, out_dtype=torch.float32))
    if DEV == "cpu":   # (on CUDA the Gluon kernels take these)
        assert _routes_to_gemv(16, 4096, kp) and not _routes_to_gemv(8, 28672, kp) and not _routes_to_gemv(17, 64, kp)
    odd = torch.randn(1, 63).bfloat16()
    assert not supported(odd, kp) and not supported(torch.randn(17, 64).bfloat16(), kp)
    with pytest.raises(ValueError):
        w12_gemv(torch.randn(1, 32).bfloat16().to(DEV), kp)


def test_default_config_uses_the_measured_tables():
    assert default_config(1, 6144, 4096) == tuned_config(1, 6144, 4096) is not None   # one row: its entry
    assert default_config(3, 4096, 4096) == default_config(4, 4096, 4096)   # 3 rows: the 4-row entry
    assert default_config(8, 4096, 4096).stages == 3                 # 8 rows: the compiler's pipeline
    assert default_config(8, 300, 640).split_k >= 1                  # untuned shape: the heuristic
