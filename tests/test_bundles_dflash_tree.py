"""DFLASH tree verify (``tree`` bundle, hooks H0-H5) against SGLang 0.5.23's own code, on CPU.

SGLang's functions are compiled from the installed wheel's source (``load_sglang_function``); its
Triton kernels (``verify_tree_greedy``, ``reconstruct_indices_from_tree_mask``, the cache-loc
kernels of ``move_accept_tokens_to_target_kvcache``) run under ``TRITON_INTERPRET=1``. The builder
is compared with ``specpilot.kernels.tree``'s heap builder, the layout with
``tree_layout.build_verify_layout``; a toy RoPE transformer checks that each node's masked logits
are the causal logits of its root path, and a toy worker driven through SGLang's real
``HookRegistry`` decodes exactly the toy target's greedy continuation with and without the hooks.
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace
from typing import List, Optional

import pytest

from sglang_support import SKIP_REASON, fresh_hook_registry, load_sglang_function, sglang_dir

torch = pytest.importorskip("torch")

from specpilot.bundles import dflash_tree as dt  # noqa: E402
from specpilot.bundles import dflash_tree_hooks as hk  # noqa: E402
from specpilot.bundles.tree_layout import build_verify_layout, verify_greedy  # noqa: E402
from specpilot.kernels.tree import build_best_first  # noqa: E402

SGL = sglang_dir()
SPEC = "sglang.kernels.ops.speculative"
WORKER = "sglang.srt.speculative.dflash_worker_v2"
SECOND = 0.3  # the toy drafter ranks the target's own next token just below its favourite
SITES = SimpleNamespace(DFLASH_SELECTOR="selector", DFLASH_ACCEPT_GREEDY="accept-greedy",
                        DFLASH_ACCEPT_SAMPLE="accept-sample")


def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@pytest.fixture(scope="module")
def sgl():
    if SGL is None:
        pytest.skip(SKIP_REASON)
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, below
    import logging

    import triton
    import triton.language as tl

    ns = {"torch": torch, "triton": triton, "tl": tl, "F": torch.nn.functional, "Tuple": tuple, "List": List,
          "Optional": Optional, "next_power_of_2": _p2, "_is_cpu": False, "maybe_detect_oob": lambda *a, **k: None,
          "SIMULATE_ACC_LEN": 0, "SpecTpSyncSite": SITES, "is_dflash_sampling_verify_available": lambda: False,
          "logger": logging.getLogger("sglang-under-test")}

    def load(module, name, keep=False):
        return load_sglang_function(SGL, module, name, ns, keep_decorators=keep)

    f = {}
    load(f"{SPEC}.spec_tree", "verify_tree_greedy_kernel_triton", keep=True)
    f["verify"] = load(f"{SPEC}.spec_tree", "verify_tree_greedy_triton")
    load(f"{SPEC}.reconstruct_tree", "_reconstruct_tree_mask_kernel", keep=True)
    load(f"{SPEC}.reconstruct_tree", "_num_warps_for")
    f["reconstruct"] = load(f"{SPEC}.reconstruct_tree", "reconstruct_indices_from_tree_mask_triton")
    load(f"{SPEC}.cache_locs", "assign_extend_cache_locs", keep=True)
    f["fill_front"] = load(f"{SPEC}.cache_locs", "fill_front_out_cache_loc_func")
    load(f"{SPEC}.eagle", "fill_accept_out_cache_loc", keep=True)
    f["fill_accept"] = load(f"{SPEC}.eagle", "fill_accept_out_cache_loc_func")
    f["compact"] = load("sglang.srt.speculative.eagle_worker_common", "_compact_accept_to_front")
    f["move_native"] = load("sglang.srt.mem_cache.memory_pool", "move_kv_cache_native")
    f["dflash_accept"] = load(f"{SPEC}.dflash", "compute_dflash_correct_drafts_and_bonus")
    f["commit_accept"] = load(WORKER, "_commit_accept")
    load(WORKER, "_is_all_greedy")
    f["accept_block"] = load(WORKER, "DFlashWorkerV2._accept_block")
    load("sglang.srt.models.dflash", "_score_edges")
    load("sglang.srt.models.dflash", "_follow_maps")
    f["build_lattice"] = load("sglang.srt.models.dflash", "CandidateSelector.build_lattice")
    f["sample_path"] = load("sglang.srt.models.dflash", "CandidateSelector.sample_path")
    return f


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    from specpilot.bundles import plugin

    monkeypatch.setattr(plugin, "registered", lambda: [])  # other tests may have registered lattice-trace
    hk._state.update(disabled=False, steps=0, skipped={})
    yield
    hk._state.update(disabled=False, steps=0, skipped={})


def _lattice(gen, b, m, k, ties=False, dtype=torch.float64, vocab=60):
    scores = (torch.randint(0, 3, (b, m, k, k), generator=gen).to(dtype) if ties
              else torch.randn(b, m, k, k, generator=gen, dtype=dtype))
    return scores, torch.randint(0, vocab, (b, m, k), generator=gen)


def _heap_tree(scores, cand, n, r):
    logp0, trans = dt.lattice_logprobs(scores)
    m, k = cand.shape[1], cand.shape[2]
    logprobs = [logp0[r].tolist()] + [[0.0] * k for _ in range(m - 1)]  # unused with transitions
    return build_best_first(cand[r].tolist(), logprobs, trans[r].tolist(), n - 1)


def _assert_prefix_closed(tree, n):
    par, dep, sc = tree.parents, tree.depth, tree.score
    assert par.shape == dep.shape == sc.shape == (par.shape[0], n) and tree.tokens.shape == (par.shape[0], n - 1)
    assert par.dtype == dep.dtype == torch.int64
    assert torch.all(par[:, 0] == -1) and torch.all(dep[:, 0] == 0)
    idx = torch.arange(1, n)
    assert torch.all((par[:, 1:] >= 0) & (par[:, 1:] < idx)), "a parent must precede its child"
    assert torch.equal(dep[:, 1:], dep.gather(1, par[:, 1:]) + 1)


# --------------------------------------------------------------------------------------- builder

@pytest.mark.parametrize("ties", [False, True])
def test_builder_equals_the_heap_builder(ties):
    """Same nodes, order, parents, tokens and scores as specpilot.kernels.tree's best-first heap,
    ties included (float64, identical additions)."""
    gen = torch.Generator().manual_seed(10 + ties)
    checked = 0
    for _ in range(60):
        m, k, n = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 9), (1, 6), (2, 18)))
        if sum(dt.beam_widths(m, k, n - 1)) < n - 1:
            continue
        scores, cand = _lattice(gen, 3, m, k, ties=ties)
        tree = dt.build_tree(scores, cand, n)
        _assert_prefix_closed(tree, n)
        for r in range(3):
            ref = _heap_tree(scores, cand, n, r)
            assert tree.parents[r, 1:].tolist() == [p + 1 for p in ref.parents]
            assert tree.tokens[r].tolist() == list(ref.tokens)
            assert tree.depth[r, 1:].tolist() == [d + 1 for d in ref.depth]
            assert tree.score[r, 1:].tolist() == list(ref.score)
            checked += 1
    assert checked > 100


def test_builder_float32_nonfinite_and_chain():
    gen = torch.Generator().manual_seed(11)
    scores, cand = _lattice(gen, 4, 7, 4, dtype=torch.float32)
    scores[0, 2] = float("-inf")        # a dead edge: every child of depth 2 has path score -inf
    scores[1, 0, 0, 1] = float("nan")   # NaN counts as -inf
    scores[2] = float("-inf")
    tree = dt.build_tree(scores, cand, 8)
    _assert_prefix_closed(tree, 8)
    assert tree.score.dtype == torch.float32 and tree.tokens.dtype == cand.dtype
    assert torch.all(tree.score[3, 1:] <= 0) and torch.all(tree.score[3, 1:].diff() <= 0)
    # K = 1 leaves one tree: the chain, in the order stock walks it
    scores1, cand1 = _lattice(gen, 2, 5, 1)
    tree1 = dt.build_tree(scores1, cand1, 6)
    assert tree1.parents.tolist() == [[-1, 0, 1, 2, 3, 4]] * 2
    assert torch.equal(tree1.tokens, dt.greedy_path(scores1, cand1))


@pytest.mark.parametrize("args, message", [
    (lambda: (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.long), 4), "must be \\[b, m, K, K\\]"),
    (lambda: (torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, dtype=torch.long), 4), "square per edge"),
    (lambda: (torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 5, dtype=torch.long), 4), "candidate ids must be"),
    (lambda: (torch.zeros(2, 3, 4, 4, dtype=torch.long), torch.zeros(2, 3, 4, dtype=torch.long), 4),
     "floating point"),
    (lambda: (torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4, dtype=torch.long), 1), "at least 2 nodes"),
    (lambda: (torch.zeros(2, 2, 1, 1), torch.zeros(2, 2, 1, dtype=torch.long), 5), "fewer than 4 nodes"),
])
def test_bad_lattice_raises_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        dt.build_tree(*args(), )


def test_bad_layout_input_raises_clear_errors():
    with pytest.raises(ValueError, match="parents must be \\[b, N\\]"):
        dt.retrieve_links(torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="depth must be"):
        dt.verify_layout(torch.tensor([[-1, 0]]), torch.tensor([0, 1]), torch.tensor([3]), 20)
    with pytest.raises(ValueError, match="seq_lens must be"):
        dt.verify_layout(torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), torch.tensor([3, 4]), 20)


# ---------------------------------------------------------------------------------------- layout

def test_layout_equals_tree_layout_and_sglang_reconstruct(sgl):
    gen = torch.Generator().manual_seed(12)
    bs, m, k, n = 3, 6, 3, 7
    scores, cand = _lattice(gen, bs, m, k, ties=True)
    tree = dt.build_tree(scores, cand, n)
    seq = torch.tensor([5, 0, 9])
    host_sum = int((seq + n).sum())   # the worker's host bound: committed prefix + one block
    lay = dt.verify_layout(tree.parents, tree.depth, seq, dt.full_mask_len(host_sum, bs, n))
    want_mask, want_pos, want_ri, want_nt, want_ns = build_verify_layout(tree.parents.tolist(), seq, 0)
    assert lay.custom_mask.dtype == torch.bool and lay.custom_mask.numel() == host_sum * n + n * n * bs
    assert torch.equal(lay.custom_mask[: want_mask.numel()], want_mask)
    assert torch.all(lay.custom_mask[want_mask.numel():])
    for got, want in ((lay.positions, want_pos), (lay.retrieve_index, want_ri), (lay.retrieve_next_token, want_nt),
                      (lay.retrieve_next_sibling, want_ns)):
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
    # SGLang's NGRAM-style reconstruction from the N x N ancestor mask gives the same metadata
    anc = dt.ancestor_mask(tree.parents)
    out = torch.full((4, bs * n), -7, dtype=torch.int64)
    sgl["reconstruct"](anc.flatten(), seq, out[0], out[1], out[2], out[3], bs, n)
    assert torch.equal(out[0], lay.positions)
    for i, t in enumerate((lay.retrieve_index, lay.retrieve_next_token, lay.retrieve_next_sibling), 1):
        assert torch.equal(out[i].view(bs, n), t)


# ------------------------------------------------------------------------------------ acceptance

def _planted(gen, bs, m, k, truth, vocab=60, p=0.8, boost=1.5):
    """A lattice whose candidates hold ``truth[b][e]`` (the target's continuation) with probability
    p, its edge scores raised by ``boost`` (a drafter that is often, not always, right)."""
    scores, cand = _lattice(gen, bs, m, k, vocab=vocab)
    for b in range(bs):
        for e in range(m):
            if torch.rand(1, generator=gen) < p:
                slot = int(torch.randint(0, k, (1,), generator=gen))
                cand[b, e, slot] = truth[b][e]
                scores[b, e, :, slot] += boost
    return scores, cand


def _target_predict(tree, cand_full, truth, vocab=60):
    """The target's argmax after each node: the truth's next token when the node's root path is a
    prefix of the truth, else an unrelated token."""
    bs, n = tree.parents.shape
    out = torch.zeros(bs, n, dtype=torch.int64)
    for b in range(bs):
        for i in range(n):
            path, j = [], i
            while j > 0:
                path.append(int(cand_full[b, j]))
                j = int(tree.parents[b, j])
            path = path[::-1]
            on_truth = path == truth[b][: len(path)]
            out[b, i] = truth[b][len(path)] if on_truth else vocab + 1 + (7 * i + b) % 5
    return out


def test_tree_accept_with_sglangs_verify(sgl):
    gen = torch.Generator().manual_seed(13)
    bs, m, k, n = 4, 7, 3, 8
    truth = [torch.randint(0, 60, (m + 1,), generator=gen).tolist() for _ in range(bs)]
    scores, cand = _planted(gen, bs, m, k, truth)
    tree = dt.build_tree(scores, cand, n)
    cand_full = torch.cat([torch.full((bs, 1), 3), tree.tokens], dim=1)
    lay = dt.verify_layout(tree.parents, tree.depth, torch.tensor([4, 6, 8, 10]), dt.full_mask_len(28, bs, n))
    tp = _target_predict(tree, cand_full, truth)
    bufs = dt.verify_buffers(bs, n, "cpu")
    sgl["verify"](*bufs, cand_full, lay.retrieve_index, lay.retrieve_next_token, lay.retrieve_next_sibling, tp)
    ref = verify_greedy(cand_full, lay.retrieve_index, lay.retrieve_next_token, lay.retrieve_next_sibling, tp, n)
    for got, want in zip(bufs, ref):
        assert torch.equal(got.long(), want)
    prefix = torch.tensor([4, 6, 8, 10])
    acc, commit, bonus, out, new = dt.accept_outputs(cand_full, *bufs, prefix)
    assert (acc.dtype, commit.dtype, bonus.dtype, out.dtype, out.shape) == (
        torch.int32, torch.int32, torch.int64, torch.int64, (bs, n))
    for b in range(bs):
        a = int(acc[b])
        assert out[b, : a + 1].tolist() == truth[b][: a + 1]   # accepted drafts, then the bonus
        assert int(bonus[b]) == truth[b][a] and int(commit[b]) == a + 1 and int(new[b]) == int(prefix[b]) + a + 1
        # no longer root path of the tree matches the truth
        on_tree = {tuple(int(cand_full[b, j]) for j in _path(tree.parents[b], i)) for i in range(1, n)}
        assert tuple(truth[b][: a + 1]) not in on_tree
    assert int(acc.max()) >= 2


def _path(parents, i):
    out = []
    while i > 0:
        out.append(i)
        i = int(parents[i])
    return out[::-1]


def test_chain_tree_reproduces_stock_dflash_accept(sgl):
    """Verify a chain-shaped tree with SGLang's tree verify: exactly stock DFLASH's greedy accept
    (compute_dflash_correct_drafts_and_bonus + _commit_accept), tail of out_tokens included."""
    gen = torch.Generator().manual_seed(14)
    for bs, block in [(1, 2), (5, 8), (3, 16)]:
        cand = torch.randint(0, 30, (bs, block), generator=gen)
        tp = torch.randint(0, 30, (bs, block), generator=gen)
        for b in range(bs):
            k = int(torch.randint(0, block, (1,), generator=gen))
            tp[b, :k] = cand[b, 1:k + 1]
        want_len, want_bonus = sgl["dflash_accept"](candidates=cand, target_predict=tp)
        want_out, want_commit = sgl["commit_accept"](cand, want_len, want_bonus)
        chain = dt.chain_tree(cand[:, 1:])
        lay = dt.verify_layout(chain.parents, chain.depth, torch.zeros(bs, dtype=torch.long), block * block * bs)
        bufs = dt.verify_buffers(bs, block, "cpu")
        sgl["verify"](*bufs, cand, lay.retrieve_index, lay.retrieve_next_token, lay.retrieve_next_sibling, tp)
        prefix = torch.arange(bs) * 3 + 11
        acc, commit, bonus, out, new = dt.accept_outputs(cand, *bufs, prefix)
        for got, want in ((acc, want_len), (commit, want_commit), (bonus, want_bonus), (out, want_out)):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert torch.equal(new, prefix + want_commit)


# ------------------------------------------------------------------------------------ compaction

def _accepted(gen, bs, n, m=None, k=2):
    """A random tree and an accepted path through it (accept_index global, -1 padded)."""
    m = m or n - 1
    truth = [torch.randint(0, 9, (m + 1,), generator=gen).tolist() for _ in range(bs)]
    scores, cand = _planted(gen, bs, m, k, truth, vocab=9, p=0.95)
    tree = dt.build_tree(scores, cand, n)
    cand_full = torch.cat([torch.zeros(bs, 1, dtype=torch.long), tree.tokens], dim=1)
    lay = dt.verify_layout(tree.parents, tree.depth, torch.zeros(bs, dtype=torch.long), n * n * bs)
    tp = _target_predict(tree, cand_full, truth, vocab=9)
    pred, acc_idx, acc_num = verify_greedy(cand_full, lay.retrieve_index, lay.retrieve_next_token,
                                           lay.retrieve_next_sibling, tp, n)
    return acc_idx.to(torch.int32), acc_num.to(torch.int32)


def test_kv_move_pairs_on_a_fake_pool(sgl):
    gen = torch.Generator().manual_seed(15)
    bs, n, slots = 4, 6, 64
    overlapping = 0
    # a fixed case where pairs overlap (request 0: slot 1 <- node 2 while slot 2 <- node 3), then random trees
    fixed = (torch.tensor([[0, 2, 3, 5, -1, -1], [6, 7, -1, -1, -1, -1], [12, 14, 15, 16, 17, -1],
                           [18, -1, -1, -1, -1, -1]], dtype=torch.int32), torch.tensor([3, 1, 4, 0], dtype=torch.int32))
    for case in range(6):
        acc_idx, acc_num = fixed if case == 0 else _accepted(gen, bs, n, k=3)
        write = torch.randperm(slots, generator=gen)[: bs * n]
        pool = torch.randn(slots, 2, 3, generator=gen)
        want = pool.clone()
        w = write.view(bs, n)
        for b in range(bs):
            for j in range(int(acc_num[b]) + 1):
                want[w[b, j]] = pool[w[b, int(acc_idx[b, j]) - b * n]]
        tgt, src = dt.kv_move_pairs(write, acc_idx, acc_num)
        assert tgt.dtype == src.dtype == torch.int64 and tgt.shape == src.shape == (bs * n,)
        live = tgt != src
        overlapping += int(sum(int(s) in set(tgt[live].tolist()) for s in src[live]))
        # all at once with SGLang's native move (gather, then scatter)
        k, v = pool.clone(), pool.clone()
        sgl["move_native"]([k], [v], tgt, src)
        assert torch.equal(k, want) and torch.equal(v, want)
        # in ascending chunks (move_kv_cache's tiled kernel past its cap) and one pair at a time
        for chunk in (1, 3, 7):
            k = pool.clone()
            for s in range(0, bs * n, chunk):
                k[tgt[s:s + chunk]] = k[src[s:s + chunk]]
            assert torch.equal(k, want), chunk
        # SGLang's own pairs (move_accept_tokens_to_target_kvcache: fill_front + fill_accept) move the same
        size = bs * n
        s_tgt, s_src = torch.zeros(size, dtype=torch.int64), torch.zeros(size, dtype=torch.int64)
        sgl["fill_front"](acc_num.long() + 1, write, s_tgt)
        sgl["fill_accept"](acc_idx, write, s_src, size)
        k = pool.clone()
        sgl["move_native"]([k], [k.clone()], s_tgt, s_src)
        assert torch.equal(k[write], want[write])
    assert overlapping > 0  # some pair read a slot another pair wrote


def test_hidden_compaction_equals_sglang(sgl):
    gen = torch.Generator().manual_seed(16)
    for bs, n in [(1, 4), (3, 8)]:
        acc_idx, _ = _accepted(gen, bs, n)
        x = torch.randn(bs * n, 5, generator=gen)
        assert torch.equal(dt.compact_to_front(x, acc_idx, bs, n), sgl["compact"](x, acc_idx, bs, num_draft_tokens=n))
        x3 = torch.randn(bs * n, 2, 3, generator=gen)
        assert torch.equal(dt.compact_to_front(x3, acc_idx, bs, n), sgl["compact"](x3, acc_idx, bs, num_draft_tokens=n))


# -------------------------------------------------------------------------- toy RoPE transformer

class Toy:
    """A tiny causal transformer with RoPE (float64). ``extend`` runs new tokens against cached
    keys/values under an explicit ``allowed [new, past + new]`` mask."""

    def __init__(self, vocab=29, d=16, heads=2, layers=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.6  # noqa: E731
        self.vocab, self.h, self.dh, self.nl = vocab, heads, d // heads, layers
        self.emb, self.head = r(vocab, d), r(d, vocab)
        self.w = [tuple(r(d, d) for _ in range(4)) for _ in range(layers)]

    def rope(self, x, pos):
        half = self.dh // 2
        ang = pos.to(torch.float64)[:, None] / (100.0 ** (torch.arange(half, dtype=torch.float64) / half))
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., :half] * sin + x[..., half:] * cos], -1)

    def extend(self, tokens, positions, allowed, past=None):
        x, new_kv = self.emb[tokens], []
        t = x.shape[0]
        for layer, (wq, wk, wv, wo) in enumerate(self.w):
            q = self.rope((x @ wq).view(t, self.h, self.dh), positions)
            kk = self.rope((x @ wk).view(t, self.h, self.dh), positions)
            vv = (x @ wv).view(t, self.h, self.dh)
            new_kv.append((kk, vv))
            if past is not None:
                kk, vv = torch.cat([past[layer][0], kk]), torch.cat([past[layer][1], vv])
            att = torch.einsum("qhd,khd->hqk", q, kk) / self.dh ** 0.5
            att = att.masked_fill(~allowed[None], float("-inf")).softmax(-1)
            x = x + torch.einsum("hqk,khd->qhd", att, vv).reshape(t, -1) @ wo
        return x @ self.head, x, new_kv

    def causal(self, tokens):
        t = len(tokens)
        return self.extend(torch.tensor(tokens), torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril())

    def greedy(self, tokens, count):
        tokens = list(tokens)
        for _ in range(count):
            tokens.append(int(self.causal(tokens)[0][-1].argmax()))
        return tokens[-count:] if count else []


def test_tree_logits_equal_causal_runs_of_each_root_path():
    """Losslessness of the layout: each node's logits under the FULL mask and tree positions equal
    the causal logits of prefix + its root path; committed tokens equal greedy decoding."""
    gen = torch.Generator().manual_seed(17)
    toy = Toy()
    bs, m, k, n = 2, 5, 3, 6
    prompts = [torch.randint(0, toy.vocab, (p,), generator=gen).tolist() for p in (4, 7)]
    roots = [toy.greedy(p, 1)[0] for p in prompts]
    truth = [toy.greedy(p + [r], m + 1) for p, r in zip(prompts, roots)]
    scores, cand = _planted(gen, bs, m, k, truth, vocab=toy.vocab, p=0.9)
    tree = dt.build_tree(scores, cand, n)
    seq = torch.tensor([len(p) for p in prompts])
    lay = dt.verify_layout(tree.parents, tree.depth, seq, dt.full_mask_len(int((seq + n).sum()), bs, n))
    cand_full = torch.cat([torch.tensor(roots)[:, None], tree.tokens], dim=1)
    start, predict = 0, torch.zeros(bs, n, dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        p = len(prompt)
        rows = lay.custom_mask[start:start + n * (p + n)].view(n, p + n)
        start += n * (p + n)
        _, _, past = toy.causal(prompt)
        logits, _, _ = toy.extend(cand_full[b], lay.positions.view(bs, n)[b], rows, past)
        for i in range(n):
            path = [int(cand_full[b, j]) for j in [0] + _path(tree.parents[b], i)]
            want = toy.causal(prompt + path)[0][-1]
            assert torch.allclose(logits[i], want, atol=1e-10), (b, i)
        predict[b] = logits.argmax(-1)
    bufs = verify_greedy(cand_full, lay.retrieve_index, lay.retrieve_next_token, lay.retrieve_next_sibling,
                         predict, n)
    acc, _, _, out, _ = dt.accept_outputs(cand_full, *bufs, seq)
    for b in range(bs):
        a = int(acc[b])
        assert out[b, : a + 1].tolist() == truth[b][: a + 1]
    assert int(acc.sum()) > 0


# ----------------------------------------------------------------------------------------- hooks

class _Mode:
    def is_extend(self):
        return False

    def is_idle(self):
        return False


def _greedy_info():
    return SimpleNamespace(is_all_greedy=True, has_custom_logit_processor=False, penalizer_orchestrator=None,
                           logit_bias=None, grammar_mask=None, acc_linear_penalties=None,
                           sampling_mask_batch_indices=None)


class TritonAttnBackend:  # the class name is what the eligibility check reads
    pass


def _worker(**over):
    runner = SimpleNamespace(model_config=SimpleNamespace(model_is_mrope=False), attn_backend=TritonAttnBackend(),
                             token_to_kv_pool=type("MHATokenToKVPool", (), {})(), is_hybrid_swa=False,
                             sliding_window_size=None)
    w = SimpleNamespace(selector=SimpleNamespace(top_k=3), lilicorr=None, _is_domino=False, block_size=5,
                        model_runner=runner, _need_mamba_verify_commit=False, device="cpu")
    for key, val in over.items():
        obj, _, attr = key.rpartition(".")
        setattr(eval("w." + obj) if obj else w, attr, val)  # noqa: S307 (test helper on our own object)
    return w


def _stand_in_sgl(sgl, calls=None):
    def verify(**kw):
        sgl["verify"](**kw)
        if calls is not None:
            calls.append(kw["accept_index"].clone())
    return SimpleNamespace(verify=verify, mambaish_config=lambda cfg: None, simulate_acc_len=0, sites=SITES,
                           parallel=lambda: SimpleNamespace(attn_dp_enabled=False))


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"selector": None}, "no CandidateSelector"),
    ({"_is_domino": True}, "Domino"),
    ({"_need_mamba_verify_commit": True}, "hybrid"),
    ({"model_runner.sliding_window_size": 128}, "sliding-window"),
    ({"model_runner.model_config.model_is_mrope": True}, "mrope"),
    ({"model_runner.attn_backend": object()}, "verify attention backend object"),
    ({"model_runner.token_to_kv_pool": type("SWAKVPool", (), {})()}, "KV pool SWAKVPool"),
])
def test_static_eligibility(sgl, monkeypatch, change, reason):
    monkeypatch.setattr(hk, "_sgl", lambda: _stand_in_sgl(sgl))
    monkeypatch.setattr(hk, "settings", lambda: {"dflash_tree_max_batch": 4})
    got = hk.static_ineligible(_worker(**change))
    assert got == reason if reason is None else reason in got


def test_switched_off_and_lattice_trace_keep_stock(sgl, monkeypatch):
    from specpilot.bundles import plugin

    monkeypatch.setattr(hk, "_sgl", lambda: _stand_in_sgl(sgl))
    monkeypatch.setattr(hk, "settings", lambda: {"dflash_tree_max_batch": 0})
    assert "switched off" in hk.static_ineligible(_worker())
    monkeypatch.setattr(hk, "settings", lambda: {"dflash_tree_max_batch": 4})
    monkeypatch.setattr(plugin, "registered", lambda: [
        "after sglang.srt.models.dflash.CandidateSelector.build_lattice <- specpilot.bundles.lattice_trace:x"])
    assert "lattice-trace" in hk.static_ineligible(_worker())


class _Engine:
    """The toy target behind a stand-in DFLASH worker: a KV pool per layer indexed by slot, each
    request's slots ``base + position`` (req_to_token), prompts prefilled causally."""

    def __init__(self, toy, prompts, slots=256):
        self.toy = toy
        self.k = [torch.zeros(len(prompts) * slots, toy.h, toy.dh, dtype=torch.float64) for _ in range(toy.nl)]
        self.v = [x.clone() for x in self.k]
        self.base = torch.arange(len(prompts)) * slots
        for b, p in enumerate(prompts):
            _, _, kv = toy.causal(p)
            for layer, (kk, vv) in enumerate(kv):
                self.k[layer][self.base[b]:self.base[b] + len(p)] = kk
                self.v[layer][self.base[b]:self.base[b] + len(p)] = vv

    def verify(self, tokens, positions, mask, prefix, window):
        """Target verify of ``tokens [bs, B]``: causal within the block when ``mask`` is None (stock
        DFLASH), else the FULL custom mask. Writes K/V to ``window``; (logits, hidden) [bs*B, .]."""
        bs, blk = tokens.shape
        logits, hidden, start = [], [], 0
        for b in range(bs):
            p = int(prefix[b])
            if mask is None:
                rows = torch.cat([torch.ones(blk, p, dtype=torch.bool), torch.ones(blk, blk, dtype=torch.bool).tril()], 1)
            else:
                rows = mask[start:start + blk * (p + blk)].view(blk, p + blk)
                start += blk * (p + blk)
            past = [(self.k[i][self.base[b]:self.base[b] + p], self.v[i][self.base[b]:self.base[b] + p])
                    for i in range(self.toy.nl)]
            lg, hid, kv = self.toy.extend(tokens[b], positions[b], rows, past)
            for i, (kk, vv) in enumerate(kv):
                self.k[i][window[b]], self.v[i][window[b]] = kk, vv
            logits.append(lg)
            hidden.append(hid)
        return torch.cat(logits), torch.cat(hidden)


def _fake_module(sgl, engine, draft_seed):
    """Stand-ins for DFlashWorkerV2 / CandidateSelector / DFlashVerifyInput carrying SGLang's own
    build_lattice, sample_path and _accept_block; forward_batch_generation follows stock's decode
    step (draft block -> lattice -> chain -> verify input -> target verify -> accept -> draft KV)."""
    mod = types.ModuleType("_sp_fake_dflash_tree")
    gen = torch.Generator().manual_seed(draft_seed)
    toy = engine.toy

    class CandidateSelector:
        build_lattice = sgl["build_lattice"]
        sample_path = sgl["sample_path"]

        def __init__(self, k, rank=4, hidden=6):
            g = torch.Generator().manual_seed(5)
            self.top_k = k
            self.predecessor_codebook = torch.randn(toy.vocab, rank, generator=g) * 0.1  # pair term < unary
            self.successor_codebook = torch.randn(toy.vocab, rank, generator=g)
            self.hidden_projection = torch.nn.Linear(hidden, rank, bias=False)
            with torch.no_grad():  # deterministic, whatever the global RNG did before
                self.hidden_projection.weight.copy_(torch.randn(rank, hidden, generator=g))

    class DFlashVerifyInput:
        def __init__(self, *, draft_token, positions, draft_token_num, custom_mask=None, kv_loc_plan=None):
            self.draft_token, self.positions, self.draft_token_num = draft_token, positions, draft_token_num
            self.custom_mask, self.kv_loc_plan, self.ragged_verify_layout = custom_mask, kv_loc_plan, None

        def prepare_for_verify(self, batch, target_worker, *, defer_metadata_init=False):
            batch.input_ids = self.draft_token
            graphs = target_worker.model_runner.decode_cuda_graph_runner
            return SimpleNamespace(input_ids=self.draft_token, positions=self.positions,
                                   custom_mask=self.custom_mask, graphs=graphs), graphs is not None

    pool = type("MHATokenToKVPool", (), {"move_kv_cache": lambda self, tgt, src: sgl["move_native"](
        engine.k, engine.v, tgt, src)})()

    class DFlashWorkerV2:
        _accept_block = sgl["accept_block"]

        def __init__(self, block, k):
            self.block_size, self.device, self.selector = block, "cpu", CandidateSelector(k)
            self.lilicorr, self._is_domino, self._need_mamba_verify_commit = None, False, False
            self._selector_sample, self._use_triton_accept_bonus = None, False
            self.synced, self.verified, self.appended = [], [], []
            self._tp_sync = SimpleNamespace(sync=lambda site, t: self.synced.append(site) or t)
            self.graphs = object()
            self.model_runner = SimpleNamespace(
                model_config=SimpleNamespace(model_is_mrope=False), attn_backend=TritonAttnBackend(),
                token_to_kv_pool=pool, is_hybrid_swa=False, sliding_window_size=None,
                decode_cuda_graph_runner=self.graphs, kv_index_translator="translator")
            self.target_worker = SimpleNamespace(model_runner=self.model_runner)

        def init_cuda_graphs(self):  # "capture": the selector runs once per graph batch size
            m, k = self.block_size - 1, self.selector.top_k
            for b in (1, 2, 9):
                self.selector.build_lattice(candidate_ids=torch.zeros(b, m, k, dtype=torch.long),
                                            unary_logits=torch.zeros(b, m, k), hidden_states=torch.zeros(b, m, 6),
                                            anchor_token_ids=torch.zeros(b, dtype=torch.long))

        def draft(self, batch, contexts):
            """The drafter: top-K candidates per position, the target's continuation planted often."""
            bs, m, k = len(contexts), self.block_size - 1, self.selector.top_k
            cand = torch.randint(0, toy.vocab, (bs, m, k), generator=gen)
            unary = torch.randn(bs, m, k, generator=gen) * 2
            for b, ctx in enumerate(contexts):
                for e, tok in enumerate(toy.greedy(ctx, m)):
                    if torch.rand(1, generator=gen) < 0.85:
                        slot = int(torch.randint(0, k, (1,), generator=gen))
                        cand[b, e, slot] = tok
                        unary[b, e, slot] = unary[b, e].max() - SECOND  # often the runner-up
            hidden = torch.randn(bs, m, 6, generator=gen)
            anchors = batch.spec_info.bonus_tokens
            scores = self.selector.build_lattice(candidate_ids=cand, unary_logits=unary, hidden_states=hidden,
                                                 anchor_token_ids=anchors)
            tokens, _ = self.selector.sample_path(candidate_ids=cand, scores=scores, uniforms=torch.rand(bs, m, generator=gen),
                                                  temperatures=torch.ones(bs), greedy_mask=torch.ones(bs, dtype=torch.bool))
            return tokens

        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
            bs, blk = len(batch.seq_lens), self.block_size
            prefix = batch.seq_lens
            draft_tokens = torch.cat([batch.spec_info.bonus_tokens[:, None], self.draft(batch, batch.contexts)], 1)
            positions_2d = prefix[:, None] + torch.arange(blk)
            window = engine.base[:, None] + positions_2d          # req_to_token[prefix:prefix+B]
            plan = SimpleNamespace(write_ids=lambda translator: window.reshape(-1))
            verify_input = DFlashVerifyInput(draft_token=draft_tokens.reshape(-1), positions=positions_2d.reshape(-1),
                                             draft_token_num=blk, custom_mask=None, kv_loc_plan=plan)
            batch.seq_lens_sum = int((prefix + blk).sum())       # the verify host bound stock sets
            fb, _ = verify_input.prepare_for_verify(batch, self.target_worker, defer_metadata_init=False)
            self.verified.append(fb)
            logits, hidden = engine.verify(fb.input_ids.view(bs, blk), fb.positions.view(bs, blk), fb.custom_mask,
                                           prefix, window)
            accept_len, commit_lens, bonus, out_tokens, new_seq_lens = self._accept_block(
                candidates=draft_tokens, next_token_logits=logits, sampling_info=batch.sampling_info,
                draft_input=batch.spec_info, prefix_lens=prefix, bs=bs)
            self._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden, cache_loc=window.reshape(-1),
                                                          cache_loc_2d=window, positions=positions_2d.reshape(-1),
                                                          commit_lens=commit_lens)
            if new_seq_lens is None:
                new_seq_lens = prefix + commit_lens.to(prefix.dtype)
            return out_tokens, commit_lens, bonus, new_seq_lens

        def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None,
                                                      commit_lens=None, extend_lens=None):
            rows = target_hidden.view(cache_loc_2d.shape[0], cache_loc_2d.shape[1], -1)
            self.appended.append([(int(positions.view(cache_loc_2d.shape)[b, 0]), rows[b, : int(c)].clone())
                                  for b, c in enumerate(commit_lens)])

    mod.CandidateSelector, mod.DFlashVerifyInput, mod.DFlashWorkerV2 = CandidateSelector, DFlashVerifyInput, DFlashWorkerV2
    return mod


