"""Verify steps of 2..64 rows (chain and tree verification): the kernels between two GEMMs.

* :mod:`.rows`    ``rms_norm_rows``, ``add_rms_norm_rows`` (residual add + the next RMSNorm),
  ``rope_store_rows`` (RoPE at each row's position, K/V into the caches at each row's slot, q
  out), ``silu_mul_rows``: one kernel each, launched with programmatic dependent launch
* :mod:`.blas`    the projections: the skinny GEMM where the measured table (``tuned/<arch>.json``)
  has an entry for the layer and rows, else ``F.linear`` on the BLAS library it picks for the rows
* :mod:`.skinny`  ``skinny_linear``: split-K tensor-core GEMM for 2..64 rows, fixed-order reduction
* :mod:`.common`  the PDL switch
* :mod:`.naive`   the plain torch references (the layers' arithmetic, ``linear``)

The projections are cuBLAS or the skinny GEMM (bf16) or the W12 GEMM (``kernels/w12``), the
attention is ``kernels/attention`` (split-KV, masked), the rows' argmax ``kernels/decode/argmax``;
``engine/fused_verify.py`` chains them.
"""
