"""The ``tree`` bundle's hooks on SGLang 0.5.23's DFLASH worker: greedy best-first tree verify with
N = the draft block size. Tensor work is in :mod:`.dflash_tree`; this module decides when it runs
and wires it into the worker's step.

* H0 AROUND ``DFlashWorkerV2.init_cuda_graphs``: before capture, the static eligibility check; an
  eligible worker gets lattice buffers ``cand [cap, m, K]`` / ``scores [cap, m, K, K]`` on its
  ``CandidateSelector`` (cap = ``dflash_tree_max_batch``).
* H1 AFTER ``CandidateSelector.build_lattice``: copies the lattice into those buffers (also inside
  the draft CUDA-graph capture, so graph replays fill them); returns None (scores unchanged).
* H2 AROUND ``DFlashWorkerV2.forward_batch_generation``: scopes an eligible decode step (at most
  cap requests, all plain greedy: no penalties, bias, custom processor, grammar, sampling masks or
  logprobs); any other step runs stock, and the draft always walks stock's chain.
* H3 AROUND ``DFlashVerifyInput.prepare_for_verify``: builds the tree from the buffers (rows whose
  buffered lattice does not reproduce the drafted chain keep the chain, as a chain-shaped tree),
  broadcasts it over TP, writes its tokens into the block in place (the worker's ``candidates``
  share that storage), sets new ``positions`` (prefix + depth; the worker's chain positions stay
  for H5) and a FULL ``custom_mask``, hides the target's decode CUDA-graph runner so the verify
  runs eagerly with the mask, then calls stock.
* H4 AROUND ``DFlashWorkerV2._accept_block``: restores the graph runner; greedy tree acceptance
  with SGLang's ``verify_tree_greedy_func``; returns stock's contract; moves the accepted path's
  target K/V to the front of each request's verify window (``move_kv_cache``).
* H5 BEFORE ``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc``: on the decode call,
  moves the accepted path's hidden rows to the front, so the draft KV is rebuilt for root + path
  at the chain slots and positions stock passes.

Once H3 has written the tree into the block the step cannot go back to stock: an error after that
propagates (stock's chain accept on tree tokens would not be lossless). An error while planning
(before anything is written) turns the mechanism off for the process and the step runs stock.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from . import dflash_tree as dt

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("specpilot.dflash_tree")

DEFAULTS = {"dflash_tree_max_batch": 16}
BACKENDS = ("FlashInferAttnBackend", "TritonAttnBackend")     # eager verify honours custom_mask
POOLS = ("MHATokenToKVPool", "PageMajorMHATokenToKVPool")     # plain per-token move_kv_cache
WORKER_ATTR = "_specpilot_dflash_tree"
LATTICE_ATTR = "_specpilot_dflash_lattice"

_step: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specpilot_dflash_tree_step", default=None)
_state = {"disabled": False, "steps": 0, "skipped": {}}


@dataclass
class LatticeBuffers:
    cap: int
    cand: "torch.Tensor"    # int64 [cap, m, K]
    scores: "torch.Tensor"  # float32 [cap, m, K, K]


def settings() -> dict:
    from .plugin import current_settings

    cur = current_settings()
    return {k: cur.get(k, v) for k, v in DEFAULTS.items()}


def _sgl():
    """The SGLang pieces the hooks call, imported when first needed (tests pass stand-ins)."""
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

    return SimpleNamespace(verify=verify_tree_greedy_func, mambaish_config=mambaish_config, parallel=get_parallel,
                           simulate_acc_len=spec_utils.SIMULATE_ACC_LEN, sites=SpecTpSyncSite)


def _skip(reason: str) -> None:
    _state["skipped"][reason] = _state["skipped"].get(reason, 0) + 1


# ------------------------------------------------------------------------- H0, H1: the lattice

def static_ineligible(worker) -> str | None:
    """Why this worker never runs tree verify (None: it can). Checked once, before capture."""
    from .plugin import registered

    if int(settings()["dflash_tree_max_batch"]) <= 0:
        return "switched off (dflash_tree_max_batch=0)"
    if any("specpilot.bundles.lattice_trace:" in h for h in registered()):
        return "lattice-trace is active (it records stock's chain; tree verify stays off)"
    if getattr(worker, "selector", None) is None:
        return "not a DFlash2 drafter (no CandidateSelector)"
    if getattr(worker, "lilicorr", None) is not None or getattr(worker, "_is_domino", False):
        return "LiLiCorr or Domino drafter"
    if int(worker.block_size) < 2:
        return "block size < 2"
    sgl = _sgl()
    if sgl.parallel().attn_dp_enabled:
        return "DP attention"
    if sgl.simulate_acc_len > 0:
        return "SGLANG_SIMULATE_ACC_LEN is set"
    runner = worker.model_runner  # the target's
    if worker._need_mamba_verify_commit or sgl.mambaish_config(runner.model_config) is not None:
        return "hybrid (recurrent-state) target"
    if getattr(runner, "is_hybrid_swa", False) or (getattr(runner, "sliding_window_size", None) or 0) > 0:
        return "sliding-window attention"
    if getattr(runner.model_config, "model_is_mrope", False):
        return "mrope positions"
    backend = type(runner.attn_backend).__name__
    if backend not in BACKENDS or getattr(runner.attn_backend, "use_sliding_window_kv_pool", False):
        return f"verify attention backend {backend} (tree masks: FlashInfer or Triton, full attention)"
    pool = type(runner.token_to_kv_pool).__name__
    if pool not in POOLS:
        return f"KV pool {pool} (plain MHA pools only)"
    return None


def arm(worker) -> None:
    """Allocate the lattice buffers on the worker's selector (before the draft graphs capture)."""
    import torch

    cap, block, k = int(settings()["dflash_tree_max_batch"]), int(worker.block_size), int(worker.selector.top_k)
    dev = worker.device
    setattr(worker.selector, LATTICE_ATTR, LatticeBuffers(
        cap=cap, cand=torch.zeros((cap, block - 1, k), dtype=torch.int64, device=dev),
        scores=torch.zeros((cap, block - 1, k, k), dtype=torch.float32, device=dev)))
    setattr(worker, WORKER_ATTR, {"cap": cap, "n": block})


