"""W12 format and codec: bit-exact round trips (every bf16 pattern, specials, odd shapes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.kernels.w12 import decode, encode
from specpilot.kernels.w12.format import RECORD_BYTES, check, repad, unpack_codes


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def from_bits(bits, shape) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(shape)


def roundtrip(w: torch.Tensor):
    t = encode(w)
    check(t)
    assert torch.equal(bits_of(decode(t)), bits_of(w))
    t128 = repad(t, 128)
    assert torch.equal(bits_of(decode(t128)), bits_of(w))
    return t


@pytest.mark.parametrize("shape", [(256, 256)])
def test_every_bf16_bit_pattern_round_trips(shape):
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(shape)
    t = roundtrip(allbits)
    # zeros, denormals and inf/nan (2 * 2 * 128 patterns each side) are always escapes
    assert t.num_escapes >= 2 * 2 * 128


SPECIAL = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7F7F, 0x0080, 0x3F80]


@st.composite
def weights(draw):
    n = draw(st.integers(1, 33))
    k = draw(st.integers(1, 130))
    kind = draw(st.sampled_from(["normal", "any", "special", "mixed_scale"]))
    if kind == "any":
        bits = draw(st.lists(st.integers(0, 65535), min_size=n * k, max_size=n * k))
        return from_bits(bits, (n, k))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * draw(st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 1e30]))
    if kind == "mixed_scale":  # spans far more than 16 binades: many out-of-window escapes
        w = w * torch.exp2(torch.randint(-60, 60, (n, k), generator=g).float())
    w = w.to(torch.bfloat16)
    if kind == "special":
        idx = torch.randint(0, n * k, (max(1, n * k // 5),), generator=g)
        vals = torch.tensor([SPECIAL[i % len(SPECIAL)] for i in range(idx.numel())], dtype=torch.int32)
        flat = bits_of(w).flatten().clone()
        flat[idx] = vals.to(torch.int16)
        w = flat.view(torch.bfloat16).reshape(n, k)
    return w


@settings(max_examples=25, deadline=None)
@given(weights())
def test_random_weights_round_trip_bit_for_bit(w):
    roundtrip(w)


def test_rows_that_are_all_escapes():
    w = torch.zeros(20, 70, dtype=torch.bfloat16)
    w[3] = float("nan")
    w[4] = float("-inf")
    w[5] = from_bits([0x0001] * 70, (70,))  # denormals
    w[6] = (torch.randn(70, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()  # seeded: tiny draws may escape
    t = roundtrip(w)
    assert t.num_escapes == 19 * 70 + int((bits_of(w[6]) == 0).sum())


def test_nan_payloads_and_signed_zeros_are_kept():
    w = from_bits([0x7FC1, 0xFFC3, 0x7F81, 0x8000, 0x0000, 0xFF81], (2, 3))
    roundtrip(w)


def test_record_layout_and_padding():
    w = (torch.randn(130, 70) * 0.02).bfloat16()
    t = encode(w)
    assert t.rows_stored == 144 and t.k_pad == 128
    # one full 128-row tile (2 k-tiles of 12 KB) plus a 16-row tile cut to the rows present
    assert t.records.numel() == 2 * RECORD_BYTES + 2 * 16 * 96
    byte, nib = unpack_codes(t)
    assert bool((byte[130:] == 0).all()) and bool((nib[:, 70:] == 0).all())


def test_window_covers_the_most_weights():
    # 60 weights near 1.0 and 4 tiny ones 2**-40: the window sits on the large ones, tiny ones escape
    w = torch.ones(1, 64)
    w[0, :4] = 2.0 ** -40
    t = encode(w.bfloat16())
    assert t.num_escapes == 4
    assert 127 - 15 <= int(t.low_exp[0]) <= 127


def test_bits_per_weight_on_gaussian_weights():
    w = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    t = encode(w)
    assert 12.0 < t.bits_per_weight() <= 12.02
    assert t.escape_rate() < 5e-4


def test_qpass_sets_low_bits_to_midpoint_and_keeps_escapes():
    w = (torch.randn(16, 64) * 0.02).bfloat16()
    w[0, 0] = 0.0
    w[1, 1] = float("inf")
    t = encode(w)
    q = decode(t, qpass=True)
    b, qb = bits_of(w).to(torch.int32) & 0xFFFF, bits_of(q).to(torch.int32) & 0xFFFF
    esc = torch.zeros(b.numel(), dtype=torch.bool)
    esc[t.esc_pos] = True
    esc = esc.reshape(b.shape)
    assert bool(esc[0, 0]) and bool(esc[1, 1])
    assert torch.equal(qb[esc], b[esc])
    assert torch.equal(qb[~esc], (b[~esc] & ~0xF) | 0x8)


def test_qpass_view_equals_the_decoded_8_bit_view():
    """kernels.w12.qpass_view (TLV's Q pass, made at load without records) is decode(encode(w),
    qpass=True) bit for bit: escapes (zero, denormal, inf, outside the window) included, across
    row chunks."""
    from specpilot.kernels.w12 import qpass_view

    w = (torch.randn(40, 96, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    w[0, :4] = 0.0
    w[1, 1] = float("inf")
    w[2, 2] = 1e-39
    w[3, 3] = 3e4
    q = qpass_view(w, chunk_rows=16)
    assert torch.equal(bits_of(q), bits_of(decode(encode(w), qpass=True)))
    with pytest.raises(ValueError):
        qpass_view(w.float())


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError):
        encode(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        encode(torch.zeros(3, 3))


def test_check_catches_structural_damage():
    t = encode((torch.randn(16, 64) * 0.02).bfloat16())
    t.records = t.records[:-1]
    with pytest.raises(ValueError):
        check(t)


# ----------------------------------------------------------------------------------------------
# compact side data of checkpoint files (format 2)
# ----------------------------------------------------------------------------------------------

from specpilot.kernels.w12.format import (pack_positions, pack_windows, positions_bytes,  # noqa: E402
                                          unpack_positions, unpack_windows, windows_bytes)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=60, unique=True))
def test_positions_round_trip_with_any_gaps(values):
    pos = torch.tensor(sorted(values), dtype=torch.int64)
    codes = pack_positions(pos)
    assert codes.dtype == torch.int16 and codes.numel() * 2 == positions_bytes(pos)
    assert torch.equal(unpack_positions(codes), pos)


def test_positions_edge_gaps():
    for vals in ([0], [65534], [65535], [65536], [0, 65535, 131070, 131071], [5, 5 + 3 * 65535]):
        pos = torch.tensor(vals, dtype=torch.int64)
        assert torch.equal(unpack_positions(pack_positions(pos)), pos), vals
    with pytest.raises(ValueError):
        pack_positions(torch.tensor([3, 3]))          # not distinct
    with pytest.raises(ValueError):
        unpack_positions(torch.tensor([-1], dtype=torch.int16))   # ends in a skip code


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 239), min_size=0, max_size=40))
def test_windows_round_trip(values):
    low = torch.tensor(values, dtype=torch.uint8)
    stored, base = pack_windows(low)
    assert stored.numel() == windows_bytes(low)
    assert (base is None) == (not values or max(values) - min(values) > 15)
    assert torch.equal(unpack_windows(stored, len(values), base), low)


def test_compact_side_data_cuts_bits_per_weight():
    w = (torch.randn(576, 576, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    w[::7, ::11] = 0.0                                   # plenty of escapes
    t = encode(w)
    side_v1 = t.low_exp.numel() + 4 * t.num_escapes      # format 1: a byte per window, int32 positions
    side_v2 = windows_bytes(t.low_exp) + positions_bytes(t.esc_pos)
    assert side_v2 < side_v1 / 1.8
    assert t.stored_bytes() == t.records.numel() + side_v2 + 2 * t.num_escapes
