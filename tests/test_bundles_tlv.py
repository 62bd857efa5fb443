"""tlv (experimental): the Q-pass rule against SGLang 0.5.23's own accept rule and draft head
(compiled from the installed wheel, CPU), the hook's contract, the W12 Q view, and a toy
two-pass loop that must decode exactly what greedy decoding of the exact model decodes."""

from __future__ import annotations

import ast
import sys
import types
from types import SimpleNamespace

import pytest

from sglang_support import SKIP_REASON, load_sglang_function, sglang_dir

torch = pytest.importorskip("torch")

from specpilot.bundles import tlv  # noqa: E402
from specpilot.bundles import w12_quantization as w12b  # noqa: E402

SGL = sglang_dir()
WORKER = "sglang.srt.speculative.dflash_worker_v2"


@pytest.fixture(scope="module")
def sgl():
    if SGL is None:
        pytest.skip(SKIP_REASON)
    ns = {"torch": torch, "Tuple": tuple, "is_dense_head_weight": lambda w: w is not None and w.dtype in (
        torch.bfloat16, torch.float16, torch.float32)}
    return {
        "accept": load_sglang_function(SGL, "sglang.kernels.ops.speculative.dflash",
                                       "compute_dflash_correct_drafts_and_bonus", ns),
        "head": load_sglang_function(SGL, WORKER, "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head", ns),
    }


@pytest.fixture(autouse=True)
def clean_state():
    tlv._state.update(disabled=False, cycles=0, skipped={})
    yield
    tlv._state.update(disabled=False, cycles=0, skipped={})


def _chain_and_predict(gen, bs, block, vocab=20):
    chain = torch.randint(0, vocab, (bs, block), generator=gen)
    predict = torch.randint(0, vocab, (bs, block), generator=gen)
    for b in range(bs):  # the target agrees with the first k drafts, k random (0 .. block-1)
        k = int(torch.randint(0, block, (1,), generator=gen))
        predict[b, :k] = chain[b, 1:k + 1]
    return chain, predict


def test_commit_chain_is_sglangs_greedy_accept_rule(sgl):
    gen = torch.Generator().manual_seed(0)
    for bs, block in [(1, 2), (3, 8), (5, 16)]:
        chain, predict = _chain_and_predict(gen, bs, block)
        want_len, want_bonus = sgl["accept"](candidates=chain, target_predict=predict)
        got_len, got_bonus = tlv.commit_chain(chain, predict)
        assert got_len.tolist() == want_len.tolist() and torch.equal(got_bonus, want_bonus)


def test_repair_puts_c_in_front_and_keeps_the_rest_of_the_draft():
    gen = torch.Generator().manual_seed(1)
    chain, q = _chain_and_predict(gen, 6, 8)
    out = tlv.repair_chain(chain, q)
    correct, bonus = tlv.commit_chain(chain, q)
    assert out.shape == (6, 7) and out.dtype == chain.dtype
    for b in range(6):
        k = int(correct[b])
        assert out[b, :k].tolist() == chain[b, 1:k + 1].tolist()       # the Q-accepted drafts
        if k < 7:
            assert int(out[b, k]) == int(bonus[b])                     # the Q pass's token
            assert out[b, k + 1:].tolist() == chain[b, k + 2:].tolist()  # draft (1) after it
        else:
            assert torch.equal(out[b], chain[b, 1:])
    # a second Q pass over the repaired chain accepts at least one more draft (C is a prefix)
    again = torch.cat([chain[:, :1], out], dim=1)
    assert torch.all(tlv.commit_chain(again, q)[0] >= torch.clamp(correct + 1, max=7))


