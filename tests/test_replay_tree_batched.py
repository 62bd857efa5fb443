"""The batched best-first builder (shared node budget) against the engine's single-request builder."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from specpilot.kernels.tree import build_best_first, build_best_first_shared
from specpilot.kernels.tree_batched import build_batched
from specpilot.kernels.tree_batched_ref import build_batched_ref


def lattice(B, m, K, seed, dtype=torch.float64, neg_inf=False):
    g = torch.Generator().manual_seed(seed)
    tok = torch.stack([torch.stack([torch.randperm(500, generator=g)[:K] for _ in range(m)]) for _ in range(B)])
    lp = torch.log_softmax(torch.randn(B, m, K, generator=g, dtype=dtype) * 2, -1).sort(-1, descending=True).values
    tr = torch.log_softmax(torch.randn(B, max(m - 1, 0), K, K, generator=g, dtype=dtype) * 2, -1)
    if neg_inf:
        tr[torch.rand(tr.shape, generator=g) < 0.3] = float("-inf")
    return tok, lp, tr


def host(x):
    return None if x is None else x.tolist()


def same(tree_a, tree_b):
    return (tuple(tree_a.tokens), tuple(tree_a.parents), tuple(tree_a.depth), tuple(tree_a.cand)) == \
        (tuple(tree_b.tokens), tuple(tree_b.parents), tuple(tree_b.depth), tuple(tree_b.cand))


@pytest.mark.parametrize("B,m,K,n", [(3, 4, 4, 8), (2, 1, 5, 3), (2, 5, 3, 40), (4, 6, 8, 16), (1, 3, 2, 1)])
@pytest.mark.parametrize("cond", [False, True])
def test_per_request_equals_engine_builder(B, m, K, n, cond):
    for seed in range(3):
        tok, lp, tr = lattice(B, m, K, seed)
        t = tr if cond else None
        out = build_batched(tok, lp, t, n)          # CPU: the torch path
        for b in range(B):
            want = build_best_first(host(tok[b]), host(lp[b]), host(t[b]) if cond else None, n)
            got = out.request(b)
            assert same(got, want), (seed, b)
            assert torch.allclose(torch.tensor(got.score, dtype=torch.float64), torch.tensor(want.score, dtype=torch.float64))
        assert out.tokens.shape == (B, n)


def test_non_finite_edges_are_never_expanded():
    tok, lp, tr = lattice(3, 4, 4, 5, neg_inf=True)
    out = build_batched(tok, lp, tr, 30)
    for b in range(3):
        want = build_best_first(host(tok[b]), host(lp[b]), host(tr[b]), 30)
        assert same(out.request(b), want)
        assert int(out.count[b]) == len(want)


@pytest.mark.parametrize("budget", [0, 1, 7, 20, 64])
def test_shared_budget_equals_engine_shared_builder(budget):
    B, m, K, n = 4, 5, 4, 64        # cap >= budget: no request is ever capped
    tok, lp, tr = lattice(B, m, K, budget)
    out = build_batched(tok, lp, tr, n, budget=budget)
    want = build_best_first_shared([(host(tok[b]), host(lp[b]), host(tr[b])) for b in range(B)], budget)
    for b in range(B):
        assert same(out.request(b), want[b])
    assert int(out.count.sum()) == budget


def test_shared_budget_invariants_with_cap():
    B, m, K, n = 6, 6, 5, 8
    tok, lp, tr = lattice(B, m, K, 11)
    full = build_batched(tok, lp, tr, n)
    out = build_batched(tok, lp, tr, n, budget=torch.tensor(20))
    assert int(out.count.sum()) == 20 and bool((out.count <= n).all())
    for b in range(B):
        c = int(out.count[b])
        assert out.valid[b, :c].all() and not out.valid[b, c:].any()          # a prefix of the list
        assert torch.equal(out.tokens[b], full.tokens[b])                        # of the same list
        assert all(-1 <= p < i for i, p in enumerate(out.parents[b, :c].tolist()))   # prefix-closed
    # shared fill: every kept node outscores every dropped one that was not dropped by the cap
    kept = out.score[out.valid]
    dropped = full.score[full.valid & ~out.valid]
    assert kept.min() >= dropped.max()


def test_float32_matches_float64_order():
    tok, lp, tr = lattice(4, 8, 8, 3)
    a = build_batched_ref(tok, lp, tr, 32)
    b = build_batched_ref(tok, lp.float(), tr.float(), 32)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_bad_shapes():
    tok, lp, tr = lattice(2, 3, 4, 0)
    with pytest.raises(ValueError):
        build_batched(tok, lp[:, :2], None, 4)
    with pytest.raises(ValueError):
        build_batched(tok, lp, tr[:, :1], 4)
    with pytest.raises(ValueError):
        build_batched(tok, lp, None, 0)


TRITON_SCRIPT = r"""
import json, torch
from specpilot.kernels.tree import build_best_first, build_best_first_shared
from specpilot.kernels.tree_batched import build_batched
res = []
for (B, m, K, n, cond, budget) in [(2, 3, 5, 6, True, None), (2, 3, 3, 4, False, None), (3, 3, 3, 4, True, 7)]:
    g = torch.Generator().manual_seed(B * 10 + m)
    tok = torch.stack([torch.stack([torch.randperm(300, generator=g)[:K] for _ in range(m)]) for _ in range(B)])
    lp = torch.log_softmax(torch.randn(B, m, K, generator=g) * 2, -1).sort(-1, descending=True).values
    tr = torch.log_softmax(torch.randn(B, m - 1, K, K, generator=g) * 2, -1)
    t = tr if cond else None
    out = build_batched(tok, lp, t, n, budget=budget, backend="triton")
    h = lambda x: x.double().tolist()
    if budget is None:
        want = [build_best_first(tok[b].tolist(), h(lp[b]), h(t[b]) if cond else None, n) for b in range(B)]
    else:
        want = build_best_first_shared([(tok[b].tolist(), h(lp[b]), h(t[b])) for b in range(B)], budget)
    for b in range(B):
        got = out.request(b)
        res.append([list(got.tokens) == list(want[b].tokens) and list(got.parents) == list(want[b].parents)
                    and list(got.depth) == list(want[b].depth), len(got)])
