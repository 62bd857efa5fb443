"""The certified INT8 LM head inside SGLang's DFLASH worker (part of the ``w12`` bundle).

SGLang 0.5.23's ``DFlashWorkerV2._greedy_sample_from_vocab_parallel_head`` takes the argmax of
the target's LM head over the drafter's hidden states (the eager DFlash draft path). The AROUND
hook below answers it with ``specpilot.kernels.lm_head``: an INT8 copy of the head bounds every
logit (Cauchy-Schwarz), tokens whose upper bound is below the best lower bound are dropped and the
survivors are rescored exactly, so the result is the argmax of the exact logits (lowest id on a
tie). Stock takes the argmax of bf16-rounded logits, so the two can differ only where bf16
rounding ties or reorders the top logits; drafting is not verification, so losslessness is
unaffected either way.

Rows are answered by the original method whenever the head is not a plain dense matrix holding
the whole vocabulary on this rank (tensor parallelism, added vocabulary, a quantized head).

The target's verify pass (eligible steps only), three hooks and a guard:

* V1 AROUND ``DFlashWorkerV2.forward_batch_generation``: scopes a decode step whose verify logits
  SGLang itself may skip (``DFlashWorkerV2._can_skip_verify_logits``: greedy, no logprobs,
  penalties, bias, grammar, custom logit processor, sampling masks or selector sampling) on a
  worker that defers its target LogitsProcessor's verify gather. Every other step runs stock.
* V2 AROUND ``LogitsProcessor._get_logits``: inside that scope, for the worker's target
  LogitsProcessor in TARGET_VERIFY mode, executed in Python (not while a CUDA graph is being
  captured, except G1's certified variant below), with a dense full-vocabulary head on this rank
  (no TP gather, DP-attention gather, LoRA, quantized head, bias, softcapping or RL on-policy
  path), the dense head matmul is skipped:
  the certified head computes the exact-logit argmax of every row (``argmax_exact``: no host sync)
  and ``_get_logits`` returns the token ids as an int64 ``[N, 1]`` tensor. Its width (1) is below
  the vocabulary, so the worker's own deferred-shard test treats it as a deferred shard.
* V3 AROUND ``LogitsProcessor.deferred_argmax``: given that ``[N, 1]`` tensor, returns its ids
  (int64 ``[N]``). The worker then sets ``next_token_logits = None`` and passes the ids to
  ``_accept_block`` as ``target_predict``: SGLang's own skip-logits path (the one its TP deferred
  argmax takes).
* guard AROUND ``LogitsProcessor.finish_deferred_gather``: never reached for these steps (V1
  checked SGLang's skip predicate); given the ``[N, 1]`` ids it raises rather than gather them.

A verify replayed from a CUDA graph runs no Python, so the choice is made per step between two
captured graphs (SGLang's own multi-graph mechanism: ``ShapeKey.variant_label``), two more hooks:

* G1 AROUND ``FullCudaGraphBackend.capture_one``: stock's graph is captured first, unchanged. Then,
  for the target's ``DecodeCudaGraphRunner`` in TARGET_VERIFY mode (not the drafter's; no ragged
  verify, LoRA, PD-mux, two-batch overlap or torch.compile; at most ``GRAPH_MAX_ROWS`` verify rows;
  the one LogitsProcessor the DFLASH worker marked, with a head V2 may serve), the same
  ``forward_fn`` is captured again under ``variant_label = GRAPH_LABEL`` inside a capture scope in
  which V2 serves (``argmax_exact`` is graph-safe; the INT8 copy is built before the capture). The
  same ``forward_fn`` means the same static input buffers and the attention metadata that
  ``capture_one_shape`` prepared once for both graphs: a second ``capture_one_shape`` would rebuild
  it (FlashInfer makes new wrappers with their own int workspaces, and replay plans only the
  newest), leaving stock's graph stale. A variant whose captured forward V2 did not serve is dropped.
* G2 AROUND ``FullCudaGraphBackend.replay``: inside V1's scope (an eligible step), a TARGET_VERIFY
  replay on that backend whose key has a certified variant replays it and hands its int64
  ``[rows, 1]`` ids to V3 (``execute`` slices them to the real rows like logits). Every other
  replay (an ineligible step, the drafter's graphs, keys without a variant) replays stock's graph
  with stock's key, so its output is exactly stock's.

Graph eligibility (``can_run_graph``), the key stock chose and the eager fallback are SGLang's.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("specpilot.lm_head")

_ATTR = "_specpilot_certified_head"
MAX_ROWS = 64


def _full_vocab_weight(lm_head):
    """The dense [vocab, hidden] weight when this rank holds the whole original vocabulary."""
    import torch

    weight = getattr(lm_head, "weight", None)
    if weight is None or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dim() != 2:
        return None
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        return weight
    num_org = int(getattr(shard, "num_org_elements", -1))
    if (int(getattr(shard, "num_added_elements", 1)) != 0 or int(getattr(shard, "org_vocab_start_index", 1)) != 0
            or num_org != int(getattr(lm_head, "org_vocab_size", -2))):
        return None  # a TP shard or an added vocabulary: stock handles it
    return weight[:num_org]


def certified_head(lm_head, weight):
    """The certified head for ``weight``, built once per head (the INT8 copy costs ~V*H bytes)."""
    key = (weight.data_ptr(), tuple(weight.shape), weight.device.type)
    cached = getattr(lm_head, _ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if weight.is_cuda:
        from specpilot.kernels.lm_head.certified import CertifiedHead

        head = CertifiedHead(weight, max_rows=MAX_ROWS)
    else:
        from specpilot.kernels.lm_head import quantize_head

        head = quantize_head(weight)
    setattr(lm_head, _ATTR, (key, head))
    return head


def certified_argmax(lm_head, weight, hidden, exact: bool = False):
    """Exact-logit argmax of ``hidden`` [N, H] over ``weight`` rows, through the certified head.
    With ``exact`` the GPU path is ``CertifiedHead.argmax_exact`` (device fallback, no host sync)."""
    import torch

    head = certified_head(lm_head, weight)
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], MAX_ROWS):
        h = hidden[start:start + MAX_ROWS]
        if weight.is_cuda and exact:
            out[start:start + h.shape[0]] = head.argmax_exact(h.to(weight.dtype))
        elif weight.is_cuda:
            out[start:start + h.shape[0]] = head(h.to(weight.dtype)).argmax
        else:
            from specpilot.kernels.lm_head import certified_argmax_ref

            out[start:start + h.shape[0]] = certified_argmax_ref(h.to(weight.dtype), head).argmax
    return out


def around_greedy_sample_from_head(original, self, *args, hidden_states=None, lm_head=None, chunk_size=256,
                                   **kwargs):
    """AROUND DFlashWorkerV2._greedy_sample_from_vocab_parallel_head: token ids [N] (int64)."""
    weight = None if (args or kwargs or hidden_states is None) else _full_vocab_weight(lm_head)
    if weight is None or hidden_states.numel() == 0:
        return original(self, *args, hidden_states=hidden_states, lm_head=lm_head, chunk_size=chunk_size, **kwargs)
    return certified_argmax(lm_head, weight, hidden_states)


# ------------------------------------------------------------------- the target's verify pass

_verify = None  # contextvars.ContextVar, created on first use
_state = {"steps": 0, "graph_steps": 0, "skipped": {}, "disabled": False}
UNQUANTIZED_HEADS = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def _scope():
    global _verify
    if _verify is None:
        import contextvars

        _verify = contextvars.ContextVar("specpilot_w12_verify_head", default=None)
    return _verify


def _skip(reason: str) -> None:
    _state["skipped"][reason] = _state["skipped"].get(reason, 0) + 1


def verify_step_ineligible(worker, batch) -> str | None:
    """Why this DFLASH step's verify keeps stock's dense head (None: the certified head may serve it)."""
    if _state["disabled"]:
        return "disabled after an error"
    mode = batch.forward_mode
    if mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False):
        return "not a decode step"
    lp = getattr(worker, "_target_logits_processor", None)
    if lp is None or not getattr(lp, "defer_verify_gather", False):
        return "no deferred target LogitsProcessor"
    if not worker._can_skip_verify_logits(batch, batch.sampling_info):  # SGLang's own predicate
        return "verify logits needed (not plain greedy)"
    return None


def around_forward_batch_generation(original, self, batch, *args, **kwargs):
    """V1: AROUND DFlashWorkerV2.forward_batch_generation: scope an eligible step."""
    try:
        reason = verify_step_ineligible(self, batch)
    except Exception:  # a missing attribute on another SGLang build: stock step
        reason = "eligibility check failed"
    if reason is not None:
        _skip(reason)
        return original(self, batch, *args, **kwargs)
    token = _scope().set({"lp": self._target_logits_processor})
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _scope().reset(token)


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def verify_head_weight(lp, lm_head, logits_metadata, embedding_bias):
    """The dense full-vocabulary weight when this LogitsProcessor call may use the certified head."""
    import torch

    mode = getattr(logits_metadata, "forward_mode", None)
    if mode is None or not mode.is_target_verify() or embedding_bias is not None:
        return None
    if (lp.do_tensor_parallel_all_gather or lp.do_tensor_parallel_all_gather_dp_attn or lp.use_attn_tp_group
            or lp.final_logit_softcapping or (lp.logit_scale is not None and not lp.logit_scale > 0)
            or getattr(lp, "rl_on_policy_target", None) is not None):
        return None
    if hasattr(lm_head, "set_lora") or getattr(lm_head, "use_intel_amx_backend", False):
        return None
    qm = getattr(lm_head, "quant_method", None)
    if qm is not None and type(qm).__name__ not in UNQUANTIZED_HEADS:
        return None
    weight = _full_vocab_weight(lm_head)
    if weight is None or weight.dtype not in (torch.bfloat16, torch.float32) or weight.shape[0] != lp.vocab_size:
        return None  # fp16 (the INT8 copy takes bf16/fp32) or a vocabulary stock would slice
    return weight


def around_get_logits(original, self, hidden_states, lm_head, logits_metadata, embedding_bias=None,
                      use_logits_buffer=True):
    """V2: AROUND LogitsProcessor._get_logits: int64 [N, 1] certified argmax on an eligible verify."""
    scope = _scope().get()
    weight = None
    if scope is not None and scope["lp"] is self and not _state["disabled"] and hidden_states.dim() == 2 \
            and hidden_states.shape[0] > 0 and (scope.get("capture") or not _capturing()):
        weight = verify_head_weight(self, lm_head, logits_metadata, embedding_bias)
    if weight is None or hidden_states.shape[-1] != weight.shape[1] or self.vocab_size <= 1:
        return original(self, hidden_states, lm_head, logits_metadata, embedding_bias, use_logits_buffer)
    try:
        ids = certified_argmax(lm_head, weight, hidden_states, exact=True).view(-1, 1)
    except Exception:  # e.g. building the INT8 copy failed; nothing was written: stock's head
        logger.exception("SpecPilot w12: certified verify head failed; the dense head serves from now on")
        _state["disabled"] = True
        return original(self, hidden_states, lm_head, logits_metadata, embedding_bias, use_logits_buffer)
    scope["ids"] = ids
    if not scope.get("capture"):
        _state["steps"] += 1
    return ids


def _is_ids(logits) -> bool:
    import torch

    return isinstance(logits, torch.Tensor) and logits.dtype == torch.int64 and logits.dim() == 2 \
        and logits.shape[-1] == 1


def _ours(logits) -> bool:
    scope = _scope().get()
    return scope is not None and "ids" in scope and _is_ids(logits)


def around_deferred_argmax(original, self, logits, *args, **kwargs):
    """V3: AROUND LogitsProcessor.deferred_argmax: the certified ids as int64 [N]."""
    if not args and not kwargs and _ours(logits):
        return logits[:, 0]
    return original(self, logits, *args, **kwargs)


def around_finish_deferred_gather(original, self, logits, *args, **kwargs):
    """V3 guard: AROUND LogitsProcessor.finish_deferred_gather: never gather the [N, 1] ids."""
    if _ours(logits):
        raise RuntimeError("SpecPilot w12: the verify's logits were skipped by the certified head, "
                           "but the worker asked for them (its skip predicate changed within the step)")
    return original(self, logits, *args, **kwargs)


# ------------------------------------------------------------ captured target-verify graphs (G1, G2)

GRAPH_LABEL = "specpilot-certified-head"  # ShapeKey.variant_label of the certified variant
GRAPH_MAX_ROWS = MAX_ROWS                 # larger graphs keep only stock's variant (one pass over the INT8 copy)
_GRAPHS = "_specpilot_certified_graphs"   # on the backend: {"lp": the target LogitsProcessor, "keys": set()}


def graph_head_plan(runner, shape_key):
    """(lp, lm_head, weight) when ``runner`` captures DFLASH's target verify at ``shape_key`` and the
    certified variant may be captured beside stock's graph; None otherwise."""
    mode = getattr(runner, "capture_forward_mode", None)
    mr = getattr(runner, "model_runner", None)
    if (_state["disabled"] or mode is None or not mode.is_target_verify() or mr is None
            or getattr(mr, "is_draft_worker", True) or getattr(mr, "lora_manager", None) is not None):
        return None
    if any(getattr(runner, flag, True) for flag in ("ragged_verify_mode", "record_nolora_graph", "enable_pdmux",
                                                    "enable_two_batch_overlap", "enable_torch_compile")):
        return None  # token-count keys, LoRA/PD-mux/TBO variants, torch.compile'd forwards: stock only
    if shape_key.variant_label is not None or shape_key.stream_idx is not None \
            or shape_key.size * int(getattr(runner, "captured_req_width", GRAPH_MAX_ROWS + 1)) > GRAPH_MAX_ROWS:
        return None
    # the one LogitsProcessor DFlashWorkerV2._defer_target_verify_gather marked (the worker exists by now)
    lps = [m for m in mr.model.modules() if getattr(m, "defer_verify_gather", False) is True]
    lm_head = getattr(mr.model, "lm_head", None)
    if len(lps) != 1 or lm_head is None:
        return None
    import types

    weight = verify_head_weight(lps[0], lm_head, types.SimpleNamespace(forward_mode=mode), None)
    return None if weight is None else (lps[0], lm_head, weight)


