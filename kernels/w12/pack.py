"""W12 weights laid out for the kernels: :class:`KernelPack`.

The records stay as the format stores them (12 KB per 128 x 64 tile, padded to whole 128-row
tiles), seen as int64 and int32 words; the escapes become a CSR list by row with each escape's
exact correction ``w - slot`` precomputed for the exact pass and for the Q pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import TILE_K, TILE_N, W12Tensor, repad


@dataclass
class KernelPack:
    """W12 weights laid out for the kernel: 128-row record tiles plus escape CSR with deltas."""

    shape: tuple[int, int]
    rows_stored: int
    rec64: torch.Tensor        # int64 view of the records
    rec32: torch.Tensor        # int32 view of the same bytes
    low_exp: torch.Tensor      # uint8 [N]
    esc_rowptr: torch.Tensor   # int32 [N + 1]
    esc_row: torch.Tensor      # int32 [nnz]
    esc_col: torch.Tensor      # int32 [nnz]
    esc_delta: torch.Tensor    # fp32 [nnz]: w - 2**(L_n - 127) (exact weight minus decoded slot)
    esc_delta_q: torch.Tensor  # fp32 [nnz]: same for the Q pass (slot decodes to 1.0001b * 2**...)
    max_escapes_per_row: int
    esc_w: torch.Tensor | None = None   # bf16 [nnz]: the escaped weights' exact bits (restore.py)

    @property
    def k_tiles(self) -> int:
        return (self.shape[1] + TILE_K - 1) // TILE_K

    def nbytes(self) -> int:
        return int(self.rec64.numel() * 8 + self.low_exp.numel() + self.esc_row.numel() * 16
                   + self.esc_rowptr.numel() * 4)

    @staticmethod
    def from_w12(t: W12Tensor, device=None) -> "KernelPack":
        device = torch.device(device) if device is not None else t.records.device
        if device.type == "cuda" and not torch.cuda.is_available():
            from specpilot.errors import EnvironmentMissing

            raise EnvironmentMissing(f"KernelPack on {device}: no CUDA device here")
        t = repad(t.to("cpu"), TILE_N) if t.rows_stored % TILE_N else t.to("cpu")
        n, k = t.shape
        rec = t.records.contiguous()
        if rec.numel() % 8:
            raise ValueError("record bytes not a multiple of 8")
        rows = torch.div(t.esc_pos, k, rounding_mode="floor") if n and k else t.esc_pos
        cols = t.esc_pos - rows * k
        counts = torch.bincount(rows, minlength=n) if rows.numel() else torch.zeros(n, dtype=torch.int64)
        rowptr = torch.zeros(n + 1, dtype=torch.int64)
        rowptr[1:] = torch.cumsum(counts, 0)
        low = t.low_exp.to(torch.int64)[rows] if rows.numel() else torch.zeros(0, dtype=torch.int64)
        w = (t.esc_bits.to(torch.int32) << 16).view(torch.float32)
        base = torch.ldexp(torch.ones_like(w), (low - 127).to(torch.float32))
        baseq = base * (1.0 + 8.0 / 128.0)
        dev = device
        return KernelPack(
            (n, k), t.rows_stored,
            rec.view(torch.int64).to(dev), rec.view(torch.int32).to(dev),
            t.low_exp.to(dev),
            rowptr.to(torch.int32).to(dev), rows.to(torch.int32).to(dev), cols.to(torch.int32).to(dev),
            (w - base).to(dev), (w - baseq).to(dev),
            int(counts.max()) if counts.numel() else 0,
            t.esc_bits.view(torch.bfloat16).to(dev),
        )