print(json.dumps(res))
"""


def test_triton_kernel_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert all(ok for ok, _ in res), res
    assert sum(n for _, n in res[-3:]) == 7          # the shared budget is spent exactly


@pytest.mark.gpu
def test_triton_on_cuda_and_graph_capture():
    from specpilot.kernels.tree_batched import alloc

    tok, lp, tr = lattice(32, 16, 16, 0, dtype=torch.float32)
    tok, lp, tr = tok.cuda(), lp.cuda(), tr.cuda()
    out = build_batched(tok, lp, tr, 32)
    for b in range(0, 32, 5):
        want = build_best_first(host(tok[b].cpu()), lp[b].cpu().double().tolist(), tr[b].cpu().double().tolist(), 32)
        assert same(out.request(b), want)
    buf = alloc(32, 32, "cuda")
    budget = torch.tensor(512, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        build_batched(tok, lp, tr, 32, budget=budget, out=buf)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        build_batched(tok, lp, tr, 32, budget=budget, out=buf)
    buf.count.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert int(buf.count.sum()) == 512
    assert math.isfinite(float(buf.score[buf.valid].min()))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 4), m=st.integers(1, 5), K=st.integers(1, 5), n=st.integers(1, 12),
       budget=st.one_of(st.none(), st.integers(0, 40)), cond=st.booleans(), seed=st.integers(0, 10**6))
def test_batched_invariants(B, m, K, n, budget, cond, seed):
    """Prefix closure, budget, cap and agreement with the engine's heap, for any shape."""
    tok, lp, tr = lattice(B, m, K, seed)
    out = build_batched(tok, lp, tr if cond else None, n, budget=budget)
    count = out.count.tolist()
    assert all(0 <= c <= n for c in count)
    if budget is not None:
        total_nodes = sum(min(n, sum(K ** d for d in range(1, m + 1))) for _ in range(B))
        assert sum(count) == min(budget, total_nodes)
    for b in range(B):
        t = out.request(b)
        assert all(-1 <= p < i for i, p in enumerate(t.parents))                        # parents first
        assert all((p == -1) == (d == 0) for p, d in zip(t.parents, t.depth))
        assert all(t.depth[p] + 1 == d for p, d in zip(t.parents, t.depth) if p >= 0)   # prefix-closed
        assert list(t.score) == sorted(t.score, reverse=True)                            # best first
        assert bool(out.valid[b, :count[b]].all()) and not bool(out.valid[b, count[b]:].any())
        if budget is None:
            want = build_best_first(host(tok[b]), host(lp[b]), host(tr[b]) if cond else None, n)
            assert same(t, want)
