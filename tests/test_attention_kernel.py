"""The fused split-KV attention kernel against the plain torch reference (CPU: Triton's
interpreter; GPU tests at the end), and the engine's attention switch."""

from __future__ import annotations

import pytest
import torch

from specpilot.kernels.attention import decode as fused
from specpilot.kernels.attention import naive as ref
from kernel_checks import tree_mask


def _case(T, nh, nkv, hd, S, dtype=torch.float32, seed=0, device="cpu", dead_tail=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, nh, hd, generator=g).to(dtype)
    k = torch.randn(nkv, S, hd, generator=g).to(dtype)
    v = torch.randn(nkv, S, hd, generator=g).to(dtype)
    mask = torch.rand(T, S, generator=g) < 0.4
    mask[:, 0] = True  # every row attends somewhere (the engine's rows always see their own slot)
    if dead_tail:
        mask[:, S // 2:] = False  # whole tiles nobody attends: skipped without loading K/V
    return [t.to(device) for t in (q, k, v, mask)]


@pytest.mark.parametrize("T,nh,nkv,hd,S", [
    (1, 4, 2, 16, 100),     # AR decode, S not a multiple of the tile
    (1, 8, 8, 32, 64),      # no grouping, one tile
    (3, 8, 2, 32, 200),     # a few verification rows
    (5, 4, 1, 64, 70),      # one KV head for all query heads
    (20, 8, 2, 16, 300),    # 80 rows: two row blocks
])
def test_fused_equals_reference_fp32(T, nh, nkv, hd, S):
    q, k, v, mask = _case(T, nh, nkv, hd, S)
    got = fused.masked_gqa_attention(q, k, v, mask, hd ** -0.5)
    want = ref.masked_gqa_attention(q, k, v, mask, hd ** -0.5)
    assert got.shape == want.shape == (T, nh * hd) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows,slots", [([3, 1, 7], [2, 0, 1]), ([20, 1], [1, 3])])
def test_batched_equals_reference_per_request(rows, slots):
    """Several requests' rows in one launch, each segment over its own cache slot (slots out of
    order, one segment of 80 group rows: two row blocks), against the reference per request."""
    nh, nkv, hd, S = 8, 2, 16, 150
    T = sum(rows)
    q, _, _, mask = _case(T, nh, nkv, hd, S, seed=5)
    g = torch.Generator().manual_seed(6)
    k = torch.randn(4, nkv, S, hd, generator=g)
    v = torch.randn(4, nkv, S, hd, generator=g)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    segs = torch.tensor(list(zip(starts, rows, slots)), dtype=torch.int32)
    got = fused.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs, max(rows))
    want = ref.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for t0, n, slot in zip(starts, rows, slots):   # the one-request kernel on each request's rows
        one = fused.masked_gqa_attention(q[t0:t0 + n], k[slot], v[slot], mask[t0:t0 + n], hd ** -0.5)
        torch.testing.assert_close(got[t0:t0 + n], one, atol=2e-6, rtol=2e-6)


def test_batched_refuses_a_bad_segment_table():
    q, k, v, mask = _case(2, 4, 2, 16, 64)
    with pytest.raises(ValueError, match="segment table"):
        fused.batched_gqa_attention(q, k[None], v[None], mask, 0.25, torch.tensor([[0, 2, 0]]), 2)
    with pytest.raises(ValueError, match="segment table"):
        fused.batched_gqa_attention(q, k, v, mask, 0.25, torch.tensor([[0, 2, 0]], dtype=torch.int32), 2)


def test_fused_tree_mask_rows_see_only_their_ancestors():
    """A tree step: each row's mask is the committed prefix plus its ancestors; changing a value the
    mask hides changes nothing, changing one it shows does."""
    T, nh, nkv, hd, S, n = 4, 4, 2, 16, 96, 40
    q, k, v, _ = _case(T, nh, nkv, hd, S, seed=3)
    mask = tree_mask([-1, 0, 0, 1], n, S)
    base = fused.masked_gqa_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(base, ref.masked_gqa_attention(q, k, v, mask, 0.25), atol=2e-6, rtol=2e-6)
    v2 = v.clone()
    v2[:, n + 2] += 1.0  # node 2: seen by row 2 only
    out = fused.masked_gqa_attention(q, k, v2, mask, 0.25)
    changed = (out - base).abs().amax(-1) > 1e-6
    assert changed.tolist() == [False, False, True, False]


