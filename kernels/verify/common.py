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


def request_caches(T: int, k_cache, v_cache, req):
    """The caches a KV-store launch of ``T`` rows indexes by request: [1, nkv, S, hd] views of one
    request's [nkv, S, hd] caches (``req`` None), or [requests, nkv, S, hd] caches with ``req`` [T]."""
    if k_cache.dim() != (3 if req is None else 4) or (req is not None and req.shape != (T,)):
        raise ValueError("caches [nkv, S, hd] for one request, [requests, nkv, S, hd] with req [T] for several")
    return (k_cache[None], v_cache[None]) if req is None else (k_cache, v_cache)
