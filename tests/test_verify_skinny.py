"""The skinny GEMM of multi-row steps (kernels/verify/skinny.py) against its plain reference, its
split-K reduction's determinism, bad input, and the routing of ``blas.linear`` by the table.

On the CPU the kernel runs under Triton's interpreter at small shapes; ``-m gpu`` runs every table
entry at its layer's shape and the ends of its row range, eager and captured."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from specpilot.kernels.verify import blas  # noqa: E402
from specpilot.kernels.verify import naive as R  # noqa: E402
from specpilot.kernels.verify.skinny import SkinnyConfig, skinny_linear  # noqa: E402
from kernel_checks import gemm_inputs, within_bf16_rounding  # noqa: E402


@pytest.mark.parametrize("m,k,n,cfg", [
    (1, 128, 64, SkinnyConfig(1, 2)),
    (3, 256, 96, SkinnyConfig(1, 2)),        # N not a multiple of BLOCK_N
    (16, 300, 130, SkinnyConfig(3, 2)),      # K not a multiple of BLOCK_K, split-K
    (17, 512, 64, SkinnyConfig(4, 2)),       # the 32-row tile, split 4
    (33, 256, 128, SkinnyConfig(8, 2)),      # the 64-row tile, more splits asked than K has tiles
    (64, 192, 64, SkinnyConfig(2, 3)),
])
def test_skinny_gemm_matches_the_reference(m, k, n, cfg):
    x, w = gemm_inputs(m, k, n, seed=m)
    got = skinny_linear(x, w, cfg)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert within_bf16_rounding(got, x.float() @ w.float().T)
    assert within_bf16_rounding(got, R.linear(x, w))


def test_split_k_is_bitwise_deterministic_and_leaves_the_counters_at_zero():
    from specpilot.kernels import workspace

    x, w = gemm_inputs(9, 640, 192, seed=3)
    cfg = SkinnyConfig(5, 2)
    a = skinny_linear(x, w, cfg)
    b = skinny_linear(x, w, cfg)
    assert torch.equal(a, b)
    assert int(workspace.counters(x.device, "skinny.blocks", 3)[:3].abs().sum()) == 0
    # every split count gives the reference to one rounding
    for split in (1, 2, 3, 10):
        assert within_bf16_rounding(skinny_linear(x, w, SkinnyConfig(split, 2)), x.float() @ w.float().T)


def test_rows_past_m_never_reach_the_output():
    """Padding rows of the tile read as zero: a row's result does not depend on what follows x."""
    x, w = gemm_inputs(5, 128, 64, seed=4)
    big = torch.cat([x, torch.full((11, 128), 1e4, dtype=x.dtype)])
    assert torch.equal(skinny_linear(big[:5], w, SkinnyConfig(2, 2)),
                       skinny_linear(x, w, SkinnyConfig(2, 2)))


@pytest.mark.parametrize("x,w,msg", [
    (torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16), "1..64 rows"),
    (torch.zeros(65, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16), "1..64 rows"),
    (torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16), "x \\[M, K\\]"),
    (torch.zeros(4, 64, dtype=torch.bfloat16)[:, ::2], torch.zeros(64, 32, dtype=torch.bfloat16), "contiguous"),
    (torch.zeros(4, 64, dtype=torch.float16), torch.zeros(64, 64, dtype=torch.bfloat16), "one dtype"),
])
def test_bad_operands_are_refused(x, w, msg):
    with pytest.raises(ValueError, match=msg):
        skinny_linear(x, w)


def test_linear_routes_by_the_table(monkeypatch):
    """``blas.linear`` takes the skinny GEMM where the table has an entry for the layer and rows,
    cuBLAS otherwise; the CPU and fp32 weights always take ``F.linear``."""
    from specpilot.kernels import tuning

    entry = {"kernel": "skinny", "n": 64, "k": 128, "rows": [2, 16],
             "config": {"split": 2, "stages": 2}}
    real = tuning.lookup

    def lookup(op, kernel, arch=None, rows=None, **key):
        if op == "verify" and kernel == "skinny":
            return [entry] if key == {"n": 64, "k": 128} and 2 <= rows <= 16 else []
        return real(op, kernel, arch, rows, **key)

    monkeypatch.setattr(tuning, "lookup", lookup)
    blas._skinny.cache_clear()
    try:
        assert blas.skinny_config("cpu", 64, 128, 8) == SkinnyConfig(2, 2)
        assert blas.skinny_config("cpu", 64, 128, 17) is None and blas.skinny_config("cpu", 64, 96, 8) is None
        calls = []
        monkeypatch.setattr(blas, "skinny_linear", lambda h, w, cfg: calls.append(cfg) or R.linear(h, w))
        x, w = gemm_inputs(8, 128, 64)
        blas.linear(x, w)       # the CPU: F.linear
        assert calls == []
        if torch.cuda.is_available():
            blas.linear(x.cuda(), w.cuda())
            assert calls == [SkinnyConfig(2, 2)]
    finally:
        blas._skinny.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routed_skinny_gemms_agree_on_the_gpu_eager_and_captured():
    """Every table entry at its layer's shape and the ends of its row range: within one rounding
    of the fp32 product, and a CUDA graph replay gives the eager bits."""
    from specpilot.kernels import tuning

    arch = tuning.device_arch("cuda")
    entries = [e for e in tuning.table("verify", arch)["entries"] if e["kernel"] == "skinny"]
    if not entries:
        pytest.skip("the table routes no layer to the skinny GEMM")
    for e in entries:
        lo, hi = e["rows"]
        for m in sorted({lo, hi}):
            x, w = gemm_inputs(m, e["k"], e["n"], seed=m, device="cuda")
            cfg = blas.skinny_config("cuda", e["n"], e["k"], m)
            eager = skinny_linear(x, w, cfg)
            assert within_bf16_rounding(eager, x.float() @ w.float().T), (e, m)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = skinny_linear(x, w, cfg)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (e, m)
