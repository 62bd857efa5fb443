"""Deterministic (row-invariant) steps: the GEMM and attention kernels give a row the bits it has
alone, and a tree step's rows are bitwise the AR steps along their paths (CPU: Triton's
interpreter; the GPU tests at the end run the engine on Qwen3.5-9B and Llama-3.1-8B shapes)."""

import copy

import pytest
import torch

from specpilot.kernels.attention import invariant as attn
from specpilot.kernels.attention import naive as attn_ref
from specpilot.kernels.gdn import path as gpath
from specpilot.kernels.verify import invariant as gemm
from specpilot.kernels.verify import naive as gemm_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,k,n", [(40, 200, 150), (64, 300, 130)])
def test_invariant_linear_rows_are_their_bits_alone(m, k, n):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    y = gemm.linear(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), gemm_ref.linear(x.float(), w.float()), atol=2e-2, rtol=2 ** -7)
    for r in (0, 5, 16, m - 1):              # first and later row tiles, first and inner rows of a tile
        assert torch.equal(gemm.linear(x[r:r + 1], w)[0], y[r])
    assert torch.equal(gemm.linear(x[3:20], w), y[3:20])


def test_invariant_linear_split_depends_on_the_weight_only():
    assert gemm.split_for(4096, 4096, "cpu") == gemm.split_for(4096, 4096, "cpu") >= 1
    assert gemm.split_for(128256, 4096, "cpu") == 1          # an LM head has programs enough
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemm.linear(torch.zeros(3, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="no rows"):
        gemm.linear(torch.zeros(0, 8), torch.zeros(4, 8))


def _tree_mask(T, S, n, parents):
    mask = torch.zeros(T, S, dtype=torch.bool)
    mask[:, :n] = True
    for r, path in enumerate(gpath.row_paths(parents).tolist()):
        mask[r, [n + a for a in path if a >= 0]] = True
    return mask


def test_key_table_lists_each_rows_visible_slots_in_order():
    mask = _tree_mask(4, 12, 5, [-1, 0, 0, 2])
    keys, n = attn.key_table(mask)
    assert n.tolist() == [6, 7, 7, 8]
    assert keys[3, :8].tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    assert keys[1, :7].tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_invariant_attention_row_equals_its_keys_alone():
    """Each row of a tree step (committed prefix over two splits, ancestors at scattered slots) has
    the bits of the same query over the same keys laid out at consecutive slots (an AR step)."""
    torch.manual_seed(0)
    nh, nkv, hd, S, n = 8, 2, 32, 300, 200
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 7]
    T = len(parents)
    q, k, v = torch.randn(T, nh, hd), torch.randn(nkv, S, hd), torch.randn(nkv, S, hd)
    mask = _tree_mask(T, S, n, parents)
    out = attn.masked_gqa_attention(q, k, v, mask, hd ** -0.5)
    torch.testing.assert_close(out, attn_ref.masked_gqa_attention(q, k, v, mask, hd ** -0.5), atol=1e-5, rtol=1e-5)
    for r in (0, 4, 8):
        seen = mask[r].nonzero()[:, 0]
        kk, vv = torch.zeros_like(k), torch.zeros_like(v)
        kk[:, :len(seen)], vv[:, :len(seen)] = k[:, seen], v[:, seen]
        alone = torch.zeros(1, S, dtype=torch.bool)
        alone[0, :len(seen)] = True
        assert torch.equal(attn.masked_gqa_attention(q[r:r + 1], kk, vv, alone, hd ** -0.5)[0], out[r])
    with pytest.raises(ValueError, match="mask must be"):
        attn.masked_gqa_attention(q, k, v, mask[:, :10], hd ** -0.5)


def _deterministic_model(name, ctx):
    from specpilot.engine.api import build_model

    m, _, _ = build_model(name, True, torch.float32, DEV, ctx)
    for g in m.gdn_layers():
        g.impl = "triton"        # the row kernels (the interpreter on the CPU)
    assert m.set_decode("fused") == "fused"
    assert m.set_deterministic(True) and all(g.verify == "path" for g in m.gdn_layers())
    return m


@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid"])
def test_tree_step_rows_are_the_ar_steps_along_their_paths_bitwise(name):
    """After a prompt, one tree step of 6 rows gives each row on the deepest path the hidden state,
    bit for bit, of AR steps taking that path's tokens one at a time; the committed caches too."""
    from specpilot.engine.step_input import StepInput

    ctx, n = 32, 9
    m = _deterministic_model(name, ctx)
    if name == "tiny":
        m.layers = m.layers[:2]     # attention into the next layer and into the head: enough, and quicker
    ar = torch.arange(ctx)
    pos = torch.arange(n)
    m.hidden(StepInput(torch.arange(20, 20 + n), pos, pos, ar[None, :] <= pos[:, None], "seq"), ctx)
    twin = copy.deepcopy(m)
    parents = [-1, 0, 1, 0, 3, 4]
    depth = [0, 1, 2, 1, 2, 3]
    T = len(parents)
    tokens = torch.tensor([7, 30, 31, 40, 41, 42])
    step = StepInput(tokens, torch.tensor([n + d for d in depth]), n + torch.arange(T), _tree_mask(T, ctx, n, parents),
                     "tree", gpath.row_paths(parents))
    tree = m.hidden(step, ctx)
    for row in (0, 3, 4, 5):                # the root path of row 5
        p = n + depth[row]
        one = twin.hidden(StepInput(tokens[row:row + 1], torch.tensor([p]), torch.tensor([p]), (ar <= p)[None], "seq"), ctx)
        assert torch.equal(one[0], tree[row]), row
    m.commit(n, [0, 3, 4, 5], "tree")
    for a, b in zip(m.layers, twin.layers):
        for name_ in ("k_cache", "v_cache", "state", "conv_state"):
            if hasattr(a.mixer, name_):
                x, y = getattr(a.mixer, name_), getattr(b.mixer, name_)
                assert torch.equal(x[..., :n + 4, :] if "cache" in name_ else x, y[..., :n + 4, :] if "cache" in name_ else y)


