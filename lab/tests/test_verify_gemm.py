"""lab/verify/gemm.py (the unrouted tensor-core projections of a verify step) against its
references: CPU under Triton's interpreter, ``-m gpu`` at Llama-3.1-8B shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lab.verify import gemm as G  # noqa: E402
from lab.verify import naive as R  # noqa: E402
from kernel_checks import DEV, closeness, rope_tables as _rope_tables, row_inputs as _inputs  # noqa: E402

SMALL = G.RowsConfig(pairs=8, block_k=32, warps=1, stages=1)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
_close = closeness(TOL)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [3, 17])
def test_fused_projections_match_the_reference(dt, T):
    g, rnd, x, gamma = _inputs(dt, T)
    K = x.shape[1]
    N, inter = 48, 24
    w, res = rnd(N, K, scale=0.1), rnd(T, N)
    _close(G.gemm_residual(x, w, res, SMALL), R.gemm_residual(x, w, res), dt)
    w13 = rnd(2 * inter, K, scale=0.1)
    _close(G.norm_gate_up_silu(x, gamma, 1e-5, w13, inter, SMALL), R.norm_gate_up_silu(x, gamma, 1e-5, w13, inter), dt)

    nh, nkv, hd, S = 4, 2, 16, 40
    wq = rnd((nh + 2 * nkv) * hd, K, scale=0.1)
    cos, sin = _rope_tables(hd, 64)
    pos = torch.randint(0, 64, (T,), generator=g).to(DEV)
    slots = torch.randperm(S, generator=g)[:T].to(DEV)
    kc, vc = rnd(nkv, S, hd), rnd(nkv, S, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    q = G.norm_qkv_rope_store(x, gamma, 1e-5, wq, cos, sin, pos, slots, kc, vc, nh, nkv, SMALL)
    q2 = R.norm_qkv_rope_store(x, gamma, 1e-5, wq, cos, sin, pos, slots, kc2, vc2, nh, nkv)
    _close(q, q2, dt)
    _close(kc, kc2, dt)
    _close(vc, vc2, dt)
    others = torch.ones(S, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.equal(kc[:, others], kc2[:, others]) and torch.equal(vc[:, others], vc2[:, others])


def test_normalised_projection_is_the_layer_mathematics():
    """``rstd * (W @ (gamma x))`` (the fused prologue) is the layer's ``W @ rms_norm(x)``: in fp32 they
    agree to rounding, in bf16 to bf16 rounding."""
    from specpilot.engine.norm import rms_norm

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 64, generator=g), torch.randn(32, 64, generator=g) * 0.1
    gamma = torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(R.norm_linear(x, gamma, 1e-5, w), rms_norm(x, gamma, 1e-5) @ w.T, atol=1e-5, rtol=1e-5)
    xb, wb, gb = x.bfloat16(), w.bfloat16(), gamma.bfloat16()
    torch.testing.assert_close(R.norm_linear(xb, gb, 1e-5, wb), rms_norm(xb, gb, 1e-5) @ wb.T, atol=2e-2, rtol=2e-2)


def test_configs_and_shape_errors():
    x = torch.zeros(3, 64, device=DEV)
    with pytest.raises(ValueError, match="power of two"):
        G.check_config(G.RowsConfig(pairs=12))
    with pytest.raises(ValueError, match="pairs >= 8"):
        G.check_config(G.RowsConfig(pairs=4))
    with pytest.raises(ValueError, match="divide head_dim"):
        G.check_config(G.RowsConfig(pairs=16), "rope", hd=16)
    with pytest.raises(ValueError, match="1..64 rows"):
        G.gemm_residual(torch.zeros(65, 64, device=DEV), torch.zeros(32, 64, device=DEV), torch.zeros(65, 32, device=DEV))
    with pytest.raises(ValueError, match="x's dtype"):
        G.gemm_residual(x, torch.zeros(32, 64, device=DEV, dtype=torch.bfloat16), torch.zeros(3, 32, device=DEV))
    with pytest.raises(ValueError, match="multiple of 16"):
        G.gemm_residual(x, torch.zeros(40, 64, device=DEV), torch.zeros(3, 40, device=DEV), SMALL)
    assert [G.row_tile(t) for t in (1, 2, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
    with pytest.raises(ValueError):
        G.row_tile(65)
    for rows in (2, 17, 33, 64):
        G.check_config(G.config_for("rope", 6144, 4096, rows), "rope", 128)



@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 33, 64])
def test_gpu_fused_projections_at_llama_shapes(T):
    """bf16 tensor-core kernels with their table configs at Llama-3.1-8B layer shapes against the
    references, and the same bits on a second run."""
    g = torch.Generator().manual_seed(T)
    dt = torch.bfloat16

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt).cuda()

    x, gamma = rnd(T, 4096), (torch.rand(4096, generator=g) + 0.5).to(dt).cuda()
    w2, a, res = rnd(4096, 14336, scale=0.02), rnd(T, 14336), rnd(T, 4096)
    got = G.gemm_residual(a, w2, res)
    _close(got, R.gemm_residual(a, w2, res), dt)
    assert torch.equal(got, G.gemm_residual(a, w2, res))
    w13 = rnd(2 * 14336, 4096, scale=0.02)
    _close(G.norm_gate_up_silu(x, gamma, 1e-5, w13, 14336), R.norm_gate_up_silu(x, gamma, 1e-5, w13, 14336), dt)
    nh, nkv, hd, S = 32, 8, 128, 256
    wq = rnd((nh + 2 * nkv) * hd, 4096, scale=0.02)
    cos, sin = _rope_tables(hd, 2048)
    pos = torch.randint(0, 2048, (T,), generator=g).cuda()
    slots = torch.randperm(S, generator=g)[:T].cuda()
    kc, vc = rnd(nkv, S, hd), rnd(nkv, S, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    q = G.norm_qkv_rope_store(x, gamma, 1e-5, wq, cos, sin, pos, slots, kc, vc, nh, nkv)
    q2 = R.norm_qkv_rope_store(x, gamma, 1e-5, wq, cos, sin, pos, slots, kc2, vc2, nh, nkv)
    _close(q, q2, dt)
    _close(kc, kc2, dt)
    _close(vc, vc2, dt)


