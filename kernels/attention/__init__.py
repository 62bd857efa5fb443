"""Masked grouped-query attention over the engine's static KV cache.

* :mod:`.decode`  ``masked_gqa_attention``: the fused split-KV Triton kernel (CUDA, or Triton's
  interpreter), and ``supports`` (what it takes)
* :mod:`.naive`   ``masked_gqa_attention`` in plain torch (the engine's reference path)
"""

__all__ = ["masked_gqa_attention", "store_kv", "supports"]


def __getattr__(name):   # the kernel module imports Triton: on first use only
    if name in __all__:
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
