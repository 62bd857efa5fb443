"""Verify steps of 2..64 rows (chain and tree verification): the kernels between two GEMMs.

* :mod:`.rows`    ``rms_norm_rows``, ``add_rms_norm_rows`` (residual add + the next RMSNorm),
  ``rope_store_rows`` (RoPE at each row's position, K/V into the caches at each row's slot, q
  out), ``silu_mul_rows``: one kernel each, launched with programmatic dependent launch
* :mod:`.blas`    the projections: the warp-K, TMA-ring or skinny GEMM where the measured table
  (``tuned/<arch>.json``) has an entry for the rows (and layer), else ``F.linear`` on the BLAS
  library it picks for the rows
* :mod:`.warpk`   ``warpk_linear``: one request's steps of 2..8 rows, the warp-K tensor-core GEMM
* :mod:`.skinny`  ``skinny_linear``: split-K tensor-core GEMM for 2..64 rows, fixed-order reduction
* :mod:`.ring`    ``ring_linear``: stream-K GEMM for 1..64 rows on Hopper, weights through a TMA ring
  into ``wgmma``, the first ring's weights read before the PDL wait
* :mod:`.common`  the PDL switch
* :mod:`.naive`   the plain torch references (the layers' arithmetic, ``linear``)

The projections are cuBLAS or one of these GEMMs (bf16) or the W12 GEMM (``kernels/w12``), the
attention is ``kernels/attention`` (split-KV, masked), the rows' argmax ``kernels/decode/argmax``;
``engine/fused_verify.py`` chains them.
"""
