"""Bit-exactness of the W12 kernels' fast decode (``gluon_common.decode_pairs``: ``prmt`` byte
permutes and single-``lop3`` selects) against the format and against the plain decode
(``common.decode_pairs``'s integer recipe), on a torch mirror of each (the Gluon code cannot run on a
CPU; on the GPU the GEMV tests check the kernel itself against the fp32 reference).

Per weight: both parities of the view word (nibble bytes 0, 2 or 1, 3), the 4 weights of a word,
all 2^12 values of a weight's own bits (view byte: sign, 4-bit exponent code, 3 mantissa bits;
4-bit nibble) over several backgrounds of the other 52 bits. The circuits are affine over GF(2)
(shifts, byte permutes, masks with disjoint ORs), so agreeing on zero and on the 64 unit inputs
proves them equal on all 2^64 (view word, nibble word) pairs; affinity is checked on random inputs.
"""

from __future__ import annotations

import pytest
import torch

M32 = 0xFFFFFFFF
BYTE_OF = (0, 2, 1, 3)                          # weight k of a view word -> its byte
NIB_SHIFT = ((0, 16, 4, 20), (8, 24, 12, 28))   # [odd][k] -> bit offset of its nibble in the nibble word
SEL_X = (0x2604, 0x2705)                        # the kernel's prmt selectors, [odd]
SEL_Y = (0x3614, 0x3715)


def prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode; the selectors used here never set the replicate bit)."""
    out = torch.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 7
        out |= (((a if s < 4 else b) >> (8 * (s & 3))) & 0xFF) << (8 * i)
    return out


def extract(p0, p1):
    """``_f32_lo`` / ``_f32_hi`` of the two bf16 pairs: weights 4c, 4c+1, 4c+2, 4c+3 as fp32 bits."""
    return ((p0 << 16) & M32, p0 & 0xFFFF0000, (p1 << 16) & M32, p1 & 0xFFFF0000)


def plain(be, nn, odd, qpass=False):
    """The plain integer recipe (``common.decode_pairs``, per view word) line by line."""
    SGN, MAG, NIB, EXP = 0x80008000, 0x07F007F0, 0x000F000F, 0x38003800
    if qpass:
        ln0 = ln1 = 0x00080008
    else:
        nw = (nn >> 8) if odd else nn
        ln0, ln1 = nw & NIB, (nw >> 4) & NIB
    p0 = ((be << 8) & SGN) | ((be << 4) & MAG) | ln0 | EXP
    p1 = (be & SGN) | ((be >> 4) & MAG) | ln1 | EXP
    return extract(p0, p1)


def fast(be, nn, odd, qpass=False):
    """``gluon_common.decode_pairs`` line by line (``_sel_*`` and ``_or_masked`` are the lop3s)."""
    sel = lambda a, b, k: (a & k) | (b & ~k & M32)          # noqa: E731  lop3 0xE2
    if qpass:
        t0, t1 = sel(be << 8, be << 4, 0x80008000), sel(be, be >> 4, 0x80008000)
        return extract((t0 & 0x87F087F0) | 0x38083808, (t1 & 0x87F087F0) | 0x38083808)
    xs = prmt(be, nn, SEL_X[odd])
    t0 = sel(be << 4, xs, 0x07F007F0)
    ys = prmt(be, nn, SEL_Y[odd])
    t1 = sel(be, ys >> 4, 0x80008000)
    return extract((t0 & 0x87FF87FF) | 0x38003800, (t1 & 0x87FF87FF) | 0x38003800)


def reference(be, nn, odd, qpass=False):
    """From the format: view byte ``s | c << 3 | m_hi`` and nibble ``m_lo`` of weight k give the bf16
    ``s << 15 | (c + 112) << 7 | m_hi << 4 | m_lo`` (Q pass: ``m_lo = 8``), promoted to fp32."""
    out = []
    for k in range(4):
        b = (be >> (8 * BYTE_OF[k])) & 0xFF
        lo = 8 if qpass else (nn >> NIB_SHIFT[odd][k]) & 0xF
        out.append((((b >> 7) << 15) | ((((b >> 3) & 0xF) + 112) << 7) | ((b & 7) << 4) | lo) << 16)
    return tuple(out)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _per_weight_inputs(odd, k, backgrounds=14):
    g = torch.Generator().manual_seed(8 * odd + k)
    bg_be = torch.cat([torch.tensor([0, M32]), torch.randint(0, 2**32, (backgrounds,), generator=g)])
    bg_nn = torch.cat([torch.tensor([0, M32]), torch.randint(0, 2**32, (backgrounds,), generator=g)])
    own = torch.arange(4096, dtype=torch.int64)
    bsh, nsh = 8 * BYTE_OF[k], NIB_SHIFT[odd][k]
    be = (bg_be[:, None] & ~(0xFF << bsh) & M32) | ((own >> 4)[None, :] << bsh)
    nn = (bg_nn[:, None] & ~(0xF << nsh) & M32) | ((own & 0xF)[None, :] << nsh)
    return be.reshape(-1), nn.reshape(-1)


@pytest.mark.parametrize("qpass", [False, True])
@pytest.mark.parametrize("odd", [0, 1])
def test_every_weight_value_decodes_exactly(odd, qpass):
    for k in range(4):
        be, nn = _per_weight_inputs(odd, k)
        out = fast(be, nn, odd, qpass)
        assert _same(out, reference(be, nn, odd, qpass)) and _same(out, plain(be, nn, odd, qpass))
        assert torch.equal(out[k] >> 31, (be >> (8 * BYTE_OF[k] + 7)) & 1)   # the sign, -0 included


@pytest.mark.parametrize("qpass", [False, True])
@pytest.mark.parametrize("odd", [0, 1])
def test_equal_on_all_inputs_by_affinity(odd, qpass):
    z = torch.zeros(1, dtype=torch.int64)
    unit = torch.tensor([1 << i for i in range(32)])
    be = torch.cat([z, unit, torch.zeros(32, dtype=torch.int64)])
    nn = torch.cat([z, torch.zeros(32, dtype=torch.int64), unit])
    assert _same(fast(be, nn, odd, qpass), plain(be, nn, odd, qpass))
    g = torch.Generator().manual_seed(odd)
    a = [torch.randint(0, 2**32, (20000,), generator=g) for _ in range(6)]
    for f in (fast, plain):   # f(a ^ b ^ c) == f(a) ^ f(b) ^ f(c): affine
        fx = f(a[0] ^ a[1] ^ a[2], a[3] ^ a[4] ^ a[5], odd, qpass)
        parts = [f(a[i], a[i + 3], odd, qpass) for i in range(3)]
        assert all(torch.equal(x, p ^ q ^ r) for x, p, q, r in zip(fx, *parts))


def test_prmt_mirror():
    a, b = torch.tensor([0x44332211]), torch.tensor([0x88776655])
    assert int(prmt(a, b, 0x3210)) == 0x44332211 and int(prmt(a, b, 0x7654)) == 0x88776655
    assert int(prmt(a, b, 0x2604)) == 0x33771155
