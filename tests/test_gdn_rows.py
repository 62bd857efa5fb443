"""GDN row kernels (kernels/gdn/rows.py) against the torch reference (naive.py, path.py), under
Triton's interpreter on the CPU; the engine's GDN layer with impl=triton against impl=torch."""

import pytest
import torch
import torch.nn.functional as F

from specpilot.kernels.gdn import naive, path as gpath, rows as grows

NK, NV, DK, DV, KW = 2, 4, 16, 8, 4
C = 2 * NK * DK + NV * DV


def _layer_inputs(R, seed=0, dtype=torch.float32, gate_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(R, C, generator=gen).to(dtype)
    ab = (torch.randn(R, 2 * NV, generator=gen) * gate_scale).to(dtype)
    A_log = torch.rand(NV, generator=gen) * 2
    dt_bias = torch.ones(NV, dtype=dtype)
    state = torch.randn(NV, DK, DV, generator=gen)
    return qkv, ab, A_log, dt_bias, state


def _reference(qkv, ab, A_log, dt_bias, state, paths):
    """path.path_verify on the kernel's inputs prepared as the torch layer prepares them."""
    R = qkv.shape[0]
    q, k, v = qkv.float().split([NK * DK, NK * DK, NV * DV], -1)
    q = q.reshape(R, NK, DK).repeat_interleave(NV // NK, 1)
    k = k.reshape(R, NK, DK).repeat_interleave(NV // NK, 1)
    b, a = ab.float().chunk(2, -1)
    g = -A_log.exp() * F.softplus(a + dt_bias.float())
    prep = naive.prepare(q, k, v.reshape(R, NV, DV), g, torch.sigmoid(b))
    return prep, gpath.path_verify(*prep, state, paths)


TREES = {
    "tree": [-1, 0, 1, 1, 0, 3, 5],
    "chain15": list(range(-1, 15)),
    "star": [-1] + [0] * 9,
}


@pytest.mark.parametrize("shape", sorted(TREES))
def test_gdn_rows_matches_path_verify(shape):
    parents = TREES[shape]
    R = len(parents)
    qkv, ab, A_log, dt_bias, state = _layer_inputs(R, seed=R)
    paths = gpath.row_paths(parents)
    before = state.clone()
    out = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK)
    _, ref = _reference(qkv, ab, A_log, dt_bias, state, paths)
    assert torch.equal(state, before)
    assert torch.allclose(out.view(R, NV, DV), ref, rtol=1e-4, atol=1e-5)


def test_gdn_rows_random_63_node_tree_and_adversarial_gates():
    gen = torch.Generator().manual_seed(11)
    parents = [-1] + [int(torch.randint(0, r, (1,), generator=gen)) for r in range(1, 64)]
    qkv, ab, A_log, dt_bias, state = _layer_inputs(64, seed=5, gate_scale=12.0)   # beta, decay near 0 and 1
    paths = gpath.row_paths(parents)
    out = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK)
    _, ref = _reference(qkv, ab, A_log, dt_bias, state, paths)
    assert torch.allclose(out.view(64, NV, DV), ref, rtol=1e-4, atol=1e-5)


def test_commit_replay_is_bitwise_sequential_decoding():
    """Replaying accepted rows (one path, state written) equals AR steps one token at a time, and a
    verify row's output equals the AR step's output for that token: one loop body."""
    parents = TREES["tree"]
    R = len(parents)
    qkv, ab, A_log, dt_bias, state = _layer_inputs(R, seed=2)
    paths = gpath.row_paths(parents)
    verify = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK)
    accepted = [0, 1, 3, 5, 6]
    committed = state.clone()
    grows.gdn_rows(qkv, ab, A_log, dt_bias, committed, torch.tensor([accepted]), NK, output=False,
                   new_state=committed)
    seq = state.clone()
    for r in accepted:
        o = grows.gdn_rows(qkv[r:r + 1], ab[r:r + 1], A_log, dt_bias, seq, None, NK, new_state=seq)
        assert torch.equal(o[0], verify[r]), r
    assert torch.equal(committed, seq)


def test_gated_norm_rows_matches_layer_rounding():
    R = 3
    qkv, ab, A_log, dt_bias, state = _layer_inputs(R, seed=9)
    z = torch.randn(R, NV * DV)
    w = torch.rand(DV) + 0.5
    plain = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, grows.chain_paths(R, "cpu"), NK).view(R, NV, DV)
    from specpilot.engine.norm import rms_norm

    ref = rms_norm(plain, w, 1e-6) * F.silu(z.view(R, NV, DV))
    torch.testing.assert_close(grows.gated_norm_rows(plain, z, w, 1e-6).view(R, NV, DV), ref, rtol=1e-5, atol=1e-6)


