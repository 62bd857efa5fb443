"""Chunked GDN prefill through flash-linear-attention (``fla-core``).

A prompt's GDN layers are a plain sequence: fla's ``chunk_gated_delta_rule`` (WY-chunked, tensor
cores; grouped value heads, in-kernel q/k L2 normalisation with the same eps as
:func:`.naive.l2norm`) does this well, so the engine uses it rather than a kernel of its own. It
runs on CUDA only; elsewhere, or without fla, the engine keeps the torch reference
(:func:`.naive.recurrent`). The result agrees with the reference to fp32/bf16 rounding (fla
normalises q/k in the activation dtype and sums in chunks), not bit for bit, which is all a
prefill needs: decoding continues from its final state in either case.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:   # not installed, or no GPU Triton backend
        return None
    return chunk_gated_delta_rule


def available(device) -> bool:
    """Whether fla's chunked kernel can run on ``device`` (the callers' gate: the functions below
    take whatever device their inputs are on)."""
    return torch.device(device).type == "cuda" and _chunk() is not None


def _fla():
    fn = _chunk()
    if fn is None:
        raise RuntimeError("fla-core's chunk_gated_delta_rule needs CUDA and the fla-core package")
    return fn


def _run(fn, q, k, v, g, beta, initial_state, **varlen):
    """fla's call as the engine makes it (in-kernel q/k normalisation, final state out): (o, final)."""
    return fn(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
              initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True, **varlen)


def chunk_prefill(q, k, v, g, beta, state):
    """Gated delta rule over T tokens from ``state`` [nv, dk, dv] (fp32; updated in place).

    ``q``/``k`` [T, nk, dk] raw (normalised in the kernel), ``v`` [T, nv, dv], ``g``/``beta`` [T, nv]
    fp32 (log decay, post-sigmoid write strength). Returns o [T, nv, dv] fp32."""
    o, final = _run(_fla(), q, k, v, g, beta, state[None])
    state.copy_(final[0])
    return o[0].float()


def chunk_prefill_segments(q, k, v, g, beta, states, slots: list[int], lengths: list[int]):
    """:func:`chunk_prefill` for several requests' prompt chunks laid one after another (``lengths``
    rows each) in one variable-length call (``cu_seqlens``): chunk i starts from
    ``states[slots[i]]`` and leaves its final state there. Returns o [T, nv, dv] fp32."""
    fn = _fla()
    if len(slots) != len(lengths) or sum(lengths) != q.shape[0] or min(lengths) < 1:
        raise ValueError(f"chunk_prefill_segments: {len(slots)} slots and lengths {lengths} for {q.shape[0]} rows")
    cu_cpu = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
    idx = torch.tensor(slots, dtype=torch.long).to(q.device, non_blocking=True)
    o, final = _run(fn, q, k, v, g, beta, states.index_select(0, idx),
                    cu_seqlens=cu_cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cu_cpu)
    states.index_copy_(0, idx, final.to(states.dtype))
    return o[0].float()
