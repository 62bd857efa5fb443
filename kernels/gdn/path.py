"""GDN tree verification without per-node state snapshots, and commit by replay (paper 4.2).

Verification: every tree row walks its own root path from the committed state, one depth at a
time; all paths advance together, so peak memory is one working state per row, never a stored
snapshot per node. Commit: the accepted rows' (prepared) inputs are replayed from the committed
state with the same :func:`step`, so the result equals sequential decoding bit for bit.

Rows are the verifier's input rows: row 0 is the root (the pending token), rows 1..n the tree
nodes. ``paths[r, d]`` is the row index of row r's depth-d ancestor on its root path (row 0 at
depth 0, row r itself at its own depth), -1 beyond it.
"""

from __future__ import annotations

import torch

from .naive import step


def row_paths(parents_rows: list[int]) -> torch.Tensor:
    """paths [R, D] from each row's parent row (-1 for row 0)."""
    paths: list[list[int]] = []
    for r, p in enumerate(parents_rows):
        paths.append((paths[p] if p >= 0 else []) + [r])
    width = max((len(p) for p in paths), default=1)
    out = torch.full((len(paths), width), -1, dtype=torch.long)
    for r, p in enumerate(paths):
        out[r, :len(p)] = torch.tensor(p)
    return out


def random_parents(rows: int, seed: int, max_depth: int = 15) -> list[int]:
    """Parent rows of a random tree of ``rows`` rows (row 0 the root, -1), each row's parent drawn
    uniformly among the earlier rows of depth below ``max_depth``: verify-step layouts for the
    kernel checks of tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for r in range(1, rows):
        while True:
            p = int(torch.randint(0, r, (1,), generator=gen))
            if depth[p] < max_depth:
                break
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def path_verify(q, k, v, g, beta, state, paths):
    """Outputs of every row along its own root path. q,k [R,H,dk], v [R,H,dv], g,beta [R,H]
    (prepared), state [H,dk,dv] committed (not modified), paths [R, D]. Returns out [R,H,dv]."""
    R = q.shape[0]
    s = state.expand((R,) + tuple(state.shape)).clone()
    out = q.new_zeros(v.shape)
    lengths = (paths >= 0).sum(1)
    for d in range(paths.shape[1]):
        rows = torch.nonzero(lengths > d).flatten()
        if rows.numel() == 0:
            break
        a = paths[rows, d]
        s_new, o = step(s[rows], q[a], k[a], v[a], g[a], beta[a])
        s[rows] = s_new
        ends = lengths[rows] == d + 1  # rows whose own token sits at depth d take this output
        out[rows[ends]] = o[ends]
    return out


def commit(q, k, v, g, beta, state, accepted_rows):
    """Replay the accepted rows from the committed ``state``; returns the new state [H,dk,dv]."""
    s = state[None]
    for r in accepted_rows:
        s, _ = step(s, q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1])
    return s[0]


def conv_windows(paths: torch.Tensor, kernel: int) -> torch.Tensor:
    """Index [R, kernel] of each row's causal-conv window along its root path into
    ``cat(conv_state[-(kernel-1):], x_rows)``: entries < kernel-1 address the committed conv state."""
    R, D = paths.shape
    depth = (paths >= 0).sum(1)  # path length per row
    idx = torch.empty((R, kernel), dtype=torch.long)
    for j in range(kernel):
        pos = depth - kernel + j  # position along the path (negative: before the root, in the conv state)
        from_path = paths.gather(1, pos.clamp(min=0)[:, None])[:, 0] + (kernel - 1)
        idx[:, j] = torch.where(pos >= 0, from_path, pos + (kernel - 1))
    return idx


def chain_windows(T: int, kernel: int) -> torch.Tensor:
    """conv_windows for a plain sequence of T rows (prefill, AR, chain)."""
    r = torch.arange(T)[:, None]
    j = torch.arange(kernel)[None, :]
    return r + j  # (r - (kernel-1) + j) + (kernel - 1)


def causal_conv(x_rows, conv_state, windows, weight):
    """Depthwise causal conv + SiLU over gathered windows. x_rows [R, C], conv_state [kernel-1, C],
    windows [R, kernel] (from conv_windows / chain_windows), weight [C, kernel]. Returns [R, C]."""
    buf = torch.cat([conv_state.to(x_rows.dtype), x_rows], 0)
    win = buf[windows]  # [R, kernel, C]
    out = (win * weight.t()[None]).sum(1)
    return torch.nn.functional.silu(out)