def test_self_rows_equal_one_row_paths():
    """paths=None (each row walks only itself, the AR step) is the one-row path, bit for bit."""
    R = 4
    qkv, ab, A_log, dt_bias, state = _layer_inputs(R, seed=13)
    own = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, None, NK)
    single = torch.arange(R)[:, None]
    assert torch.equal(own, grows.gdn_rows(qkv, ab, A_log, dt_bias, state, single, NK))


@pytest.mark.parametrize("shape", ["tree", "chain15"])
def test_conv_rows_matches_causal_conv(shape):
    parents = TREES[shape]
    R = len(parents)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(R, C, generator=gen)
    cs = torch.randn(KW - 1, C, generator=gen)
    w = torch.randn(C, KW, generator=gen)
    paths = gpath.row_paths(parents)
    ref = gpath.causal_conv(x, cs, gpath.conv_windows(paths, KW), w)
    got = grows.conv_rows(x, cs, w, paths)
    assert torch.allclose(got, ref, atol=1e-5)
    if shape == "chain15":
        assert torch.allclose(grows.conv_rows(x, cs, w), ref, atol=1e-5)
    kept = torch.full((R + 3, C), float("nan"))   # rows of a larger buffer, as a bucket's kept rows
    assert grows.conv_rows(x, cs, w, paths, out=kept[:R]).data_ptr() == kept.data_ptr()
    assert torch.equal(kept[:R], got) and kept[R:].isnan().all()
    for bad in (kept[:R - 1], kept[:R].double(), torch.empty(C, R).t()):
        with pytest.raises(ValueError, match="conv_rows: out must be"):
            grows.conv_rows(x, cs, w, paths, out=bad)


def test_conv_rows_advance_shifts_state():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, C, generator=gen)
    cs = torch.randn(KW - 1, C, generator=gen)
    w = torch.randn(C, KW, generator=gen)
    want = torch.cat([cs[1:], x])
    out = grows.conv_rows(x, cs.clone(), w)
    cs2 = cs.clone()
    assert torch.equal(grows.conv_rows(x, cs2, w, advance=True), out)
    assert torch.equal(cs2, want)


def test_rows_of_several_requests_each_advance_their_own_slot():
    """Continuous batching (``slots``): each row is the next token of its own request; conv and
    delta rule read and advance that request's states, bit for bit the one-request AR step's."""
    R, n = 3, 4
    slots = torch.tensor([2, 0, 3])
    gen = torch.Generator().manual_seed(9)
    qkv, ab, A_log, dt_bias, _ = _layer_inputs(R, seed=9)
    states = torch.randn(n, NV, DK, DV, generator=gen)
    convs = torch.randn(n, KW - 1, C, generator=gen)
    w = torch.randn(C, KW, generator=gen)
    want_st, want_cv, want_conv, want_o = states.clone(), convs.clone(), [], []
    for r, s in enumerate(slots.tolist()):
        want_conv.append(grows.conv_rows(qkv[r:r + 1], want_cv[s], w, advance=True))
        want_o.append(grows.gdn_rows(want_conv[-1], ab[r:r + 1], A_log, dt_bias, want_st[s], None, NK,
                                     new_state=want_st[s]))
    st, cv = states.clone(), convs.clone()
    conv = grows.conv_rows(qkv, cv, w, advance=True, slots=slots)
    o = grows.gdn_rows(conv, ab, A_log, dt_bias, st, None, NK, new_state=st, slots=slots)
    assert torch.equal(conv, torch.cat(want_conv)) and torch.equal(o, torch.cat(want_o))
    assert torch.equal(st, want_st) and torch.equal(cv, want_cv)
    assert torch.equal(st[1], states[1]) and torch.equal(cv[1], convs[1])   # a slot no row names stays
    with pytest.raises(ValueError, match="slots"):
        grows.gdn_rows(conv, ab, A_log, dt_bias, st[0], None, NK, slots=slots)
    with pytest.raises(ValueError, match="slots"):
        grows.conv_rows(qkv, cv[0], w, slots=slots)


