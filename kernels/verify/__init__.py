"""Verify steps of 2..64 rows (chain and tree verification): the kernels between two GEMMs.

* :mod:`.rows`    ``rms_norm_rows``, ``add_rms_norm_rows`` (residual add + the next RMSNorm),
  ``rope_store_rows`` (RoPE at each row's position, K/V into the caches at each row's slot, q
  out), ``silu_mul_rows``: one kernel each, launched with programmatic dependent launch
* :mod:`.blas`    the projections' ``F.linear`` on the BLAS library the measured table picks for
  the step's rows (``tuned/<arch>.json``)
* :mod:`.common`  the PDL switch
* :mod:`.naive`   the plain torch references (the layers' arithmetic)

The projections are cuBLAS (bf16) or the W12 GEMM (``kernels/w12``), the attention is
``kernels/attention`` (split-KV, masked), the rows' argmax ``kernels/decode/argmax``;
``engine/fused_verify.py`` chains them.
"""
