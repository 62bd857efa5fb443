"""The tree bundle against SGLang 0.5.23's own code, run on CPU.

SGLang's EAGLE top-k expansion (``_select_top_k_tokens_first/_later``), ``organize_draft_results``
and its Triton tree-building / greedy-verify kernels are compiled from the installed wheel's source
(the Triton kernels under ``TRITON_INTERPRET=1``) and fed the same inputs as SpecPilot's versions.
"""

from __future__ import annotations

import os

import pytest

from sglang_support import SKIP_REASON, load_sglang_function, sglang_dir

SGL = sglang_dir()
pytestmark = pytest.mark.skipif(SGL is None, reason=SKIP_REASON)

torch = pytest.importorskip("torch")
SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"


@pytest.fixture(scope="module")
def sgl():
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, below
    import enum

    import triton
    import triton.language as tl

    ns = {"torch": torch, "triton": triton, "tl": tl, "IntEnum": enum.IntEnum,
          "maybe_detect_oob": lambda *a, **k: None, "Optional": __import__("typing").Optional}
    f = {}
    f["fast_topk"] = load_sglang_function(SGL, "sglang.srt.utils.common", "fast_topk", ns)
    for name in ("_select_top_k_tokens_first", "_select_top_k_tokens_later"):
        f[name] = load_sglang_function(SGL, "sglang.srt.speculative.spec_utils", name, ns)
    f["organize"] = load_sglang_function(SGL, "sglang.srt.speculative.eagle_utils", "organize_draft_results", ns)
    f["TreeMaskMode"] = load_sglang_function(SGL, SPEC_TREE, "TreeMaskMode", ns)
    for name in ("sgl_build_tree_kernel_efficient_triton", "verify_tree_greedy_kernel_triton"):
        load_sglang_function(SGL, SPEC_TREE, name, ns, keep_decorators=True)
    f["build"] = load_sglang_function(SGL, SPEC_TREE, "sgl_build_tree_kernel_triton", ns)
    f["verify"] = load_sglang_function(SGL, SPEC_TREE, "verify_tree_greedy_triton", ns)
    return f


def eagle_draft(sgl, bs, topk, steps, gen, ties=False):
    """score_list / token_list / parents_list exactly as SGLang's EAGLE draft loop builds them."""
    vocab = 50
    score_list, token_list, parents_list = [], [], []
    scores = None
    for i in range(steps):
        rows = bs if i == 0 else bs * topk
        logits = torch.randn(rows, vocab, generator=gen)
        if ties:  # a confident drafter: many children with probability exactly 1
            sure = torch.rand(rows, generator=gen) < 0.5
            logits[sure] = -1e4
            logits[sure, 0] = 0.0
        probs = torch.softmax(logits, -1)
        topk_p, topk_index = torch.topk(probs, topk, dim=-1)
        if i == 0:
            _, _, scores, info = sgl["_select_top_k_tokens_first"](topk_p, topk_index, None, topk)
        else:
            _, _, scores, info = sgl["_select_top_k_tokens_later"](i, topk_p, topk_index, None, scores, topk)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
    return score_list, token_list, parents_list


def test_organize_draft_results_same_contract_and_values(sgl):
    from specpilot.bundles.tree import organize_draft_results

    gen = torch.Generator().manual_seed(0)
    for bs, topk, steps, n in [(1, 1, 3, 4), (2, 4, 5, 16), (3, 8, 4, 32), (2, 2, 1, 3)]:
        inputs = eagle_draft(sgl, bs, topk, steps, gen)
        want = sgl["organize"](*inputs, n)
        got = organize_draft_results(*inputs, n)
        for w, g in zip(want, got):
            assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device
            assert g.is_contiguous() == w.is_contiguous()
            assert torch.equal(g, w)


def test_prefix_closed_under_ties(sgl):
    from specpilot.bundles.tree import eagle_parents, organize_draft_results

    gen = torch.Generator().manual_seed(1)
    topk, broken_stock = 4, 0
    for _ in range(8):
        inputs = eagle_draft(sgl, 2, topk, 5, gen, ties=True)
        pl, sel, _ = organize_draft_results(*inputs, 12)
        assert all(p != -2 for row in eagle_parents(pl, sel, topk) for p in row)
        spl, ssel, _ = sgl["organize"](*inputs, 12)
        broken_stock += sum(p == -2 for row in eagle_parents(spl, ssel, topk) for p in row)
    # stock's torch.topk is free to drop a tied parent; ours never does (asserted above)
    print(f"orphan nodes in stock's selections over 8 tie-heavy drafts (bs 2, topk 4, 5 steps, 11 nodes): {broken_stock}")