def test_verify_rows_of_several_requests_walk_their_own_paths_and_states():
    """Continuous batching with paths: several requests' verify rows in one launch (a tree, a chain
    and a single pending row), each row walking its root path within its request's rows from that
    request's committed conv and recurrent state; bit for bit the one-request launches, states
    untouched."""
    gen = torch.Generator().manual_seed(21)
    parents = {2: [-1, 0, 1, 1, 0, 3], 0: list(range(-1, 4)), 3: [-1]}     # slot -> its rows' parents
    sizes = [len(p) for p in parents.values()]
    R = sum(sizes)
    qkv, ab, A_log, dt_bias, _ = _layer_inputs(R, seed=21)
    states = torch.randn(4, NV, DK, DV, generator=gen)
    convs = torch.randn(4, KW - 1, C, generator=gen)
    w = torch.randn(C, KW, generator=gen)
    want_conv, want_o, rows_paths, slots = [], [], [], []
    start = 0
    for (slot, par), n in zip(parents.items(), sizes):
        local = gpath.row_paths(par)
        r = slice(start, start + n)
        want_conv.append(grows.conv_rows(qkv[r], convs[slot], w, local))
        want_o.append(grows.gdn_rows(want_conv[-1], ab[r], A_log, dt_bias, states[slot], local, NK))
        rows_paths.append(torch.where(local >= 0, local + start, local))
        slots += [slot] * n
        start += n
    depth = max(p.shape[1] for p in rows_paths)
    paths = torch.cat([F.pad(p, (0, depth - p.shape[1]), value=-1) for p in rows_paths])
    slots = torch.tensor(slots)
    st, cv = states.clone(), convs.clone()
    conv = grows.conv_rows(qkv, cv, w, paths, slots=slots)
    o = grows.gdn_rows(conv, ab, A_log, dt_bias, st, paths, NK, slots=slots)
    assert torch.equal(conv, torch.cat(want_conv)) and torch.equal(o, torch.cat(want_o))
    assert torch.equal(st, states) and torch.equal(cv, convs)
    with pytest.raises(ValueError, match="advance"):
        grows.conv_rows(qkv, cv, w, paths, advance=True, slots=slots)
    with pytest.raises(ValueError, match="slots"):
        grows.gdn_rows(conv, ab, A_log, dt_bias, st, paths, NK, new_state=st, slots=slots)


def test_commit_of_several_requests_replays_each_path_into_its_own_slot():
    """A batched commit (paths [P, L], slots [P], no output, the state itself as new_state): each
    request's accepted path is replayed into its own slot's state, bit for bit the one-request
    commit; slots no path names stay as they were."""
    gen = torch.Generator().manual_seed(23)
    R = 11
    qkv, ab, A_log, dt_bias, _ = _layer_inputs(R, seed=23)
    states = torch.randn(4, NV, DK, DV, generator=gen)
    accepted = {2: [0, 1, 3], 0: [5, 6], 3: [8]}            # slot -> accepted rows of the walked step
    want = states.clone()
    for slot, rows in accepted.items():
        grows.gdn_rows(qkv, ab, A_log, dt_bias, want[slot], torch.tensor([rows]), NK, output=False,
                       new_state=want[slot])
    paths = torch.full((3, 3), -1, dtype=torch.long)
    for b, rows in enumerate(accepted.values()):
        paths[b, :len(rows)] = torch.tensor(rows)
    st = states.clone()
    assert grows.gdn_rows(qkv, ab, A_log, dt_bias, st, paths, NK, output=False, new_state=st,
                          slots=torch.tensor(list(accepted))) is None
    assert torch.equal(st, want) and torch.equal(st[1], states[1])
    with pytest.raises(ValueError, match="commit"):   # a commit writes the states it reads
        grows.gdn_rows(qkv, ab, A_log, dt_bias, st, paths, NK, output=False, new_state=st.clone(),
                       slots=torch.tensor(list(accepted)))
    with pytest.raises(ValueError, match="slots"):    # one slot per path
        grows.gdn_rows(qkv, ab, A_log, dt_bias, st, paths, NK, output=False, new_state=st, slots=torch.tensor([2, 0]))