def test_fused_is_deterministic_and_plan_fills_the_gpu():
    q, k, v, mask = _case(2, 8, 2, 32, 256, seed=5)
    a = fused.masked_gqa_attention(q, k, v, mask, 0.2)
    b = fused.masked_gqa_attention(q, k, v, mask, 0.2)
    assert torch.equal(a, b)
    R, block_m, row_blocks, splits = fused.plan(1, 32, 8, 1344)  # Llama-3.1-8B decode, static cache
    assert (R, block_m, row_blocks) == (4, 16, 1) and 8 * splits >= 128


def test_program_targets_come_from_the_measured_table():
    """At head_dim 128, batched steps of few rows per request take the live walk (without its checked
    tail, RoPE in the split pass) with one split per
    program from 16 requests on (fewer: the merge in the last program), one request's AR step the
    live walk, its 64-row steps the live walk and the merge in the last program (their table
    entries); other verify rows and long segments keep the default. A given target changes only the
    split, not the result."""
    cpu = torch.device("cpu")
    # batched steps: no checked walk past the rows' highest slot, RoPE in the split pass (one-row segments)
    live = fused.SplitConfig(128, True, 3, merge="last", tail=False, rope=True)
    assert fused.split_config(cpu, True, 1, 128) == fused.split_config(cpu, True, 4, 128) == live
    # 4 to 16 requests: 128-slot tiles (one program per SM); more requests keep 64
    wide = fused.SplitConfig(128, True, 3, merge="last", block_n=128, tail=False, rope=True)
    assert fused.split_config(cpu, True, 1, 128, 16) == fused.split_config(cpu, True, 4, 128, 4) == wide
    assert fused.split_config(cpu, True, 1, 128, 32) == fused.split_config(cpu, True, 1, 128, 3) == live
    assert fused.split_config(cpu, True, 33, 128) == fused.SplitConfig()
    assert fused.split_config(cpu, False, 1, 128) == fused.SplitConfig(256, True, 2, prefetch=1)
    assert fused.split_config(cpu, False, 2, 128) == fused.split_config(cpu, False, 33, 128) == fused.SplitConfig()
    assert fused.split_config(cpu, False, 64, 128) == fused.SplitConfig(128, True, 2, merge="last")
    # other head dims keep what was measured for them (Qwen3.5's 256) or the default
    assert fused.split_config(cpu, True, 1, 256) == fused.SplitConfig(512)
    assert fused.split_config(cpu, True, 1, 64) == fused.split_config(cpu, False, 1, 256) == fused.SplitConfig()
    assert fused.plan(1, 32, 8, 1344, 16, fused.SplitConfig(128))[3] == 1   # 16 requests: one split each
    assert fused.plan(1, 32, 8, 1344, 16, fused.SplitConfig(512))[3] == 4
    assert fused.plan(1, 32, 8, 1344, 16)[3] == 2
    # a count between powers of two splits as its bucket does: 9 requests as 16 (72 programs, one
    # wave, where rounding 72 pairs up to 128 programs made 144), 3 as 4
    assert fused.plan(1, 32, 8, 1344, 9, wide)[3] == fused.plan(1, 32, 8, 1344, 16, wide)[3] == 1
    assert fused.plan(1, 32, 8, 1344, 3, live)[3] == fused.plan(1, 32, 8, 1344, 4, live)[3] == 4
    q, k, v, mask = _case(2, 8, 2, 32, 256, seed=6)
    a = fused.masked_gqa_attention(q, k, v, mask, 0.2, cfg=fused.SplitConfig(16))
    b = fused.masked_gqa_attention(q, k, v, mask, 0.2, cfg=fused.SplitConfig(1024))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_tile_size_changes_the_walk_not_the_result():
    """128- and 32-slot tiles (``SplitConfig.block_n``) give what 64-slot tiles give, in one split
    or several; a tile the kernel cannot take is refused."""
    q, k, v, mask = _case(3, 8, 2, 32, 320, seed=9)
    ref = fused.masked_gqa_attention(q, k, v, mask, 0.2, cfg=fused.SplitConfig(16))
    for cfg in (fused.SplitConfig(16, block_n=128), fused.SplitConfig(4, block_n=128),
                fused.SplitConfig(16, block_n=32)):
        torch.testing.assert_close(fused.masked_gqa_attention(q, k, v, mask, 0.2, cfg=cfg), ref, atol=1e-5, rtol=1e-5)
    for bad in ({"block_n": 96}, {"block_n": 256}, {"block_n": 8}):
        with pytest.raises(ValueError, match="block_n must be"):
            fused.SplitConfig(**bad)


