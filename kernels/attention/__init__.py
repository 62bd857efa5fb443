"""Masked grouped-query attention over the engine's static KV cache: a plain torch reference
(:mod:`.reference`) and a fused split-KV Triton kernel (:mod:`.decode`)."""