def test_bad_inputs_are_refused():
    qkv, ab, A_log, dt_bias, state = _layer_inputs(3)
    paths = grows.chain_paths(3, "cpu")
    with pytest.raises(ValueError, match="qkv"):
        grows.gdn_rows(qkv[:, 1:], ab, A_log, dt_bias, state, paths, NK)
    with pytest.raises(ValueError, match="paths"):
        grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths[:2], NK)
    with pytest.raises(ValueError, match="one row.s path"):
        grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK, new_state=state)
    with pytest.raises(ValueError, match="float32"):
        grows.gdn_rows(qkv, ab, A_log, dt_bias, state.double(), paths, NK)
    with pytest.raises(ValueError, match="advance"):
        grows.conv_rows(torch.randn(2, C), torch.randn(KW - 1, C), torch.randn(C, KW), advance=True)
    with pytest.raises(ValueError, match="at least one row"):
        grows.chain_paths(0, "cpu")
    long = grows.chain_paths(100, "cpu")         # the cached table grows for a longer chain
    assert long.shape == (100, 100) and long[99, 99] == 99 and long[3, 4] == -1


def _step_engine(impl, mode="ar"):
    from specpilot.engine.api import load_engine

    e = load_engine(f"engine:model=tiny-hybrid,ctx=128,mode={mode}")
    for m in e.model.gdn_layers():
        m.impl = impl
    return e


# tiny-hybrid's n-gram drafts for this prompt: nothing for two steps, then two tokens, then a branching
# tree of 6 (chain: 3), then steps from the states that tree's commit left (8 tokens: at 6 the tree
# is cut to the two tokens the request can still take)
PROMPT, NEW = list(b"ab path"), 8


def _drafted_rows(r) -> int:
    """The most rows a verify step of generation result ``r`` ran (1: it verified no drafts)."""
    return max(t[0] for t in r.step_times)


@pytest.fixture(scope="module")
def torch_ar():
    """tiny-hybrid's AR tokens through the torch layers (fp32)."""
    return _step_engine("torch").generate(PROMPT, max_new_tokens=NEW).output_ids


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_engine_kernels_give_ar_tokens_and_match_torch(mode, torch_ar):
    """tiny-hybrid (fp32) through the row kernels: AR and the speculative modes (verifying drafted
    rows) give the torch layers' AR tokens."""
    r = _step_engine("triton", mode).generate(PROMPT, max_new_tokens=NEW)
    assert r.output_ids == torch_ar
    assert _drafted_rows(r) == {"ar": 1, "chain": 4, "tree": 7}[mode]


def test_decay_rows_match_the_layer():
    R = 5
    qkv, ab, A_log, dt_bias, state = _layer_inputs(R, seed=12)
    g, beta = grows.decay_rows(ab, A_log, dt_bias)
    b, a = ab.float().chunk(2, -1)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, torch.sigmoid(b), rtol=1e-5, atol=1e-6)


def test_engine_wy_verify_gives_ar_tokens(torch_ar):
    """tiny-hybrid (fp32) with the GDN layers verifying through TreeWY: AR's tokens."""
    e = _step_engine("triton", "tree")
    for m in e.model.gdn_layers():
        m.verify = "wy"
    r = e.generate(PROMPT, max_new_tokens=NEW)
    assert r.output_ids == torch_ar and _drafted_rows(r) == 7


def test_prompts_take_the_walk_only_when_short_and_compiled(monkeypatch):
    """A prompt chunk walks its rows (O(rows^2)) only on a GPU without fla and up to
    WALKED_PROMPT_ROWS rows; under the interpreter the torch recurrence is the faster."""
    from specpilot.kernels.gdn import prefill

    assert not grows.walks_prompt(8, "cpu")                  # the CPU tests run interpreted
    monkeypatch.setattr(grows, "interpreting", lambda: False)
    monkeypatch.setattr(prefill, "available", lambda device: False)
    assert grows.walks_prompt(grows.WALKED_PROMPT_ROWS, "cuda")
    assert not grows.walks_prompt(grows.WALKED_PROMPT_ROWS + 1, "cuda")
    monkeypatch.setattr(prefill, "available", lambda device: True)
    assert not grows.walks_prompt(8, "cuda")


def test_verify_method_defaults_to_path_off_cuda_and_above_64_rows():
    assert grows.verify_method(33, "cpu") == "path"
    assert grows.verify_method(65, "cpu") == "path"