def around_init_cuda_graphs(original, self, *args, **kwargs):
    """H0: AROUND DFlashWorkerV2.init_cuda_graphs."""
    try:
        reason = static_ineligible(self)
        if reason is None:
            arm(self)
    except Exception as e:
        logger.exception("SpecPilot tree: DFLASH eligibility check failed")
        reason = f"eligibility check failed ({type(e).__name__})"
    if reason is not None:
        setattr(self, WORKER_ATTR, None)
        logger.info("SpecPilot tree: DFLASH tree verify off: %s", reason)
    else:
        logger.info("SpecPilot tree: DFLASH tree verify on (N = block size %d, batches up to %d)",
                    int(self.block_size), getattr(self, WORKER_ATTR)["cap"])
    return original(self, *args, **kwargs)


def after_build_lattice(result, self, *args, candidate_ids=None, **kwargs):
    """H1: AFTER CandidateSelector.build_lattice: copy (candidate ids, scores) into the buffers.
    Returns None: SGLang's scores are untouched."""
    buf = getattr(self, LATTICE_ATTR, None)
    if buf is None or candidate_ids is None or result is None or args:
        return None
    b = int(result.shape[0])
    if b <= buf.cap and tuple(result.shape[1:]) == tuple(buf.scores.shape[1:]) \
            and tuple(candidate_ids.shape[1:]) == tuple(buf.cand.shape[1:]):
        buf.scores[:b].copy_(result)
        buf.cand[:b].copy_(candidate_ids)
    return None


# ------------------------------------------------------------------------------ H2: the step

def plain_greedy(batch) -> bool:
    """Greedy with nothing that changes the target's argmax or needs its logits (the conditions of
    the worker's ``_can_skip_verify_logits``, without its per-step sampled-selector state)."""
    if batch.has_grammar or batch.return_logprob:
        return False
    info = batch.sampling_info
    if info is None:
        return True
    pen = getattr(info, "penalizer_orchestrator", None)
    return bool(info.is_all_greedy and not info.has_custom_logit_processor
                and getattr(info, "acc_linear_penalties", None) is None
                and (pen is None or not pen.is_required)
                and getattr(info, "grammar_mask", None) is None
                and getattr(info, "logit_bias", None) is None
                and getattr(info, "sampling_mask_batch_indices", None) is None)


