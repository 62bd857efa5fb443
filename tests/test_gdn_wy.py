"""The TreeWY GDN verification kernel (kernels/gdn/wy.py) against the torch path reference.

On the CPU the kernel runs under Triton's interpreter at small shapes (its bf16 dots are upcast
there, so bf16 inputs are compared with the reference on the same values in fp32); ``-m gpu``
checks Qwen3.5-9B GDN shapes to one bf16 ulp and a CUDA-graph replay."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from specpilot.kernels.gdn import naive, path as gpath  # noqa: E402
from specpilot.kernels.gdn import wy_verify  # noqa: E402
from specpilot.kernels.gdn.wy import wy_verify_segments  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, k, v, g, beta, state, paths):
    """path_verify on the same values in fp32, key heads repeated over the value heads."""
    rep = v.shape[1] // q.shape[1]
    prepared = naive.prepare(q.float().repeat_interleave(rep, 1), k.float().repeat_interleave(rep, 1),
                             v.float(), g.float(), beta.float())
    return gpath.path_verify(*prepared, state, paths)


def _inputs(R, nk=2, nv=4, dk=16, dv=16, dt=torch.float32, seed=0, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(R, nk, dk, generator=gen), torch.randn(R, nk, dk, generator=gen)
    v = torch.randn(R, nv, dv, generator=gen)
    g = -torch.rand(R, nv, generator=gen)
    beta = torch.rand(R, nv, generator=gen)
    state = torch.randn(nv, dk, dv, generator=gen)
    to = lambda t, d=None: t.to(device=device, dtype=d or t.dtype)  # noqa: E731
    return to(q, dt), to(k, dt), to(v, dt), to(g), to(beta), to(state)


def _random_parents(n_nodes, seed, window=None):
    """Row parents of a random tree: row i's parent is an earlier row (among the last ``window``)."""
    rnd = random.Random(seed)
    return [-1] + [rnd.randrange(max(0, i - window) if window else 0, i) for i in range(1, n_nodes + 1)]


