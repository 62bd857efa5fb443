"""W12: lossless 12-bit bf16 weights, and the GEMM kernels that read them.

The format:

* :mod:`.format`      the format and its vectorized torch codec (``encode``/``decode``, ``W12Tensor``)
* :mod:`.checkpoint`  pack / verify / stats of safetensors checkpoints
* :mod:`.files`       finding a checkpoint's files and checking their headers (no torch)
* :mod:`.pack`        ``KernelPack``: W12 weights laid out for the kernels
* :mod:`.module`      ``W12Linear`` and ``convert_model`` for transformers models

The kernels (``y = x @ W.T`` from the records, fp32 accumulation, bitwise deterministic):

* :mod:`.routing`     ``w12_linear`` and ``route``: which kernel and config run a product
* :mod:`.mma`, :mod:`.mma_tma`, :mod:`.warpk`, :mod:`.gemv_gluon`   the Gluon kernels (CUDA)
* :mod:`.gemv`, :mod:`.gemm`   the Triton kernels (any GPU; the CPU under Triton's interpreter)
* :mod:`.common`, :mod:`.gluon_common`, :mod:`.gluon_epilogue`, :mod:`.fragments`   their shared pieces
* ``tuned/<arch>.json``   the measured configs and the routing order (:mod:`specpilot.kernels.tuning`)
* :mod:`.naive`       the plain torch reference the kernels are tested against
"""

__all__ = ["FORMAT_VERSION", "KernelPack", "W12Linear", "W12Tensor", "convert_model", "decode", "encode", "qpass_view",
           "route", "w12_linear"]


def __getattr__(name):   # torch (the codec), Triton and Gluon (the kernels): on first use only
    if name in ("FORMAT_VERSION", "W12Tensor", "decode", "encode", "qpass_view"):
        from . import format

        return getattr(format, name)
    if name == "KernelPack":
        from .pack import KernelPack

        return KernelPack
    if name in ("W12Linear", "convert_model"):
        from . import module

        return getattr(module, name)
    if name in ("w12_linear", "route"):
        from . import routing

        return getattr(routing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
