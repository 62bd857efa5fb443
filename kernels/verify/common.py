"""What the multi-row step kernels (:mod:`.gemm`, :mod:`.rows`) share: the PDL switch and the
rows a program's tile covers."""

from __future__ import annotations

# programmatic dependent launch for the multi-row kernels (as kernels/decode/gemv.USE_PDL for one row)
USE_PDL = True
MAX_ROWS = 64   # the fused multi-row step takes steps of up to this many rows


def row_tile(rows: int) -> int:
    """Rows a tile covers (``tl.dot`` needs at least 16): the next power of two >= ``rows``."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the multi-row kernels take 1..{MAX_ROWS} rows, got {rows}")
    return max(16, 1 << (rows - 1).bit_length())