def _decode(sgl, registry, cap, steps=5, block=5, k=3, seed=0):
    """Greedy decoding of two prompts through the stand-in worker; returns (streams, worker, engine)."""
    import specpilot.bundles.dflash_tree_hooks as hooks_mod

    toy = Toy(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, toy.vocab, (p,), generator=gen).tolist() for p in (5, 8)]
    engine = _Engine(toy, prompts)
    mod = _fake_module(sgl, engine, draft_seed=seed + 2)
    sys.modules[mod.__name__] = mod
    registry.HookRegistry.reset()
    try:
        for h in _tree_hooks():
            where = f"{mod.__name__}." + ".".join(h.target.rsplit(".", 2)[-2:])
            registry.HookRegistry.register(where, hooks_mod.__dict__[h.handler.split(":")[1]],
                                           registry.HookType[h.type.upper()])
        registry.HookRegistry.apply_hooks()
        hooks_mod.settings = lambda: {"dflash_tree_max_batch": cap}
        worker = mod.DFlashWorkerV2(block, k)
        worker.init_cuda_graphs()
        streams = [p + toy.greedy(p, 1) for p in prompts]
        batch = SimpleNamespace(forward_mode=_Mode(), is_extend_in_batch=False, has_grammar=False, return_logprob=False,
                                sampling_info=_greedy_info(), seq_lens=torch.tensor([len(p) for p in prompts]),
                                seq_lens_sum=None,
                                spec_info=SimpleNamespace(bonus_tokens=torch.tensor([s[-1] for s in streams])))
        for _ in range(steps):
            batch.contexts = [list(s) for s in streams]
            out, commit, bonus, new = worker.forward_batch_generation(batch)
            for b in range(len(streams)):
                streams[b] += out[b, : int(commit[b])].tolist()
            batch.seq_lens, batch.spec_info.bonus_tokens = new, bonus
            assert worker.model_runner.decode_cuda_graph_runner is worker.graphs  # restored every step
        return streams, worker, engine, prompts
    finally:
        sys.modules.pop(mod.__name__, None)


