"""The engine's attention implementations: ``torch`` (the plain reference, every device) and
``fused`` (the split-KV Triton kernel, ``specpilot.kernels.attention.decode``, CUDA), chosen per
model with :func:`set_attention` (engine spec key ``attn``)."""

from __future__ import annotations

import torch

from specpilot.engine.spec import ATTENTIONS, check_choice
from specpilot.kernels.attention import naive as reference

_OP = None


def _fused_op():
    """Cache write plus fused attention as one torch custom op (``specpilot::store_kv_attention``)
    that declares it mutates the caches. Compiled layers then update the caches in place: written
    as ``cache[0, :, slots] = k`` inside a compiled region, the update of a module buffer is
    functionalized into a copy of the whole cache and a copy back, four full-cache kernels per layer
    and step. Defined on first use: ``torch.library`` imports Triton, which on a CPU-only machine
    must come after ``TRITON_INTERPRET`` is set (the kernel module does)."""
    global _OP
    if _OP is None:
        from specpilot.kernels.attention import decode

        @torch.library.custom_op("specpilot::store_kv_attention", mutates_args=("k_cache", "v_cache"))
        def store_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, kv_len: int,
                               scale: float) -> torch.Tensor:
            decode.store_kv(k, v, k_cache[0], v_cache[0], slots)
            return decode.masked_gqa_attention(q, k_cache[0, :, :kv_len], v_cache[0, :, :kv_len], mask[:, :kv_len],
                                               scale)

        @store_kv_attention.register_fake
        def _(q, k, v, k_cache, v_cache, slots, mask, kv_len, scale):
            return v_cache.new_empty(q.shape[0], q.shape[1] * q.shape[2])

        _OP = store_kv_attention
    return _OP


def _store(k, v, k_cache, v_cache, slots):
    """Write the step's rows ``k``/``v`` [T, nkv, hd] into the caches [1, nkv, S, hd] at ``slots``."""
    # .to: a no-op unless a pass computes in another dtype than the cache (TLV's bf16 Q pass)
    k_cache[0, :, slots] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache[0, :, slots] = v.transpose(0, 1).to(v_cache.dtype)


def store_and_attend(q, k, v, k_cache, v_cache, slots, mask, kv_len: int, scale: float, fused: bool):
    """Write the step's K/V rows into the caches, then attend: ``q`` [T, nh, hd] over the first
    ``kv_len`` cache slots under ``mask`` [T, >= kv_len]; returns [T, nh * hd]."""
    if fused:
        return _fused_op()(q, k, v, k_cache, v_cache, slots, mask, kv_len, scale)
    _store(k, v, k_cache, v_cache, slots)
    return reference.masked_gqa_attention(q, k_cache[0, :, :kv_len], v_cache[0, :, :kv_len], mask[:, :kv_len], scale)


def attend(q, k, v, mask, scale: float, fused: bool):
    """Attention alone (the step's K/V already stored): ``q`` [T, nh, hd] over one request's
    ``k``/``v`` [nkv, S, hd] under ``mask`` [T, S]; returns [T, nh * hd]."""
    if fused:
        from specpilot.kernels.attention import decode

        return decode.masked_gqa_attention(q, k, v, mask, scale)
    return reference.masked_gqa_attention(q, k, v, mask, scale)


def resolve(impl: str, device: str) -> str:
    """``auto``: fused on CUDA, torch elsewhere. (``EngineSpec`` refuses ``fused`` off CUDA for
    users: there the Triton interpreter runs it, for tests, far too slow to serve.)"""
    check_choice("attention", impl, ATTENTIONS)
    if impl == "auto":
        return "fused" if str(device).startswith("cuda") else "torch"
    return impl
