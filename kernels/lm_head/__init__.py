"""Certified INT8 LM head: INT8 copy + Cauchy-Schwarz bound + exact rescoring of survivors.

* :mod:`.naive`     plain torch reference (exact head, and the certified algorithm step by step)
* :mod:`.certified` the fast path (Triton kernels) and ``CertifiedHead``
"""

from .naive import Int8Head, certified_argmax_ref, exact_argmax, exact_logits, quantize_head

__all__ = ["Int8Head", "certified_argmax_ref", "exact_argmax", "exact_logits", "quantize_head"]
