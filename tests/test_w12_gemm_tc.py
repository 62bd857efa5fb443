"""The tensor-core W12 GEMM (kernels/w12/gemm_tc.py) against the fp32 reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import decode, encode  # noqa: E402
from specpilot.kernels.w12.gemm import KernelPack  # noqa: E402
from specpilot.kernels.w12.gemm_tc import TcConfig, w12_linear_tc  # noqa: E402

from test_w12_gemm import DEV, check_close, make_weight  # noqa: E402


@pytest.mark.parametrize("m,n,k,cfg", [
    (5, 40, 200, TcConfig(32, 64, 2, num_stages=1)),     # partial tiles everywhere, split-K
    (17, 130, 256, TcConfig(64, 128, 1, num_stages=2)),  # two row tiles, two records per step
])
def test_w12_tc_matches_fp32_reference(m, n, k, cfg):
    w = make_weight(n, k)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().to(DEV)
    y = w12_linear_tc(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = w12_linear_tc(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))      # bitwise run to run


def test_w12_tc_qpass_matches_reference():
    w = make_weight(40, 128)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    y = w12_linear_tc(x, kp, qpass=True, config=TcConfig(32, 64, 1, num_stages=1), out_dtype=torch.float32).cpu()
    ref = x.cpu().float() @ decode(encode(w), qpass=True).float().T
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_w12_tc_rejects_bad_input():
    w = make_weight(24, 64)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    with pytest.raises(ValueError):
        w12_linear_tc(torch.randn(2, 32).bfloat16().to(DEV), kp)
    with pytest.raises(ValueError):
        w12_linear_tc(torch.randn(2, 64).bfloat16().to(DEV), kp, config=TcConfig(48))
