"""Bundle ``tlv`` (experimental): the two-pass cycle of paper 4.3 in SGLang 0.5.23's DFLASH worker.

The paper's cycle: draft (1) a tree; a Q pass that reads only W12's 8-bit view picks a commit chain
C (the Q pass's accepted path plus its bonus token) without touching target state; draft (2) a
fresh subtree from the end of C; one exact pass over C plus the subtree accepts the longest
matching path. Only the exact pass accepts tokens, so the cycle is lossless.

What this bundle installs (the parts SGLang 0.5.23's DFLASH worker can host without replacing
its decode step):

* AROUND ``DFlashWorkerV2.forward_batch_generation`` scopes an eligible decode step (at most
  ``tlv_max_batch`` greedy requests, plain DFlash drafter, no grammar/logprobs/penalties, non-hybrid
  target served by ``--quantization w12``, TP 1, no DP attention); other steps run stock.
* AROUND ``DFlashWorkerV2._greedy_sample_from_vocab_parallel_head`` (the draft (1) head): after
  the drafter's block, a **Q pass** runs the target over ``[anchor, draft]`` with every W12
  linear layer reading its 8-bit view (:data:`specpilot.bundles.w12_quantization.QPASS`), eagerly (never a
  captured CUDA graph), and :func:`repair_chain` puts C in front: the drafts the Q pass accepts,
  then its bonus token in place of the first rejected draft. SGLang's own exact verify and
  greedy accept then run unchanged on ``[anchor, C, rest of draft (1)]``.

Gaps against the paper (stated in the memory entry): no draft (2) - the positions after C keep
draft (1)'s parallel guesses instead of a fresh draft from the end of C; a chain of the worker's
block size, not C plus a 32-node subtree; the Q pass writes K/V into the verify window that the
exact pass then overwrites (it commits nothing), rather than leaving the cache untouched.
"""

from __future__ import annotations

import contextvars
import logging

logger = logging.getLogger("specpilot.tlv")

_step: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specpilot_tlv_step", default=None)
_state = {"disabled": False, "cycles": 0, "skipped": {}}
DEFAULTS = {"tlv_max_batch": 1}


# ------------------------------------------------------------------------------ the cycle's rule

def commit_chain(chain, q_predict):
    """(correct [bs] int64, bonus [bs] int64): how many drafts of ``chain`` [bs, B] (anchor first)
    the Q pass accepts, and its token after them (SGLang's greedy DFlash accept rule, applied to
    the Q pass's argmax ``q_predict`` [bs, B]). C = ``chain[b, 1:1+correct[b]] + [bonus[b]]``."""
    import torch

    drafts = chain[:, 1:]
    match = (drafts == q_predict[:, :-1]).to(torch.int64)
    correct = torch.cumprod(match, dim=1).sum(dim=1)
    bonus = q_predict.gather(1, correct.unsqueeze(1)).squeeze(1).to(torch.int64)
    return correct, bonus


def repair_chain(chain, q_predict):
    """The drafts [bs, B-1] the exact pass verifies after the Q pass: C (the Q-accepted drafts, then
    the Q pass's bonus token in place of the first rejected draft) followed by draft (1)'s
    remaining positions. Same dtype and device as ``chain``; pure tensor ops (no host sync)."""
    import torch

    correct, bonus = commit_chain(chain, q_predict)
    drafts = chain[:, 1:].clone()
    width = drafts.shape[1]
    if width == 0:
        return drafts
    at = correct.clamp(max=width - 1).unsqueeze(1)
    inside = (correct < width).unsqueeze(1)
    current = drafts.gather(1, at)
    drafts.scatter_(1, at, torch.where(inside, bonus.unsqueeze(1).to(drafts.dtype), current))
    return drafts


def greedy_accept(chain, predict):
    """Exact-pass accept (greedy): tokens committed per row = accepted drafts + the bonus."""
    correct, bonus = commit_chain(chain, predict)
    return [chain[b, 1:1 + int(correct[b])].tolist() + [int(bonus[b])] for b in range(chain.shape[0])]


def run_cycles(anchor: int, n_tokens: int, block: int, draft, q_next, exact_next, two_pass: bool = True):
    """Reference loop of greedy speculative decoding with or without the Q pass (tests, docs).

    ``draft(context, width)`` returns ``width`` draft tokens after ``context``; ``q_next(tokens)``
    and ``exact_next(tokens)`` return the Q pass's / the exact target's argmax after each prefix
    of ``tokens`` (a list of ``len(tokens)`` ids). Returns (generated tokens, exact passes)."""
    import torch

    out, passes = [anchor], 0
    while len(out) - 1 < n_tokens:
        drafts = draft(out, block - 1)
        chain = torch.tensor([[out[-1]] + list(drafts)])
        if two_pass:
            q = torch.tensor([q_next(out[:-1] + chain[0].tolist())[-block:]])
            chain = torch.cat([chain[:, :1], repair_chain(chain, q)], dim=1)
        exact = torch.tensor([exact_next(out[:-1] + chain[0].tolist())[-block:]])
        out += greedy_accept(chain, exact)[0]
        passes += 1
    return out[1:1 + n_tokens], passes


# --------------------------------------------------------------------- SGLang 0.5.23 hooks

def settings() -> dict:
    from .plugin import current_settings

    cur = current_settings()
    return {k: cur.get(k, v) for k, v in DEFAULTS.items()}


