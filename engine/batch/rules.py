"""The batching rules of paper 4.4. They only choose which rows are drafted, verified and admitted,
never what is accepted, so every choice is lossless.

* **Node budget** (``budget``): ``shared`` fills one budget of ``nodes x requests`` nodes best-first
  by path log-probability over every request of the step (each request's share is a prefix of its
  own best-first list, so a prefix-closed tree; at most ``SHARED_CAP x nodes`` nodes per request);
  ``equal`` gives each request its own ``nodes``-node tree. Both through the batched builder
  (``specpilot.kernels.tree.build_batched``: the Triton kernel on CUDA, its torch reference elsewhere).
* **Per-request drafter block** (``block=adaptive``): each request verifies at most ``block`` draft
  positions, chosen from ``block_sizes(depth)`` (16/12/8 for 16 positions) on the device from its
  recent accepted lengths and the confidence of its current draft (:func:`choose_blocks`);
  positions past the block are cut from the lattice before the tree is built.
* **Prompt admission** (``admit``): see :func:`plan_admission`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SHARED_CAP = 2        # a request's share of a shared budget is at most this many times ``nodes``
BLOCK_WINDOW = 8      # recent verify steps a request's block looks at
BLOCK_FRACTION = 0.75  # keep a bigger block while the expected accepted length exceeds this share of the next smaller


def block_sizes(depth: int) -> list[int]:
    """Draft blocks a request may use, largest first: ``depth``, 3/4 and 1/2 of it (16/12/8)."""
    return sorted({max(1, depth), max(1, math.ceil(3 * depth / 4)), max(1, math.ceil(depth / 2))}, reverse=True)


def pack_lattices(lattices, m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Lattices (``specpilot.engine.drafters.Lattice``) as ``tokens`` [B, m, k] (int64),
    ``logprobs`` [B, m, k] and ``transitions`` [B, m-1, k, k] (float32; -inf where a request has no
    such candidate). A request without transitions gets its marginal scores in them; ``None`` when
    no request has any."""
    B = len(lattices)
    m, k = max(1, m), max(1, k)   # an empty lattice (a drafter that proposed nothing) still has a shape
    tok = np.zeros((B, m, k), dtype=np.int64)
    lp = np.full((B, m, k), -np.inf, dtype=np.float32)
    has_tr = m > 1 and any(lat.transitions for lat in lattices)
    tr = np.full((B, m - 1, k, k), -np.inf, dtype=np.float32) if has_tr else None
    for b, lat in enumerate(lattices):   # numpy, a block per lattice where its rows are even
        _fill(tok[b], lat.tokens[:m])
        _fill(lp[b], lat.logprobs[:m])
        if tr is not None:
            for i in range(1, min(lat.m, m)):
                if lat.transitions:
                    _fill(tr[b, i - 1], lat.transitions[i - 1][:k])
                else:
                    na = min(len(lat.tokens[i - 1]), k)
                    tr[b, i - 1, :na, :] = lp[b, i][None, :]
    dev = torch.device(device)
    return (torch.from_numpy(tok).to(dev), torch.from_numpy(lp).to(dev),
            None if tr is None else torch.from_numpy(tr).to(dev))


def _fill(out: np.ndarray, rows: list) -> None:
    """``out[i, :len(rows[i])] = rows[i]`` (cut to ``out``'s width) for a list of rows."""
    if not rows:
        return
    w = out.shape[1]
    n = len(rows[0])
    if all(len(r) == n for r in rows):
        out[:len(rows), :min(n, w)] = np.asarray(rows, dtype=out.dtype)[:, :w]
        return
    for i, r in enumerate(rows):
        out[i, :min(len(r), w)] = r[:w]


def draft_confidence(logprobs: torch.Tensor) -> torch.Tensor:
    """Expected accepted draft length [B] if the drafter's top candidate at each position were right
    with its own probability: sum_i prod_{j <= i} p_top(j) (marginal scores; 0 past the draft)."""
    p = torch.exp(logprobs[:, :, 0].float())   # exp(-inf) = 0
    return torch.cumprod(p, dim=1).sum(1)