def _head(v=300, h=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(weight=(torch.randn(v, h, generator=g) * 0.1).to(torch.bfloat16))


def test_draft_head_hook_returns_stocks_contract(sgl, monkeypatch):
    bs, block = 2, 6
    head = _head()
    hidden = torch.randn(bs * (block - 1), 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    worker = SimpleNamespace(block_size=block, _draft_block_ids_buf=torch.tensor([[7] + [99] * (block - 1),
                                                                                   [8] + [99] * (block - 1)]))
    stock = sgl["head"](worker, hidden_states=hidden, lm_head=head)
    chain = torch.cat([torch.tensor([[7], [8]]), stock.view(bs, block - 1)], dim=1)
    q = chain.roll(-1, dims=1).clone()
    q[0, 2] = 123  # Q accepts 2 drafts of row 0, then says 123; row 1 accepts everything
    monkeypatch.setattr(tlv, "ineligible", lambda w, b: None)
    monkeypatch.setattr(tlv, "q_pass", lambda w, b, c: q)
    batch = SimpleNamespace(seq_lens=torch.tensor([10, 12]))
    calls = []

    def forward(self, batch):  # stock forward_batch_generation: drafts once through the head
        calls.append(tlv.around_draft_head(sgl["head"], self, hidden_states=hidden, lm_head=head))
        calls.append(tlv.around_draft_head(sgl["head"], self, hidden_states=hidden, lm_head=head))
        return "result"

    assert tlv.around_forward_batch_generation(forward, worker, batch) == "result"
    got, second = calls
    assert got.dtype == stock.dtype == torch.long and got.shape == stock.shape and got.device == stock.device
    want = stock.view(bs, block - 1).clone()
    want[0, 2] = 123
    assert torch.equal(got, want.reshape(-1)) and tlv._state["cycles"] == 1
    assert torch.equal(second, stock)  # one Q pass per step
    # outside a scoped step the head is stock
    assert torch.equal(tlv.around_draft_head(sgl["head"], worker, hidden_states=hidden, lm_head=head), stock)


def test_a_failing_q_pass_serves_stock_and_turns_tlv_off(sgl, monkeypatch):
    head, block = _head(), 4
    hidden = torch.randn(3, 32).to(torch.bfloat16)
    worker = SimpleNamespace(block_size=block, _draft_block_ids_buf=torch.zeros(1, block, dtype=torch.long))
    monkeypatch.setattr(tlv, "ineligible", lambda w, b: None)

    def boom(*a):
        raise RuntimeError("no attention backend")

    monkeypatch.setattr(tlv, "q_pass", boom)
    out = []
    tlv.around_forward_batch_generation(
        lambda self, batch: out.append(tlv.around_draft_head(sgl["head"], self, hidden_states=hidden, lm_head=head)),
        worker, SimpleNamespace(seq_lens=torch.tensor([5])))
    assert torch.equal(out[0], sgl["head"](worker, hidden_states=hidden, lm_head=head))
    assert tlv._state["disabled"]
    monkeypatch.undo()
    assert tlv.ineligible(worker, SimpleNamespace()) == "disabled after an error"


class _Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_extend(self):
        return self.kind == "extend"

    def is_idle(self):
        return self.kind == "idle"


def _worker(**kw):
    base = dict(selector=None, lilicorr=None, _is_domino=False, _need_mamba_verify_commit=False,
                _can_skip_verify_logits=lambda batch, info: True)
    base.update(kw)
    return SimpleNamespace(**base)


def _batch(bs=1, kind="decode", **kw):
    base = dict(forward_mode=_Mode(kind), is_extend_in_batch=False, seq_lens=torch.zeros(bs), has_grammar=False,
                return_logprob=False, sampling_info=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("worker, batch, reason", [
    (_worker(), _batch(kind="extend"), "not a decode step"),
    (_worker(), _batch(kind="idle"), "not a decode step"),
    (_worker(), _batch(bs=2), "batch larger than tlv_max_batch"),
    (_worker(), _batch(return_logprob=True), "not plain greedy"),
    (_worker(_can_skip_verify_logits=lambda b, i: False), _batch(), "not plain greedy"),
    (_worker(selector=object()), _batch(), "not a plain DFlash drafter"),
    (_worker(_is_domino=True), _batch(), "not a plain DFlash drafter"),
    (_worker(_need_mamba_verify_commit=True), _batch(), "hybrid"),
])
def test_ineligible_steps_run_stock(worker, batch, reason):
    assert reason in tlv.ineligible(worker, batch)
    calls = []
    tlv.around_forward_batch_generation(lambda self, b: calls.append(tlv._step.get()), worker, batch)
    assert calls == [None]  # the step was not scoped: the draft head stays stock


def test_q_pass_restores_the_batch_and_the_graph_runner(monkeypatch):
    """q_pass against stand-ins of SGLang's verify input and target worker (SGLang's own
    modules need its GPU dependencies): eager, in Q mode, and nothing left behind."""
    seen = {}

    class DFlashVerifyInput:
        def __init__(self, **kw):
            self.kw = kw

        def prepare_for_verify(self, batch, target_worker, *, defer_metadata_init=False):
            seen["graphs_during_prepare"] = runner.decode_cuda_graph_runner
            seen["seq_lens_cpu"] = batch.seq_lens_cpu.tolist()
            batch.input_ids, batch.spec_info, batch.forward_mode = self.kw["draft_token"], self, "TARGET_VERIFY"
            return SimpleNamespace(kw=self.kw), False

    fbi = types.ModuleType("sglang.srt.model_executor.forward_batch_info")
    fbi.CaptureHiddenMode = SimpleNamespace(FULL="full", NULL="null")
    dinfo = types.ModuleType("sglang.srt.speculative.dflash_info")
    dinfo.DFlashVerifyInput = DFlashVerifyInput
    for name in ("sglang", "sglang.srt", "sglang.srt.model_executor", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fbi.__name__, fbi)
    monkeypatch.setitem(sys.modules, dinfo.__name__, dinfo)

    bs, block, vocab = 2, 4, 11
    logits = torch.randn(bs * block, vocab)

    def forward(*, batch, forward_batch, is_verify, skip_attn_backend_init):
        seen["qpass"] = w12b.QPASS.get()
        seen["graphs_during_forward"] = runner.decode_cuda_graph_runner
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits))

    graphs = object()
    runner = SimpleNamespace(decode_cuda_graph_runner=graphs,
                             kv_index_translator=SimpleNamespace(plan=lambda **kw: ("plan", kw["read_extent"])))
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=runner, forward_batch_generation=forward),
        _draft_block_positions_buf=torch.arange(3 * block).view(3, block),
        _draft_verify_out_cache_loc_buf=torch.arange(100, 100 + 3 * block).view(3, block),
        _target_logits_processor=None)
    marker = object()
    batch = SimpleNamespace(out_cache_loc=marker, seq_lens_cpu=torch.tensor([5, 9]), seq_lens_sum=14,
                            input_ids=marker, spec_info=marker, forward_mode=marker, req_pool_indices=torch.tensor([0, 1]),
                            seq_lens=torch.tensor([5, 9]))
    chain = torch.randint(0, vocab, (bs, block))
    q = tlv.q_pass(worker, batch, chain)
    assert q.shape == (bs, block) and q.dtype == chain.dtype
    assert torch.equal(q, logits.argmax(-1).view(bs, block))
    assert seen["qpass"] is True and w12b.QPASS.get() is False
    assert seen["graphs_during_prepare"] is None and seen["graphs_during_forward"] is None
    assert runner.decode_cuda_graph_runner is graphs
    assert seen["seq_lens_cpu"] == [5 + block, 9 + block]  # the verify host bound, as stock sets it
    assert all(getattr(batch, k) is marker for k in ("out_cache_loc", "input_ids", "spec_info", "forward_mode"))
    assert batch.seq_lens_cpu.tolist() == [5, 9] and batch.seq_lens_sum == 14


