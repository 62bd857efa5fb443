"""Greedy best-first tree verify for SGLang's DFLASH worker, as plain torch (static shapes, no host
sync): the library behind the ``tree`` bundle's DFLASH hooks (:mod:`.dflash_tree_hooks`).

A tree has ``N`` nodes per request, N = the worker's draft block size B (verified greedily and
eagerly): node 0 is the root (the bonus/anchor token the worker puts first in its
block), nodes ``1..N-1`` are drafted tokens, every parent has a smaller index than its children
("parent-first"), so the tree fills the worker's ``[bs, N]`` block in place of the chain.

* :func:`build_tree` - the best-first tree over a DFlash2 lattice (``CandidateSelector.build_lattice``
  scores ``[b, m, K, K]`` and candidate ids ``[b, m, K]``): edge log-probabilities are
  ``log_softmax(score[b, 0, 0])`` for the first edge and ``log_softmax(score[b, e, p, :])`` for
  edge e > 0 given the parent's candidate p (the rows ``lattice-trace`` records). A beam of width
  N-1 runs over the depths, then one global top-(N-1) under a single total order (path score
  descending, then depth ascending, then rank within the depth). That is exactly the node sequence
  ``specpilot.kernels.tree.build_best_first`` pops from its heap, ties included (tested), so the
  tree is prefix-closed: a selected node's parent ranks before it (score >= the child's, smaller
  depth), and a node in the global top N-1 is in its depth's top N-1, so its parent survived the beam.
* :func:`verify_layout` - what SGLang's tree verify reads: FULL_MASK custom mask (per request N rows
  of ``prefix + N`` columns, prefix visible, then ancestor-or-self), positions ``prefix + depth``,
  ``retrieve_index / retrieve_next_token / retrieve_next_sibling`` (the conventions of
  ``build_tree_kernel_efficient`` and ``reconstruct_indices_from_tree_mask``).
* :func:`accept_outputs` - the worker's ``_accept_block`` outputs from ``verify_tree_greedy``'s
  ``(predicts, accept_index, accept_token_num)``.
* :func:`kv_move_pairs` / :func:`compact_to_front` - the accepted path moved to the front of each
  request's verify window (target KV slots, hidden rows), so the worker's chain-layout code after
  accept (draft-KV rebuild, committed-KV reads) sees a chain.

Non-finite scores: NaN counts as -inf; -inf paths rank last and may fill the budget (the heap
builder skips them), which keeps the shape static and the tree prefix-closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class LatticeTree:
    """A batch of trees of N nodes (node 0 = root). All tensors are on the lattice's device."""

    parents: "torch.Tensor"   # int64 [b, N]; parents[:, 0] = -1
    depth: "torch.Tensor"     # int64 [b, N]; depth[:, 0] = 0
    tokens: "torch.Tensor"    # [b, N-1] candidate ids of nodes 1..N-1 (candidate_ids' dtype)
    score: "torch.Tensor"     # [b, N] path log-probability (root 0)


@dataclass
class VerifyLayout:
    custom_mask: "torch.Tensor"            # bool [mask_len] (FULL_MASK, padded with True)
    positions: "torch.Tensor"              # int64 [b * N]
    retrieve_index: "torch.Tensor"         # int64 [b, N]
    retrieve_next_token: "torch.Tensor"    # int64 [b, N]
    retrieve_next_sibling: "torch.Tensor"  # int64 [b, N]


def _torch():
    import torch

    return torch


# --------------------------------------------------------------------------------- the builder