def test_fused_refuses_unsupported_shapes():
    q, k, v, mask = _case(1, 6, 4, 16, 64)
    with pytest.raises(ValueError, match="divisible"):
        fused.masked_gqa_attention(q, k, v, mask, 0.25)
    q, k, v, mask = _case(1, 4, 2, 24, 64)
    with pytest.raises(ValueError, match="power-of-two"):
        fused.masked_gqa_attention(q, k, v, mask, 0.25)


def test_engine_forward_with_fused_attention_equals_torch():
    """The tiny engine model's logits for a prefill plus a tree-shaped step, fused vs torch (fp32)."""
    from specpilot.engine.api import build_model
    from specpilot.engine.step_input import StepInput

    model, _, _ = build_model("tiny", True, torch.float32, "cpu", 128)
    model.layers = model.layers[:2]   # a layer into the next one, and the last into the head: half the work
    prompt = torch.arange(10) * 7 % 256
    S = model.max_seq

    def steps():
        outs = []
        model.reset()
        mask = torch.zeros(10, S, dtype=torch.bool)
        mask[:, :10] = torch.tril(torch.ones(10, 10, dtype=torch.bool))
        outs.append(model(StepInput(prompt, torch.arange(10), torch.arange(10), mask)))
        tree = torch.tensor([5, 6, 7])   # root, two children
        mask = torch.zeros(3, S, dtype=torch.bool)
        mask[:, :10] = True
        mask[0, 10] = mask[1, [10, 11]] = mask[2, [10, 12]] = True
        outs.append(model(StepInput(tree, torch.tensor([10, 11, 11]), torch.tensor([10, 11, 12]), mask)))
        return outs

    assert model.set_attention("auto") == "torch"
    want = steps()
    for blk in model.layers:
        blk.mixer.fused = True  # the interpreter on the CPU (resolve() refuses fused there for users)
    got = steps()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec,msg", [
    ("engine:model=tiny,attn=flash", "unknown attention"),
    ("engine:model=tiny,attn=fused", "needs device=cuda"),
])
def test_engine_spec_attention_errors(spec, msg):
    from specpilot.engine.api import EngineSpec
    from specpilot.errors import InputError

    with pytest.raises(InputError, match=msg):
        EngineSpec.parse(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 32])