def _drop_graph(backend, key) -> None:
    for table in (getattr(backend, "_graphs", None), getattr(backend, "_outputs", None)):
        if isinstance(table, dict):
            table.pop(key, None)


def around_graph_capture_one(original, self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
    """G1: AROUND FullCudaGraphBackend.capture_one: stock's graph first, unchanged; then, for DFLASH's
    target verify, the certified-head variant of the same ``forward_fn`` (same static inputs and the
    attention metadata capture_one_shape prepared once) under ``GRAPH_LABEL``."""
    original(self, shape_key, forward_fn, capture_inputs, post_warmup_hook)
    try:
        plan = graph_head_plan(self._cuda_graph_runner, shape_key)
    except Exception:  # an attribute missing on another SGLang build: stock graphs only
        logger.exception("SpecPilot w12: certified verify graph check failed; stock graphs only")
        plan = None
    if plan is None:
        return
    import dataclasses

    lp, lm_head, weight = plan
    key = dataclasses.replace(shape_key, variant_label=GRAPH_LABEL)
    scope = {"lp": lp, "capture": True}
    token = _scope().set(scope)
    try:
        certified_head(lm_head, weight)  # the INT8 copy, built before the capture (not recorded in it)
        original(self, key, forward_fn, capture_inputs, post_warmup_hook)
    except Exception:
        logger.exception("SpecPilot w12: capturing the certified verify graph failed; stock graphs only")
        _state["disabled"] = True
        _drop_graph(self, key)
        return
    finally:
        _scope().reset(token)
    ids = getattr(getattr(self, "_outputs", {}).get(key), "next_token_logits", None)
    if not _is_ids(ids):  # V2 did not serve the captured forward: it would only duplicate stock's graph
        _drop_graph(self, key)
        _skip("certified verify graph not captured")
        return
    graphs = self.__dict__.setdefault(_GRAPHS, {"lp": lp, "keys": set()})
    graphs["keys"].add(key)


def around_graph_replay(original, self, shape_key, static_forward_batch, **kwargs):
    """G2: AROUND FullCudaGraphBackend.replay: inside V1's scope (an eligible step) a target verify of
    the scoped worker's model replays the certified variant; every other replay is stock's graph."""
    graphs = getattr(self, _GRAPHS, None)
    scope = _scope().get()
    if graphs is None or scope is None or scope.get("capture") or scope["lp"] is not graphs["lp"] \
            or _state["disabled"]:
        return original(self, shape_key, static_forward_batch, **kwargs)
    import dataclasses

    key = dataclasses.replace(shape_key, variant_label=GRAPH_LABEL)
    mode = getattr(static_forward_batch, "forward_mode", None)
    if key not in graphs["keys"] or mode is None or not mode.is_target_verify():
        _skip("no certified verify graph for this batch")
        return original(self, shape_key, static_forward_batch, **kwargs)
    out = original(self, key, static_forward_batch, **kwargs)
    scope["ids"] = out.next_token_logits  # int64 [rows, 1]: V3 and the guard recognise them
    _state["graph_steps"] += 1
    return out