def check_lattice(scores, candidate_ids, n_nodes: int) -> tuple[int, int, int]:
    """(b, m, K) of a lattice, or ValueError naming what is wrong (host metadata only)."""
    if getattr(scores, "ndim", None) != 4:
        raise ValueError(f"lattice scores must be [b, m, K, K], got shape {tuple(getattr(scores, 'shape', ()))}")
    b, m, k, k2 = scores.shape
    if k != k2:
        raise ValueError(f"lattice scores must be [b, m, K, K] (square per edge), got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"lattice scores must be floating point, got {scores.dtype}")
    if getattr(candidate_ids, "shape", None) != (b, m, k):
        raise ValueError(f"candidate ids must be [b, m, K] = {(b, m, k)}, got "
                         f"{tuple(getattr(candidate_ids, 'shape', ()))}")
    if candidate_ids.device != scores.device:
        raise ValueError(f"candidate ids on {candidate_ids.device}, scores on {scores.device}")
    if m < 1 or k < 1:
        raise ValueError(f"empty lattice: m={m} positions, K={k} candidates")
    if int(n_nodes) < 2:
        raise ValueError(f"a tree needs at least 2 nodes (the root and one draft), got {n_nodes}")
    if sum(beam_widths(m, k, int(n_nodes) - 1)) < int(n_nodes) - 1:
        raise ValueError(f"the lattice has fewer than {int(n_nodes) - 1} nodes (m={m}, K={k})")
    return b, m, k


def beam_widths(m: int, k: int, width: int) -> list[int]:
    """Static beam width per depth: min(width, K^(d+1)), for the depths a tree of ``width`` nodes
    can reach (at most ``width``)."""
    out, reach = [], 1
    for _ in range(min(m, width)):
        reach = min(reach * k, width)
        out.append(reach)
    return out


def lattice_logprobs(scores):
    """(logp0 [b, K], trans [b, m-1, K, K]) in at least float32; NaN counts as -inf."""
    torch = _torch()
    x = scores.to(torch.promote_types(scores.dtype, torch.float32))
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    logp0 = torch.log_softmax(x[:, 0, 0], dim=-1)
    trans = torch.log_softmax(x[:, 1:], dim=-1)
    return (torch.nan_to_num(logp0, nan=float("-inf")), torch.nan_to_num(trans, nan=float("-inf")))


def _sort_desc(x):
    torch = _torch()
    return torch.sort(x, dim=-1, descending=True, stable=True)


def build_tree(scores, candidate_ids, n_nodes: int) -> LatticeTree:
    """The best-first tree of ``n_nodes`` nodes (root included) per request; see the module doc."""
    torch = _torch()
    b, m, k = check_lattice(scores, candidate_ids, n_nodes)
    n, width = int(n_nodes), int(n_nodes) - 1
    dev = scores.device
    logp0, trans = lattice_logprobs(scores)
    widths = beam_widths(m, k, width)

    s, order = _sort_desc(logp0)
    beam_s, beam_c = [s[:, : widths[0]]], [order[:, : widths[0]]]
    beam_p = [torch.full((b, widths[0]), -1, dtype=torch.int64, device=dev)]
    for d in range(1, len(widths)):
        # candidates of depth d: every beam node of depth d-1 (in rank order) x its K children
        parent_cand = beam_c[-1]
        edge = torch.gather(trans[:, d - 1], 1, parent_cand[:, :, None].expand(-1, -1, k))
        s, order = _sort_desc((beam_s[-1][:, :, None] + edge).reshape(b, -1))
        w = widths[d]
        beam_s.append(s[:, :w])
        beam_p.append(torch.div(order[:, :w], k, rounding_mode="floor"))
        beam_c.append(order[:, :w] % k)

    all_s = torch.cat(beam_s, dim=1)                       # [b, T], depth-major, rank-minor
    all_c = torch.cat(beam_c, dim=1)
    all_p = torch.cat(beam_p, dim=1)
    depth_of = torch.tensor([d for d, w in enumerate(widths) for _ in range(w)], dtype=torch.int64, device=dev)
    start_of = torch.tensor([sum(widths[:d]) for d in range(len(widths))], dtype=torch.int64, device=dev)
    chosen = _sort_desc(all_s).indices[:, :width]          # flat beam index of nodes 1..N-1
    node_depth = depth_of[chosen]
    node_cand = all_c.gather(1, chosen)
    node_prank = all_p.gather(1, chosen)
    node_of = torch.full((b, all_s.shape[1]), -1, dtype=torch.int64, device=dev)
    node_of.scatter_(1, chosen, torch.arange(1, n, dtype=torch.int64, device=dev).expand(b, -1).contiguous())
    parent_flat = start_of[(node_depth - 1).clamp(min=0)] + node_prank.clamp(min=0)
    parent = torch.where(node_depth == 0, torch.zeros_like(node_depth), node_of.gather(1, parent_flat))
    tokens = candidate_ids.reshape(b, m * k).gather(1, node_depth * k + node_cand)
    zero = torch.zeros((b, 1), dtype=torch.int64, device=dev)
    return LatticeTree(
        parents=torch.cat([zero - 1, parent], dim=1),
        depth=torch.cat([zero, node_depth + 1], dim=1),
        tokens=tokens,
        score=torch.cat([torch.zeros((b, 1), dtype=all_s.dtype, device=dev), all_s.gather(1, chosen)], dim=1),
    )


def greedy_path(scores, candidate_ids):
    """The chain ``CandidateSelector.sample_path`` walks for greedy rows: argmax of ``score[:, 0, 0]``,
    then argmax of ``score[:, e, previous]``. Returns the tokens [b, m]."""
    torch = _torch()
    b, m, k = check_lattice(scores, candidate_ids, 2)
    idx = scores[:, 0, 0].argmax(dim=-1)
    path = [idx]
    for e in range(1, m):
        row = scores[:, e].gather(1, idx[:, None, None].expand(-1, 1, k))[:, 0]
        idx = row.argmax(dim=-1)
        path.append(idx)
    return candidate_ids.gather(2, torch.stack(path, dim=1)[:, :, None])[:, :, 0]


def chain_tree(chain_tokens) -> LatticeTree:
    """The stock chain as a tree: node i's parent is node i-1. ``chain_tokens`` [b, N-1]."""
    torch = _torch()
    b, w = chain_tokens.shape
    ar = torch.arange(w + 1, dtype=torch.int64, device=chain_tokens.device)
    return LatticeTree(parents=(ar - 1).expand(b, -1).contiguous(), depth=ar.expand(b, -1).contiguous(),
                       tokens=chain_tokens, score=torch.zeros((b, w + 1), device=chain_tokens.device))


def choose_rows(use_tree, tree: LatticeTree, chain: LatticeTree) -> LatticeTree:
    """Per row (``use_tree`` bool [b]): the tree's row, else the chain's. No host sync."""
    torch = _torch()
    sel = use_tree[:, None]
    return LatticeTree(parents=torch.where(sel, tree.parents, chain.parents),
                       depth=torch.where(sel, tree.depth, chain.depth),
                       tokens=torch.where(sel, tree.tokens, chain.tokens.to(tree.tokens.dtype)),
                       score=torch.where(sel, tree.score, chain.score.to(tree.score.dtype)))


# ---------------------------------------------------------------------------------- the layout

def check_parents(parents) -> tuple[int, int]:
    if getattr(parents, "ndim", None) != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents must be [b, N] with N >= 1, got shape {tuple(getattr(parents, 'shape', ()))}")
    return int(parents.shape[0]), int(parents.shape[1])


def ancestor_mask(parents, max_depth: int | None = None):
    """bool [b, N, N]: mask[b, i, j] = node j is node i or one of its ancestors (<= max_depth
    parent gathers; default N-1)."""
    torch = _torch()
    b, n = check_parents(parents)
    up = parents.to(torch.int64).clamp(min=0)  # the root is its own parent
    cur = torch.arange(n, dtype=torch.int64, device=parents.device).expand(b, -1).contiguous()
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, -1, -1).contiguous()
    for _ in range(n - 1 if max_depth is None else int(max_depth)):
        cur = up.gather(1, cur)
        anc.scatter_(2, cur[:, :, None], True)
    return anc