def choose_blocks(recent: torch.Tensor, confidence: torch.Tensor, sizes: list[int],
                  fraction: float = BLOCK_FRACTION) -> torch.Tensor:
    """Each request's block [B] (int64, on the device): ``need`` = the larger of its mean recent
    accepted draft length (``recent`` [B, W], NaN = no record; no record at all keeps the largest
    block) and its draft's confidence; the largest size is kept while ``need`` exceeds ``fraction``
    of the next smaller size, and so on down."""
    known = ~torch.isnan(recent)
    cnt = known.sum(1)
    mean = torch.where(known, recent, torch.zeros_like(recent)).sum(1) / cnt.clamp_min(1)
    mean = torch.where(cnt > 0, mean, torch.full_like(mean, float("inf")))
    need = torch.maximum(mean, confidence.to(mean.dtype))
    out = torch.full_like(cnt, sizes[-1])
    for bigger, smaller in reversed(list(zip(sizes, sizes[1:]))):
        out = torch.where(need > fraction * smaller, torch.full_like(out, bigger), out)
    return out


def cut_blocks(logprobs: torch.Tensor, transitions: torch.Tensor | None, blocks: torch.Tensor):
    """Scores with positions at or past each request's block set to -inf (never expanded)."""
    m = logprobs.shape[1]
    keep = torch.arange(m, device=logprobs.device)[None, :] < blocks[:, None]      # [B, m]
    neg = torch.full((), float("-inf"), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(keep[:, :, None], logprobs, neg)
    tr = None
    if transitions is not None:
        tr = torch.where(keep[:, 1:, None, None], transitions, neg)
    return lp, tr


def build_trees(tokens, logprobs, transitions, nodes: int, budget: str, requests: int | None = None):
    """The step's trees as :class:`~specpilot.kernels.tree.BatchedTrees` (``budget``: shared | equal).
    ``requests``: how many of the lattices are requests' (a shared budget is ``nodes`` for each);
    the rest are padding, empty lattices that grow no node."""
    from specpilot.kernels.tree.batched import build_batched

    B = tokens.shape[0] if requests is None else requests
    if budget == "shared":
        return build_batched(tokens, logprobs, transitions, max(1, SHARED_CAP * nodes),
                             budget=torch.full((), B * nodes, dtype=torch.int64, device=tokens.device))
    return build_batched(tokens, logprobs, transitions, max(1, nodes))


def plan_admission(admit: str, prefill_left: list[int], verify_rows: int, admit_rows: int,
                   chunk: int) -> tuple[list[int], bool]:
    """Which prompts' rows join this verify step (paper 4.4, prompt admission).

    ``prefill_left``: prompt rows still to prefill, per prefilling request (arrival order);
    ``verify_rows``: the step's verify rows; ``chunk``: the rows of a prefill pass (the scheduler's
    ``prefill_chunk``: prompts in arrival order, at least one prompt's chunk). Returns (rows each
    prompt puts into the step, whether a prefill pass of its own must run first for the others):

    * ``off``: no prompt joins; any prompt is prefilled in passes of their own.
    * ``waiting``: only prompts that would otherwise wait join, whole, while their rows fit in what
      the verify step leaves of ``admit_rows`` (their compute hides behind the step's weight reads).
      When every prompt fits, they all join and no pass runs. Otherwise a pass runs for the prompts
      that do not fit, and it takes prompts in arrival order up to ``chunk`` rows: those it takes
      do not wait, so they go to it; only the prompts past its rows join the step (admitting a
      prompt the pass takes anyway saves no pass, and with bucket graphs a step of more than one
      prompt chunk runs eagerly).
    * ``all``: every prompt joins with its next chunk of up to ``chunk`` rows, whatever the step's size.
    """
    n = len(prefill_left)
    if admit == "off" or verify_rows == 0:
        return [0] * n, n > 0
    if admit == "all":
        return [min(left, chunk) for left in prefill_left], False
    free = max(0, admit_rows - verify_rows)
    if sum(prefill_left) <= free:
        return list(prefill_left), False
    budget, out = chunk, []
    for left in prefill_left:
        taken = max(0, min(left, budget))
        budget -= taken
        if taken == 0 and left <= free:   # past the pass's rows: it would wait
            out.append(left)
            free -= left
        else:
            out.append(0)
    return out, True
