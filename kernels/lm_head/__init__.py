"""Certified INT8 LM head: INT8 copy + Cauchy-Schwarz bound + exact rescoring of survivors.

* :mod:`.naive`     plain torch reference (exact head, and the certified algorithm step by step)
* :mod:`.certified` the fast path (Triton kernels) and ``CertifiedHead``; its bounds-GEMM tiles by row
  count are measured data (``tuned/<arch>.json``, :mod:`specpilot.kernels.tuning`)
"""

from .naive import Int8Head, certified_argmax_ref, exact_argmax, exact_logits, quantize_head

__all__ = ["CertifiedHead", "Int8Head", "certified_argmax_ref", "exact_argmax", "exact_logits", "quantize_head"]


def __getattr__(name):   # the kernels import Triton: on first use only
    if name == "CertifiedHead":
        from .certified import CertifiedHead

        return CertifiedHead
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