def _tree_hooks():
    from specpilot.bundles.memory import load_memory

    return [h for h in load_memory()["tree"].hooks if h.handler.startswith("specpilot.bundles.dflash_tree_hooks:")]


@pytest.fixture
def registry():
    with fresh_hook_registry(SGL, "_sp_hook_registry_dflash_tree") as reg:
        yield reg


def test_the_six_hooks_cover_the_plan():
    got = {(h.type, h.target.rsplit(".", 2)[-2] + "." + h.target.rsplit(".", 1)[-1]) for h in _tree_hooks()}
    assert got == {("around", "DFlashWorkerV2.init_cuda_graphs"), ("after", "CandidateSelector.build_lattice"),
                   ("around", "DFlashWorkerV2.forward_batch_generation"),
                   ("around", "DFlashVerifyInput.prepare_for_verify"), ("around", "DFlashWorkerV2._accept_block"),
                   ("before", "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc")}


def test_hooked_worker_decodes_the_greedy_continuation(sgl, registry, monkeypatch):
    """Through SGLang's HookRegistry: tree steps (verify under the FULL mask, SGLang's verify kernel,
    KV moved in the pool, hidden compacted) decode exactly the toy target's greedy continuation."""
    import specpilot.bundles.dflash_tree_hooks as hooks_mod

    calls = []
    monkeypatch.setattr(hooks_mod, "_sgl", lambda: _stand_in_sgl(sgl, calls))
    monkeypatch.setattr(hooks_mod, "settings", hooks_mod.settings)  # _decode sets it; restored after
    stock, _, _, _ = _decode(sgl, registry, cap=1)  # the same drafter, verified by stock's chain
    hk._state.update(steps=0, skipped={})
    calls.clear()
    streams, worker, engine, prompts = _decode(sgl, registry, cap=4)
    for s, p in zip(streams, prompts):
        assert s == p + engine.toy.greedy(p, len(s) - len(p)), "not the target's greedy continuation"
    tree_tokens, chain_tokens = (sum(len(s) - len(p) for s, p in zip(x, prompts)) for x in (streams, stock))
    print(f"toy drafter (target's token often its runner-up), 2 requests x 5 steps, block 5: "
          f"tree verify committed {tree_tokens} tokens, stock's chain {chain_tokens}")
    assert tree_tokens > chain_tokens  # this toy drafter's runner-ups are on the tree, not the chain
    assert hk._state["steps"] == 5 and hk._state["disabled"] is False and not hk._state["skipped"]
    assert all(fb.custom_mask is not None and fb.graphs is None for fb in worker.verified)  # eager, masked
    assert worker.synced.count("selector") == 5 and worker.synced.count("accept-greedy") == 5
    # the tree accepted off-chain paths (a node's index is not its depth), so the KV move mattered
    assert any(int(a[b, j]) not in (-1, b * 5 + j) for a in calls for b in range(2) for j in range(5))
    # the draft KV was rebuilt from the committed tokens' hidden states (H5), as a causal run gives them
    for step in worker.appended:
        for b, (start, rows) in enumerate(step):
            _, hidden, _ = engine.toy.causal(streams[b][: start + rows.shape[0]])
            assert torch.allclose(rows, hidden[start:], atol=1e-10)
    assert vars(worker.selector)[hk.LATTICE_ATTR].cap == 4  # H0 armed the selector before "capture"


