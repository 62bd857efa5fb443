"""FP8 (e4m3) projections for the TLV Q pass (``qview=fp8``): the weights as e4m3 with one
power-of-two scale per tensor, the activations split per row into a high and a low e4m3 part
(about bf16's precision), one FP8 tensor-core GEMM (``torch._scaled_mm``, cuBLASLt) over both parts
stacked as twice the rows, the parts recombined with their row scales by the next row kernel.

* :mod:`.naive`  the plain torch reference: scales, quantization, recombination, the product
* :mod:`.rows`   the Triton kernels: a step's rows quantized (``quantize_rows``) and recombined
  (``combine_rows``), and ``quant_hilo``, the quantization the fused row kernels of
  :mod:`specpilot.kernels.verify.rows` inline
* :mod:`.linear` ``Fp8Weight`` (``quantize_weight``), ``SplitRows`` and ``fp8_linear``

A tensor core multiplies e4m3 operands without the decode the W12 kernels run per record, so the
GEMM streams its 8 bits a weight at cuBLASLt's pace (docs/tlv.md has the measured figures).
"""

from .linear import Fp8Weight, SplitRows, fp8_linear, quantize_weight

__all__ = ["Fp8Weight", "SplitRows", "fp8_linear", "quantize_weight"]
