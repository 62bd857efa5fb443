"""Fused one-row decode kernels: a dense layer's AR step in four GEMV kernels plus attention.

* :mod:`.gemv`            the entry points (``norm_qkv_rope_store``, ``gemv_residual``,
  ``norm_gate_up_silu``, ``rms_norm_row``) and the kernel for dense weights; W12 weights go to
* :mod:`.gemv_w12_gluon`  the Gluon kernels (CUDA), or :mod:`.gemv_w12` (Triton) elsewhere
* :mod:`.argmax`          ``argmax_row``: the logits' argmax in two small kernels
* :mod:`.common`          their shared prologue and epilogues
* :mod:`.naive`           the plain torch references (the engine's layer code, step by step)
* ``tuned/<arch>.json``   the measured configs (:mod:`specpilot.kernels.tuning`)
"""

__all__ = ["argmax_row", "gemv_residual", "norm_gate_up_silu", "norm_qkv_rope_store", "rms_norm_row"]


def __getattr__(name):   # the kernel modules import Triton: on first use only
    if name == "argmax_row":
        from .argmax import argmax_row

        return argmax_row
    if name in __all__:
        from . import gemv

        return getattr(gemv, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