def step_ineligible(worker, batch) -> str | None:
    if _state["disabled"]:
        return "disabled after an error"
    armed = getattr(worker, WORKER_ATTR, None)
    if not armed:
        return "worker not eligible (see the startup log)"
    mode = batch.forward_mode
    if mode.is_extend() or mode.is_idle() or getattr(batch, "is_extend_in_batch", False):
        return "not a decode step"
    bs = len(batch.seq_lens)
    if bs == 0 or bs > armed["cap"]:
        return "batch larger than dflash_tree_max_batch"
    if not plain_greedy(batch):
        return "not plain greedy"
    return None


def _restore_graph_runner(step) -> None:
    saved = step.pop("runner", None)
    if saved is not None:
        runner, graphs = saved
        runner.decode_cuda_graph_runner = graphs


def around_forward_batch_generation(original, self, batch, *args, **kwargs):
    """H2: AROUND DFlashWorkerV2.forward_batch_generation."""
    try:
        reason = step_ineligible(self, batch)
    except Exception:
        logger.exception("SpecPilot tree: step eligibility check failed; stock step")
        reason = "eligibility check failed"
    if reason is not None:
        _skip(reason)
        return original(self, batch, *args, **kwargs)
    step = {"worker": self, "bs": len(batch.seq_lens), "n": int(self.block_size)}
    token = _step.set(step)
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _restore_graph_runner(step)
        _step.reset(token)


# ---------------------------------------------------------------------------- H3: the verify

def plan_verify(step, verify_input, batch, target_worker) -> dict | None:
    """The tree and its layout for this step's verify, or None (stock chain verify). Writes nothing."""
    import torch

    worker, bs, n = step["worker"], step["bs"], step["n"]
    reason = None
    if batch.forward_mode.is_idle():
        reason = "idle batch"
    elif int(verify_input.draft_token_num) != n or verify_input.custom_mask is not None \
            or getattr(verify_input, "ragged_verify_layout", None) is not None:
        reason = "not the worker's block verify"
    elif verify_input.draft_token.numel() != bs * n or len(batch.seq_lens) != bs:
        reason = "verify block is not [bs, N]"
    elif verify_input.kv_loc_plan is None or batch.seq_lens_sum is None:
        reason = "no KV plan or no host bound on sequence lengths"
    buf = getattr(worker.selector, LATTICE_ATTR, None)
    if reason is None and (buf is None or bs > buf.cap or buf.cand.shape[1] != n - 1):
        reason = "no lattice buffers for this batch"
    write_ids = None
    if reason is None:
        write_ids = verify_input.kv_loc_plan.write_ids(target_worker.model_runner.kv_index_translator)
        if write_ids is None or write_ids.numel() != bs * n:
            reason = "no target write ids for the verify window"
    if reason is not None:
        _skip(reason)
        return None
    cand_ids, scores = buf.cand[:bs], buf.scores[:bs]
    chain = verify_input.draft_token.view(bs, n)[:, 1:]
    fresh = (dt.greedy_path(scores, cand_ids) == chain).all(dim=1)   # the buffers hold this step's lattice
    tree = dt.choose_rows(fresh, dt.build_tree(scores, cand_ids, n), dt.chain_tree(chain))
    packed = torch.cat([tree.parents, tree.depth, tree.tokens.to(torch.int64)], dim=1).contiguous()
    worker._tp_sync.sync(_sgl().sites.DFLASH_SELECTOR, packed)   # every TP rank verifies rank 0's tree
    parents, depth, tokens = packed[:, :n], packed[:, n:2 * n], packed[:, 2 * n:]
    layout = dt.verify_layout(parents, depth, batch.seq_lens, dt.full_mask_len(batch.seq_lens_sum, bs, n))
    return {"n": n, "tokens": tokens, "layout": layout, "write_ids": write_ids.reshape(-1)}


