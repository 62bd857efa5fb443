"""Step assembly: the rows of every request of a step as one :class:`BatchStepInput`.

A request contributes a :class:`Rows` block: its tokens at cache positions ``cslots`` of its slot
and rope positions ``pos``, attending to its slot's committed positions ``0 .. n_ctx - 1`` and to
the block's rows that ``local`` allows (a verify block: the pending token and each node's
ancestors; a prefill chunk: causal). :func:`assemble` lays the blocks out one after another
(eager steps) or, with ``pad=(B, N)``, as B requests x N rows (CUDA-graph buckets): padding rows
come after a request's rows (cache positions past them, attending position 0 only, predictions
dropped) and padding requests take the free slots after the running ones. A slot's padding rows
write past what the slot holds (at the start of a free slot): the attention walks a slot's cache up
to the highest position its rows write, so padding costs what the slot holds, not the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specpilot.engine.batch.drafting import kv_len
from specpilot.engine.step_input import BatchStepInput, Segment


@dataclass
class Rows:
    slot: int
    tokens: list[int]
    pos: list[int]
    cslots: list[int]
    n_ctx: int
    local: np.ndarray                 # bool [rows, rows]: row i attends row j
    gdn_rows: str = "seq"
    paths: torch.Tensor | None = None
    need: tuple[int, ...] = ()        # rows whose argmax the step returns

    def __len__(self) -> int:
        return len(self.tokens)


def verify_rows(slot: int, pending: int, tree, n_cache: int, gdn_rows: str, paths=None) -> Rows:
    """Row 0 = the pending token at ``n_cache``, rows 1.. = the tree's nodes after it."""
    from specpilot.kernels import tree as treelib

    T = 1 + len(tree)
    local = np.zeros((T, T), dtype=bool)
    local[:, 0] = True
    if len(tree):
        local[1:, 1:] = treelib.ancestor_mask(tree)
    local[0, 0] = True
    return Rows(slot, [pending] + list(tree.tokens), [n_cache] + [n_cache + 1 + d for d in tree.depth],
                list(range(n_cache, n_cache + T)), n_cache, local, gdn_rows, paths, tuple(range(T)))


def prefill_rows(slot: int, prompt: list[int], a: int, b: int, last: bool) -> Rows:
    """Prompt tokens ``a .. b-1`` (causal); the argmax of the chunk's last row when ``last``."""
    n = b - a
    return Rows(slot, list(prompt[a:b]), list(range(a, b)), list(range(a, b)), a, np.tril(np.ones((n, n), dtype=bool)),
                "seq", None, (n - 1,) if last else ())


def assemble(blocks: list[Rows], max_seq: int, device, pad: tuple[int, int] | None = None,
             dump: int | None = None, prompt: tuple[Rows, int] | None = None, held: dict[int, int] | None = None
             ) -> tuple[BatchStepInput, int, list[list[int]]]:
    """The step's input, its kv_len and, per block, the step rows of its ``need`` rows.

    ``pad=(B, N)``: the layout of CUDA-graph bucket (B, N): slot b's rows at ``b*N``; every block
    must be of a slot below B with at most N rows. Slots below B without a block (free, or a request
    prefilling) get N padding rows, attending position 0 only. ``held`` gives per slot the first
    cache position past what it holds (0 for a free slot; a request's committed or prefilled
    length): the padding rows write there (in a mixed step's chunk slot, past the chunk's own
    padding), so the attention's walk, which ends at the highest position a slot's rows write,
    reads only what the slot holds. Slots ``held`` leaves out, or whose rows would pass the cache's
    end, write at its last N positions. Either way nothing live is overwritten: a slot's positions
    past what it holds are written before they are read. With ``dump`` (a hybrid's spare cache
    slot) the padding rows write there instead, at the same positions (their GDN rows advance a
    state). ``prompt=(block, P)`` (with ``pad``: mixed bucket (B, N, P)): a prompt chunk's rows
    after the B x N rows, padded to P rows (cache positions past the chunk, attending position 0
    only: :func:`fits_mixed` leaves N positions of the cache after them); its ``need`` rows come
    last in the result."""
    if pad is None:
        width = kv_len(max_seq, max(max(b.cslots[-1] + 1, b.n_ctx) for b in blocks))
        layout = [(b, len(b)) for b in blocks]
    else:
        width = max_seq
        B, N = pad
        by_slot = {b.slot: b for b in blocks}
        layout = [(by_slot.get(s, s), N) for s in range(B)]
        if prompt is not None:
            layout.append(prompt)
            blocks = list(blocks) + [prompt[0]]
    T = sum(n for _, n in layout)
    tokens = np.zeros(T, dtype=np.int64)
    pos = np.zeros(T, dtype=np.int64)
    cs = np.zeros(T, dtype=np.int64)
    req = np.zeros(T, dtype=np.int64)
    mask = np.zeros((T, width), dtype=bool)
    segs, need, where = [], [], {}
    r = 0
    for blk, n in layout:
        if isinstance(blk, int):   # a slot without rows in this step
            req[r:r + n] = blk if dump is None else dump
            at = max_seq - n if held is None else held.get(blk, max_seq - n)
            if prompt is not None and blk == prompt[0].slot:   # past the chunk's rows and its padding
                at = prompt[0].cslots[-1] + 1 + prompt[1] - len(prompt[0])
            cs[r:r + n] = min(at, max_seq - n) + np.arange(n)
            mask[r:r + n, 0] = True
            segs.append(Segment(blk, r, n))
            r += n
            continue
        k = len(blk)
        tokens[r:r + k] = blk.tokens
        pos[r:r + k] = blk.pos
        cs[r:r + k] = blk.cslots
        req[r:r + n] = blk.slot
        mask[r:r + k, :blk.n_ctx] = True
        cols = np.asarray(blk.cslots)
        for i in range(k):
            mask[r + i, cols[blk.local[i]]] = True
        if n > k:   # padding rows after the request's own
            pos[r + k:r + n] = blk.n_ctx
            cs[r + k:r + n] = blk.cslots[-1] + 1 + np.arange(n - k)
            mask[r + k:r + n, 0] = True
        segs.append(Segment(blk.slot, r, n, blk.gdn_rows, blk.paths))
        where[id(blk)] = [r + i for i in blk.need]
        r += n
    need = [where[id(b)] for b in blocks]
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return BatchStepInput(t(tokens), t(pos), t(cs), t(req), t(mask), segs), width, need


def fits_mixed(pblock: Rows, P: int, N: int, max_seq: int) -> bool:
    """Whether prompt chunk ``pblock`` goes into a mixed bucket's P prompt rows (:func:`assemble`'s
    ``prompt``) with ``N`` positions of the cache left after its padding rows, where the bucket's
    padding rows for the request's own slot write."""
    return len(pblock) <= P and pblock.cslots[-1] + 1 + P - len(pblock) <= max_seq - N