@pytest.mark.parametrize("args,why", [
    (["--device", "cpu"], "--deterministic needs --device cuda"),
    (["--device", "cuda", "--decode", "layers"], "drop --decode layers"),
    (["--device", "cuda", "--w12"], "not --w12"),
    (["--device", "cuda", "--batch", "2"], "one request at a time"),
    (["--device", "cuda", "--model", "tiny-hybrid", "--gdn", "wy"], "--gdn wy rounds otherwise"),
    (["--device", "cuda", "--mode", "tree", "--nodes", "64"], "lower --nodes to 63"),
    (["--device", "cuda", "--mode", "chain", "--depth", "64"], "lower --depth to 63"),
])
def test_run_refuses_what_deterministic_cannot_do(run_cli, args, why):
    code, out, err = run_cli("run", "--model", "tiny", "--deterministic", "--max-new-tokens", "2", "--prompt", "ab", *args)
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1 and not out


def test_spec_text_round_trips():
    from specpilot.engine.spec import EngineSpec

    s = EngineSpec.parse("engine:model=tiny,device=cuda,deterministic=1,mode=tree,nodes=32")
    assert s.deterministic and EngineSpec.parse(str(s)) == s


def test_run_table_title_says_the_steps_are_deterministic():
    from specpilot.engine.spec import EngineSpec
    from specpilot.commands.run import _title

    spec = EngineSpec.parse("engine:model=tiny,device=cuda,deterministic=1,mode=tree")
    info = {"dtype": "bfloat16", "deterministic": True, "gdn": None, "w12": None}
    assert _title("tiny", spec, info) == "tiny tree (bfloat16, cuda, deterministic steps)"
    assert _title("tiny", EngineSpec.parse("engine:model=tiny,mode=ar"), dict(info, deterministic=False,
                                                                           dtype="float32")) == "tiny ar (float32, cpu)"


# ---------------------------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 17, 33, 64])
def test_gpu_invariant_linear_at_llama_shapes(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.randn(64, k, generator=g, device="cuda").bfloat16()
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
        y = gemm.linear(x[:m], w)
        torch.testing.assert_close(y.float(), x[:m].float() @ w.float().T, atol=2e-2, rtol=2 ** -7)
        assert torch.equal(gemm.linear(x[m - 1:m], w)[0], y[m - 1])
        assert torch.equal(gemm.linear(x, w)[:m], y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hd,nh,nkv", [(128, 32, 8), (256, 16, 4)])
def test_gpu_invariant_attention_rows_equal_their_keys_alone(hd, nh, nkv):
    g = torch.Generator(device="cuda").manual_seed(hd)
    S, n = 1200, 1000
    parents = gpath.random_parents(33, hd)
    T = len(parents)
    q = torch.randn(T, nh, hd, generator=g, device="cuda").bfloat16()
    k = torch.randn(nkv, S, hd, generator=g, device="cuda").bfloat16()
    v = torch.randn(nkv, S, hd, generator=g, device="cuda").bfloat16()
    mask = _tree_mask(T, S, n, parents).cuda()
    out = attn.masked_gqa_attention(q, k, v, mask, hd ** -0.5)
    ref = attn_ref.masked_gqa_attention(q.float(), k.float(), v.float(), mask, hd ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=2 ** -7)
    for r in range(T):
        seen = mask[r].nonzero()[:, 0]
        kk, vv = torch.zeros_like(k), torch.zeros_like(v)
        kk[:, :len(seen)], vv[:, :len(seen)] = k[:, seen], v[:, seen]
        alone = (torch.arange(S, device="cuda") < len(seen))[None]
        assert torch.equal(attn.masked_gqa_attention(q[r:r + 1], kk, vv, alone, hd ** -0.5)[0], out[r])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["qwen3.5-9b", "llama-3.1-8b"])
def test_gpu_bf16_chain_tree_tlv_give_ar_tokens(model):
    """Random bf16 weights at the real shapes, CUDA graphs: with deterministic steps, chain, tree
    and tlv give the AR mode's tokens, as many as asked. The tree and tlv drafter is the target's
    every layer but the last, so long drafts are accepted and a tree's deep rows decide tokens."""
    from specpilot.engine.api import load_engine
    from specpilot.models import load_model_spec

    layers = load_model_spec(model).num_layers

    base = f"engine:model={model},random=1,device=cuda,ctx=1536,deterministic=1"
    prompt = [int(t) for t in torch.randint(5, 20000, (300,), generator=torch.Generator().manual_seed(1))]
    prompt = prompt[:150] + prompt[:150]            # a repeat: the n-gram drafter proposes
    e = load_engine(base + ",mode=ar")
    ar = e.generate(prompt, 48).output_ids
    assert len(ar) == 48
    del e
    for mode, extra in (("chain", ",drafter=ngram,depth=8"), ("tree", f",drafter=self,draft_layers={layers - 1},nodes=32,depth=8"),
                        ("tlv", f",drafter=self,draft_layers={layers - 1},nodes=32,depth=8")):
        e = load_engine(base + f",mode={mode}{extra}")
        r = e.generate(prompt, 48)
        assert r.output_ids == ar, mode
        assert mode != "tree" or r.tau > 1.5, (mode, r.tau)
        del e
        torch.cuda.empty_cache()