def test_lattice_copy_hook_keeps_stock_scores_and_respects_the_cap():
    buf = hk.LatticeBuffers(cap=2, cand=torch.zeros(2, 3, 2, dtype=torch.long), scores=torch.zeros(2, 3, 2, 2))
    selector = SimpleNamespace(**{hk.LATTICE_ATTR: buf})
    scores, cand = torch.randn(2, 3, 2, 2), torch.randint(0, 9, (2, 3, 2))
    assert hk.after_build_lattice(scores, selector, candidate_ids=cand, unary_logits=None, hidden_states=None,
                                  anchor_token_ids=None) is None  # SGLang keeps its own scores
    assert torch.equal(buf.scores, scores) and torch.equal(buf.cand, cand)
    hk.after_build_lattice(torch.ones(3, 3, 2, 2), selector, candidate_ids=cand.repeat(2, 1, 1)[:3])
    assert torch.equal(buf.scores, scores)  # a batch past the cap is not copied (H2 runs it stock)
    hk.after_build_lattice(scores, SimpleNamespace(), candidate_ids=cand)  # an unarmed selector: nothing


def test_ineligible_steps_run_stock(sgl, registry, monkeypatch):
    """A batch over dflash_tree_max_batch runs stock: SGLang's chain verify and accept, no mask."""
    import specpilot.bundles.dflash_tree_hooks as hooks_mod

    monkeypatch.setattr(hooks_mod, "_sgl", lambda: _stand_in_sgl(sgl))
    monkeypatch.setattr(hooks_mod, "settings", hooks_mod.settings)
    streams, worker, engine, prompts = _decode(sgl, registry, cap=1, steps=3)
    for s, p in zip(streams, prompts):
        assert s == p + engine.toy.greedy(p, len(s) - len(p))
    assert hk._state["steps"] == 0 and hk._state["skipped"] == {"batch larger than dflash_tree_max_batch": 3}
    assert all(fb.custom_mask is None and fb.graphs is worker.graphs for fb in worker.verified)
    assert worker.synced == ["accept-greedy"] * 3


