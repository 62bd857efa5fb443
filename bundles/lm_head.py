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
  captured), with a dense full-vocabulary head on this rank (no TP gather, DP-attention gather,
  LoRA, quantized head, bias, softcapping or RL on-policy path), the dense head matmul is skipped:
  the certified head computes the exact-logit argmax of every row (``argmax_exact``: no host sync)
  and ``_get_logits`` returns the token ids as an int64 ``[N, 1]`` tensor. Its width (1) is below
  the vocabulary, so the worker's own deferred-shard test treats it as a deferred shard.
* V3 AROUND ``LogitsProcessor.deferred_argmax``: given that ``[N, 1]`` tensor, returns its ids
  (int64 ``[N]``). The worker then sets ``next_token_logits = None`` and passes the ids to
  ``_accept_block`` as ``target_predict``: SGLang's own skip-logits path (the one its TP deferred
  argmax takes).
* guard AROUND ``LogitsProcessor.finish_deferred_gather``: never reached for these steps (V1
  checked SGLang's skip predicate); given the ``[N, 1]`` ids it raises rather than gather them.

A verify replayed from a CUDA graph never runs V2 (the graph holds stock's dense head), so it is
stock.
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
_state = {"steps": 0, "skipped": {}, "disabled": False}
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
            and hidden_states.shape[0] > 0 and not _capturing():
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
    _state["steps"] += 1
    return ids


def _ours(logits) -> bool:
    import torch

    scope = _scope().get()
    return (scope is not None and "ids" in scope and logits is not None and logits.dtype == torch.int64
            and logits.dim() == 2 and logits.shape[-1] == 1)


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
