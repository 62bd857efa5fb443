"""The verify layout SGLang's tree verifier expects, built from a parent array (plain torch).

SGLang 0.5.23 builds it in ``build_tree_kernel_efficient`` (``sglang/kernels/ops/speculative/
spec_tree.py``) from EAGLE's ``(parent_list, top_scores_index)`` and verifies with
``verify_tree_greedy``. A tree here is ``parents[b][i]`` for nodes ``i = 0..N-1``: node 0 is the
root (the bonus/anchor token, ``parents[b][0] = -1``), every other node's parent has a smaller
index. The outputs match the kernel's contract exactly (checked in the tests against SGLang's own
Triton kernel, interpreted on CPU):

* ``retrieve_index[b, i] = b * N + i`` (int64, [bs, N]);
* ``retrieve_next_token[b, p]`` = the smallest-index child of p, -1 if none (int64, [bs, N]);
* ``retrieve_next_sibling[b, i]`` = the next larger-index child of i's parent, -1 if none;
* ``positions[b * N + i] = seq_lens[b] + depth(i)`` (int64, [bs * N]);
* ``tree_mask`` (bool): FULL_MASK rows of ``seq_len + N`` per node (prefix True, then ancestor-or-
  self over the N nodes), batch after batch; QLEN_ONLY: the N x N ancestor-or-self block per batch.
"""

from __future__ import annotations

FULL_MASK, QLEN_ONLY = 0, 1


def check_parents(parents) -> None:
    for b, row in enumerate(parents):
        if not row or row[0] != -1:
            raise ValueError(f"tree {b}: node 0 must be the root (parent -1)")
        for i, p in enumerate(row[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"tree {b}: node {i} has parent {p}; parents must precede their children")


def ancestor_mask(parents):
    """[bs, N, N] bool: mask[b, i, j] = j is i or an ancestor of i."""
    import torch

    bs, n = len(parents), len(parents[0])
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b, row in enumerate(parents):
        for i in range(n):
            j = i
            while j != -1:
                mask[b, i, j] = True
                j = row[j]
    return mask


def depths(parents):
    out = []
    for row in parents:
        d = [0] * len(row)
        for i in range(1, len(row)):
            d[i] = d[row[i]] + 1
        out.append(d)
    return out


def build_verify_layout(parents, seq_lens, tree_mask_mode: int = FULL_MASK, device=None):
    """(tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling)."""
    import torch

    check_parents(parents)
    bs, n = len(parents), len(parents[0])
    if any(len(r) != n for r in parents):
        raise ValueError("every request's tree must have the same node count (pad with the budget)")
    seq = [int(s) for s in (seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens)]
    retrieve_index = torch.arange(bs * n, dtype=torch.long).view(bs, n)
    next_token = torch.full((bs, n), -1, dtype=torch.long)
    next_sibling = torch.full((bs, n), -1, dtype=torch.long)
    for b, row in enumerate(parents):
        for i in range(n - 1, 0, -1):  # reverse, so the first child is the smallest index
            p = row[i]
            if next_token[b, p] != -1:
                next_sibling[b, i] = next_token[b, p]
            next_token[b, p] = i
    dep = torch.tensor(depths(parents), dtype=torch.long)
    positions = (dep + torch.tensor(seq, dtype=torch.long)[:, None]).flatten()
    anc = ancestor_mask(parents)
    if tree_mask_mode == FULL_MASK:
        chunks = []
        for b in range(bs):
            rows = torch.cat([torch.ones(n, seq[b], dtype=torch.bool), anc[b]], dim=1)
            chunks.append(rows.flatten())
        tree_mask = torch.cat(chunks)
    elif tree_mask_mode == QLEN_ONLY:
        tree_mask = anc.flatten()
    else:
        raise ValueError(f"tree mask mode {tree_mask_mode} is not supported (FULL_MASK=0, QLEN_ONLY=1)")
    out = (tree_mask, positions, retrieve_index, next_token, next_sibling)
    return tuple(t.to(device) for t in out) if device is not None else out


def verify_greedy(candidates, retrieve_index, next_token, next_sibling, target_predict, num_speculative_tokens):
    """Plain-torch twin of SGLang's ``verify_tree_greedy``: (predicts, accept_index, accept_token_num).

    ``candidates`` [bs, N] token per node, ``target_predict`` [bs, N] the target's argmax after
    each node. Walks from the root, at each level taking the first child (in sibling order) whose
    token equals the target's prediction at the last accepted node.
    """
    import torch

    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.long)
    accept_index = torch.full((bs, num_speculative_tokens), -1, dtype=torch.long)
    accept_num = torch.zeros(bs, dtype=torch.long)
    flat_target = target_predict.flatten()
    for b in range(bs):
        last = int(retrieve_index[b, 0])
        accept_index[b, 0] = last
        cur, k = 0, 0
        for _ in range(1, num_speculative_tokens):
            cur = int(next_token[b, cur])
            target = int(flat_target[last])
            matched = False
            while cur != -1:
                if int(candidates[b, cur]) == target:
                    predicts[last] = target
                    k += 1
                    accept_index[b, k] = int(retrieve_index[b, cur])
                    last = int(retrieve_index[b, cur])
                    matched = True
                    break
                cur = int(next_sibling[b, cur])
            if not matched:
                break
        accept_num[b] = k
        predicts[last] = int(flat_target[last])
    return predicts, accept_index, accept_num
