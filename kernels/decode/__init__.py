"""Fused one-row decode kernels for dense layers (:mod:`.gemv`: RMSNorm prologue, residual, SiLU and
RoPE + KV-store epilogues) and their plain torch references (:mod:`.reference`)."""
