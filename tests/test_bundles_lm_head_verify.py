"""w12's certified LM head in the target's DFLASH verify pass (V1-V3 of specpilot.bundles.lm_head), on CPU.

SGLang's own code runs here: ``LogitsProcessor._get_logits`` (with its dense ``_compute_lm_head``),
``is_deferred_shard``, ``DFlashWorkerV2._can_skip_verify_logits``, ``_defer_target_verify_gather``,
``_accept_block`` (+ ``compute_dflash_correct_drafts_and_bonus``, ``_commit_accept``) and the
worker's verify tail, read verbatim from ``forward_batch_generation`` (from ``target_predict = None``
to the ``_accept_block`` call) and executed in a stand-in worker. The hooks are installed by SGLang's
HookRegistry from the w12 memory entry, on stand-in classes of the same names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from sglang_support import SKIP_REASON, fresh_hook_registry, load_sglang_function, sglang_dir

torch = pytest.importorskip("torch")
pytest.importorskip("specpilot.kernels.lm_head")

from specpilot.bundles import lm_head as lh  # noqa: E402
from specpilot.kernels.lm_head import exact_argmax  # noqa: E402

SGL = sglang_dir()
WORKER = "sglang.srt.speculative.dflash_worker_v2"
LOGITS = "sglang.srt.layers.logits_processor"
TAIL_START = "        target_predict = None\n        target_lp = self._target_logits_processor\n"
TAIL_END = "            target_predict=target_predict,\n        )\n"
V, H, BLOCK = 300, 32, 4
HANDLERS = ("around_forward_batch_generation", "around_get_logits", "around_deferred_argmax",
            "around_finish_deferred_gather", "around_graph_capture_one", "around_graph_replay")
GRAPH_SIZES = (1, 2, 4)  # captured batch sizes of the stand-in verify graph runner


def _verify_tail() -> str:
    """The worker's code between the target verify forward and the end of the _accept_block call."""
    src = (SGL / Path(*WORKER.split("."))).with_suffix(".py").read_text(encoding="utf-8")
    assert src.count(TAIL_START) == 1, "SGLang's verify tail moved: update this test"
    start = src.index(TAIL_START)
    end = src.index(TAIL_END, start) + len(TAIL_END)
    return textwrap.dedent(src[start:end])


class _Mode:
    def __init__(self, verify=False, extend=False):
        self.verify, self.extend = verify, extend
        self.name = "TARGET_VERIFY" if verify else "EXTEND" if extend else "DECODE"

    def is_extend(self):
        return self.extend or self.verify

    def is_idle(self):
        return False

    def is_target_verify(self):
        return self.verify


class _Graph:
    """torch.cuda.CUDAGraph on CPU. ``replay`` runs the captured forward again in the contextvars
    context it was captured in and writes the results into the tensors the capture returned: what a
    real replay does (it repeats the captured kernels, whatever Python's state is at replay time)."""
    recording = None

    def __init__(self):
        self.fn = self.ctx = self.out = None

    def replay(self):
        new = self.ctx.run(self.fn)
        for name in ("next_token_logits", "hidden_states"):
            getattr(self.out, name).copy_(getattr(new, name))


@contextlib.contextmanager
def _graph_capture(cuda_graph, pool=None, stream=None):
    cuda_graph.ctx, _Graph.recording = contextvars.copy_context(), cuda_graph
    try:
        yield
    finally:
        _Graph.recording = None


def _greedy_info():
    return SimpleNamespace(is_all_greedy=True, has_custom_logit_processor=False, penalizer_orchestrator=None,
                           logit_bias=None, grammar_mask=None, acc_linear_penalties=None,
                           sampling_mask_batch_indices=None)