def retrieve_links(parents):
    """(retrieve_index, retrieve_next_token, retrieve_next_sibling), int64 [b, N]: node b*N+i, the
    smallest-index child of each node, the next larger-index child of each node's parent (-1: none)."""
    torch = _torch()
    b, n = check_parents(parents)
    dev = parents.device
    p = parents.to(torch.int64)
    ar = torch.arange(n, dtype=torch.int64, device=dev)
    none = torch.full((), n, dtype=torch.int64, device=dev)
    retrieve_index = torch.arange(b, dtype=torch.int64, device=dev)[:, None] * n + ar
    child = p[:, None, :] == ar[None, :, None]                      # [b, parent, node]
    first = torch.where(child, ar, none).amin(dim=-1)
    sibling = (p[:, :, None] == p[:, None, :]) & (ar[None, None, :] > ar[None, :, None]) & (ar[None, :, None] > 0)
    nxt = torch.where(sibling, ar, none).amin(dim=-1)
    return (retrieve_index, torch.where(first == n, -1, first), torch.where(nxt == n, -1, nxt))


def full_mask_len(seq_lens_sum: int, bs: int, n: int) -> int:
    """The FULL_MASK length SGLang's verify backends size for ``seq_lens_sum`` (the host bound the
    worker sets on the batch): ``seq_lens_sum * N + N * N * bs`` (``generate_attn_arg_prefill``).
    It is at least the exact layout ``sum(N * (prefix + N))`` whenever ``seq_lens_sum >= sum(prefix)``."""
    return int(seq_lens_sum) * int(n) + int(n) * int(n) * int(bs)


def full_mask(anc, seq_lens, mask_len: int):
    """FULL_MASK bool [mask_len]: request b's N rows of ``prefix_b + N`` columns (prefix True, then
    ``anc[b]``), requests back to back from offset 0; the rest (padding) True. No host sync; the
    caller guarantees ``mask_len`` covers the layout (:func:`full_mask_len`)."""
    torch = _torch()
    b, n, _ = anc.shape
    seq = seq_lens.to(device=anc.device, dtype=torch.int64)
    per_req = n * (seq + n)
    starts = torch.cumsum(per_req, 0) - per_req
    ar = torch.arange(n, dtype=torch.int64, device=anc.device)
    idx = (starts[:, None, None] + ar[None, :, None] * (seq + n)[:, None, None] + seq[:, None, None]
           + ar[None, None, :])
    mask = torch.ones(int(mask_len), dtype=torch.bool, device=anc.device)
    mask.scatter_(0, idx.reshape(-1), anc.reshape(-1))
    return mask


