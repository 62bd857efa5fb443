"""Plain torch reference of the gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5 style).

Per head, with a fp32 state ``S`` of shape [d_k, d_v] and per-token decay ``g`` (log space, <= 0)
and write strength ``beta`` in (0, 1)::

    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T        # delta rule: replace what k currently reads
    o  = S^T (q / sqrt(d_k))

q and k are L2-normalised first. Every other GDN routine here (chain snapshots, tree path
verification, commit replay) is written with :func:`step` so that they agree bit for bit.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q, k, v, g, beta):
    """fp32, normalised q (scaled) and k. Shapes: q,k [..., H, d_k], v [..., H, d_v], g,beta [..., H]."""
    q = l2norm(q.float()) * (q.shape[-1] ** -0.5)
    return q, l2norm(k.float()), v.float(), g.float(), beta.float()


def step(state, q, k, v, g, beta):
    """One token for a batch of states. state [B, H, dk, dv]; q,k [B, H, dk]; v [B, H, dv]; g,beta [B, H].

    Returns (new_state, out [B, H, dv])."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return state, out


def recurrent(q, k, v, g, beta, state, keep_states: bool = True):
    """Sequential gated delta rule over T tokens from ``state`` [H, dk, dv] (prepared inputs,
    q,k [T, H, dk], v [T, H, dv], g,beta [T, H]). Returns (out [T, H, dv], states [T, H, dk, dv])
    where ``states[t]`` is the state after token t (the per-position snapshots stock keeps);
    with ``keep_states=False`` only the final state is returned, as states [1, H, dk, dv]."""
    outs, states = [], []
    s = state[None]
    for t in range(q.shape[0]):
        s, o = step(s, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        outs.append(o[0])
        if keep_states:
            states.append(s[0])
    if not keep_states:
        return (torch.stack(outs) if outs else q.new_zeros((0,) + v.shape[1:])), s
    if not outs:
        return q.new_zeros((0,) + v.shape[1:]), state.new_zeros((0,) + state.shape)
    return torch.stack(outs), torch.stack(states)