@pytest.fixture(scope="module")
def sgl():
    if SGL is None:
        pytest.skip(SKIP_REASON)
    import triton
    import triton.language as tl

    ns = {"torch": torch, "triton": triton, "tl": tl, "Optional": Optional, "Tuple": tuple,
          "SIMULATE_ACC_LEN": 0, "SpecTpSyncSite": SimpleNamespace(DFLASH_ACCEPT_GREEDY="accept-greedy"),
          "is_dflash_sampling_verify_available": lambda: False, "logger": logging.getLogger("sglang-under-test"),
          # LogitsProcessor._get_logits's helpers on one CPU rank (no tracing, no LoRA, no collectives)
          "_trace_e2e_logits": lambda *a, **k: None, "_is_npu": False, "_is_cpu": True,
          "envs": SimpleNamespace(SGLANG_TRACE_LOGITS_E2E_SYNC=SimpleNamespace(get=lambda: False)),
          "LoRABatchLayout": SimpleNamespace(TP_GLOBAL="tp", DP_LOCAL="dp"),
          "get_forward": lambda: SimpleNamespace(scoped=lambda **k: contextlib.nullcontext()),
          "use_intel_amx_backend": lambda layer: getattr(layer, "use_intel_amx_backend", False)}

    def load(module, name, keep=False):
        return load_sglang_function(SGL, module, name, ns, keep_decorators=keep)

    f = {}
    load(LOGITS, "_has_lm_head_runtime_attrs")
    ns["_UNQUANTIZED_LM_HEAD_METHODS"] = {"UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "PackWeightMethod"}
    load(LOGITS, "should_apply_lm_head_quant_method")
    for m in ("_get_logits", "_compute_lm_head", "_gather_dp_attn_hidden_states", "_can_gather_softcap_fused",
              "_scatter_dp_attn_logits", "_copy_logits_to_buffer", "is_deferred_shard", "deferred_argmax",
              "finish_deferred_gather"):
        f[m] = load(LOGITS, f"LogitsProcessor.{m}")
    f["dflash_accept"] = load("sglang.kernels.ops.speculative.dflash", "compute_dflash_correct_drafts_and_bonus")
    load(WORKER, "_commit_accept")
    load(WORKER, "_is_all_greedy")
    for m in ("_accept_block", "_can_skip_verify_logits", "_defer_target_verify_gather"):
        f[m] = load(WORKER, f"DFlashWorkerV2.{m}")
    f["tail"] = compile(_verify_tail(), "dflash_worker_v2.py (verify tail)", "exec")
    # graphs: DecodeCudaGraphRunner.execute (replay, rows sliced) and FullCudaGraphBackend's capture/replay
    ns.update(dataclasses=dataclasses, device_timer_ctx=lambda *a, **k: contextlib.nullcontext(),
              SharedReadEnds=SimpleNamespace(PRE_REPLAY="pre", IN_REPLAY="in", POST_REPLAY="post"),
              PPProxyTensors=type("PPProxyTensors", (), {}))
    ns["envs"].SGLANG_LOG_DECODE_GRAPH_KEY = SimpleNamespace(get=lambda: False)
    ns["LogitsProcessorOutput"] = f["LogitsProcessorOutput"] = load(LOGITS, "LogitsProcessorOutput", keep=True)
    f["ShapeKey"] = load_sglang_function(SGL, "sglang.srt.model_executor.runner.shape_key", "ShapeKey",
                                         {"dataclass": dataclasses.dataclass, "Optional": Optional},
                                         keep_decorators=True)
    f["execute"] = load("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner.execute")
    bns = {"torch": SimpleNamespace(cuda=SimpleNamespace(CUDAGraph=_Graph)), "partial": functools.partial,
           "graph_pool_capture_scope": contextlib.nullcontext, "graph_pool_replay_scope": contextlib.nullcontext}
    for m in ("capture_one", "can_run", "replay"):
        f[m] = load_sglang_function(SGL, "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
                                    f"FullCudaGraphBackend.{m}", bns)
    f["ns"] = ns
    return f


def _fake_module(sgl, *, softcap=None, weight_dtype=torch.float32, seed=0):
    """Stand-ins named LogitsProcessor / DFlashWorkerV2 carrying SGLang's methods; the worker's
    ``forward_batch_generation`` is: target verify forward (LogitsProcessor._get_logits over every
    verify row, as LogitsProcessor.forward does in TARGET_VERIFY mode) + SGLang's verify tail."""
    mod = types.ModuleType("_sp_fake_w12_verify")
    g = torch.Generator().manual_seed(seed)
    lm_head = SimpleNamespace(weight=(torch.randn(V, H, generator=g) * 0.2).to(weight_dtype),
                              quant_method=type("UnquantizedEmbeddingMethod", (), {"apply": lambda *a: None})(),
                              org_vocab_size=V,
                              shard_indices=SimpleNamespace(num_org_elements=V, num_added_elements=0,
                                                            org_vocab_start_index=0))
    calls = {"dense": 0, "adjust": 0, "accept_logits": []}

    class LogitsProcessor:
        for _m in ("_get_logits", "_gather_dp_attn_hidden_states", "_can_gather_softcap_fused",
                   "_scatter_dp_attn_logits", "_copy_logits_to_buffer", "is_deferred_shard", "deferred_argmax",
                   "finish_deferred_gather"):
            locals()[_m] = sgl[_m]
        del _m

        def __init__(self):
            self.vocab_size, self.logit_scale, self.final_logit_softcapping = V, None, softcap
            self.use_attn_tp_group = self.do_tensor_parallel_all_gather = False
            self.do_tensor_parallel_all_gather_dp_attn = False
            self.use_fp32_lm_head = self.use_fp32_lm_head_output = False
            self.rl_on_policy_target = None
            self.defer_verify_gather = False

        def _compute_lm_head(self, *args, **kwargs):
            calls["dense"] += 1
            return sgl["_compute_lm_head"](self, *args, **kwargs)

    sgl["ns"]["LogitsProcessor"] = LogitsProcessor  # _defer_target_verify_gather's isinstance

    class DFlashWorkerV2:
        _accept_block = sgl["_accept_block"]
        _can_skip_verify_logits = sgl["_can_skip_verify_logits"]
        _defer_target_verify_gather = sgl["_defer_target_verify_gather"]

        def __init__(self):
            self.block_size, self._selector_sample, self._use_triton_accept_bonus = BLOCK, None, False
            self.synced = []
            self._tp_sync = SimpleNamespace(sync=lambda site, t: self.synced.append(site) or t)
            self.lp = LogitsProcessor()
            self.target_worker = SimpleNamespace(model_runner=SimpleNamespace(
                model=SimpleNamespace(modules=lambda: [object(), self.lp])))
            self._target_logits_processor = self._defer_target_verify_gather()  # as __init__ does
            self.runner = None  # the target's verify graph runner, when _worker(graphs=True) captured one

        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
            bs, hidden, draft_tokens = len(batch.seq_lens), batch.hidden, batch.draft_tokens
            if self.runner is not None:  # the verify replayed from a captured graph
                logits_output = self.runner.execute(SimpleNamespace(forward_mode=_Mode(verify=True), batch_size=bs,
                                                                    hidden=hidden))
            else:
                meta = SimpleNamespace(forward_mode=_Mode(verify=True), next_token_logits_buffer=None)
                logits_output = SimpleNamespace(next_token_logits=self.lp._get_logits(hidden, lm_head, meta))
            self.logits_before_tail = logits_output.next_token_logits

            def adjust(**kw):
                calls["adjust"] += 1

            def accept_block(**kw):
                calls["accept_logits"].append(kw["next_token_logits"])
                return self._accept_block(**kw)

            env = dict(self=SimpleNamespace(_target_logits_processor=self._target_logits_processor,
                                            _can_skip_verify_logits=self._can_skip_verify_logits,
                                            block_size=self.block_size, _accept_block=accept_block),
                       batch=batch, sampling_info=batch.sampling_info, logits_output=logits_output,
                       grammar_tree=None, grammar_barrier=grammar_barrier, draft_tokens=draft_tokens,
                       draft_input=None, prefix_lens=batch.seq_lens, bs=bs,
                       apply_dflash_verify_logits_adjustments=adjust, build_grammar_vocab_mask=None)
            exec(sgl["tail"], dict(sgl["ns"]), env)
            return tuple(env[k] for k in ("accept_len", "commit_lens", "bonus", "out_tokens", "new_seq_lens"))

    class FullCudaGraphBackend:
        capture_one, can_run, replay = sgl["capture_one"], sgl["can_run"], sgl["replay"]

        def __init__(self, runner):  # FullCudaGraphBackend.__init__'s state, on CPU
            self._graphs, self._outputs, self._pool, self._capture_stream = {}, {}, None, None
            self._cuda_graph_runner, self._tp_group = runner, SimpleNamespace(barrier=lambda: None)
            self._device_module = SimpleNamespace(synchronize=lambda: None, graph=_graph_capture)
            self._precarve = SimpleNamespace(measure=contextlib.nullcontext, mint=lambda: None)
            self._reuse_output_buffer, self._output_buffer, self._memory_saver_adapter = False, None, None

        def replay_session(self):
            return contextlib.nullcontext()

    class DecodeCudaGraphRunner:
        """The target's verify graph runner: SGLang's execute; capture = capture_one_shape per size."""
        execute = sgl["execute"]
        capture_forward_mode, captured_req_width, is_dllm = _Mode(verify=True), BLOCK, False
        ragged_verify_mode = record_nolora_graph = enable_pdmux = enable_two_batch_overlap = False
        enable_torch_compile = False

        def __init__(self, lp):
            model = SimpleNamespace(modules=lambda: [object(), lp], lm_head=lm_head)
            self.lp, self.backend = lp, FullCudaGraphBackend(self)
            self.model_runner = SimpleNamespace(is_draft_worker=False, lora_manager=None, model=model, device_timer=None)
            self.static_hidden = torch.zeros(max(GRAPH_SIZES) * BLOCK, H, dtype=lm_head.weight.dtype)

        def capture(self):  # largest first; per size the model's verify forward over static inputs (hidden = input)
            meta = SimpleNamespace(forward_mode=self.capture_forward_mode, next_token_logits_buffer=None)
            for bs in sorted(GRAPH_SIZES, reverse=True):
                def forward(rows=self.static_hidden[: bs * BLOCK]):
                    hidden = rows.clone()
                    return sgl["LogitsProcessorOutput"](next_token_logits=self.lp._get_logits(hidden, lm_head, meta),
                                                        hidden_states=hidden)

                def run_once(forward=forward):
                    out = forward()
                    if _Graph.recording is not None:
                        _Graph.recording.fn, _Graph.recording.out = forward, out
                    return out

                self.backend.capture_one(sgl["ShapeKey"](size=bs), run_once)

        def load_batch(self, forward_batch, pp_proxy_tensors=None):  # pad to a captured size, fill the inputs
            self.raw_num_token = forward_batch.batch_size * BLOCK
            self.bs = min(s for s in GRAPH_SIZES if s >= forward_batch.batch_size)
            self.static_hidden[: self.raw_num_token].copy_(forward_batch.hidden)
            self._replay_graph_key = sgl["ShapeKey"](size=self.bs)

        def model_context(self):
            return contextlib.nullcontext()

        def _replay_attn_backend(self):
            return None

        def _resolve_shared_read_ends(self, attn_backend, mode):
            return None

        def _process_output_after_replay(self, output, forward_batch):
            return output

    mod.LogitsProcessor, mod.DFlashWorkerV2 = LogitsProcessor, DFlashWorkerV2
    mod.FullCudaGraphBackend, mod.DecodeCudaGraphRunner = FullCudaGraphBackend, DecodeCudaGraphRunner
    return mod, lm_head, calls


@pytest.fixture
def registry():
    with fresh_hook_registry(SGL, "_sp_hook_registry_w12_verify") as reg:
        yield reg


@pytest.fixture(autouse=True)
def clean_state():
    lh._state.update(steps=0, graph_steps=0, skipped={}, disabled=False)
    yield
    lh._state.update(steps=0, graph_steps=0, skipped={}, disabled=False)


def _verify_hooks():
    from specpilot.bundles.memory import load_memory

    return [h for h in load_memory()["w12"].hooks if h.handler.split(":")[1] in HANDLERS]


def _install(registry, mod):
    sys.modules[mod.__name__] = mod
    for h in _verify_hooks():
        where = f"{mod.__name__}." + ".".join(h.target.rsplit(".", 2)[-2:])
        registry.HookRegistry.register(where, getattr(lh, h.handler.split(":")[1]), registry.HookType[h.type.upper()])
    registry.HookRegistry.apply_hooks()


def _batch(lm_head, seed=1, bs=3, **over):
    """Hidden rows of a verify block and draft tokens that follow the exact argmax for a few positions."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bs * BLOCK, H, generator=g).to(lm_head.weight.dtype)
    want = exact_argmax(hidden, lm_head.weight).view(bs, BLOCK)
    draft = torch.randint(0, V, (bs, BLOCK), generator=g)
    for b in range(bs):  # row b: the first b drafts are the target's tokens, then a miss
        draft[b, 1:1 + b] = want[b, :b]
        if b + 1 < BLOCK:
            draft[b, 1 + b] = (want[b, b] + 1) % V
    batch = SimpleNamespace(forward_mode=_Mode(), is_extend_in_batch=False, has_grammar=False, return_logprob=False,
                            sampling_info=_greedy_info(), seq_lens=torch.tensor([7, 11, 5][:bs]),
                            hidden=hidden, draft_tokens=draft)
    for k, v in over.items():
        setattr(batch, k, v)
    return batch, want


@contextlib.contextmanager
def _worker(sgl, registry, hooked=True, graphs=False, **mod_over):
    """A stand-in worker (hooks installed unless ``hooked`` is false); with ``graphs``, its target's
    verify graphs are captured after the worker exists (SGLang: scheduler.init_all_cuda_graphs)."""
    mod, lm_head, calls = _fake_module(sgl, **mod_over)
    try:
        if hooked:
            _install(registry, mod)
        worker = mod.DFlashWorkerV2()
        if graphs:
            worker.runner = mod.DecodeCudaGraphRunner(worker.lp)
            worker.runner.capture()
            calls["dense_at_capture"] = calls["dense"]
        yield worker, calls, lm_head
    finally:
        sys.modules.pop(mod.__name__, None)


def _run(sgl, registry, batch_over=None, hooked=True, graphs=False, **mod_over):
    with _worker(sgl, registry, hooked, graphs, **mod_over) as (worker, calls, lm_head):
        batch, want = _batch(lm_head, **(batch_over or {}))
        out = worker.forward_batch_generation(batch)
        return out, worker, calls, want, lm_head


def test_the_verify_hooks_are_in_the_entry():
    got = {(h.type, h.target.rsplit(".", 2)[-2] + "." + h.target.rsplit(".", 1)[-1]) for h in _verify_hooks()}
    assert got == {("around", "DFlashWorkerV2.forward_batch_generation"), ("around", "LogitsProcessor._get_logits"),
                   ("around", "LogitsProcessor.deferred_argmax"),
                   ("around", "LogitsProcessor.finish_deferred_gather"),
                   ("around", "FullCudaGraphBackend.capture_one"), ("around", "FullCudaGraphBackend.replay")}


def test_eligible_verify_skips_the_dense_head_and_accepts_like_stock(sgl, registry):
    stock, s_worker, s_calls, want, _ = _run(sgl, registry, hooked=False)
    assert s_calls["dense"] == 1 and s_calls["adjust"] == 1  # stock: dense logits, adjusted, argmax in accept
    assert torch.equal(s_calls["accept_logits"][0].argmax(-1).view(3, BLOCK), want)  # fp32 head: no near-ties
    ours, worker, calls, want2, _ = _run(sgl, registry)
    assert torch.equal(want, want2)
    assert calls["dense"] == 0 and calls["adjust"] == 0, "the dense head or the logits adjustments ran"
    assert calls["accept_logits"] == [None]  # SGLang's skip path: next_token_logits = None
    assert worker.logits_before_tail.dtype == torch.long and worker.logits_before_tail.shape == (3 * BLOCK, 1)
    assert torch.equal(worker.logits_before_tail.view(3, BLOCK), want)  # exact head's argmax, every row
    assert lh._state["steps"] == 1 and not lh._state["skipped"]
    for a, b in zip(ours, stock):
        assert (a is None and b is None) or torch.equal(a, b)
    assert ours[0].tolist() == [0, 1, 2]  # accept lengths follow the planted drafts
    assert worker.synced == s_worker.synced == ["accept-greedy"]


def test_bf16_head_gives_the_exact_argmax(sgl, registry):
    ours, worker, calls, want, lm_head = _run(sgl, registry, weight_dtype=torch.bfloat16, batch_over={"seed": 3})
    assert calls["dense"] == 0
    assert torch.equal(worker.logits_before_tail.view(3, BLOCK), want)  # exact_argmax of the bf16 rows
    assert getattr(lm_head, lh._ATTR)[1] is not None  # the INT8 copy is cached on the head (shared with drafting)


@pytest.mark.parametrize("change", ["logprob", "penalty", "sampling", "extend"])
def test_ineligible_steps_are_stock(sgl, registry, change):
    over = {"logprob": {"return_logprob": True},
            "penalty": {"sampling_info": SimpleNamespace(**{**vars(_greedy_info()),
                                                            "logit_bias": torch.zeros(V)})},
            "sampling": {"sampling_info": SimpleNamespace(**{**vars(_greedy_info()), "is_all_greedy": False})},
            "extend": {"forward_mode": _Mode(extend=True)}}[change]
    stock, _, s_calls, _, _ = _run(sgl, registry, batch_over=over, hooked=False)
    ours, worker, calls, _, _ = _run(sgl, registry, batch_over=over)
    assert calls["dense"] == 1 and calls["adjust"] == s_calls["adjust"] == 1
    assert worker.logits_before_tail.dtype == torch.float32 and worker.logits_before_tail.shape == (3 * BLOCK, V)
    assert calls["accept_logits"][0] is not None and lh._state["steps"] == 0 and sum(lh._state["skipped"].values()) == 1
    for a, b in zip(ours, stock):
        assert (a is None and b is None) or torch.equal(a, b)


def test_softcapped_head_is_stock(sgl, registry):
    ours, worker, calls, _, _ = _run(sgl, registry, softcap=30.0)
    stock, _, _, _, _ = _run(sgl, registry, softcap=30.0, hooked=False)
    assert calls["dense"] == 1 and worker.logits_before_tail.shape == (3 * BLOCK, V) and lh._state["steps"] == 0
    for a, b in zip(ours, stock):
        assert (a is None and b is None) or torch.equal(a, b)


def test_get_logits_outside_the_scope_or_not_verify_calls_stock():
    seen = []

    def original(*a):
        seen.append(a)
        return "stock"

    lp = SimpleNamespace(vocab_size=V)
    meta = SimpleNamespace(forward_mode=_Mode(verify=True))
    h = torch.ones(2, H)
    assert lh.around_get_logits(original, lp, h, SimpleNamespace(weight=torch.ones(V, H)), meta) == "stock"
    token = lh._scope().set({"lp": lp})
    try:  # in scope, but a decode-mode call (not the verify)
        assert lh.around_get_logits(original, lp, h, SimpleNamespace(weight=torch.ones(V, H)),
                                    SimpleNamespace(forward_mode=_Mode())) == "stock"
    finally:
        lh._scope().reset(token)
    assert len(seen) == 2 and all(a[4] is None and a[5] is True for a in seen)  # arguments passed on unchanged


def test_finish_deferred_gather_refuses_the_ids_and_passes_logits_on():
    token = lh._scope().set({"lp": None, "ids": torch.zeros(4, 1, dtype=torch.long)})
    try:
        with pytest.raises(RuntimeError, match="skipped by the certified head"):
            lh.around_finish_deferred_gather(None, None, torch.zeros(4, 1, dtype=torch.long))
        logits = torch.zeros(4, 10)
        assert lh.around_finish_deferred_gather(lambda self, x: "gathered", None, logits) == "gathered"
        assert lh.around_deferred_argmax(lambda self, x: "stock", None, logits) == "stock"
    finally:
        lh._scope().reset(token)


# ------------------------------------------------------------ captured target-verify graphs (G1, G2)

def _same(ours, stock):
    for a, b in zip(ours, stock):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("hooked", [True, False])
def test_graph_capture_keeps_stock_graphs_and_adds_the_certified_variant(sgl, registry, hooked):
    with _worker(sgl, registry, hooked=hooked, graphs=True) as (worker, calls, _):
        backend, key = worker.runner.backend, sgl["ShapeKey"]
        stock = {key(size=b) for b in GRAPH_SIZES}
        ours = {key(size=b, variant_label=lh.GRAPH_LABEL) for b in GRAPH_SIZES} if hooked else set()
        assert set(backend._graphs) == stock | ours
        assert calls["dense"] == 3 * len(GRAPH_SIZES)  # stock's two warmups + capture per size; none for ours
        for b in GRAPH_SIZES:
            logits = backend._outputs[key(size=b)].next_token_logits
            assert logits.dtype == torch.float32 and logits.shape == (b * BLOCK, V)
            if hooked:
                ids = backend._outputs[key(size=b, variant_label=lh.GRAPH_LABEL)].next_token_logits
                assert ids.dtype == torch.long and ids.shape == (b * BLOCK, 1)
        if hooked:
            assert getattr(backend, lh._GRAPHS) == {"lp": worker.lp, "keys": ours} and lh._state["steps"] == 0


def test_graph_replay_of_an_eligible_step_is_the_certified_variant(sgl, registry):
    stock, s_worker, s_calls, want, _ = _run(sgl, registry, hooked=False, graphs=True)
    assert s_calls["dense"] == s_calls["dense_at_capture"] + 1  # stock's graph replays its dense head
    ours, worker, calls, want2, _ = _run(sgl, registry, graphs=True)
    assert torch.equal(want, want2) and calls["dense"] == calls["dense_at_capture"]  # the variant has none
    assert calls["accept_logits"] == [None] and calls["adjust"] == 0  # SGLang's skip path
    ids = worker.logits_before_tail  # 3 requests replayed in the 4-request graph: execute kept the real rows
    assert ids.dtype == torch.long and ids.shape == (3 * BLOCK, 1) and torch.equal(ids.view(3, BLOCK), want)
    assert lh._state["graph_steps"] == 1 and lh._state["steps"] == 0 and not lh._state["skipped"]
    _same(ours, stock)
    assert worker.synced == s_worker.synced == ["accept-greedy"]


@pytest.mark.parametrize("change", ["logprob", "sampling"])
def test_graph_replay_of_an_ineligible_step_is_stock(sgl, registry, change):
    over = {"logprob": {"return_logprob": True},
            "sampling": {"sampling_info": SimpleNamespace(**{**vars(_greedy_info()), "is_all_greedy": False})}}[change]
    stock, s_worker, _, _, _ = _run(sgl, registry, batch_over=over, hooked=False, graphs=True)
    ours, worker, calls, _, _ = _run(sgl, registry, batch_over=over, graphs=True)
    assert calls["dense"] == calls["dense_at_capture"] + 1 and lh._state["graph_steps"] == 0
    assert torch.equal(worker.logits_before_tail, s_worker.logits_before_tail)  # stock graph's logits, bit for bit
    assert worker.logits_before_tail.shape == (3 * BLOCK, V) and calls["accept_logits"][0] is not None
    _same(ours, stock)


@pytest.mark.parametrize("bs", [2, 3])
def test_graph_sizes_beyond_the_row_limit_keep_only_stock(sgl, registry, monkeypatch, bs):
    monkeypatch.setattr(lh, "GRAPH_MAX_ROWS", 2 * BLOCK)  # variants for 1 and 2 requests, not for 4
    stock, _, _, want, _ = _run(sgl, registry, hooked=False, graphs=True, batch_over={"bs": bs})
    ours, worker, calls, _, _ = _run(sgl, registry, graphs=True, batch_over={"bs": bs})
    assert getattr(worker.runner.backend, lh._GRAPHS)["keys"] == {
        sgl["ShapeKey"](size=b, variant_label=lh.GRAPH_LABEL) for b in (1, 2)}
    if bs == 2:
        assert torch.equal(worker.logits_before_tail.view(2, BLOCK), want) and lh._state["graph_steps"] == 1
    else:  # 3 requests replay the 4-request graph: stock's only
        assert worker.logits_before_tail.shape == (3 * BLOCK, V) and calls["dense"] == calls["dense_at_capture"] + 1
        assert lh._state["skipped"] == {"no certified verify graph for this batch": 1}
    _same(ours, stock)


@pytest.mark.parametrize("change", ["draft worker", "not verify", "ragged", "torch.compile", "lora label", "unmarked"])
def test_graph_plan_refuses_other_runners(sgl, registry, change):
    with _worker(sgl, registry, graphs=True) as (worker, _, _):
        runner, key = worker.runner, sgl["ShapeKey"](size=1)
        assert lh.graph_head_plan(runner, key)[0] is worker.lp
        if change == "draft worker":
            runner.model_runner.is_draft_worker = True
        elif change == "not verify":
            runner.capture_forward_mode = _Mode()
        elif change == "ragged":
            runner.ragged_verify_mode = True
        elif change == "torch.compile":
            runner.enable_torch_compile = True
        elif change == "lora label":
            key = sgl["ShapeKey"](size=1, variant_label="nolora")
        else:
            worker.lp.defer_verify_gather = False
        assert lh.graph_head_plan(runner, key) is None