def verify_layout(parents, depth, seq_lens, mask_len: int) -> VerifyLayout:
    """Everything SGLang's tree verify reads, from a parent array and node depths."""
    torch = _torch()
    b, n = check_parents(parents)
    if tuple(depth.shape) != (b, n):
        raise ValueError(f"depth must be [b, N] = {(b, n)}, got {tuple(depth.shape)}")
    if tuple(seq_lens.shape) != (b,):
        raise ValueError(f"seq_lens must be [b] = {(b,)}, got {tuple(seq_lens.shape)}")
    anc = ancestor_mask(parents)
    ri, nt, ns = retrieve_links(parents)
    positions = (seq_lens.to(device=parents.device, dtype=torch.int64)[:, None] + depth).reshape(-1)
    return VerifyLayout(full_mask(anc, seq_lens, mask_len), positions, ri, nt, ns)


# ------------------------------------------------------------------------- acceptance, compaction

def verify_buffers(bs: int, n: int, device):
    """(predicts int32 [bs*N], accept_index int32 [bs, N] = -1, accept_token_num int32 [bs]): the
    mutable outputs ``verify_tree_greedy`` fills, in the dtypes ``eagle_sample`` passes."""
    torch = _torch()
    return (torch.zeros(bs * n, dtype=torch.int32, device=device),
            torch.full((bs, n), -1, dtype=torch.int32, device=device),
            torch.zeros(bs, dtype=torch.int32, device=device))


def accept_outputs(candidates, predicts, accept_index, accept_num, prefix_lens):
    """``_accept_block``'s (accept_len int32, commit_lens int32, bonus int64, out_tokens int64
    [bs, N], new_seq_lens) from the tree verify. ``out_tokens[b, :a+1]`` are the accepted path's
    tokens then the bonus; past that, like stock's ``_commit_accept``, the remaining drafts
    (``candidates[b, a+2:]``, never read) and 0 last. A chain tree gives stock's values exactly."""
    torch = _torch()
    bs, n = candidates.shape
    a = accept_num.to(torch.int64)
    width = accept_index.shape[1]
    path = predicts.to(torch.int64)[accept_index.to(torch.int64).clamp(min=0).reshape(-1)].view(bs, width)
    out = torch.zeros((bs, n), dtype=torch.int64, device=candidates.device)
    out[:, :-1] = candidates[:, 1:]
    cols = torch.arange(n, dtype=torch.int64, device=candidates.device)
    keep = cols[None, :width] <= a[:, None]
    out[:, :width] = torch.where(keep, path, out[:, :width])
    bonus = out.gather(1, a[:, None])[:, 0]
    commit = accept_num.to(torch.int32) + 1
    return accept_num.to(torch.int32), commit, bonus, out, prefix_lens + commit.to(prefix_lens.dtype)


def kv_move_pairs(write_ids, accept_index, accept_num):
    """(tgt, src) int64 [bs * N]: slot k of request b's verify window receives the K/V of accepted
    node ``accept_index[b, k]`` (global ``b * N + i``) for k <= accept_num[b]; other pairs are
    identity moves. Safe for in-place moves applied all at once (gather then scatter), in
    request-major ascending chunks, or one pair at a time in order: a pair never reads a slot an
    earlier pair wrote (a path's node index at depth k is >= k)."""
    torch = _torch()
    bs, n = accept_index.shape
    w = write_ids.to(torch.int64).reshape(bs, n)
    local = accept_index.to(torch.int64) - torch.arange(bs, dtype=torch.int64, device=w.device)[:, None] * n
    cols = torch.arange(n, dtype=torch.int64, device=w.device)
    live = cols[None, :] <= accept_num.to(torch.int64)[:, None]
    src = torch.where(live, w.gather(1, torch.where(live, local, cols[None, :]).clamp(0, n - 1)), w)
    return w.reshape(-1), src.reshape(-1)


def compact_to_front(x, accept_index, bs: int, n: int):
    """Rows ``x[b*N + k] = x[accept_index[b, k]]`` for every column k of ``accept_index`` (a padding
    -1 gathers row 0; it lands past the accepted length and is never read); other rows unchanged.
    The contract of SGLang's ``eagle_worker_common._compact_accept_to_front``."""
    torch = _torch()
    width = accept_index.shape[1]
    gathered = x[accept_index.to(torch.int64).clamp(min=0).reshape(-1)]
    out = x.clone()
    out.view(bs, n, *x.shape[1:])[:, :width] = gathered.view(bs, width, *x.shape[1:])
    return out
