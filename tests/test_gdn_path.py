"""GDN: path verification and commit replay against plain sequential recurrence; conv windows."""

import torch

from specpilot.kernels.gdn import naive, path as gpath


def _inputs(R, H=2, dk=4, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(R, H, dk, generator=g), torch.randn(R, H, dk, generator=g)
    v = torch.randn(R, H, dv, generator=g)
    gate = -torch.rand(R, H, generator=g)
    beta = torch.rand(R, H, generator=g)
    return naive.prepare(q, k, v, gate, beta)


def test_step_matches_closed_form():
    q, k, v, g, b = _inputs(1)
    S = torch.randn(2, 4, 3)
    s1, o = naive.step(S[None], q, k, v, g, b)
    # closed form per head: S' = a S + k beta (v - a S^T k)^T
    for h in range(2):
        a = g[0, h].exp()
        Sa = a * S[h]
        ref = Sa + torch.outer(k[0, h], b[0, h] * (v[0, h] - Sa.t() @ k[0, h]))
        assert torch.allclose(s1[0, h], ref, atol=1e-6)
        assert torch.allclose(o[0, h], ref.t() @ q[0, h], atol=1e-6)


def _tree_rows():
    # rows: 0 root; tree nodes 1..6 with parents (rows) 0,1,1,0,3,5
    parents = [-1, 0, 1, 1, 0, 3, 5]
    return parents


def test_path_verify_equals_sequential_along_each_path():
    parents = _tree_rows()
    R = len(parents)
    q, k, v, g, b = _inputs(R, seed=3)
    state = torch.randn(2, 4, 3)
    paths = gpath.row_paths(parents)
    out = gpath.path_verify(q, k, v, g, b, state, paths)
    for r in range(R):
        rows = [x for x in paths[r].tolist() if x >= 0]
        o_seq, _ = naive.recurrent(q[rows], k[rows], v[rows], g[rows], b[rows], state)
        assert torch.equal(out[r], o_seq[-1]), r  # bit for bit
    assert torch.equal(state, state.clone())


def test_commit_replay_equals_sequential_and_chain_snapshot():
    q, k, v, g, b = _inputs(5, seed=4)
    state = torch.randn(2, 4, 3)
    accepted = [0, 2, 4]
    new = gpath.commit(q, k, v, g, b, state, accepted)
    _, states = naive.recurrent(q[accepted], k[accepted], v[accepted], g[accepted], b[accepted], state)
    assert torch.equal(new, states[-1])
    # chain: path verification of a chain equals the sequential snapshots' outputs
    chain = gpath.row_paths([-1, 0, 1, 2, 3])
    out_tree = gpath.path_verify(q, k, v, g, b, state, chain)
    out_seq, _ = naive.recurrent(q, k, v, g, b, state)
    assert torch.equal(out_tree, out_seq)


def test_conv_windows_match_conv1d_along_paths():
    C, K = 5, 4
    parents = _tree_rows()
    R = len(parents)
    x = torch.randn(R, C)
    conv_state = torch.randn(K - 1, C)
    w = torch.randn(C, K)
    paths = gpath.row_paths(parents)
    got = gpath.causal_conv(x, conv_state, gpath.conv_windows(paths, K), w)
    for r in range(R):
        rows = [i for i in paths[r].tolist() if i >= 0]
        seq = torch.cat([conv_state, x[rows]], 0).t()[None]  # [1, C, L]
        ref = torch.nn.functional.silu(torch.nn.functional.conv1d(seq, w[:, None, :], groups=C))[0, :, -1]
        assert torch.allclose(got[r], ref, atol=1e-5)
    chain = gpath.causal_conv(x, conv_state, gpath.chain_windows(R, K), w)
    assert torch.equal(chain, gpath.causal_conv(x, conv_state, gpath.conv_windows(gpath.row_paths(list(range(-1, R - 1))), K), w))


def test_hybrid_tree_forward_with_chain_shape_equals_chain_mode():
    """Chain-shaped trees give results identical to the chain (stock) mode, bit for bit."""
    from specpilot.engine.api import load_engine
    from specpilot.engine.step_input import StepInput

    e = load_engine("engine:model=tiny-hybrid,ctx=256")
    m = e.model
    prompt = list(b"hybrid models keep state")
    m.reset()
    pos = torch.arange(len(prompt))
    mask = torch.arange(256)[None, :] <= pos[:, None]
    m(StepInput(torch.tensor(prompt), pos, pos, mask, "seq"))
    saved = [(g.state.clone(), g.conv_state.clone()) for g in m.gdn_layers()]
    n = len(prompt)
    rows = torch.tensor([1, 2, 3, 4, 5])
    slots = n + torch.arange(5)
    mask2 = torch.arange(256)[None, :] <= slots[:, None]
    chain_paths = gpath.row_paths([-1, 0, 1, 2, 3])
    a = m(StepInput(rows, slots, slots, mask2, "chain"))
    m.commit(n, [0, 1, 2], "chain")
    after_chain = [(g.state.clone(), g.conv_state.clone()) for g in m.gdn_layers()]
    for g, (s, c) in zip(m.gdn_layers(), saved):
        g.state.copy_(s)
        g.conv_state.copy_(c)
    b = m(StepInput(rows, slots, slots, mask2, "tree", chain_paths))
    m.commit(n, [0, 1, 2], "tree")
    assert torch.equal(a, b)
    for (s1, c1), g in zip(after_chain, m.gdn_layers()):
        assert torch.equal(s1, g.state) and torch.equal(c1, g.conv_state)


def test_naive_rule_matches_transformers_qwen3_next_reference(monkeypatch):
    """Our gated delta rule equals transformers' torch_recurrent_gated_delta_rule (Qwen3-Next)."""
    import importlib
    import sys

    mod = __import__("pytest").importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    # with fla-core installed transformers swaps in fla's Triton kernel; the torch function is the
    # reference, so load the module once as if fla were absent (and restore it afterwards)
    monkeypatch.setitem(sys.modules, "fla", None)
    mod = importlib.reload(mod)
    monkeypatch.undo()
    try:
        _compare_with(mod)
    finally:
        importlib.reload(mod)


def _compare_with(mod):
    gen = torch.Generator().manual_seed(7)
    Tn, H, dk, dv = 6, 2, 8, 4
    q, k = torch.randn(1, Tn, H, dk, generator=gen), torch.randn(1, Tn, H, dk, generator=gen)
    v = torch.randn(1, Tn, H, dv, generator=gen)
    g = -torch.rand(1, Tn, H, generator=gen)
    beta = torch.rand(1, Tn, H, generator=gen)
    state = torch.randn(1, H, dk, dv, generator=gen)
    ref_out, ref_state = mod.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    pq, pk, pv, pg, pb = naive.prepare(q[0], k[0], v[0], g[0], beta[0])
    out, states = naive.recurrent(pq, pk, pv, pg, pb, state[0])
    assert torch.allclose(out, ref_out[0], atol=1e-5)
    assert torch.allclose(states[-1], ref_state[0], atol=1e-5)


def test_random_parents_are_topological_and_depth_bounded():
    parents = gpath.random_parents(64, seed=3, max_depth=5)
    assert parents[0] == -1 and all(0 <= p < r for r, p in enumerate(parents) if r)
    assert max((gpath.row_paths(parents) >= 0).sum(1)) <= 6   # root + 5 levels
    assert parents == gpath.random_parents(64, seed=3, max_depth=5)