def test_fused_on_cuda_matches_reference_bf16(T):
    """Llama-3.1-8B attention shapes in bf16 on the GPU: within bf16 rounding of the float32
    reference (the torch bf16 path rounds scores and probabilities, the kernel does not)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    q, k, v, mask = _case(T, 32, 8, 128, 1344, dtype=torch.bfloat16, device="cuda", seed=T)
    got = fused.masked_gqa_attention(q, k, v, mask, 128 ** -0.5)
    want = ref.masked_gqa_attention(q.float(), k.float(), v.float(), mask, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got, fused.masked_gqa_attention(q, k, v, mask, 128 ** -0.5))


@pytest.mark.gpu
def test_engine_fused_attention_equals_torch_on_cuda_fp32():
    """Greedy tokens of the tiny engine, fp32 on CUDA, AR and tree: fused attention = torch attention."""
    from specpilot.engine.api import load_engine

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    prompt = list(b"the quick brown fox jumps over the lazy dog")
    for mode in ("ar", "tree"):
        a = load_engine(f"engine:model=tiny,mode={mode},dtype=float32,device=cuda,ctx=512,attn=torch").generate(prompt, 40)
        b = load_engine(f"engine:model=tiny,mode={mode},dtype=float32,device=cuda,ctx=512,attn=fused").generate(prompt, 40)
        assert a.output_ids == b.output_ids


def test_store_kv_writes_rows_at_slots_only():
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)[:, :, :]  # [T, nkv, hd]
    kc, vc = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    want_k, want_v = kc.clone(), vc.clone()
    slots = torch.tensor([5, 17, 6])
    want_k[:, slots] = k.transpose(0, 1)
    want_v[:, slots] = v.transpose(0, 1)
    fused.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_set_attention_falls_back_or_refuses_unsupported_head_dims(monkeypatch):
    """auto on CUDA takes the reference for shapes the kernel does not tile; an explicit fused is an
    input error naming the shapes. (resolve is patched to answer as on a CUDA machine.)"""
    import specpilot.engine.attention as ea
    from specpilot.engine.api import TINY_CONFIGS
    from specpilot.engine.model import Transformer
    from specpilot.errors import InputError
    from specpilot.models import spec_from_config

    odd = spec_from_config({**TINY_CONFIGS["tiny"], "head_dim": 24}, name="odd")
    model = Transformer(odd, max_seq=32)
    monkeypatch.setattr(ea, "resolve", lambda impl, device: "fused" if impl in ("auto", "fused") else impl)
    assert model.set_attention("auto") == "torch"
    assert not any(getattr(b.mixer, "fused", False) for b in model.layers)
    with pytest.raises(InputError, match="head_dim 24"):
        model.set_attention("fused")
    tiny = Transformer(spec_from_config(dict(TINY_CONFIGS["tiny"]), name="tiny"), max_seq=32)
    assert tiny.set_attention("auto") == "fused" and all(b.mixer.fused for b in tiny.layers)


def test_cli_attention_choice_errors(run_cli):
    code, _, err = run_cli("run", "--model", "tiny", "--prompt", "x", "--attn", "fused")
    assert code == 2 and "--attn fused needs --device cuda" in err and err.count("\n") == 1
    code, _, err = run_cli("run", "--model", "tiny", "--prompt", "x", "--attn", "flash")
    assert code == 2 and "flash" in err
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--random-weights", "--device", "cpu", "--rows", "1",
                           "--attn", "fused")
    assert code == 2 and "--attn fused needs --device cuda" in err
    code, out, _ = run_cli("run", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "2", "--format", "json")
    assert code == 0 and '"attn": "torch"' in out


def test_merge_takes_more_splits_than_it_loads_at_once():
    """A cache split into more parts than the merge loads at once (``MERGE_SPLITS``): the merge's
    loop over them gives the reference's result, with the live keys in the last splits only."""
    S = fused.BLOCK_N * (2 * fused.MERGE_SPLITS + 3)
    q, k, v, mask = _case(2, 4, 2, 16, S, seed=8, dead_tail=False)
    mask[:, : S - 3 * fused.BLOCK_N] = False   # every split before the last three sees nothing
    mask[:, -1] = True
    cfg = fused.SplitConfig(1 << 12)
    assert fused.plan(2, 4, 2, S, 1, cfg)[3] > 2 * fused.MERGE_SPLITS
    got = fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=cfg)
    torch.testing.assert_close(got, ref.masked_gqa_attention(q, k, v, mask, 0.25), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("T,target", [(1, 64), (3, 4), (20, 64), (20, 8)])
def test_merge_in_the_last_program_gives_the_references_result(T, target):
    """``merge=last``: the last program of each (KV head, row block) combines the splits; the
    result is the reference's (one row block and two), one request and batched, run after run (the
    block counters are left at zero)."""
    nh, nkv, hd, S = 8, 2, 16, 300
    q, k, v, mask = _case(T, nh, nkv, hd, S, seed=T + target)
    cfg = fused.SplitConfig(target, merge="last")
    assert fused.plan(T, nh, nkv, S, 1, cfg)[3] > 1
    want = ref.masked_gqa_attention(q, k, v, mask, 0.25)
    got = fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=cfg)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert torch.equal(got, fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=cfg))
    segs = torch.tensor([[0, T, 1]], dtype=torch.int32)   # the request in cache slot 1, slot 0 another's
    kb, vb = torch.stack((v, k)), torch.stack((k, v))
    torch.testing.assert_close(fused.batched_gqa_attention(q, kb, vb, mask, 0.25, segs, T, cfg=cfg), want,
                               atol=2e-6, rtol=2e-6)


def _refuse_merge_kernel(monkeypatch):
    """Make a launch of the merge kernel fail the test."""
    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched")

    monkeypatch.setattr(fused, "_attn_merge", Refused())


def test_merge_in_the_last_program_launches_no_merge_kernel(monkeypatch):
    q, k, v, mask = _case(3, 8, 2, 16, 200, seed=12)
    _refuse_merge_kernel(monkeypatch)
    got = fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=fused.SplitConfig(64, merge="last"))
    torch.testing.assert_close(got, ref.masked_gqa_attention(q, k, v, mask, 0.25), atol=2e-6, rtol=2e-6)


