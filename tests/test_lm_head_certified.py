"""Certified INT8 LM head: the argmax always equals the exact head's (ties, near-ties, fallback)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specpilot.kernels.lm_head import certified_argmax_ref, exact_argmax, exact_logits, quantize_head  # noqa: E402
from specpilot.kernels.lm_head.naive import bounds_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def head_with_ties(v=2000, h=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, h, generator=g) * 0.05).bfloat16()
    w[11] = w[10]                                                      # exact duplicate: a true tie
    w[21] = (w[20].view(torch.int16) + 1).view(torch.bfloat16)         # one-ulp near-duplicate
    w[31] = w[30].clone()
    w[31, 0] = (w[30, 0].view(torch.int16) + 1).view(torch.bfloat16)   # differs in one weight by one ulp
    return w


def rows(w, n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, w.shape[1], generator=g)
    for i, t in enumerate([11, 10, 20, 21, 30, 31]):       # point h at the planted (near-)ties
        hs[i] = w[t].float() * 40 + hs[i] * 0.01
    hs[6] = (w[100].float() + w[101].float()) * 30         # between two unrelated tokens
    hs[7] = torch.randn(w.shape[1], generator=g) * 0.01    # flat: many survivors
    return hs.bfloat16()


def test_bounds_hold_for_every_token():
    w = head_with_ties()
    head = quantize_head(w)
    h = rows(w)
    a, rho = bounds_ref(h, head)
    z = exact_logits(h, w).double()
    assert bool(((z - a).abs() <= rho).all())


def test_reference_certified_argmax_equals_exact_head_including_ties():
    w = head_with_ties()
    head = quantize_head(w)
    h = rows(w)
    res = certified_argmax_ref(h, head)
    ref = exact_argmax(h, w)
    assert torch.equal(res.argmax, ref)
    assert int(res.argmax[0]) == 10 and int(res.argmax[1]) == 10   # a tie goes to the lowest id
    for m in range(h.shape[0]):   # survivors' logits are the exact head's
        assert torch.equal(res.survivor_logits[m], exact_logits(h[m:m + 1], w, res.survivors[m])[0])
    assert res.survivors[8].numel() < 10   # an ordinary peaked row keeps few tokens


def test_too_many_survivors_falls_back_to_the_full_head():
    w = head_with_ties()
    head = quantize_head(w)
    h = torch.zeros(2, w.shape[1]).bfloat16()   # all logits 0: everything survives, id 0 wins
    res = certified_argmax_ref(h, head, max_survivors=16)
    assert bool(res.fallback.all()) and res.argmax.tolist() == [0, 0]


def test_quantize_head_rejects_non_finite_weights():
    w = head_with_ties(200, 64)
    w[3, 3] = float("nan")
    with pytest.raises(ValueError):
        quantize_head(w)


def test_fast_path_matches_reference():
    pytest.importorskip("triton")
    from specpilot.kernels.lm_head.certified import CertifiedHead

    w = head_with_ties(1500, 128).to(DEV)
    ch = CertifiedHead(w, max_rows=32, max_survivors=64)
    h = rows(w.cpu(), 20)
    h[7] = 0.0                                       # every logit 0: everything survives
    h = h.to(DEV)
    res = ch(h)
    ref = exact_argmax(h, w)
    assert torch.equal(res.argmax, ref)
    assert int(res.argmax[0]) == 10
    assert bool(res.fallback[7]) and int(res.argmax[7]) == 0   # fell back to the full head
    idx, val = ch.survivor_logits(2)
    assert torch.equal(val, exact_logits(h[2:3], w, idx)[0])
    res2 = ch(h)                                     # state was reset: same answer again
    assert torch.equal(res2.argmax, res.argmax)
    with pytest.raises(ValueError):
        ch(torch.zeros(40, 128, dtype=torch.bfloat16, device=DEV))


def test_argmax_exact_falls_back_on_the_device():
    """``argmax_exact`` (no host sync, for CUDA graphs) equals the exact head in every row: rows with
    too many survivors and rows with a non-finite h go to the device fallback kernel."""
    pytest.importorskip("triton")
    from specpilot.kernels.lm_head.certified import CertifiedHead

    w = head_with_ties(320, 64).to(DEV)
    ch = CertifiedHead(w, max_rows=16, max_survivors=8)
    h = rows(w.cpu(), 12)
    h[3] = 0.0                                       # every logit 0: everything survives, id 0 wins
    h[5] = h[5] * 1e-3                               # nearly flat logits: many survivors
    h = h.to(DEV)
    arg = ch.argmax_exact(h)
    assert torch.equal(arg, exact_argmax(h, w))
    assert int(ch.count[3]) > ch.cap                 # row 3 really took the fallback
    assert torch.equal(ch.argmax_exact(h), arg)      # state reset between calls
    bad = h.clone()
    bad[1, 7] = float("inf")                         # exact logits +-inf / NaN: NaN never wins
    got = ch.argmax_exact(bad)
    assert torch.equal(got[torch.arange(12) != 1], arg[torch.arange(12) != 1])
    assert torch.equal(got[1:2], exact_argmax(bad[1:2], w))


def test_tile_by_row_count_and_fixed_config():
    pytest.importorskip("triton")
    from specpilot.kernels.lm_head.certified import CertifiedHead

    w = head_with_ties(700, 128).to(DEV)
    ch = CertifiedHead(w, max_rows=8, max_survivors=64)
    assert ch.tile(1)[0] == 64 and ch.tile(8)[0] == 128  # narrow tiles for the one-row weight stream
    h8 = rows(w.cpu(), 8).to(DEV)
    h1 = h8[:1].clone()
    auto1, auto8 = ch(h1).argmax, ch(h8).argmax
    assert torch.equal(auto1, exact_argmax(h1, w)) and torch.equal(auto8, exact_argmax(h8, w))
    ch.configure(128, 128, 4, 4)                     # a fixed tile gives the same answers
    assert ch.tile(1) == (128, 128, 4, 4)
    assert torch.equal(ch(h1).argmax, auto1) and torch.equal(ch(h8).argmax, auto8)
    ch.configure(None)
    assert ch.tile(1)[0] == 64
    with pytest.raises(ValueError):
        ch.configure(32)


@pytest.mark.gpu
def test_cuda_head_at_a_real_vocab():
    from specpilot.kernels.lm_head.certified import CertifiedHead

    w = head_with_ties(32000, 2048).cuda()
    ch = CertifiedHead(w, max_rows=64)
    h = rows(w.cpu(), 64).cuda()
    assert torch.equal(ch(h).argmax, exact_argmax(h, w))
