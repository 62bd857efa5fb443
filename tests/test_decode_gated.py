"""The hybrid layers' one-row kernels (kernels/decode/gated_attention.py, gemv.norm_proj) against
their references (kernels/decode/naive.py), under Triton's interpreter on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from specpilot.kernels.decode import gated_attention as ga, gemv, naive


# float32 on the CPU: Triton's interpreter truncates float32 -> bfloat16 casts where the GPU rounds
# to nearest, so bf16 bit equality is checked on the GPU (tests/test_hybrid_gpu.py)
DT = torch.float32


def _close(a, b):
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated,rot,rows", [(True, 8, 1), (False, 16, 1), (True, 8, 3)])
def test_qk_norm_rope_store_matches_reference(gated, rot, rows):
    nh, nkv, hd, S = 4, 2, 16, 12
    gen = torch.Generator().manual_seed(rot)
    dt = DT
    proj = torch.randn(rows, nh * hd * (2 if gated else 1) + 2 * nkv * hd, generator=gen).to(dt)
    qn, kn = (torch.rand(hd, generator=gen) + 0.5).to(dt), (torch.rand(hd, generator=gen) + 0.5).to(dt)
    ang = torch.rand(S, rot, generator=gen) * 6
    cos, sin = ang.cos(), ang.sin()
    pos, slot = torch.tensor([5, 2, 9][:rows]), torch.tensor([7, 3, 11][:rows])
    caches = [torch.zeros(nkv, S, hd, dtype=dt) for _ in range(4)]
    want = naive.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[0], caches[1], nh, nkv, gated)
    got = ga.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[2], caches[3], nh, nkv, gated)
    assert _close(got, want)
    assert _close(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2][:, slot].abs().sum() > 0


def test_qk_norm_rope_store_into_each_rows_request_slot():
    """Continuous batching: row t's K/V go to request ``req[t]``'s cache ([requests, nkv, S, hd])."""
    nh, nkv, hd, S, rot = 4, 2, 16, 12, 8
    gen = torch.Generator().manual_seed(2)
    proj = torch.randn(3, nh * hd * 2 + 2 * nkv * hd, generator=gen).to(DT)
    qn, kn = (torch.rand(hd, generator=gen) + 0.5).to(DT), (torch.rand(hd, generator=gen) + 0.5).to(DT)
    ang = torch.rand(S, rot, generator=gen) * 6
    cos, sin = ang.cos(), ang.sin()
    pos, slot, req = torch.tensor([5, 2, 9]), torch.tensor([7, 3, 7]), torch.tensor([2, 0, 1])
    caches = [torch.zeros(3, nkv, S, hd, dtype=DT) for _ in range(4)]
    want = naive.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[0], caches[1], nh, nkv, True,
                                    req=req)
    got = ga.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[2], caches[3], nh, nkv, True, req=req)
    assert _close(got, want)
    assert _close(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2][2, :, 7].abs().sum() > 0 and caches[2][0, :, 7].abs().sum() == 0
    with pytest.raises(ValueError, match="requests"):
        ga.qk_norm_rope_store(proj, qn, kn, 1e-6, cos, sin, pos, slot, caches[2][0], caches[3][0], nh, nkv, True,
                              req=req)


def test_sigmoid_gate_and_norm_proj_match_reference():
    gen = torch.Generator().manual_seed(1)
    nh, hd = 4, 16
    proj = torch.randn(3, 2 * nh * hd + 64, generator=gen).to(DT)
    o = torch.randn(3, nh * hd, generator=gen).to(DT)
    assert _close(ga.sigmoid_gate(o, proj, nh), naive.sigmoid_gate(o, proj, nh))
    x = torch.randn(1, 64, generator=gen).to(DT)
    g = (torch.rand(64, generator=gen) + 0.5).to(DT)
    w = (torch.randn(96, 64, generator=gen) * 0.1).to(DT)
    want = F.linear(naive.rms_norm(x, g, 1e-6), w)
    assert _close(gemv.norm_proj(x, g, 1e-6, w), want)


def test_gated_kernels_refuse_bad_shapes():
    dt = torch.bfloat16
    cache = torch.zeros(2, 8, 16, dtype=dt)
    cos = torch.ones(8, 6)
    with pytest.raises(ValueError, match="powers of two"):
        ga.qk_norm_rope_store(torch.zeros(1, 4 * 32 + 64, dtype=dt), torch.ones(16, dtype=dt), torch.ones(16, dtype=dt),
                              1e-6, cos, cos, torch.tensor([0]), torch.tensor([0]), cache, cache, 4, 2, True)
    with pytest.raises(ValueError, match="projection row"):
        ga.qk_norm_rope_store(torch.zeros(1, 10, dtype=dt), torch.ones(16, dtype=dt), torch.ones(16, dtype=dt),
                              1e-6, torch.ones(8, 8), torch.ones(8, 8), torch.tensor([0]), torch.tensor([0]),
                              cache, cache, 4, 2, True)
    with pytest.raises(ValueError, match="sigmoid_gate"):
        ga.sigmoid_gate(torch.zeros(2, 64, dtype=dt), torch.zeros(1, 128, dtype=dt), 4)
    with pytest.raises(ValueError, match="one position"):
        ga.qk_norm_rope_store(torch.zeros(2, 4 * 32 + 64, dtype=dt), torch.ones(16, dtype=dt), torch.ones(16, dtype=dt),
                              1e-6, torch.ones(8, 8), torch.ones(8, 8), torch.tensor([0]), torch.tensor([0]),
                              cache, cache, 4, 2, True)
    with pytest.raises(ValueError, match="multiple"):
        gemv.norm_proj(torch.zeros(1, 64, dtype=dt), torch.ones(64, dtype=dt), 1e-6, torch.zeros(101, 64, dtype=dt))