def _check(parents, dt=torch.float32, inputs=None, **shape):
    q, k, v, g, beta, state = inputs if inputs is not None else _inputs(len(parents), dt=dt, **shape)
    paths = gpath.row_paths(parents).to(q.device)
    state0 = state.clone()
    o = wy_verify(q, k, v, g, beta, state, paths)
    assert o.dtype == torch.float32 and o.shape == v.shape
    assert torch.equal(state, state0)  # the committed state is not modified
    torch.testing.assert_close(o, _reference(q, k, v, g, beta, state, paths), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_random_trees_match_path_verify(dt):
    _check([-1, 0, 1, 1, 0, 3, 5], dt)               # the path tests' tree
    _check(_random_parents(20, seed=1, window=3), dt)
    _check(_random_parents(32, seed=2), dt, dk=32, dv=32)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_chain_of_depth_15_and_a_63_node_tree(dt):
    _check([-1] + list(range(15)), dt)               # root + 15: one 16-row block
    _check([-1] + list(range(32)), dt)               # a chain across blocks (block substitution)
    _check(_random_parents(63, seed=3, window=6), dt)   # R = 64, the largest tree
    _check(_random_parents(63, seed=4), dt)


@pytest.mark.parametrize("R", [17, 33])
def test_root_first_trees_of_two_to_the_k_plus_one_rows(R):
    """17 and 33 rows: the kernel applies the root, then the nodes in the 16/32-row tile; the
    nodes' paths passed by the caller (the engine's per-step memo) give the same bits."""
    from specpilot.kernels.gdn import wy

    assert wy.root_first(R) and wy.padded_rows(R) == R - 1 and not wy.root_first(R - 1)
    parents = _random_parents(R - 1, seed=R, window=5)
    _check(parents)
    _check(parents, dt=torch.bfloat16)
    q, k, v, g, beta, state = _inputs(R, seed=R)
    paths = gpath.row_paths(parents).to(DEV)
    o = wy_verify(q, k, v, g, beta, state, paths)
    torch.testing.assert_close(wy_verify(q, k, v, g, beta, state, paths, nodes=wy.node_paths(paths)), o, rtol=0, atol=0)
    with pytest.raises(ValueError, match="nodes must be"):
        wy_verify(q, k, v, g, beta, state, paths, nodes=paths)


def test_star_root_only_and_padded_paths():
    _check([-1] + [0] * 31)
    _check([-1])
    # paths wider than the rows (extra -1 columns) give the same outputs
    parents = [-1, 0, 1, 1, 0, 3, 5]
    q, k, v, g, beta, state = _inputs(len(parents), seed=11)
    paths = gpath.row_paths(parents).to(DEV)
    wide = torch.cat([paths, paths.new_full((len(parents), 20), -1)], 1)
    torch.testing.assert_close(wy_verify(q, k, v, g, beta, state, wide), wy_verify(q, k, v, g, beta, state, paths),
                               rtol=0, atol=0)


def test_adversarial_gates_and_repeated_keys():
    """g near 0 and very negative, beta near 0 and 1, and near-identical keys (A's entries near 1)."""
    for parents, seed in (([-1] + list(range(15)), 5), (_random_parents(40, seed=6, window=2), 7)):
        R = len(parents)
        q, k, v, g, beta, state = _inputs(R, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        pick = lambda vals: torch.tensor(vals)[torch.randint(len(vals), g.shape, generator=gen)].to(g)  # noqa: E731
        g = pick([0.0, -1e-6, -1e-3, -5.0, -20.0])
        beta = pick([1e-4, 0.5, 1 - 1e-4])
        _check(parents, inputs=(q, k, v, g, beta, state))
        k_rep = k[:1] + 1e-3 * k                         # nearly one key for every row
        _check(parents, inputs=(q, k_rep, v, g, torch.full_like(beta, 1 - 1e-4), state))


def test_odd_shapes_gqa_and_strided_inputs():
    """dk, dv not powers of two (masks; dv over two programs), 3 value heads per key head,
    q/k/v as views of one fused projection row, int32 paths."""
    R, nk, nv, dk, dv = 21, 2, 6, 24, 48
    gen = torch.Generator().manual_seed(8)
    mixed = torch.randn(R, 2 * nk * dk + nv * dv, generator=gen).to(DEV)
    q = mixed[:, :nk * dk].view(R, nk, dk)
    k = mixed[:, nk * dk:2 * nk * dk].view(R, nk, dk)
    v = mixed[:, 2 * nk * dk:].view(R, nv, dv)
    gb = torch.rand(R, 2 * nv, generator=gen).to(DEV)
    g, beta = -gb[:, :nv], gb[:, nv:]
    state = torch.randn(nv, dk, dv, generator=gen).to(DEV)
    parents = _random_parents(R - 1, seed=9, window=4)
    o = wy_verify(q, k, v, g, beta, state, gpath.row_paths(parents).int().to(DEV))
    ref = _reference(q, k, v, g, beta, state, gpath.row_paths(parents).to(DEV))
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_segments_of_several_requests_equal_their_own_launches(dt):
    """Continuous batching: a tree, a chain and a lone row of three requests in one launch, each
    from its own state slot, give each request's own launch bit for bit (the same tile); states
    are not modified and a slot no request names is never read."""
    sizes, parents = [7, 5, 1], [[-1, 0, 1, 1, 0, 3, 5], [-1, 0, 1, 2, 3], [-1]]
    slots = [2, 0, 3]
    R = sum(sizes)
    q, k, v, g, beta, _ = _inputs(R, dt=dt, seed=5)
    gen = torch.Generator().manual_seed(6)
    states = torch.randn(4, 4, 16, 16, generator=gen).to(DEV)
    states[1] = float("nan")
    before = states.clone()
    rows, segs, want, start = [], [], [], 0
    for n, par, slot in zip(sizes, parents, slots):
        local = gpath.row_paths(par).to(DEV)
        r = slice(start, start + n)
        want.append(wy_verify(q[r], k[r], v[r], g[r], beta[r], states[slot], local))
        rows.append(torch.nn.functional.pad(torch.where(local >= 0, local + start, local), (0, 5 - local.shape[1]),
                                            value=-1))
        segs.append([start, n, slot])
        start += n
    o = wy_verify_segments(q, k, v, g, beta, states, torch.cat(rows), torch.tensor(segs, dtype=torch.int32, device=DEV),
                           max(sizes))
    assert torch.equal(o, torch.cat(want))
    assert torch.equal(states[[0, 2, 3]], before[[0, 2, 3]]) and states[1].isnan().all()
    with pytest.raises(ValueError, match="segs"):
        wy_verify_segments(q, k, v, g, beta, states, torch.cat(rows), torch.tensor(segs, device=DEV), 7)
    with pytest.raises(ValueError, match="1..64"):
        wy_verify_segments(q, k, v, g, beta, states, torch.cat(rows),
                           torch.tensor(segs, dtype=torch.int32, device=DEV), 65)


def test_bad_inputs_are_refused_with_the_reason():
    q, k, v, g, beta, state = _inputs(65)
    with pytest.raises(ValueError, match="1..64 rows"):
        wy_verify(q, k, v, g, beta, state, gpath.row_paths(list(range(-1, 64))).to(DEV))
    q, k, v, g, beta, state = _inputs(7)
    paths = gpath.row_paths([-1, 0, 1, 1, 0, 3, 5]).to(DEV)
    with pytest.raises(ValueError, match="multiple of nk"):
        wy_verify(q[:, :1].expand(7, 3, 16), k[:, :1].expand(7, 3, 16), v, g, beta, state, paths)
    with pytest.raises(ValueError, match="q and k"):
        wy_verify(q, k[:, :, :8], v, g, beta, state, paths)
    with pytest.raises(ValueError, match="v must be"):
        wy_verify(q, k, v[:6], g, beta, state, paths)
    with pytest.raises(ValueError, match="beta must be"):
        wy_verify(q, k, v, g, beta[:, :2], state, paths)
    with pytest.raises(ValueError, match="state must be"):
        wy_verify(q, k, v, g, beta, state[:, :8], paths)
    with pytest.raises(ValueError, match="state must be"):
        wy_verify(q, k, v, g, beta, state.double(), paths)
    with pytest.raises(ValueError, match="paths must be"):
        wy_verify(q, k, v, g, beta, state, paths[:5])
    with pytest.raises(ValueError, match="share a dtype"):
        wy_verify(q, k.bfloat16(), v, g, beta, state, paths)


def test_three_bf16_pieces_hold_the_fp32_state_exactly():
    """The kernel's split of S0 (s1 = bf16(S0), s2 = bf16(S0 - s1), s3 = bf16(S0 - s1 - s2)) loses
    nothing, at any magnitude: the bf16 products on the GPU see all of the state."""
    gen = torch.Generator().manual_seed(10)
    S = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    s1 = S.bfloat16()
    r1 = S - s1.float()
    s2 = r1.bfloat16()
    s3 = (r1 - s2.float()).bfloat16()
    assert torch.equal(s1.double() + s2.double() + s3.double(), S.double())


def _bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    _, e = torch.frexp(x.abs())
    return torch.ldexp(torch.ones_like(x), e - 8)


@pytest.mark.parametrize("R", [33, 64])
def test_within_one_bf16_ulp_of_the_exact_walk_under_strong_decay(R):
    """bf16 inputs, decays as the engine computes them from A_log up to 2.7 (a path's summed decay
    reaches -100): WY's outputs round to within one bf16 ulp of a float64 walk of every path (the
    ulp taken at least at 2^-12 of the row's largest output, as benchmarks/hybrid_gpu.py)."""
    gen = torch.Generator().manual_seed(R)
    nk, nv, dk, dv = 2, 4, 32, 32
    q, k = (torch.randn(R, nk, dk, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(R, nv, dv, generator=gen).bfloat16()
    a, b = torch.randn(R, nv, generator=gen), torch.randn(R, nv, generator=gen)
    g = -(torch.rand(nv, generator=gen) * 2.7).exp() * torch.nn.functional.softplus(a + 1.0)
    beta = torch.sigmoid(b)
    state = torch.randn(nv, dk, dv, generator=gen) * 0.1
    paths = gpath.row_paths(gpath.random_parents(R, R))
    o = wy_verify(*(t.to(DEV) for t in (q, k, v, g, beta, state, paths)))
    rep = nv // nk   # a float64 walk of every path (the fp32-prepared rows, as the path kernel's reference)
    prep = naive.prepare(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta)
    ref = gpath.path_verify(*(t.double() for t in prep), state.double(), paths)
    rb, ob = ref.bfloat16().double(), o.cpu().bfloat16().double()
    ulp = _bf16_ulp(torch.maximum(rb.abs(), rb.abs().amax(-1, keepdim=True) * 2.0 ** -12).float()).double()
    assert ((ob - rb).abs() / ulp).max().item() <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("R", [17, 33, 64])
def test_gpu_qwen35_9b_shapes_within_one_bf16_ulp(R):
    """nk=16, nv=32, dk=dv=128, bf16 inputs: bf16(o) within one bf16 ulp of bf16(o_ref), o_ref the
    fp32 torch path_verify on the GPU; and a CUDA-graph replay gives the eager bits."""
    q, k, v, g, beta, state = _inputs(R, nk=16, nv=32, dk=128, dv=128, dt=torch.bfloat16, seed=R, device="cuda")
    paths = gpath.row_paths(_random_parents(R - 1, seed=R, window=4)).cuda()
    o = wy_verify(q, k, v, g, beta, state, paths)
    ref = _reference(q, k, v, g, beta, state, paths)
    ob, rb = o.bfloat16().float(), ref.bfloat16().float()
    # two fp32 computations of a value that cancels to near zero differ by fp32 rounding of its
    # terms, not by ulps of the value: ulps are taken at least at 2^-12 of the row's largest output
    floor = rb.abs().amax(-1, keepdim=True) * 2.0 ** -12
    ulp = _bf16_ulp(torch.maximum(rb.abs(), floor))
    worst = ((ob - rb).abs() / ulp).max().item()
    assert worst <= 1.0, f"{worst} bf16 ulps"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = wy_verify(q, k, v, g, beta, state, paths)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o)
