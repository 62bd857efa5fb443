"""The W12 format: lossless 12-bit storage of bf16 weights (paper section 4.1).

A bf16 weight ``[N_out, K_in]`` is stored per output channel ``n`` relative to a 16-binade
window ``[L_n, L_n + 15]`` of biased exponents (``L_n = E_n - 15``), chosen as the window that
covers the most of that channel's normal weights (ties: the lowest window). A weight inside the
window is kept in 12 bits: sign, 4-bit exponent code ``c = e - L_n`` and the 7 mantissa bits.
Everything else (zeros, denormals, inf/nan, out-of-window values) is an *escape*: its slot holds
code 0 and its exact bf16 bits sit in a per-tensor escape list sorted by position.

Records. Codes are grouped in tiles of 128 rows x 64 columns, one 12 KB record per tile:
the first 8 KB is the 8-bit view (``s | c<<3 | m>>4`` per weight, 64 bytes per row), the last 4 KB
the low 4 mantissa bits (32 bytes per row). Records are ordered row-tile major, then k-tile.
Inside a row the bytes are arranged for a cheap decode with 32-bit integer ops on the GPU:

* 8-bit view: each 4-byte word holds weights ``(w0, w2, w1, w3)`` of a group of four, so that
  ``(B << 8 & 0x80008000) | (B << 4 & 0x07F007F0)`` yields the pair (w0, w1) as two bf16 lanes and
  ``(B & 0x80008000) | (B >> 4 & 0x07F007F0)`` the pair (w2, w3).
* low nibbles: each 4-byte word holds 8 weights; pair ``p`` (weights 2p, 2p+1) is
  ``(W >> 4p) & 0x000F000F``.

Adding the constant exponent bits ``0x3800`` gives a bf16 equal to ``w * 2**(112 - L_n)`` for every
in-window weight; the GEMM multiplies the row by ``2**(L_n - 112)`` at the end (exact).

Padding. ``K`` is padded to a multiple of 64 and the number of stored rows to a multiple of 16
(files) or 128 (the GPU layout, so every record is 12 KB); the last row tile's records hold only
the stored rows. Padding slots hold code 0 and are cut off on decode. Both paddings are recorded
(``rows_stored``, ``k_pad``) in the file metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMAT_VERSION = 2   # checkpoint files: 2 = compact windows and escape positions (1 is still read)
TILE_N = 128
TILE_K = 64
ROW_ALIGN_FILE = 16
RECORD_BYTES = TILE_N * TILE_K * 3 // 2  # 12288
BYTES_PER_ROW = TILE_K          # 8-bit view, per row of a record
NIBBLE_BYTES_PER_ROW = TILE_K // 2
KERNEL_EXP_BIAS = 112           # decoded exponent field = code + 112
WINDOW = 16

# byte order of a 4-weight group in the 8-bit view, and nibble order of an 8-weight group
_BYTE_PERM = (0, 2, 1, 3)
_NIB_LO = (0, 4, 1, 5)
_NIB_HI = (2, 6, 3, 7)


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class W12Tensor:
    """One weight in W12 form (all tensors on one device, CPU for files)."""

    shape: tuple[int, int]        # (N, K) of the original bf16 weight
    rows_stored: int              # stored rows: N rounded up to 16 (file) or 128 (GPU layout)
    records: torch.Tensor         # uint8 [n_records_bytes], see module doc
    low_exp: torch.Tensor         # uint8 [N]: window low end L_n (biased exponent, 1..239)
    esc_pos: torch.Tensor         # int64 [nnz]: flat positions n*K + k, sorted
    esc_bits: torch.Tensor        # int16 [nnz]: raw bf16 bits of the escaped weights

    @property
    def k_pad(self) -> int:
        return _ceil_to(self.shape[1], TILE_K)

    @property
    def num_escapes(self) -> int:
        return int(self.esc_pos.numel())

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def stored_bytes(self) -> int:
        """Bytes in a checkpoint file (format 2): records, the per-channel windows (4 bits each
        when a tensor's windows span at most 16 binades, else a byte), escape positions as
        16-bit deltas and their 16-bit values. See :func:`pack_windows` / :func:`pack_positions`."""
        return int(self.records.numel() + windows_bytes(self.low_exp) + positions_bytes(self.esc_pos)
                   + 2 * self.num_escapes)

    def bits_per_weight(self) -> float:
        return 8.0 * self.stored_bytes() / max(1, self.numel)

    def escape_rate(self) -> float:
        return self.num_escapes / max(1, self.numel)

    def to(self, device) -> "W12Tensor":
        return W12Tensor(self.shape, self.rows_stored, self.records.to(device), self.low_exp.to(device),
                         self.esc_pos.to(device), self.esc_bits.to(device))


# ----------------------------------------------------------------------------------------------
# compact side data of checkpoint files (format 2)
# ----------------------------------------------------------------------------------------------
# Windows: when max(L) - min(L) <= 15 the per-channel window is a 4-bit offset from the tensor's
# lowest window (two per byte, low nibble first; the base goes to the file's metadata), else a
# byte per channel. Escape positions (sorted flat n*K + k): 16-bit deltas from the previous
# position (from 0 for the first); a gap g >= 65535 is written as g // 65535 codes 0xFFFF (skip
# 65535, no escape) followed by g % 65535.

DELTA_SKIP = 0xFFFF


def windows_bytes(low: torch.Tensor) -> int:
    n = int(low.numel())
    if n and int(low.max()) - int(low.min()) <= 15:
        return (n + 1) // 2
    return n


def pack_windows(low: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """uint8 [N] windows -> (stored uint8 tensor, base) with base None for the byte form."""
    n = int(low.numel())
    if not n or int(low.max()) - int(low.min()) > 15:
        return low.to(torch.uint8).contiguous(), None
    base = int(low.min())
    off = (low.to(torch.int32) - base)
    if n % 2:
        off = torch.cat([off, off.new_zeros(1)])
    pairs = off.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8).contiguous(), base


def unpack_windows(stored: torch.Tensor, n: int, base: int | None) -> torch.Tensor:
    if base is None:
        if stored.numel() != n:
            raise ValueError(f"{stored.numel()} window bytes for {n} channels")
        return stored.to(torch.uint8)
    if stored.numel() != (n + 1) // 2:
        raise ValueError(f"{stored.numel()} packed window bytes for {n} channels")
    v = stored.to(torch.int32)
    off = torch.stack([v & 15, v >> 4], dim=1).reshape(-1)[:n]
    out = off + int(base)
    if n and (int(out.min()) < 1 or int(out.max()) > 239):
        raise ValueError("window out of range")
    return out.to(torch.uint8)


def _gaps(pos: torch.Tensor) -> torch.Tensor:
    prev = torch.cat([pos.new_zeros(1), pos[:-1]])
    return pos - prev


def positions_bytes(pos: torch.Tensor) -> int:
    if not pos.numel():
        return 0
    return 2 * int(pos.numel() + (_gaps(pos) // DELTA_SKIP).sum())


def pack_positions(pos: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat positions -> int16 tensor of 16-bit delta codes (bit patterns)."""
    if not pos.numel():
        return torch.zeros(0, dtype=torch.int16)
    pos = pos.to(torch.int64).cpu()
    gaps = _gaps(pos)
    if int(pos[0]) < 0 or (gaps.numel() > 1 and int(gaps[1:].min()) <= 0):
        raise ValueError("escape positions must be sorted, distinct and non-negative")
    skips = gaps // DELTA_SKIP
    rest = gaps % DELTA_SKIP
    # escape i takes skips[i] codes 0xFFFF, then its rest: fill with 0xFFFF, write each rest at its end
    counts = skips + 1
    codes = torch.full((int(counts.sum()),), DELTA_SKIP, dtype=torch.int64)
    ends = torch.cumsum(counts, 0) - 1
    codes[ends] = rest
    return codes.to(torch.int32).to(torch.int16)   # bit patterns: 0xFFFF -> -1


def unpack_positions(stored: torch.Tensor) -> torch.Tensor:
    if not stored.numel():
        return torch.zeros(0, dtype=torch.int64)
    v = stored.to(torch.int64) & 0xFFFF
    run = torch.cumsum(v, 0)
    keep = v != DELTA_SKIP
    if not bool(keep[-1]):
        raise ValueError("escape positions end in a skip code")
    return run[keep]


def expected_record_bytes(shape: tuple[int, int], rows_stored: int) -> int:
    return rows_stored * _ceil_to(shape[1], TILE_K) * 3 // 2


# ----------------------------------------------------------------------------------------------
# encode
# ----------------------------------------------------------------------------------------------

def _choose_windows(e: torch.Tensor, normal: torch.Tensor) -> torch.Tensor:
    """Per row, the window low end L in [1, 239] covering the most normal weights (lowest on ties)."""
    n = e.shape[0]
    hist = torch.zeros(n, 256, dtype=torch.int32, device=e.device)
    hist.scatter_add_(1, e.long(), normal.to(torch.int32))
    csum = torch.zeros(n, 257, dtype=torch.int32, device=e.device)
    torch.cumsum(hist, dim=1, out=csum[:, 1:])
    lows = torch.arange(1, 240, device=e.device)
    cover = csum[:, lows + WINDOW] - csum[:, lows]          # [n, 239]
    return (cover.argmax(dim=1) + 1).to(torch.int32)       # argmax: first (lowest) maximum


def _encode_rows(bits: torch.Tensor):
    """bits: int32 [n, K] (bf16 bit patterns, 0..65535). Returns byte, nibble, L, escape mask."""
    s = bits >> 15
    e = (bits >> 7) & 0xFF
    m = bits & 0x7F
    normal = (e > 0) & (e < 255)
    low = _choose_windows(e, normal)
    c = e - low[:, None]
    inw = normal & (c >= 0) & (c < WINDOW)
    byte = torch.where(inw, (s << 7) | (c << 3) | (m >> 4), 0)
    nib = torch.where(inw, m & 0xF, 0)
    return byte, nib, low, ~inw


def _layout_records(byte: torch.Tensor, nib: torch.Tensor, rows_stored: int) -> torch.Tensor:
    """byte/nib: int32 [rows_stored, Kp] in natural order -> flat uint8 records."""
    rs, kp = byte.shape
    kt = kp // TILE_K
    bp = byte.view(rs, kp // 4, 4)[..., list(_BYTE_PERM)].reshape(rs, kp)
    nv = nib.view(rs, kp // 8, 8)
    nb = (nv[..., list(_NIB_LO)] | (nv[..., list(_NIB_HI)] << 4)).reshape(rs, kp // 2)
    bp = bp.to(torch.uint8)
    nb = nb.to(torch.uint8)
    full = rs // TILE_N
    out = []
    if full:  # all full 128-row tiles at once
        b = bp[:full * TILE_N].reshape(full, TILE_N, kt, TILE_K).permute(0, 2, 1, 3).reshape(full, kt, -1)
        q = nb[:full * TILE_N].reshape(full, TILE_N, kt, TILE_K // 2).permute(0, 2, 1, 3).reshape(full, kt, -1)
        out.append(torch.cat([b, q], dim=2).reshape(-1))
    r = rs - full * TILE_N
    if r:     # the last tile holds only the rows present
        b = bp[full * TILE_N:].reshape(r, kt, TILE_K).permute(1, 0, 2).reshape(kt, r * TILE_K)
        q = nb[full * TILE_N:].reshape(r, kt, TILE_K // 2).permute(1, 0, 2).reshape(kt, r * TILE_K // 2)
        out.append(torch.cat([b, q], dim=1).reshape(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8, device=byte.device)


def encode(weight: torch.Tensor, rows_align: int = ROW_ALIGN_FILE, chunk_rows: int = 4096) -> W12Tensor:
    """Encode a 2-D bf16 tensor into W12 (vectorized torch; works on CPU and CUDA)."""
    if weight.dim() != 2:
        raise ValueError(f"W12 encodes 2-D weights, got shape {tuple(weight.shape)}")
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"W12 encodes bf16 weights, got {weight.dtype}")
    if rows_align not in (16, 32, 64, 128):
        raise ValueError("rows_align must be 16, 32, 64 or 128")
    n, k = weight.shape
    kp = _ceil_to(k, TILE_K)
    rows_stored = _ceil_to(n, rows_align) if n else 0
    chunk_rows = max(TILE_N, chunk_rows // TILE_N * TILE_N)
    dev = weight.device
    recs, lows, pos, vals = [], [], [], []
    for r0 in range(0, max(rows_stored, 0), chunk_rows):
        r1 = min(r0 + chunk_rows, rows_stored)
        real = max(0, min(r1, n) - r0)
        bits = torch.zeros(r1 - r0, kp, dtype=torch.int32, device=dev)
        if real:
            bits[:real, :k] = weight[r0:r0 + real].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        byte, nib, low, esc = _encode_rows(bits[:real, :k]) if real else (None, None, None, None)
        fb = torch.zeros(r1 - r0, kp, dtype=torch.int32, device=dev)
        fn = torch.zeros_like(fb)
        if real:
            fb[:real, :k] = byte
            fn[:real, :k] = nib
            lows.append(low.to(torch.uint8))
            idx = esc.nonzero()
            pos.append((idx[:, 0] + r0) * k + idx[:, 1])
            vals.append(bits[:real, :k][esc].to(torch.int16))
        recs.append(_layout_records(fb, fn, r1 - r0))
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt, device=dev)  # noqa: E731
    return W12Tensor((n, k), rows_stored, cat(recs, torch.uint8), cat(lows, torch.uint8),
                     cat(pos, torch.int64), cat(vals, torch.int16))


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------

def check(t: W12Tensor) -> None:
    """Structural checks (sizes, ranges); raises ValueError naming what is wrong."""
    n, k = t.shape
    if t.rows_stored < n or t.rows_stored % 16:
        raise ValueError(f"rows_stored {t.rows_stored} invalid for {n} rows")
    if t.records.numel() != expected_record_bytes(t.shape, t.rows_stored):
        raise ValueError(f"record bytes {t.records.numel()} != expected "
                         f"{expected_record_bytes(t.shape, t.rows_stored)}")
    if t.low_exp.numel() != n:
        raise ValueError(f"window table has {t.low_exp.numel()} entries for {n} rows")
    if t.esc_pos.numel() != t.esc_bits.numel():
        raise ValueError("escape positions and values differ in length")
    if t.esc_pos.numel():
        p = t.esc_pos
        if int(p.min()) < 0 or int(p.max()) >= n * k or bool((p[1:] <= p[:-1]).any()):
            raise ValueError("escape positions out of range or not strictly increasing")
    if n and (int(t.low_exp.min()) < 1 or int(t.low_exp.max()) > 239):
        raise ValueError("window exponent out of range 1..239")


def unpack_codes(t: W12Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Records -> (8-bit view, low nibble) as int32 [rows_stored, k_pad] in natural order."""
    rs, kp = t.rows_stored, t.k_pad
    kt = kp // TILE_K
    bp = torch.empty(rs, kp, dtype=torch.uint8, device=t.records.device)
    nb = torch.empty(rs, kp // 2, dtype=torch.uint8, device=t.records.device)
    full = rs // TILE_N
    if full:
        rec = t.records[:full * kt * RECORD_BYTES].view(full, kt, RECORD_BYTES)
        bp[:full * TILE_N] = rec[..., :TILE_N * TILE_K].reshape(full, kt, TILE_N, TILE_K).permute(0, 2, 1, 3) \
            .reshape(full * TILE_N, kp)
        nb[:full * TILE_N] = rec[..., TILE_N * TILE_K:].reshape(full, kt, TILE_N, TILE_K // 2) \
            .permute(0, 2, 1, 3).reshape(full * TILE_N, kp // 2)
    r = rs - full * TILE_N
    if r:
        rec = t.records[full * kt * RECORD_BYTES:].view(kt, r * 96)
        bp[full * TILE_N:] = rec[:, :r * TILE_K].reshape(kt, r, TILE_K).permute(1, 0, 2).reshape(r, kp)
        nb[full * TILE_N:] = rec[:, r * TILE_K:].reshape(kt, r, TILE_K // 2).permute(1, 0, 2).reshape(r, kp // 2)
    inv = [_BYTE_PERM.index(i) for i in range(4)]
    byte = bp.view(rs, kp // 4, 4)[..., inv].reshape(rs, kp).to(torch.int32)
    nbv = nb.view(rs, kp // 8, 4).to(torch.int32)
    nib = torch.empty(rs, kp // 8, 8, dtype=torch.int32, device=nb.device)
    nib[..., list(_NIB_LO)] = nbv & 0xF
    nib[..., list(_NIB_HI)] = nbv >> 4
    return byte, nib.reshape(rs, kp)


def decode(t: W12Tensor, qpass: bool = False) -> torch.Tensor:
    """Restore the exact bf16 tensor (``qpass``: the 8-bit view, low mantissa bits = midpoint)."""
    n, k = t.shape
    byte, nib = unpack_codes(t)
    byte, nib = byte[:n, :k], nib[:n, :k]
    if qpass:
        nib = torch.full_like(nib, 8)
    low = t.low_exp.to(torch.int32)[:, None]
    bits = ((byte & 0x80) << 8) | ((((byte >> 3) & 0xF) + low) << 7) | ((byte & 0x7) << 4) | nib
    flat = bits.reshape(-1)
    if t.esc_pos.numel():
        flat[t.esc_pos] = t.esc_bits.to(torch.int32) & 0xFFFF
    return flat.to(torch.int16).view(torch.bfloat16).reshape(n, k)


def qpass_view(weight: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """``decode(encode(weight), qpass=True)`` straight from a 2-D bf16 weight, without building
    the records: coded weights keep their top 8 bits and get the low mantissa nibble's midpoint,
    escaped ones stay exact (TLV's Q pass, made at load)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"qpass_view takes a 2-D bf16 weight, got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty_like(weight)
    for r0 in range(0, weight.shape[0], chunk_rows):
        bits = weight[r0:r0 + chunk_rows].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        esc = _encode_rows(bits)[3]
        q = torch.where(esc, bits, (bits & 0xFFF0) | 0x8)
        out[r0:r0 + chunk_rows] = q.to(torch.int16).view(torch.bfloat16)
    return out


def repad(t: W12Tensor, rows_align: int) -> W12Tensor:
    """Re-lay the records for another row padding (e.g. 128 rows for the GPU kernel)."""
    rows = _ceil_to(t.shape[0], rows_align) if t.shape[0] else 0
    if rows == t.rows_stored:
        return t
    byte, nib = unpack_codes(t)
    fb = torch.zeros(rows, t.k_pad, dtype=torch.int32, device=byte.device)
    fn = torch.zeros_like(fb)
    keep = min(rows, t.rows_stored)
    fb[:keep], fn[:keep] = byte[:keep], nib[:keep]
    return W12Tensor(t.shape, rows, _layout_records(fb, fn, rows), t.low_exp, t.esc_pos, t.esc_bits)
