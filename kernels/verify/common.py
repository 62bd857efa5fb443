"""What the multi-row step kernels share: the programmatic-dependent-launch switch and the
argument checks of a RoPE + KV-store launch."""

from __future__ import annotations

# programmatic dependent launch for the multi-row kernels and the attention between them (as
# kernels/decode/gemv.USE_PDL for the one-row chain); off: plain launches (the tests compare both)
USE_PDL = True


def check_rope_store(T: int, hd: int, cos, sin, pos, slots, k_cache, v_cache) -> None:
    """The positions, slots, RoPE tables and caches a RoPE + KV-store launch of ``T`` rows takes."""
    if pos.shape != (T,) or slots.shape != (T,):
        raise ValueError(f"pos and slots must be [{T}]")
    if cos.shape[-1] != hd or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("RoPE tables must be [positions, head_dim], contiguous (partial rotary is not fused)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in head_dim")