def test_split_config_refuses_an_unknown_merge():
    with pytest.raises(ValueError, match="merge must be"):
        fused.SplitConfig(merge="atomic")
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="prefetch must be 0-16 tiles"):
            fused.SplitConfig(prefetch=bad)


def test_prefetch_compiles_for_sm90_before_the_pdl_wait():
    """The L2 prefetch of the first live K/V tiles (one ``cp.async.bulk.prefetch`` each, first thread
    only) sits before ``griddepcontrol.wait``; ptxas for sm_90 accepts it; without it none is issued."""
    from gluon_ptx import ptxas_report

    setup = """
from triton.compiler import ASTSource as GluonASTSource   # a Triton kernel: the plain AST source
from specpilot.kernels.attention import decode
k = decode._attn_split
ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
ptrs.update({"mask_ptr": "*u8", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "seg_ptr": "*i32", "slots_ptr": "*i64",
             "cnt_ptr": "*i32", "scale": "fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64",
             "req_ptr": "*i64"})
const = {"GRP": 4, "HD": 128, "BLOCK_M": 16, "BLOCK_N": 64, "IEEE": False, "SEGS": %s, "PDL": True, "LIVE": True,
         "STAGES": 2, "DIRECT": False, "MERGE_LAST": False, "PREFETCH": %d, "TAIL": True,
         "ROPE": False}
div = []
warps = 4
"""
    for segs, tiles in ((False, 1), (True, 2), (False, 0)):
        r = ptxas_report(setup % (segs, tiles))
        assert r["rc"] == 0, r["log"][-2000:]
        ptx = r["ptx"]
        n = ptx.count("cp.async.bulk.prefetch.L2.global")
        assert n == (2 if tiles else 0)
        if tiles:
            assert ptx.rindex("cp.async.bulk.prefetch.L2.global") < ptx.index("griddepcontrol.wait")
            assert "%tid.x" in ptx[:ptx.index("griddepcontrol.wait")]


def _rows_at_slots(T, S, context, beyond=False):
    """A step's mask: T rows at slots context..context+T-1, each seeing the context and its chain;
    ``beyond``: row 0 also sees slots past every row's own (what the live walk does not assume)."""
    mask = torch.zeros(T, S, dtype=torch.bool)
    mask[:, :context] = True
    mask[:, context:context + T] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    if beyond:
        mask[0, context + T + 20:context + T + 25] = True
    return mask, context + torch.arange(T)


@pytest.mark.parametrize("T,context,beyond", [(1, 150, False), (3, 100, True), (20, 40, False)])
def test_live_walk_gives_the_checked_walks_bits(T, context, beyond):
    """The live walk (mask, K and V loaded together below the rows' highest slot) computes what
    the checked walk does, bit for bit, also where a row attends past its own slot."""
    nh, nkv, hd, S = 8, 2, 16, 160
    q, k, v, _ = _case(T, nh, nkv, hd, S, seed=T)
    mask, slots = _rows_at_slots(T, S, context, beyond)
    slots = torch.stack((slots, -slots), 1)[:, 0]   # a strided view (stride 2) of the slots
    for target in (4, 64):
        live = fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=fused.SplitConfig(target, live=True), slots=slots)
        checked = fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=fused.SplitConfig(target), slots=slots)
        assert torch.equal(live, checked)
        torch.testing.assert_close(live, ref.masked_gqa_attention(q, k, v, mask, 0.25), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("target", [4, 64])
def test_live_walk_without_the_tail_reads_nothing_past_the_rows(target):
    """``tail=False``: the live walk alone, the same bits where no row attends past the highest slot
    of its program's rows; a mask that does (``beyond``) is what it does not see."""
    nh, nkv, hd, S, T = 8, 2, 16, 300, 3
    q, k, v, _ = _case(T, nh, nkv, hd, S, seed=12)
    for beyond in (False, True):
        mask, slots = _rows_at_slots(T, S, 60, beyond)
        walk = lambda tail: fused.masked_gqa_attention(   # noqa: E731
            q, k, v, mask, 0.25, cfg=fused.SplitConfig(target, live=True, tail=tail), slots=slots)
        assert torch.equal(walk(False), walk(True)) != beyond


def test_live_walk_in_a_batched_step():
    rows, slots_of = [3, 1, 7], [2, 0, 1]
    nh, nkv, hd, S = 8, 2, 16, 150
    T = sum(rows)
    q, _, _, _ = _case(T, nh, nkv, hd, S, seed=8)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(4, nkv, S, hd, generator=g), torch.randn(4, nkv, S, hd, generator=g)
    masks, slots = zip(*(_rows_at_slots(n, S, 30 + 17 * i) for i, n in enumerate(rows)))
    mask, slots = torch.cat(masks), torch.cat(slots)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    segs = torch.tensor(list(zip(starts, rows, slots_of)), dtype=torch.int32)
    got = fused.batched_gqa_attention(q, k, v, mask, 0.25, segs, max(rows), cfg=fused.SplitConfig(64, live=True),
                                      slots=slots)
    assert torch.equal(got, fused.batched_gqa_attention(q, k, v, mask, 0.25, segs, max(rows),
                                                        cfg=fused.SplitConfig(64), slots=slots))
    torch.testing.assert_close(got, ref.batched_gqa_attention(q, k, v, mask, 0.25, segs), atol=2e-6, rtol=2e-6)


def test_one_split_writes_the_output_without_the_merge(monkeypatch):
    """A plan of one split (few programs wanted) is one launch: the split pass divides by the sum."""
    q, k, v, mask = _case(3, 8, 2, 16, 200, seed=11)
    assert fused.plan(3, 8, 2, 200, 1, fused.SplitConfig(1))[3] == 1
    want = ref.masked_gqa_attention(q, k, v, mask, 0.25)
    _refuse_merge_kernel(monkeypatch)
    got = fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=fused.SplitConfig(1))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_live_walk_refuses_slots_of_another_shape():
    q, k, v, mask = _case(3, 8, 2, 16, 64)
    with pytest.raises(ValueError, match="slots must be"):
        fused.masked_gqa_attention(q, k, v, mask, 0.25, cfg=fused.SplitConfig(live=True), slots=torch.arange(2))