def around_prepare_for_verify(original, self, batch, target_worker, *args, **kwargs):
    """H3: AROUND DFlashVerifyInput.prepare_for_verify."""
    step = _step.get()
    if step is None or "tree" in step:
        return original(self, batch, target_worker, *args, **kwargs)
    step["tree"] = None  # one attempt per step
    try:
        plan = plan_verify(step, self, batch, target_worker)
    except Exception:
        logger.exception("SpecPilot tree: building the DFLASH tree failed; tree verify is off in this process")
        _state["disabled"] = True
        plan = None
    if plan is None:
        return original(self, batch, target_worker, *args, **kwargs)
    n = plan["n"]
    block = self.draft_token.view(-1, n)
    block[:, 1:].copy_(plan["tokens"].to(block.dtype))
    self.positions = plan["layout"].positions.to(self.positions.dtype)
    self.custom_mask = plan["layout"].custom_mask
    plan["candidates"] = block
    step["tree"] = plan
    runner = target_worker.model_runner
    step["runner"] = (runner, runner.decode_cuda_graph_runner)
    runner.decode_cuda_graph_runner = None  # eager verify: DFLASH verify graphs are captured maskless
    return original(self, batch, target_worker, *args, **kwargs)


# ---------------------------------------------------------------------- H4, H5: after the verify

def around_accept_block(original, self, *args, **kwargs):
    """H4: AROUND DFlashWorkerV2._accept_block."""
    step = _step.get()
    tree = step.get("tree") if step is not None else None
    if not tree or "accept_index" in tree or args:
        return original(self, *args, **kwargs)
    _restore_graph_runner(step)
    return tree_accept(self, tree, **kwargs)


def tree_accept(worker, tree, *, candidates, next_token_logits, sampling_info, draft_input, prefix_lens, bs,
                target_predict=None):
    """Greedy tree acceptance with stock's return contract; moves the accepted path's target K/V
    to the front of each verify window."""
    import torch

    sgl, n = _sgl(), tree["n"]
    if target_predict is None:
        target_predict = torch.argmax(next_token_logits, dim=-1)
    target_predict = target_predict.view(bs, n).to(torch.int64).contiguous()
    worker._tp_sync.sync(sgl.sites.DFLASH_ACCEPT_GREEDY, target_predict)
    cand = tree["candidates"]
    layout = tree["layout"]
    predicts, accept_index, accept_num = dt.verify_buffers(bs, n, cand.device)
    sgl.verify(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=cand,
               retrieve_index=layout.retrieve_index, retrieve_next_token=layout.retrieve_next_token,
               retrieve_next_sibling=layout.retrieve_next_sibling, target_predict=target_predict)
    out = dt.accept_outputs(cand, predicts, accept_index, accept_num, prefix_lens)
    tgt, src = dt.kv_move_pairs(tree["write_ids"], accept_index, accept_num)
    worker.target_worker.model_runner.token_to_kv_pool.move_kv_cache(tgt, src)
    tree["accept_index"] = accept_index
    _state["steps"] += 1
    return out


def before_append_target_hidden(self, *args, **kwargs):
    """H5: BEFORE DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc: the accepted path's
    hidden rows to the front (decode call only). Returns (args, kwargs) or None."""
    step = _step.get()
    tree = step.get("tree") if step is not None else None
    if not tree or "accept_index" not in tree or tree.get("compacted") or args \
            or kwargs.get("cache_loc_2d") is None or kwargs.get("target_hidden") is None:
        return None
    bs, n = step["bs"], tree["n"]
    hidden = kwargs["target_hidden"]
    hidden = hidden[: int(kwargs["cache_loc"].numel())]  # stock trims TP padding rows the same way
    if hidden.ndim != 2 or hidden.shape[0] != bs * n:
        return None  # not the [bs*N, H] rows of this verify: stock's own checks report it
    tree["compacted"] = True
    return (self,), dict(kwargs, target_hidden=dt.compact_to_front(hidden, tree["accept_index"], bs, n))
