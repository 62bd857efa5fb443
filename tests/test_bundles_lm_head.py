"""w12's certified LM head in DFlashWorkerV2._greedy_sample_from_vocab_parallel_head (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_support import SKIP_REASON, load_sglang_function, sglang_dir

torch = pytest.importorskip("torch")
pytest.importorskip("specpilot.kernels.lm_head")

from specpilot.bundles import lm_head as lh  # noqa: E402


@pytest.fixture(scope="module")
def stock():
    if sglang_dir() is None:
        pytest.skip(SKIP_REASON)
    ns = {"torch": torch, "is_dense_head_weight": lambda w: w is not None and w.dtype in (
        torch.bfloat16, torch.float16, torch.float32)}
    fn = load_sglang_function(sglang_dir(), "sglang.srt.speculative.dflash_worker_v2",
                              "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head", ns)
    return fn


def _head(v=500, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(weight=(torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16))


def test_certified_argmax_is_exact_and_agrees_with_stock_where_bf16_does_not_tie(stock):
    from specpilot.kernels.lm_head import exact_argmax

    head = _head()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(70, 64, generator=g).to(torch.bfloat16)  # > 64 rows: two certified chunks
    worker = SimpleNamespace()
    ours = lh.around_greedy_sample_from_head(stock, worker, hidden_states=hidden, lm_head=head)
    want = stock(worker, hidden_states=hidden, lm_head=head)
    assert ours.dtype == want.dtype == torch.long and ours.shape == want.shape == (70,)
    assert torch.equal(ours, exact_argmax(hidden, head.weight))
    logits = hidden.double() @ head.weight.double().T
    top2 = logits.topk(2, dim=-1).values
    bf16 = (hidden @ head.weight.T)
    unique = (bf16 == bf16.max(-1, keepdim=True).values).sum(-1) == 1
    clear = (top2[:, 0] - top2[:, 1]) > 2 ** -6 * top2[:, 0].abs()
    rows = unique & clear
    assert rows.sum() > 30  # the comparison covers most rows
    assert torch.equal(ours[rows], want[rows])


def test_tp1_shard_excludes_padding_rows():
    head = _head(v=512)
    head.weight[500:] = 10.0  # padding rows that would win if read
    head.org_vocab_size = 500
    head.shard_indices = SimpleNamespace(num_org_elements=500, num_added_elements=0, org_vocab_start_index=0)
    hidden = torch.ones(3, 64, dtype=torch.bfloat16)
    out = lh.around_greedy_sample_from_head(None, SimpleNamespace(), hidden_states=hidden, lm_head=head)
    assert int(out.max()) < 500


@pytest.mark.parametrize("change", ["tp_shard", "added_vocab", "quantized"])
def test_other_heads_go_to_stock(change):
    head = _head(v=100)
    head.org_vocab_size = 100
    head.shard_indices = SimpleNamespace(num_org_elements=100, num_added_elements=0, org_vocab_start_index=0)
    if change == "tp_shard":
        head.shard_indices.num_org_elements, head.shard_indices.org_vocab_start_index = 50, 50
    elif change == "added_vocab":
        head.shard_indices.num_added_elements = 4
    else:
        head.weight = torch.zeros(100, 64, dtype=torch.int8)
    calls = []

    def original(self, **kw):
        calls.append(kw)
        return "stock"

    assert lh.around_greedy_sample_from_head(original, SimpleNamespace(), hidden_states=torch.ones(2, 64),
                                             lm_head=head) == "stock"
    assert calls and calls[0]["chunk_size"] == 256


def test_the_int8_copy_is_built_once_per_head():
    head = _head()
    h = torch.randn(2, 64).to(torch.bfloat16)
    lh.around_greedy_sample_from_head(None, None, hidden_states=h, lm_head=head)
    first = getattr(head, lh._ATTR)[1]
    lh.around_greedy_sample_from_head(None, None, hidden_states=h, lm_head=head)
    assert getattr(head, lh._ATTR)[1] is first
