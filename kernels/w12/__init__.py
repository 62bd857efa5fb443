"""W12: lossless 12-bit bf16 weights, the fused W12 GEMM and the W12Linear module.

* :mod:`.format`   the format and its vectorized torch codec (``encode``/``decode``)
* :mod:`.naive`    plain torch references of the GEMM and the Q pass
* :mod:`.gemm`     the fused Triton GEMM (``w12_linear``) and its GPU layout (``KernelPack``)
* :mod:`.module`   ``W12Linear`` and ``convert_model`` for transformers models
* :mod:`.checkpoint` pack / verify / stats of safetensors checkpoints
"""

from .format import FORMAT_VERSION, W12Tensor, decode, encode

__all__ = ["FORMAT_VERSION", "W12Tensor", "decode", "encode"]