def test_a_planning_error_turns_tree_verify_off_and_serves_stock(sgl, registry, monkeypatch):
    import specpilot.bundles.dflash_tree_hooks as hooks_mod

    monkeypatch.setattr(hooks_mod, "_sgl", lambda: _stand_in_sgl(sgl))
    monkeypatch.setattr(hooks_mod, "settings", hooks_mod.settings)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(dt, "build_tree", broken)
    streams, worker, engine, prompts = _decode(sgl, registry, cap=4, steps=3)
    for s, p in zip(streams, prompts):
        assert s == p + engine.toy.greedy(p, len(s) - len(p))
    assert hk._state["disabled"] is True and hk._state["steps"] == 0
    assert hk._state["skipped"] == {"disabled after an error": 2}
    assert all(fb.custom_mask is None for fb in worker.verified)


def test_a_row_whose_buffered_lattice_is_not_this_steps_keeps_the_chain(sgl, monkeypatch):
    """H3's guard: the buffers must reproduce the drafted chain (stock's greedy walk); a row that
    does not (a stale or foreign lattice) is verified as the chain-shaped tree."""
    monkeypatch.setattr(hk, "_sgl", lambda: _stand_in_sgl(sgl))
    gen = torch.Generator().manual_seed(18)
    bs, n, k = 2, 6, 3
    scores, cand = _lattice(gen, 4, n - 1, k, dtype=torch.float32)
    selector = SimpleNamespace(**{hk.LATTICE_ATTR: hk.LatticeBuffers(cap=4, cand=cand, scores=scores)})
    worker = SimpleNamespace(selector=selector, _tp_sync=SimpleNamespace(sync=lambda site, t: t))
    chain = dt.greedy_path(scores[:bs], cand[:bs])
    chain[1, 2] = 99  # row 1 drafted something else than its buffered lattice's greedy walk
    block = torch.cat([torch.tensor([[7], [8]]), chain], dim=1)
    verify_input = SimpleNamespace(draft_token=block.reshape(-1), draft_token_num=n, custom_mask=None,
                                   ragged_verify_layout=None,
                                   kv_loc_plan=SimpleNamespace(write_ids=lambda tr: torch.arange(bs * n)))
    batch = SimpleNamespace(forward_mode=_Mode(), seq_lens=torch.tensor([3, 9]), seq_lens_sum=12 + 2 * n)
    target = SimpleNamespace(model_runner=SimpleNamespace(kv_index_translator=None))
    plan = hk.plan_verify({"worker": worker, "bs": bs, "n": n}, verify_input, batch, target)
    tree = dt.build_tree(scores[:bs], cand[:bs], n)
    assert torch.equal(plan["tokens"][0], tree.tokens[0]) and not torch.equal(tree.tokens[0], chain[0])
    assert torch.equal(plan["tokens"][1], chain[1])
    assert plan["layout"].positions.view(bs, n)[1].tolist() == list(range(9, 9 + n))
    assert plan["layout"].retrieve_next_token[1].tolist() == [1, 2, 3, 4, 5, -1]
    assert torch.equal(block, torch.cat([torch.tensor([[7], [8]]), chain], dim=1))  # planning writes nothing
    # a batch past the buffers' cap, or a block that is not [bs, N]: stock (None), counted
    setattr(selector, hk.LATTICE_ATTR, hk.LatticeBuffers(cap=1, cand=cand[:1], scores=scores[:1]))
    assert hk.plan_verify({"worker": worker, "bs": bs, "n": n}, verify_input, batch, target) is None
    assert hk.plan_verify({"worker": worker, "bs": 3, "n": n}, verify_input, batch, target) is None
    assert hk._state["skipped"] == {"no lattice buffers for this batch": 1, "verify block is not [bs, N]": 1}