@pytest.mark.gpu
@pytest.mark.parametrize("T,batch", [(1, 1), (33, 1), (1, 16), (4, 16)])
def test_live_walk_and_one_split_on_cuda(T, batch):
    """Llama-3.1-8B attention shapes in bf16: the live walk (pipelined on the GPU) gives the checked
    walk's bits at the same split and tile, and the table's configs (one split from 16 requests on) stay
    within bf16 rounding of the float32 reference."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    nh, nkv, hd, S, ctx = 32, 8, 128, 1152, 1000
    g = torch.Generator().manual_seed(T + batch)
    q = torch.randn(batch * T, nh, hd, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(batch, nkv, S, hd, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(batch, nkv, S, hd, generator=g).to(torch.bfloat16).cuda()
    masks, slots = zip(*(_rows_at_slots(T, S, ctx - 7 * b) for b in range(batch)))
    mask, slots = torch.cat(masks).cuda(), torch.cat(slots).cuda()
    segs = torch.tensor([[b * T, T, b] for b in range(batch)], dtype=torch.int32, device="cuda")

    def attend(cfg):
        if batch == 1:
            return fused.masked_gqa_attention(q, k[0], v[0], mask, hd ** -0.5, cfg=cfg, slots=slots)
        return fused.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs, T, cfg=cfg, slots=slots)

    for target in (64, 256):
        for bn in (64, 128):
            assert torch.equal(attend(fused.SplitConfig(target, live=True, stages=3, block_n=bn)),
                               attend(fused.SplitConfig(target, block_n=bn)))
    want = ref.batched_gqa_attention(q.float(), k.float(), v.float(), mask, hd ** -0.5, segs.cpu())
    for target in (64, 256):   # the last program's merge, twice (counters reset)
        cfg = fused.SplitConfig(target, live=True, merge="last")
        last = attend(cfg)
        assert torch.equal(last, attend(cfg))
        torch.testing.assert_close(last.float(), want, atol=2e-2, rtol=2e-2)
    got = attend(None)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # under PDL with the L2 prefetch before the wait: the same bits as without it (a hint only)
    for tiles in (1, 4):
        def with_pdl(pf):
            cfg = fused.SplitConfig(256, live=True, prefetch=pf)
            if batch == 1:
                return fused.masked_gqa_attention(q, k[0], v[0], mask, hd ** -0.5, pdl=True, cfg=cfg, slots=slots)
            return fused.batched_gqa_attention(q, k, v, mask, hd ** -0.5, segs, T, pdl=True, cfg=cfg, slots=slots)
        assert torch.equal(with_pdl(tiles), with_pdl(0))