def _sglang_layout(sgl, parent_list, sel, seq_lens, topk, steps, n, mode):
    bs = seq_lens.numel()
    if mode == 0:
        mask = torch.full((int(seq_lens.sum()) * n + n * n * bs,), True, dtype=torch.bool)
    else:
        mask = torch.full((n * bs * n,), True, dtype=torch.bool)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty(bs * n, dtype=torch.long)
    sgl["build"](parent_list, sel, seq_lens, mask, positions, retrieve[0], retrieve[1], retrieve[2],
                 topk, steps, n, sgl["TreeMaskMode"](mode))
    return mask, positions, retrieve[0], retrieve[1], retrieve[2]


@pytest.mark.parametrize("mode", [0, 1])
def test_layout_equals_sglang_kernel(sgl, mode):
    from specpilot.bundles.tree import eagle_parents, organize_draft_results
    from specpilot.bundles.tree_layout import build_verify_layout

    gen = torch.Generator().manual_seed(2)
    topk, steps, n = 3, 4, 8
    inputs = eagle_draft(sgl, 2, topk, steps, gen)
    pl, sel, _ = organize_draft_results(*inputs, n)
    seq_lens = torch.tensor([5, 9])
    want = _sglang_layout(sgl, pl, sel, seq_lens, topk, steps, n, mode)
    got = build_verify_layout(eagle_parents(pl, sel, topk), seq_lens, mode)
    names = ("tree_mask", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")
    for name, w, g in zip(names, want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


def test_verify_greedy_equals_sglang_kernel(sgl):
    from specpilot.bundles.tree import eagle_parents, organize_draft_results
    from specpilot.bundles.tree_layout import build_verify_layout, verify_greedy

    gen = torch.Generator().manual_seed(3)
    topk, steps, n, bs = 2, 4, 7, 2
    score_list, token_list, parents_list = eagle_draft(sgl, bs, topk, steps, gen)
    pl, sel, draft = organize_draft_results(score_list, token_list, parents_list, n)
    _, _, ri, nt, ns = build_verify_layout(eagle_parents(pl, sel, topk), [4, 6])
    candidates = torch.cat([torch.full((bs, 1), 7), draft], dim=1)
    for trial in range(4):
        # targets that follow the tree for a while, then diverge
        target = candidates.clone()
        if trial:
            target = torch.where(torch.rand(bs, n, generator=gen) < 0.3, torch.full_like(target, 99), target)
        target_predict = torch.zeros(bs, n, dtype=torch.long)
        for b in range(bs):
            for i in range(n):
                kid = int(nt[b, i])
                target_predict[b, i] = target[b, kid] if kid != -1 else 5
        want = (torch.zeros(bs * n, dtype=torch.long), torch.full((bs, steps + 1), -1, dtype=torch.long),
                torch.zeros(bs, dtype=torch.long))
        sgl["verify"](want[0], want[1], want[2], candidates, ri, nt, ns, target_predict)
        got = verify_greedy(candidates, ri, nt, ns, target_predict, steps + 1)
        for w, g in zip(want, got):
            assert torch.equal(g, w)


def test_lattice_tree_verified_by_sglang_accepts_replay_tau(sgl):
    """A best-first tree over a DFlash2-style lattice, laid out for SGLang and verified by its
    kernel, accepts exactly what specpilot.kernels.tree's replay acceptance says."""
    ktree = pytest.importorskip("specpilot.kernels.tree")
    from specpilot.bundles.tree import lattice_tree, lattice_verify_inputs

    gen = torch.Generator().manual_seed(4)
    m, k, budget, bs = 5, 3, 9, 2
    trees, targets, lattices = [], [], []
    for b in range(bs):
        tokens = torch.randint(0, 40, (m, k), generator=gen).tolist()
        logp = torch.log_softmax(torch.randn(m, k, generator=gen), -1).tolist()
        trans = torch.log_softmax(torch.randn(m - 1, k, k, generator=gen), -1).tolist()
        lattices.append((tokens, logp, trans))
        trees.append(lattice_tree(tokens, logp, trans, budget))
        targets.append([tokens[i][0] if i < 3 - b else 999 for i in range(m)] + [123])
    draft, mask, pos, ri, nt, ns = lattice_verify_inputs(trees, anchors=[1, 2], seq_lens=[10, 20])
    n = budget + 1
    cand = draft.view(bs, n)
    target_predict = torch.zeros(bs, n, dtype=torch.long)
    for b, (parents, toks) in enumerate(trees):
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        for i in range(n):
            target_predict[b, i] = targets[b][depth[i]]  # the target's next token after node i's path
    out = (torch.zeros(bs * n, dtype=torch.long), torch.full((bs, m + 1), -1, dtype=torch.long),
           torch.zeros(bs, dtype=torch.long))
    sgl["verify"](*out, cand, ri, nt, ns, target_predict)
    accepted = []
    for b in range(bs):
        tree = ktree.build_best_first(*lattices[b], budget)
        path, _ = ktree.accept_greedy(tree, targets[b])
        assert int(out[2][b]) == len(path)
        accepted.append(len(path))
    assert max(accepted) > 0  # the check exercised real acceptance, not just empty paths
