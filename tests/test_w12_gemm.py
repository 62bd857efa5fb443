"""Fused W12 GEMM against the torch reference (Triton interpreter on CPU, real kernels on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12.gemm import Config, default_config  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.routing import w12_linear  # noqa: E402
from specpilot.kernels.w12.naive import w12_linear_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    w[0, :32] = 0.0                 # a run of escapes in one row
    w[min(3, n - 1), min(5, k - 1)] = float("inf")
    w[min(7, n - 1), min(3, k - 1)] = 1e-30   # out of window
    w[min(9, n - 1), min(1, k - 1)] = 1e3     # out of window, large
    return w


def extreme_row(k, seed):
    """One bf16 CUDA row ``[1, k]`` with -0, subnormal (1e-39) and large (3e4) entries among normal
    ones: the inputs that catch a changed summation order or a lost sign of zero."""
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)) * 4
    x[0, ::7] = -0.0
    x[0, 1::11] = 1e-39
    x[0, 3::13] = 3e4
    return x.bfloat16().cuda()


def check_close(y, x, w):
    ref = x.float() @ w.float().T
    scale = x.float().abs() @ w.float().abs().T
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    err = (y.float() - ref).abs()[fin] / (scale[fin] + 1e-30)
    assert float(err.max()) < 2e-6


SLOW = pytest.mark.slow  # the interpreter is slow on a shared 2-core box: the rest of the matrix runs with -m slow
CASES = [  # (rows, config): every product form, split-K on and off, prefetch on and off
    (1, Config(16, 128, 2, "fma")),
    pytest.param(3, Config(32, 64, 1, "fma", prefetch=False), marks=SLOW),
    pytest.param(3, Config(16, 128, 2, "dot8"), marks=SLOW),
    (17, Config(16, 128, 1, "dot8t", prefetch=False)),
    pytest.param(17, Config(32, 128, 2, "dot"), marks=SLOW),
]


@pytest.mark.parametrize("m,cfg", CASES)
def test_w12_linear_matches_fp32_reference(m, cfg):
    w = make_weight(40, 200)   # 40 rows: a partial tile; K=200: a partial record
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)).bfloat16().to(DEV)
    y = w12_linear(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = w12_linear(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))      # bitwise run to run


def test_qpass_matches_reference_and_bf16_output():
    w = make_weight(32, 128, seed=1)
    t = encode(w)
    kp = KernelPack.from_w12(t, device=DEV)
    x = torch.randn(2, 128).bfloat16().to(DEV)
    yq = w12_linear(x, kp, qpass=True, config=Config(32, 128, 2, "fma"), out_dtype=torch.float32).cpu()
    rq = w12_linear_ref(x.cpu().float(), t, qpass=True)
    fin = torch.isfinite(rq)
    assert float(((yq - rq).abs()[fin] / (rq.abs()[fin] + 1e-2)).max()) < 1e-4
    yb = w12_linear(x, kp, config=Config(32, 128, 1, "fma"))
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 32)


def test_more_rows_than_one_block_and_default_config():
    w = make_weight(16, 64, seed=2)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(70, 64).bfloat16().to(DEV)
    cfg = default_config(70, 16, 64)
    y = w12_linear(x, kp, config=Config(16, 64, 1, "dot8"), out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    assert cfg.product in ("dot8", "dot", "dot8t")


def test_shape_mismatch_is_rejected():
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device=DEV)
    with pytest.raises(ValueError):
        w12_linear(torch.zeros(1, 32, dtype=torch.bfloat16, device=DEV), kp)


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["fma", "dot", "dot8", "dot8t"])
@pytest.mark.parametrize("m", [1, 8, 32, 64])
def test_gpu_bf16_paths_at_real_shapes(product, m):
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    y = w12_linear(x, kp, config=Config(64 if product == "fma" else 128, 128, 4, product))
    ref = x.float() @ w.float().T
    assert bool(((y.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all())
    assert torch.equal(y, w12_linear(x, kp, config=Config(64 if product == "fma" else 128, 128, 4, product)))