@pytest.mark.parametrize("rows", [17, 33])
def test_layer_wy_with_and_without_the_root_split_equals_the_path_kernel(rows):
    """A GDN layer's verify outputs through TreeWY (33 rows: the root alone, then its 32-node forest
    from the root's state) equal the path kernel's."""
    from specpilot.engine.api import load_engine
    from specpilot.engine.step_input import StepInput

    m = load_engine("engine:model=tiny-hybrid,ctx=128").model
    layer = m.gdn_layers()[0]
    layer.impl = "triton"
    gen = torch.Generator().manual_seed(rows)
    layer.state.copy_(torch.randn(layer.state.shape, generator=gen) * 0.3)
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=gen))
    parents = [-1] + [int(torch.randint(0, r, (1,), generator=gen)) for r in range(1, rows)]
    pos = torch.arange(rows)
    inp = StepInput(torch.zeros(rows, dtype=torch.long), pos, pos, torch.ones(rows, 128, dtype=torch.bool), "tree",
                    gpath.row_paths(parents))
    proj = torch.randn(rows, layer.in_proj.out_features, generator=gen)
    outs = {}
    for method in ("path", "wy"):
        layer.verify = method
        outs[method] = layer.mix(proj, inp)
    torch.testing.assert_close(outs["wy"], outs["path"], rtol=1e-4, atol=1e-5)


def test_paths_longer_than_64_rows():
    """The walk has no depth limit: a commit replaying 70 rows equals the sequential recurrence."""
    R = 70
    qkv, ab, A_log, dt_bias, state = _layer_inputs(R, seed=70)
    new = state.clone()
    grows.gdn_rows(qkv, ab, A_log, dt_bias, new, torch.arange(R)[None], NK, output=False, new_state=new)
    q, k, v = qkv.float().split([NK * DK, NK * DK, NV * DV], -1)
    b, a = ab.float().chunk(2, -1)
    g = -A_log.exp() * F.softplus(a + dt_bias.float())
    prep = naive.prepare(q.reshape(R, NK, DK).repeat_interleave(NV // NK, 1),
                         k.reshape(R, NK, DK).repeat_interleave(NV // NK, 1), v.reshape(R, NV, DV), g, torch.sigmoid(b))
    _, last = naive.recurrent(*prep, state, keep_states=False)
    assert torch.allclose(new, last[0], rtol=1e-4, atol=1e-5)


def test_prompt_chunks_of_several_requests_in_one_conv_launch():
    """``starts``: several requests' prompt chunks one after another, each row's window from its
    own request's conv state and earlier rows, bit for bit the one-request conv of each chunk;
    ``advance_conv_segments`` leaves each window where the one-request advance does (chunks
    shorter than the window included)."""
    lengths, slots = [5, 1, 2, 7], [3, 0, 2, 1]
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(sum(lengths), C, generator=gen)
    convs = torch.randn(5, KW - 1, C, generator=gen)
    w = torch.randn(C, KW, generator=gen)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    want_out, want_cv = [], convs.clone()
    for s, a, n in zip(slots, starts, lengths):
        want_out.append(grows.conv_rows(x[a:a + n], convs[s], w))
        want_cv[s] = torch.cat([convs[s], x[a:a + n]])[-(KW - 1):]
    row_slot = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)])
    row_start = torch.tensor([a for a, n in zip(starts, lengths) for _ in range(n)])
    cv = convs.clone()
    assert torch.equal(grows.conv_rows(x, cv, w, slots=row_slot, starts=row_start), torch.cat(want_out))
    grows.advance_conv_segments(cv, x, slots, starts, lengths)
    assert torch.equal(cv, want_cv)
    assert torch.equal(cv[4], convs[4])   # a slot no chunk names stays
    with pytest.raises(ValueError, match="starts"):
        grows.conv_rows(x, cv[0], w, starts=row_start)
    with pytest.raises(ValueError, match="starts"):
        grows.conv_rows(x, cv, w, grows.chain_paths(x.shape[0], "cpu"), slots=row_slot, starts=row_start)


def test_commit_graph_replays_the_accepted_gdn_path_as_the_eager_commit(monkeypatch):
    """tiny-hybrid (fp32) through the row kernels, a 4-row tree step through a GraphRunner (capture
    stood in by eager replays): the commit graph of the accepted rows leaves the GDN states, conv
    states and K/V bit for bit as Transformer.commit does."""
    from specpilot.kernels import tree as T
    from eager_runner import check_commit_graph

    tree = T.DraftTree((5, 9, 7), (-1, -1, 1), (0, 0, 1), (0, 1, 0), (0.0,) * 3)
    runner = check_commit_graph(_step_engine("triton", "tree"), list(b"gated delta"), tree, [0, 2, 3], monkeypatch)
    assert set(runner.commits) == {(4, 3, True)}
