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
"""

from __future__ import annotations

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


def certified_argmax(lm_head, weight, hidden):
    """Exact-logit argmax of ``hidden`` [N, H] over ``weight`` rows, through the certified head."""
    import torch

    head = certified_head(lm_head, weight)
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], MAX_ROWS):
        h = hidden[start:start + MAX_ROWS]
        if weight.is_cuda:
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
