"""Fused one-row decode kernels for dense layers (:mod:`.gemv`: RMSNorm prologue, residual, SiLU and
RoPE + KV-store epilogues; their W12 variants in :mod:`.gemv_w12` (Triton) and :mod:`.gemv_w12_gluon`)
and their plain torch references (:mod:`.reference`)."""
