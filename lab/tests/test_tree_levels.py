"""The level-sort batched tree kernel (``lab/tree/levels.py``) gives the frontier kernel's trees."""

import json
import os
import subprocess
import sys

import pytest
import torch

from specpilot.kernels.tree.batched import build_batched

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LEVELS_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, ROOT)
from lab.tree.levels import build_batched_levels
from specpilot.kernels.tree.batched import build_batched

def lattice(B, m, K, seed, quant):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 1000, (B, m, K), generator=g)
    lp = torch.log_softmax(torch.randn(B, m, K, generator=g) * 2, -1)
    tr = torch.log_softmax(torch.randn(B, max(m - 1, 0), K, K, generator=g) * 2, -1)
    lp, tr = (lp * quant).round() / quant, (tr * quant).round() / quant   # dyadic: exact ties
    return tok, lp.float(), tr.float()

def rows(out):
    return [(r.tokens, r.parents, r.depth, r.cand, r.score) for r in (out.request(b) for b in range(out.count.numel()))]

bad = []
for case, (B, m, K, n, budget) in enumerate([(2, 3, 3, 6, None), (3, 3, 3, 5, 7)]):
    tok, lp, tr = lattice(B, m, K, 100 + case, 2)
    a = build_batched(tok, lp, tr, n, budget=budget, backend="triton")
    c = build_batched_levels(tok, lp, tr, n, budget=budget)
    if rows(a) != rows(c) or not torch.equal(a.valid, c.valid):
        bad.append(case)
print(json.dumps(bad))
"""


def test_levels_equals_frontier_under_interpreter():
    """Small lattices (the level kernel is slow under the interpreter), with and without a budget."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"ROOT = {ROOT!r}\n" + LEVELS_SCRIPT
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def lattice(B, m, K, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    tok = torch.stack([torch.stack([torch.randperm(500, generator=g)[:K] for _ in range(m)]) for _ in range(B)])
    lp = torch.log_softmax(torch.randn(B, m, K, generator=g, dtype=dtype) * 2, -1).sort(-1, descending=True).values
    tr = torch.log_softmax(torch.randn(B, max(m - 1, 0), K, K, generator=g, dtype=dtype) * 2, -1)
    return tok, lp, tr


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, 4])
def test_frontier_equals_levels_on_cuda(quant):
    """The two Triton kernels, compiled, give identical trees (every field, valid, count)."""
    from lab.tree.levels import build_batched_levels

    tok, lp, tr = lattice(32, 16, 16, 1, dtype=torch.float32)
    if quant:   # dyadic scores: exact ties
        lp, tr = (lp * quant).round() / quant, (tr * quant).round() / quant
    tok, lp, tr = tok.cuda(), lp.cuda(), tr.cuda()
    for t, budget in ((None, None), (tr, None), (tr, torch.tensor(512, device="cuda"))):
        a = build_batched(tok, lp, t, 32, budget=budget)
        c = build_batched_levels(tok, lp, t, 32, budget=budget)
        assert torch.equal(a.valid, c.valid) and torch.equal(a.count, c.count)
        for x, y in ((a.tokens, c.tokens), (a.parents, c.parents), (a.depth, c.depth), (a.cand, c.cand),
                     (a.score, c.score)):
            assert torch.equal(x[a.valid], y[c.valid])

