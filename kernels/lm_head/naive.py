"""Plain torch reference of the certified INT8 LM head.

Definitions (shared with the fast path):

* exact logit of token v for hidden state h: ``fp32(sum_i h_i * W_vi)`` computed in fp64 from the
  bf16 values (every product is exact in fp64, for fp32 values too; the sum is rounded once to
  fp32);
* the head's argmax: the largest exact logit, the lowest token id on ties (``torch.argmax``'s rule);
* INT8 copy: ``q_v = round(W_v / s_v)``, ``s_v = max|W_v| / 127``, residual ``r_v = ||W_v - s_v q_v||``
  rounded up;
* certificate: ``|z_v - a_v| <= rho_v`` with ``a_v`` the INT8 logit and
  ``rho_v = ||h|| r_v + ||h - h~|| ||s_v q_v|| + slack`` (``h~`` the quantized h); a token whose upper
  bound ``a_v + rho_v`` is below the best lower bound ``max_u (a_u - rho_u)`` (minus a margin that
  keeps fp32 rounding from creating a tie) cannot be the argmax and is dropped; survivors are
  rescored exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_UP = 1.0 + 2.0 ** -20      # rounding-up factor for norms computed in fp32
MARGIN_REL = 2.0 ** -20     # keeps a dropped token strictly below the winner after fp32 rounding


@dataclass
class Int8Head:
    weight: torch.Tensor      # bf16 [V, H] (the exact head, used for rescoring)
    q: torch.Tensor           # int8 [V, H]
    scale: torch.Tensor       # fp32 [V]
    resid: torch.Tensor       # fp32 [V]: ||W_v - s_v q_v|| rounded up
    qnorm: torch.Tensor       # fp32 [V]: ||s_v q_v|| rounded up

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden(self) -> int:
        return self.weight.shape[1]


def quantize_head(weight: torch.Tensor, chunk: int = 16384) -> Int8Head:
    """Build the INT8 copy (per-row scale) and the per-row residual norms (fp64, rounded up)."""
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("the LM head must be a 2-D bf16 (or fp32) tensor")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("the LM head has non-finite weights; the certificate needs finite weights")
    v, h = weight.shape
    q = torch.empty(v, h, dtype=torch.int8, device=weight.device)
    scale = torch.empty(v, dtype=torch.float32, device=weight.device)
    resid = torch.empty_like(scale)
    qnorm = torch.empty_like(scale)
    for a in range(0, v, chunk):
        w = weight[a:a + chunk].double()
        s = (w.abs().amax(dim=1) / 127.0).float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        qq = torch.round(w / s.double()[:, None]).clamp_(-127, 127)
        deq = qq * s.double()[:, None]
        q[a:a + chunk] = qq.to(torch.int8)
        scale[a:a + chunk] = s
        resid[a:a + chunk] = _round_up((w - deq).norm(dim=1))
        qnorm[a:a + chunk] = _round_up(deq.norm(dim=1))
    return Int8Head(weight, q, scale, resid, qnorm)


def _round_up(x64: torch.Tensor) -> torch.Tensor:
    f = x64.float()
    return torch.where(f.double() < x64, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


def exact_logits(h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32(fp64 dot) logits of bf16 h [M, H] against W (or W[rows])."""
    w = weight if rows is None else weight[rows]
    return (h.double() @ w.double().T).float()


def exact_argmax(h: torch.Tensor, weight: torch.Tensor, chunk: int = 32768) -> torch.Tensor:
    """The full head's argmax (lowest id on ties), chunked over the vocabulary."""
    best_v = torch.full((h.shape[0],), -float("inf"), dtype=torch.float32, device=h.device)
    best_i = torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
    for a in range(0, weight.shape[0], chunk):
        z = exact_logits(h, weight[a:a + chunk])
        v, i = z.max(dim=1)   # first maximum inside the chunk
        better = v > best_v   # strict: an earlier chunk keeps its tie
        best_v = torch.where(better, v, best_v)
        best_i = torch.where(better, i + a, best_i)
    return best_i


def quantize_hidden(h: torch.Tensor):
    """Two-level int8 quantization of h rows: h ~ s1 q1 + s2 q2. Returns q1, q2, s1, s2, ||h||, ||e||."""
    hd = h.double()
    s1 = (hd.abs().amax(dim=1) / 127.0)
    s1 = torch.where(s1 > 0, s1, torch.ones_like(s1)).float().double()
    q1 = torch.round(hd / s1[:, None]).clamp_(-127, 127)
    r1 = hd - q1 * s1[:, None]
    s2 = (r1.abs().amax(dim=1) / 127.0)
    s2 = torch.where(s2 > 0, s2, torch.ones_like(s2)).float().double()
    q2 = torch.round(r1 / s2[:, None]).clamp_(-127, 127)
    e = r1 - q2 * s2[:, None]
    return (q1.to(torch.int8), q2.to(torch.int8), s1.float(), s2.float(),
            _round_up(hd.norm(dim=1)), _round_up(e.norm(dim=1)))


@dataclass
class CertifiedResult:
    argmax: torch.Tensor          # int64 [M]
    survivors: list[torch.Tensor]  # per row: token ids rescored exactly (sorted)
    survivor_logits: list[torch.Tensor]  # their exact logits
    fallback: torch.Tensor        # bool [M]: the full head was used for this row


def bounds_ref(h: torch.Tensor, head: Int8Head):
    """Approximate logits and radii (fp64 arithmetic on the int8 dots): a [M, V], rho [M, V]."""
    q1, q2, s1, s2, hn, en = quantize_hidden(h)
    qd = head.q.double()
    d1 = q1.double() @ qd.T
    d2 = q2.double() @ qd.T
    a = head.scale.double()[None, :] * (s1.double()[:, None] * d1 + s2.double()[:, None] * d2)
    rho = hn.double()[:, None] * head.resid.double()[None, :] + en.double()[:, None] * head.qnorm.double()[None, :]
    rho = rho * _UP + a.abs() * 2.0 ** -20
    return a, rho


def certified_argmax_ref(h: torch.Tensor, head: Int8Head, max_survivors: int = 256) -> CertifiedResult:
    """The certified algorithm in plain torch (the fast path's reference)."""
    a, rho = bounds_ref(h, head)
    ub, lb = a + rho, a - rho
    best_lb = lb.max(dim=1).values
    keep = ub >= (best_lb - best_lb.abs() * MARGIN_REL)[:, None]
    out, survs, slog, fb = [], [], [], []
    for m in range(h.shape[0]):
        idx = keep[m].nonzero().flatten()
        if idx.numel() > max_survivors:
            out.append(exact_argmax(h[m:m + 1], head.weight)[0])
            survs.append(idx)
            slog.append(exact_logits(h[m:m + 1], head.weight, idx)[0])
            fb.append(True)
            continue
        z = exact_logits(h[m:m + 1], head.weight, idx)[0]
        out.append(idx[z.argmax()])   # idx sorted ascending: first maximum = lowest id
        survs.append(idx)
        slog.append(z)
        fb.append(False)
    return CertifiedResult(torch.stack(out), survs, slog, torch.tensor(fb))
