"""The kernels (``specpilot.kernels``): each op folder exports its entry points, and keeps its plain
torch reference in ``naive.py`` beside the fast kernels.

* :mod:`.w12`        the W12 format (12-bit lossless bf16 weights) and its GEMM kernels (``w12_linear``)
* :mod:`.lm_head`    the certified INT8 LM head
* :mod:`.decode`     the fused one-row decode kernels (a dense layer's AR step)
* :mod:`.attention`  masked grouped-query attention over the static KV cache
* :mod:`.tree`       best-first draft trees (host heap and the batched GPU builder)
* :mod:`.gdn`        Gated DeltaNet tree verification along root paths
* :mod:`.tuning`     measured kernel configs as data (``<op>/tuned/<arch>.json``)
* :mod:`.triton_env`, :mod:`.workspace`   Triton imported one way; split-K scratch buffers
"""