def test_q_pass_restores_every_batch_field_prepare_for_verify_sets(sgl):
    """The batch attributes SGLang 0.5.23's DFlashVerifyInput.prepare_for_verify assigns are the
    ones q_pass restores (the NPU-only one aside), and the worker attributes q_pass reads exist."""
    src = (SGL / "sglang/srt/speculative/dflash_info.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "prepare_for_verify")
    assigned = {t.attr for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "batch"}
    assert assigned - {"out_cache_loc_dsv4"} <= {"input_ids", "spec_info", "forward_mode"}
    worker_src = (SGL / "sglang/srt/speculative/dflash_worker_v2.py").read_text()
    for attr in ("_draft_block_ids_buf", "_draft_block_positions_buf", "_draft_verify_out_cache_loc_buf",
                 "_target_logits_processor", "_need_mamba_verify_commit", "_is_domino", "lilicorr"):
        assert f"self.{attr} = " in worker_src, attr
    runner_src = (SGL / "sglang/srt/model_executor/model_runner.py").read_text()
    assert "self.decode_cuda_graph_runner = " in runner_src and "self.kv_index_translator = " in runner_src
    assert "self.decode_cuda_graph_runner.can_run_graph(forward_batch)" in runner_src  # hidden runner: eager


def test_w12_layers_read_the_8bit_view_only_inside_a_q_pass():
    from specpilot.kernels.w12.naive import w12_linear_ref

    layer = SimpleNamespace(weight=torch.nn.Parameter((torch.randn(48, 64) * 0.05).to(torch.bfloat16),
                                                      requires_grad=False))
    w12b.process_weights_after_loading(layer)
    x = torch.randn(3, 64).to(torch.bfloat16)
    exact = w12b.apply(layer, x)
    token = w12b.QPASS.set(True)
    try:
        q = w12b.apply(layer, x)
    finally:
        w12b.QPASS.reset(token)
    assert torch.equal(exact, w12_linear_ref(x, layer.w12)) and torch.equal(q, w12_linear_ref(x, layer.w12, qpass=True))
    assert not torch.equal(exact, q)


def test_toy_two_pass_decoding_is_lossless():
    """A toy target whose linear layer is stored in W12; the Q pass reads the 8-bit view. Greedy
    decoding with the two-pass rule must equal plain greedy decoding of the exact model."""
    from specpilot.kernels.w12 import decode, encode

    gen = torch.Generator().manual_seed(3)
    vocab, hid = 64, 48
    emb = torch.randn(vocab, hid, generator=gen)
    packed = encode((torch.randn(vocab, hid, generator=gen) * 0.3).to(torch.bfloat16))
    w_exact, w_q = decode(packed).float(), decode(packed, qpass=True).float()

    def next_tokens(weight):
        def fn(tokens):
            t = torch.tensor(tokens)
            prev = torch.cat([t[:1], t[:-1]])
            return (torch.tanh(emb[t] + 0.5 * emb[prev]) @ weight.T).argmax(-1).tolist()
        return fn

    exact_next, q_next = next_tokens(w_exact), next_tokens(w_q)

    def greedy(anchor, n):
        out = [anchor]
        while len(out) <= n:
            out.append(exact_next(out)[-1])
        return out[1:]

    def draft(context, width):  # a parallel drafter right about 70% of the time per position
        truth = greedy(context[-1], width)
        g = torch.Generator().manual_seed(len(context))
        wrong = torch.rand(width, generator=g) < 0.3
        return [int(torch.randint(0, vocab, (1,), generator=g)) if w else t for t, w in zip(truth, wrong)]

    want = greedy(5, 60)
    passes = {}
    for two_pass in (False, True):
        got, passes[two_pass] = tlv.run_cycles(5, 60, 8, draft, q_next, exact_next, two_pass=two_pass)
        assert got == want, two_pass
        assert 0 < passes[two_pass] <= 60
    print(f"toy (block 8, drafter wrong 30% per position): exact passes for 60 tokens: "
          f"one pass {passes[False]}, with the Q pass {passes[True]} (plus as many Q passes)")


def test_hooks_through_sglangs_hook_registry(sgl, monkeypatch):
    """tlv's hooks and w12's certified head, registered in the activation's order with SGLang's own
    HookRegistry on a stand-in worker carrying SGLang's own draft head: the certified head answers
    draft (1) (inner), then the Q pass repairs it (outer)."""
    from specpilot.bundles import lm_head, plugin
    from specpilot.bundles.memory import hooks_of, load_memory
    from sglang_support import load_sglang_module_file

    reg = load_sglang_module_file(SGL, "sglang.srt.plugins.hook_registry", "_sp_hook_registry_tlv")
    reg.HookRegistry.reset()
    fake = types.ModuleType("_sp_fake_tlv")
    bs, block = 1, 5
    hidden = torch.randn(bs * (block - 1), 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    head = _head()

    class DFlashWorkerV2:
        block_size = block
        _draft_block_ids_buf = torch.tensor([[3] + [0] * (block - 1)])
        _greedy_sample_from_vocab_parallel_head = sgl["head"]

        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
            return self._greedy_sample_from_vocab_parallel_head(hidden_states=hidden, lm_head=head)

    fake.DFlashWorkerV2 = DFlashWorkerV2
    sys.modules[fake.__name__] = fake
    monkeypatch.setattr(tlv, "ineligible", lambda w, b: None)
    q_seen = []

    def q_pass(worker, batch, chain):
        q_seen.append(chain.clone())
        q = chain.roll(-1, dims=1).clone()
        q[:, 0] = 77  # the Q pass rejects the first draft
        return q

    monkeypatch.setattr(tlv, "q_pass", q_pass)
    try:
        for h in hooks_of(load_memory(), ["tlv"]):
            where = "_sp_fake_tlv." + ".".join(h.target.rsplit(".", 2)[-2:])
            reg.HookRegistry.register(where, plugin.resolve(h.handler), reg.HookType[h.type.upper()])
        reg.HookRegistry.apply_hooks()
        out = DFlashWorkerV2().forward_batch_generation(SimpleNamespace(seq_lens=torch.tensor([9])))
        assert getattr(head, lm_head._ATTR, None) is not None  # the certified head answered draft (1)
        certified = lm_head.certified_argmax(head, head.weight, hidden)
        assert torch.equal(q_seen[0][0, 1:], certified)
        assert out.tolist() == [77] + certified[1:].tolist()
    finally:
        sys.modules.pop(fake.__name__, None)
        sys.modules.pop("_sp_hook_registry_tlv", None)