def _has_w12_layers(worker) -> bool:
    cached = getattr(worker, "_specpilot_tlv_w12", None)
    if cached is None:
        model = worker.target_worker.model_runner.model
        cached = any(hasattr(m, "w12") for m in model.modules())
        worker._specpilot_tlv_w12 = cached
    return cached


def ineligible(worker, batch) -> str | None:
    """Why this step runs stock (None: it runs the two-pass cycle)."""
    if _state["disabled"]:
        return "disabled after an error"
    mode = getattr(batch, "forward_mode", None)
    if mode is None or mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False):
        return "not a decode step"
    bs = len(batch.seq_lens)
    if bs == 0 or bs > int(settings()["tlv_max_batch"]):
        return "batch larger than tlv_max_batch"
    if batch.has_grammar or batch.return_logprob or not worker._can_skip_verify_logits(batch, batch.sampling_info):
        return "not plain greedy (sampling, penalties, grammar or logprobs)"
    if worker.selector is not None or worker.lilicorr is not None or worker._is_domino:
        return "not a plain DFlash drafter"
    if worker._need_mamba_verify_commit:
        return "hybrid (recurrent-state) target"
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().tp_group.world_size != 1 or get_parallel().attn_dp_enabled:
        return "tensor parallel or DP attention"
    if not _has_w12_layers(worker):
        return "target not served by --quantization w12"
    return None


def around_forward_batch_generation(original, self, batch, *args, **kwargs):
    """AROUND DFlashWorkerV2.forward_batch_generation: scope an eligible decode step."""
    try:
        reason = ineligible(self, batch)
    except Exception:
        logger.exception("SpecPilot tlv: eligibility check failed; stock step")
        reason = "eligibility check failed"
    if reason is not None:
        _state["skipped"][reason] = _state["skipped"].get(reason, 0) + 1
        return original(self, batch, *args, **kwargs)
    token = _step.set({"batch": batch, "bs": len(batch.seq_lens), "done": False})
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _step.reset(token)


def around_draft_head(original, self, *args, hidden_states=None, lm_head=None, chunk_size=256, **kwargs):
    """AROUND DFlashWorkerV2._greedy_sample_from_vocab_parallel_head: draft (1) as stock, then the
    Q pass and C in front. Returns int64 [bs * (B-1)] like stock."""
    draft = original(self, *args, hidden_states=hidden_states, lm_head=lm_head, chunk_size=chunk_size, **kwargs)
    step = _step.get()
    if step is None or step["done"] or args or kwargs:
        return draft
    step["done"] = True
    bs, block = step["bs"], int(self.block_size)
    if draft.dim() != 1 or draft.numel() != bs * (block - 1):
        return draft
    try:
        import torch

        chain = torch.cat([self._draft_block_ids_buf[:bs, :1].to(draft.dtype), draft.view(bs, block - 1)], dim=1)
        q = q_pass(self, step["batch"], chain)
        _state["cycles"] += 1
        return repair_chain(chain, q).reshape(-1)
    except Exception:
        _state["disabled"] = True
        logger.exception("SpecPilot tlv: the Q pass failed; TLV is off in this process (stock drafts from now on)")
        return draft


def q_pass(worker, batch, chain):
    """The target's argmax [bs, B] over ``chain`` with every W12 layer reading its 8-bit view.

    Built like the worker's own verify (``DFlashVerifyInput.prepare_for_verify`` on the same
    positions and verify-window slots), but eager: the decode CUDA-graph runner is hidden for
    the pass, since a captured graph would replay the exact weights. The K/V it writes go to the
    verify window's slots, which the exact pass writes again; the batch fields that
    ``prepare_for_verify`` sets are restored."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from .w12_quantization import QPASS

    bs, block = chain.shape
    positions = worker._draft_block_positions_buf[:bs].reshape(-1)
    cache_loc = worker._draft_verify_out_cache_loc_buf[:bs].reshape(-1)
    target = worker.target_worker
    runner = target.model_runner
    draft_input = batch.spec_info
    plan = runner.kv_index_translator.plan(
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
        seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu,
        write_virtual=cache_loc, read_extent=block)
    verify_input = DFlashVerifyInput(draft_token=chain.reshape(-1), positions=positions, draft_token_num=block,
                                     custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL, kv_loc_plan=plan)
    saved = {k: getattr(batch, k) for k in ("out_cache_loc", "seq_lens_cpu", "seq_lens_sum", "input_ids",
                                            "spec_info", "forward_mode")}
    graphs = runner.decode_cuda_graph_runner
    batch.out_cache_loc = cache_loc
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu + block
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    elif draft_input.nxt_kv_lens_cpu is not None:
        batch.seq_lens_cpu = draft_input.nxt_kv_lens_cpu
        batch.seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
    runner.decode_cuda_graph_runner = None
    token = QPASS.set(True)
    try:
        forward_batch, _ = verify_input.prepare_for_verify(batch, target, defer_metadata_init=False)
        out = target.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True,
                                              skip_attn_backend_init=True)
    finally:
        QPASS.reset(token)
        runner.decode_cuda_graph_runner = graphs
        for k, v in saved.items():
            setattr(batch, k, v)
    logits = out.logits_output.next_token_logits
    lp = getattr(worker, "_target_logits_processor", None)
    if lp is not None and lp.is_deferred_shard(logits):
        predict = lp.deferred_argmax(logits)
    else:
        predict = torch.argmax(logits, dim=-1)
    return predict.view(bs, block).to(chain.dtype)
