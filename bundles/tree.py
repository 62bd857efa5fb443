"""Bundle ``tree``: best-first, prefix-closed draft trees in SGLang's verify layout.

EAGLE (SGLang 0.5.23 ``eagle_utils.organize_draft_results``) keeps the ``num_draft_token - 1``
candidates with the highest cumulative path score via ``torch.topk``. Path scores only fall along
a path, so that is a best-first tree over EAGLE's expansions, except under ties: ``topk`` may keep
a child and drop its equal-scored parent, and SGLang's tree kernel then finds no parent for that
node. The REPLACE hook below returns the same contract (``parent_list`` [b, (steps-1)*topk + 1],
``top_scores_index`` [b, N-1] sorted int64, ``draft_tokens`` [b, N-1]) from a stable order: score
descending, then flat index (which orders depth), so a parent always precedes its children.

For DFlash2 lattices (``CandidateSelector.build_lattice``), :func:`lattice_tree` keeps the N nodes
with the highest parent-conditioned path score (``specpilot.kernels.tree.build_best_first``) and
:func:`lattice_verify_inputs` lays it out for SGLang's tree verifier (:mod:`.tree_layout`).
"""

from __future__ import annotations


def eagle_candidates(topk: int, steps: int) -> int:
    """The draft tokens EAGLE's ``steps`` steps of ``topk`` expansions offer (the tree's nodes are
    chosen among them): ``topk`` at the first step, ``topk * topk`` at each later one."""
    return topk + (steps - 1) * topk * topk


def settings_problem(settings: dict, drafter: str | None) -> str | None:
    """Why the node budget cannot be met by EAGLE's steps and top-k (SGLang's stock selection
    fails when it asks for more nodes than the steps drafted; so does this one)."""
    if drafter not in (None, "eagle", "eagle3"):
        return None
    budget, topk, steps = settings["node_budget"], settings["eagle_topk"], settings["eagle_steps"]
    have = eagle_candidates(topk, steps)
    if budget - 1 > have:
        return (f"node_budget={budget} needs {budget - 1} draft tokens, but eagle_steps={steps} x eagle_topk={topk} "
                f"draft {have}; raise eagle_steps or eagle_topk, or lower node_budget")
    return None


def organize_draft_results(score_list, token_list, parents_list, num_draft_token):
    """REPLACE for ``sglang.srt.speculative.eagle_utils.organize_draft_results``."""
    import torch

    scores = torch.cat(score_list, dim=1).flatten(1)          # b, topk + (steps-1)*topk*topk
    if num_draft_token - 1 > scores.shape[1]:   # stock's torch.topk fails here too: never fewer nodes
        raise RuntimeError(f"organize_draft_results: {num_draft_token - 1} draft tokens asked of "
                           f"{scores.shape[1]} candidates (--speculative-num-draft-tokens above what "
                           "--speculative-num-steps and --speculative-eagle-topk draft)")
    ss_token_list = torch.cat(token_list, dim=1)
    # Flat candidates are laid out depth by depth (EAGLE's steps), so a stable sort on the score
    # breaks ties towards the shallower node: a parent always precedes its equal-scored child.
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    chosen = order[:, : num_draft_token - 1]
    top_scores_index = torch.sort(chosen, dim=1).values
    draft_tokens = torch.gather(ss_token_list, index=top_scores_index, dim=1)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(parents_list[0].shape[0], 0, dtype=torch.long, device=parents_list[0].device)
    return parent_list, top_scores_index, draft_tokens


def eagle_parents(parent_list, top_scores_index, topk: int):
    """The parent array (root = 0) SGLang's tree kernel derives from EAGLE's selection; -2 marks a
    node whose parent was not selected (a broken tree)."""
    out = []
    for pl, sel in zip(parent_list.tolist(), top_scores_index.tolist()):
        pos = {s: i + 1 for i, s in enumerate(sel)}
        row = [-1]
        for s in sel:
            k = s // topk
            row.append(0 if k == 0 else pos.get(pl[k], -2))
        out.append(row)
    return out


def lattice_tree(tokens, logprobs, transitions, budget: int):
    """Best-first tree over one lattice step: (parents [N], node tokens [N]) with the root first.

    Node 0 is the root (the verified anchor); its token is filled by the caller. Uses the team's
    builder ``specpilot.kernels.tree.build_best_first``.
    """
    from specpilot.kernels.tree import build_best_first  # noqa: WPS433 (the mechanism lives there)

    tree = build_best_first(tokens, logprobs, transitions, budget)
    parents = [-1] + [p + 1 for p in tree.parents]  # builder: -1 = child of the root
    node_tokens = [None] + list(tree.tokens)
    return parents, node_tokens


def lattice_verify_inputs(trees, anchors, seq_lens, tree_mask_mode: int = 0):
    """SGLang verify inputs for a batch of trees of equal size (``lattice_tree`` outputs):
    (draft_tokens [bs*N], tree_mask, positions, retrieve_index, next_token, next_sibling)."""
    import torch

    from .tree_layout import build_verify_layout

    parents = [p for p, _ in trees]
    layout = build_verify_layout(parents, seq_lens, tree_mask_mode)
    draft = torch.tensor([[int(a)] + [int(t) for t in toks[1:]] for (_, toks), a in zip(trees, anchors)],
                         dtype=torch.long)
    return (draft.flatten(),) + tuple(layout)
