"""The fused split-KV attention kernel against the plain torch reference (CPU: Triton's
interpreter; GPU tests at the end), and the engine's attention switch."""

from __future__ import annotations

import pytest
import torch

from specpilot.kernels.attention import decode as fused
from specpilot.kernels.attention import naive as ref


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
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(T, S, dtype=torch.bool)
    mask[:, :n] = True
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, n + j] = True
            j = parents[j]
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
    """Batched steps of few rows per request aim at more programs (their table entry); one request
    and long segments keep the default. A given target changes only the split, not the result."""
    cpu = torch.device("cpu")
    assert fused.split_config(cpu, True, 1).target_programs == 512
    assert fused.split_config(cpu, True, 4).target_programs == 512
    assert fused.split_config(cpu, True, 33) == fused.SplitConfig()
    assert fused.split_config(cpu, False, 1) == fused.SplitConfig()
    assert fused.plan(1, 32, 8, 1344, 16, fused.SplitConfig(512))[3] == 4
    assert fused.plan(1, 32, 8, 1344, 16)[3] == 2
    q, k, v, mask = _case(2, 8, 2, 32, 256, seed=6)
    a = fused.masked_gqa_attention(q, k, v, mask, 0.2, cfg=fused.SplitConfig(16))
    b = fused.masked_gqa_attention(q, k, v, mask, 0.2, cfg=fused.SplitConfig(1024))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


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
    from specpilot.engine.model import StepInput

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
    assert code == 2 and "needs device=cuda" in err and err.count("\n") == 1
    code, _, err = run_cli("run", "--model", "tiny", "--prompt", "x", "--attn", "flash")
    assert code == 2 and "flash" in err
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--random-weights", "--device", "cpu", "--rows", "1",
                           "--attn", "fused")
    assert code == 2 and "needs device=cuda" in err
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
