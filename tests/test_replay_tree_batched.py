"""The batched best-first builder (shared node budget) against the engine's single-request builder."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from specpilot.kernels.tree import build_best_first, build_best_first_shared
from specpilot.kernels.tree.batched import build_batched
from specpilot.kernels.tree.naive import build_batched_ref


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


def test_a_shared_budget_breaks_score_ties_as_the_engines_heap_does():
    """A tie at the budget's edge goes to the shallower node, then the earlier request (the heap's
    order): the batched mask gave it to the earlier request whatever its depth (A's second node
    before B's first, tau 3.0 where the heap's trees give 2.75)."""
    half, eighth = -0.5, -0.125
    tok = torch.tensor([[[10], [11], [0]], [[20], [0], [0]], [[30], [31], [32]], [[40], [41], [42]]])
    lp = torch.tensor([[[half], [half], [-math.inf]], [[-1.0], [-math.inf], [-math.inf]],
                       [[eighth], [eighth], [eighth]], [[eighth], [eighth], [eighth]]])
    out = build_batched_ref(tok, lp, None, 4, budget=8)
    want = build_best_first_shared([(tok[b].tolist(), lp[b].tolist(), None) for b in range(4)], 8)
    assert [len(w.tokens) for w in want] == [1, 1, 3, 3]
    for b in range(4):
        assert same(out.request(b), want[b]), b
    # dyadic random lattices (exact ties everywhere) against the heap wherever no request is capped
    checked = 0
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        B, m, K, n, budget = 3, 3, 3, 12, 2 + seed % 9
        tok = torch.randint(0, 100, (B, m, K), generator=g)
        lp = (torch.log_softmax(torch.randn(B, m, K, generator=g), -1) * 2).round() / 2
        want = build_best_first_shared([(tok[b].tolist(), lp[b].tolist(), None) for b in range(B)], budget)
        if any(len(w.tokens) > n for w in want):
            continue
        out = build_batched_ref(tok, lp, None, n, budget=budget)
        assert all(same(out.request(b), want[b]) for b in range(B)), seed
        checked += 1
    assert checked > 40


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
from specpilot.kernels.tree.batched import build_batched
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


def _interpreted(script: str, timeout: int) -> str:
    """``script``'s output, run under Triton's interpreter: in this process where kernels already
    run interpreted (the CPU suite: no interpreter start-up, and conftest's cheaper device calls),
    else in a fresh one with ``TRITON_INTERPRET=1``."""
    from specpilot.kernels.triton_env import interpreting

    if interpreting():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
        return out.getvalue()
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_triton_kernel_under_interpreter():
    res = json.loads(_interpreted(TRITON_SCRIPT, 300).strip().splitlines()[-1])
    assert all(ok for ok, _ in res), res
    assert sum(n for _, n in res[-3:]) == 7          # the shared budget is spent exactly


FRONTIER_SCRIPT = r"""
import json, random, torch
from specpilot.kernels.tree import build_best_first, build_best_first_shared
from specpilot.kernels.tree.batched import build_batched
from specpilot.kernels.tree.naive import build_batched_ref

def lattice(B, m, K, seed, quant, neg):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 1000, (B, m, K), generator=g)
    lp = torch.log_softmax(torch.randn(B, m, K, generator=g) * 2, -1)
    tr = torch.log_softmax(torch.randn(B, max(m - 1, 0), K, K, generator=g) * 2, -1)
    if quant:                                    # dyadic scores: many exact ties, exact float sums
        lp, tr = (lp * quant).round() / quant, (tr * quant).round() / quant
    if neg:
        tr[torch.rand(tr.shape, generator=g) < neg] = float("-inf")
        lp[torch.rand(lp.shape, generator=g) < neg] = float("-inf")
    return tok, lp.float(), tr.float()

def rows(out):
    return [(r.tokens, r.parents, r.depth, r.cand, r.score) for r in (out.request(b) for b in range(out.count.numel()))]

res = {"cases": 0, "ties": 0, "bad_ref": [], "bad_heap": [], "bad_valid": []}
for case in range(36):
    r = random.Random(case)
    B, m, K, n = r.randint(1, 4), r.randint(1, 5), r.randint(1, 6), r.randint(1, 20)
    cond, quant = r.random() < 0.6, r.choice([None, 1, 2, 2, 4])
    neg = r.choice([0.0, 0.0, 0.3])
    budget = r.choice([None, None, r.randint(0, 40)])
    tok, lp, tr = lattice(B, m, K, case, quant, neg)
    t = tr if cond else None
    out = build_batched(tok, lp, t, n, budget=budget, backend="triton")
    ref = build_batched_ref(tok, lp, t, n, budget)
    res["cases"] += 1
    s = out.score[out.valid]
    res["ties"] += int(s.numel() - s.unique().numel())
    if rows(out) != rows(ref):
        res["bad_ref"].append(case)
    if not (torch.equal(out.valid, ref.valid) and torch.equal(out.count, ref.count)):
        res["bad_valid"].append(case)
    if budget is None:
        want = [build_best_first(tok[b].tolist(), lp[b].double().tolist(), t[b].double().tolist() if cond else None,
                                 n) for b in range(B)]
    else:   # the engine's shared heap, where no request reaches the per-request cap n
        want = build_best_first_shared([(tok[b].tolist(), lp[b].double().tolist(),
                                         t[b].double().tolist() if cond else None) for b in range(B)], budget)
        if any(len(w.tokens) > n for w in want):
            want = None
    for b in range(B if want is not None else 0):
        got = out.request(b)
        if (got.tokens, got.parents, got.depth, got.cand) != (want[b].tokens, want[b].parents, want[b].depth,
                                                              want[b].cand):
            res["bad_heap"].append([case, b])
print(json.dumps(res))
"""


def test_frontier_kernel_exact_with_ties_under_interpreter():
    """The frontier kernel against the torch reference and the engine's heap on many small random
    lattices, most with dyadic scores (exact ties everywhere), some with -inf edges and shared
    budgets."""
    res = json.loads(_interpreted(FRONTIER_SCRIPT, 600).strip().splitlines()[-1])
    assert res["cases"] == 36 and res["ties"] > 50, res            # ties were really exercised
    assert res["bad_ref"] == [] and res["bad_valid"] == [] and res["bad_heap"] == [], res


def test_frontier_kernel_compiles_for_sm90():
    """Compiled (not run) for the H200's architecture: the interpreter skips the L1 prefetch.

    In a fresh interpreter with ``TRITON_INTERPRET=0``: other test modules turn the interpreter on
    for this process, and kernels defined under it cannot be compiled."""
    import os
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from specpilot.kernels.tree import batched as tb
        sig = {a: "*fp32" for a in ("lp_ptr", "tr_ptr", "o_score")}
        sig.update({a: "*i64" for a in ("tok_ptr", "o_tok", "o_par", "o_dep", "o_cand", "o_count")})
        sig["o_valid"] = "*i1"
        const = {"M": 16, "K": 16, "N": 32, "BK": 16, "BN": 32, "LOG_BK": 4, "LOG_BN": 5, "HAS_TR": True,
                 "PREFETCH": True, "PF_TR": 128, "PF_LP": 16, "PF_TOK": 32}
        sig.update({k: "constexpr" for k in const})
        k = triton.compile(ASTSource(fn=tb._frontier_kernel, signature=sig, constexprs=const),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        print("prefetch.global.L1" in k.asm["ptx"])
    """)
    env = dict(os.environ, TRITON_INTERPRET="0")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.gpu
def test_triton_on_cuda_and_graph_capture():
    from specpilot.kernels.tree.batched import alloc

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
