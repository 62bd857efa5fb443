"""What the multi-row step kernels share: the programmatic-dependent-launch switch."""

from __future__ import annotations

# programmatic dependent launch for the multi-row kernels and the attention between them (as
# kernels/decode/gemv.USE_PDL for the one-row chain); off: plain launches (the tests compare both)
USE_PDL = True
