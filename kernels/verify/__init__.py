"""Fused verify steps: a dense layer's step for 2..64 rows (chain and tree verification).

* :mod:`.gemm`    the projections with the one-row chain's fused prologue and epilogues, on tensor
  cores (``norm_qkv_rope_store``, ``gemm_residual``, ``norm_gate_up_silu``): bf16/fp32 weights
* :mod:`.rows`    one kernel between two GEMMs (``rms_norm_rows``, ``add_rms_norm_rows``,
  ``rope_store_rows``, ``silu_mul_rows``): with cuBLAS or the W12 GEMM for the projections
* :mod:`.common`  the PDL switch and the rows a tile covers
* :mod:`.naive`   the plain torch references
* ``tuned/<arch>.json``  the measured configs (:mod:`specpilot.kernels.tuning`)

The attention is ``kernels/attention`` (split-KV, masked), the argmax ``kernels/decode/argmax``.
"""
