"""The W12 restore (kernels/w12/restore.py) against the plain decode, bit for bit (Triton interpreter
on the CPU, the real kernel on CUDA), and the routed restore + cuBLAS product on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import decode, encode  # noqa: E402
from specpilot.kernels.w12 import restore as rs  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.routing import pick, route, w12_linear  # noqa: E402
from test_w12_gemm import make_weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def escape_weight(n, k, seed=0):
    """``test_w12_gemm.make_weight`` (a run of zeros, inf, out-of-window values) plus the other kinds
    of escape: -0, a subnormal, -inf, nan, a large negative value."""
    w = make_weight(n, k, seed)
    w[0, 32:40] = 0.0
    w[1, :9] = -0.0
    w[2, 3] = 1e-39          # subnormal
    w[min(4, n - 1), 7] = float("-inf")
    w[min(5, n - 1), 2] = float("nan")
    w[n - 1, k - 1] = -3e4
    return w


@pytest.mark.parametrize("n,k", [(130, 72), (128, 64), (5, 200)])
@pytest.mark.parametrize("qpass", [False, True])
def test_restore_equals_the_plain_decode_bit_for_bit(n, k, qpass):
    packed = encode(escape_weight(n, k))
    kp = KernelPack.from_w12(packed, device=DEV)
    got = rs.restore(kp, qpass=qpass)
    want = decode(packed, qpass=qpass).to(got.device)
    assert got.shape == (n, k) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if not qpass:   # and the original weight itself, -0 and nan bits included
        assert torch.equal(got.view(torch.int16).cpu(), escape_weight(n, k).view(torch.int16))


def test_restore_writes_into_a_strided_buffer_and_refuses_a_wrong_one():
    packed = encode(escape_weight(130, 72))
    kp = KernelPack.from_w12(packed, device=DEV)
    big = torch.zeros(130, 80, dtype=torch.bfloat16, device=DEV)
    rs.restore(kp, out=big[:, :72])
    assert torch.equal(big[:, :72].view(torch.int16).cpu(), escape_weight(130, 72).view(torch.int16))
    assert not big[:, 72:].any()
    with pytest.raises(ValueError, match="out must be"):
        rs.restore(kp, out=torch.empty(130, 71, dtype=torch.bfloat16, device=DEV))
    no_bits = KernelPack(*[getattr(kp, f) for f in ("shape", "rows_stored", "rec64", "rec32", "low_exp", "esc_rowptr",
                                                    "esc_row", "esc_col", "esc_delta", "esc_delta_q",
                                                    "max_escapes_per_row")])
    with pytest.raises(ValueError, match="esc_w"):
        rs.restore(no_bits)


def test_the_route_sends_prompt_sized_products_to_the_restore_and_verify_sizes_elsewhere():
    rules = [{"kernel": "restore", "rows": [129, None]}, {"kernel": "mma", "rows": [2, None]}, {"kernel": "gemm"}]
    yes = lambda kernel: True  # noqa: E731
    none = lambda kernel: None  # noqa: E731
    assert pick(rules, 1000, 4096, yes, none) == "restore"
    assert pick(rules, 128, 4096, yes, none) == "mma"
    assert pick(rules, 1000, 4096, lambda kernel: kernel != "restore", none) == "mma"
    # the restore needs a CUDA device: on the CPU (the interpreter) the route passes it by
    kp = KernelPack.from_w12(encode(escape_weight(130, 72)), device="cpu")
    x = torch.randn(300, 72).bfloat16()
    assert not rs.supported(x, kp) and route(x, kp) != "restore"
    with pytest.raises(ValueError, match="CUDA"):
        rs.w12_restore_linear(x, kp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_routed_prompt_product_is_cublas_on_the_original_weight_bit_for_bit():
    w = escape_weight(4096, 1024, seed=3)
    w[5, 2] = 0.5   # no nan: compare products bit for bit
    w[min(4, 4095), 7] = 0.25
    w[3, 5] = 0.125
    w[4, 7] = 0.0625
    wc = w.cuda()
    kp = KernelPack.from_w12(encode(w), device="cuda")
    for m in (300, 1000):
        x = (torch.randn(m, 1024, device="cuda") * 2).bfloat16()
        assert route(x, kp) == "restore"
        y = w12_linear(x, kp)
        ref = torch.nn.functional.linear(x, wc)
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
        out = torch.empty(m, 4096, dtype=torch.bfloat16, device="cuda")
        assert w12_linear(x, kp, out=out) is out and torch.equal(out, ref)
