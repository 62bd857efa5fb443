"""Bundle ``batching``: the row-choosing rules of paper 4.4 in SGLang 0.5.23's DSpark worker and scheduler.

The rules only choose which rows are drafted, verified and admitted, never what is accepted, so
they are lossless. The policies (plain Python / torch) come first; the SGLang hook handlers below
apply them where SGLang makes the same decisions:

* **Shared node budget.** SGLang's DSpark planner (``DSparkVerifyPlanner``, ragged verify) already
  gives each request of a decode step a verify length by a best-first top-k over the survival
  probabilities of all requests' draft positions (``schedule_verify_lens_topk``), under a per-step
  budget it derives from a profiled step-time table (or "verify all" without one). AROUND
  ``_budget_from_resolved`` replaces that budget by the paper's fixed shared budget
  (``shared_budget`` verified rows per step over all requests, anchors included), and AFTER
  ``__init__`` turns off the flat-table "verify all" shortcut so the budget is used.
* **Per-request block.** AROUND ``_schedule_verify_lens`` zeroes the confidence of draft positions
  past each request's block (16/12/8 chosen by :class:`BlockPolicy` from its recent accepted
  lengths), so SGLang's own top-k spends the budget on other requests. The recent accepted lengths
  come from AFTER ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens``, where SGLang already
  has them on the host.
* **Prompt admission.** AROUND ``Scheduler._should_defer_prefill`` (the steps where SGLang makes
  every waiting prompt wait, ``--prefill-decode-interval``) admits the short waiting prompts that
  :func:`admit_prompts` picks, and AROUND ``Scheduler._get_new_batch_prefill_raw`` shows SGLang's
  prefill adder only those prompts in that step.

Every handler falls back to stock on an unexpected input (and logs once); none changes a token.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger("specpilot.batching")


# ------------------------------------------------------------------------------------ policies

def shared_budget_trees(lattices: Sequence[tuple], budget: int):
    """One node budget over all requests of a step, filled from the highest path score; each
    request's share is a prefix-closed best-first tree (``specpilot.kernels.tree``)."""
    from specpilot.kernels.tree import build_best_first_shared

    return build_best_first_shared(lattices, budget)


def shared_chain_lengths(confidence, budget: int, survival_eps: float = 1e-6) -> list[int]:
    """The shared budget over chains: ``confidence[b][j]`` is the drafter's probability that draft
    position j of request b is right given the positions before it (DSpark's confidence head).
    Returns how many draft positions of each request the ``budget`` buys when positions are taken
    best-first by path probability over all requests (``specpilot.kernels.tree``'s shared builder
    with one candidate per position). Positions whose path probability is below ``survival_eps``
    (or zero) are never taken."""
    import math

    import numpy as np

    lattices = []
    for row in confidence:
        # path probabilities as float32 running products (DSpark's own survival arithmetic)
        surv = np.cumprod(np.asarray([float(c) for c in row], dtype=np.float32), dtype=np.float32)
        logp, prev = [], 1.0
        for s in surv.astype(np.float64):
            ok = s >= survival_eps and s > 0.0 and prev > 0.0
            logp.append([math.log(s) - math.log(prev)] if ok else [-math.inf])
            prev = s if ok else 0.0
        lattices.append(([[0]] * len(logp), logp, None))
    trees = shared_budget_trees(lattices, budget) if lattices else []
    return [len(t) for t in trees]


def shared_extra_budget(bs: int, shared_budget: int, floor: int, max_len: int) -> int:
    """SGLang's per-step verify budget (tokens above each request's ``floor``) for a shared budget
    of ``shared_budget`` verified rows over ``bs`` requests, anchors included; at most what the
    requests can verify (``max_len`` each)."""
    return max(0, min(int(shared_budget) - bs * floor, bs * (max_len - floor)))


@dataclass
class BlockPolicy:
    """Per-request draft block: the largest size whose expected accepted length needs it.

    ``sizes`` largest first; a request keeps the largest block while its recent mean accepted
    length exceeds ``fraction`` of the next smaller size, else steps down.
    """

    sizes: Sequence[int] = (16, 12, 8)
    fraction: float = 0.75

    def choose(self, recent_accepted: Sequence[int]) -> int:
        if not recent_accepted:
            return self.sizes[0]
        mean = sum(recent_accepted) / len(recent_accepted)
        for bigger, smaller in zip(self.sizes, self.sizes[1:]):
            if mean > self.fraction * smaller:
                return bigger
        return self.sizes[-1]


def admit_prompts(waiting: Sequence[int], free_rows: int, max_prompt: int = 384) -> list[int]:
    """Which waiting prompts (by length) enter the verify step: only prompts that would wait
    anyway, each up to ``max_prompt`` tokens, while rows remain (paper 4.4). Returns indices."""
    chosen, rows = [], free_rows
    for i, n in enumerate(waiting):
        if n <= max_prompt and n <= rows:
            chosen.append(i)
            rows -= n
    return chosen


def mask_confidence(confidence, caps):
    """``confidence`` [bs, gamma] with the positions at or past ``caps[b]`` (int tensor [bs], draft
    positions request b may verify) set to 0, so their path probability is 0. Same shape, dtype
    and device; no host synchronisation."""
    import torch

    pos = torch.arange(confidence.shape[1], device=confidence.device)
    keep = pos.unsqueeze(0) < caps.to(confidence.device).unsqueeze(1)
    return torch.where(keep, confidence, torch.zeros((), dtype=confidence.dtype, device=confidence.device))


class BlockHistory:
    """Recent accepted lengths per request slot (``req_pool_idx``) and the block each implies.

    The scheduler thread reports accepted lengths (:meth:`observe`) and newly admitted requests
    (:meth:`forget`); the DSpark planner reads the caps of a step on the device
    (:meth:`caps_for`), which applies the pending changes with one small host-to-device copy.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.recent: dict[int, tuple[str, deque]] = {}
        self.pending: dict[int, int] = {}

    def observe(self, slot: int, rid, accepted: int, policy: BlockPolicy, window: int) -> None:
        with self.lock:
            entry = self.recent.get(slot)
            fresh = entry is None or entry[0] != rid
            if fresh:  # a request the slot has not reported before: its table entry may be stale
                entry = (rid, deque(maxlen=max(1, window)))
                self.recent[slot] = entry
            before = policy.choose(list(entry[1]))
            entry[1].append(int(accepted))
            after = policy.choose(list(entry[1]))
            if fresh or after != before:
                self.pending[slot] = after

    def forget(self, slot: int, policy: BlockPolicy) -> None:
        """A new request took ``slot``: it starts with the largest block."""
        with self.lock:
            self.recent.pop(slot, None)
            self.pending[slot] = policy.sizes[0]

    def caps_for(self, owner, req_pool_indices, pool_size: int, default: int):
        """Caps [bs] (int32, on the indices' device) for the rows of ``req_pool_indices``; the
        per-slot table lives on ``owner`` (the planner)."""
        import torch

        device = req_pool_indices.device
        table = getattr(owner, "_specpilot_block_caps", None)
        if table is None or table.device != device or table.numel() < pool_size:
            table = torch.full((pool_size,), int(default), dtype=torch.int32, device=device)
            setattr(owner, "_specpilot_block_caps", table)
        with self.lock:
            pending, self.pending = self.pending, {}
        pending = {s: c for s, c in pending.items() if 0 <= s < table.numel()}
        if pending:
            idx = torch.tensor(list(pending), dtype=torch.long).to(device, non_blocking=True)
            val = torch.tensor(list(pending.values()), dtype=torch.int32).to(device, non_blocking=True)
            table.index_copy_(0, idx, val)
        return table.index_select(0, req_pool_indices.to(torch.long))

    def clear(self) -> None:
        with self.lock:
            self.recent.clear()
            self.pending.clear()


# ------------------------------------------------------------------------- settings of a server

DEFAULTS = {"shared_budget": 192, "block_sizes": [16, 12, 8], "block_window": 8,
            "admit_max_prompt": 384, "admit_rows": 384}


def settings() -> dict:
    """The applied variants (``specpilot apply batching --set NAME=VALUE``), defaults filled in."""
    from .plugin import current_settings

    cur = current_settings()
    return {k: cur.get(k, v) for k, v in DEFAULTS.items()}


def block_policy(values: dict | None = None) -> BlockPolicy:
    sizes = (values or settings())["block_sizes"]
    if isinstance(sizes, int):
        sizes = [sizes]
    sizes = sorted({int(s) for s in sizes if int(s) >= 1}, reverse=True)
    if not sizes:
        raise ValueError("block_sizes must hold at least one size >= 1")
    return BlockPolicy(sizes=tuple(sizes))


_history = BlockHistory()
_warned: set[str] = set()


def history() -> BlockHistory:
    return _history


def _fallback(where: str) -> None:
    if where not in _warned:
        _warned.add(where)
        logger.exception("SpecPilot batching: %s failed; SGLang's own decision is used", where)


# ----------------------------------------------------- SGLang 0.5.23 hooks: the DSpark planner

def _compact(planner) -> bool:
    """Compact ragged verify (only the scheduled rows run). In SGLang's other ragged mode,
    cap-accept, every row still runs and the schedule only caps acceptance: the rules would cost
    accepted tokens and save nothing, so they stay off there."""
    return bool(getattr(planner, "is_compact_mode", True))


def after_planner_init(result, self, *args, **kwargs):
    """AFTER ``DSparkVerifyPlanner.__init__``: with a shared budget, a ragged-verify planner whose
    step-time table is flat no longer "verifies all" (SGLang's shortcut for having no budget);
    the shared budget is the budget. Returns None."""
    try:
        if (int(settings()["shared_budget"]) > 0 and getattr(self, "_budget_planner", None) is not None
                and getattr(self, "_is_verify_all", False) and _compact(self)):
            self._is_verify_all = False
            logger.info("SpecPilot batching: DSpark verify lengths come from the shared budget (%s rows per step)",
                        settings()["shared_budget"])
    except Exception:
        _fallback("planner init")
    return None


def around_budget_from_resolved(original, self, *args, **kwargs):
    """AROUND ``DSparkVerifyPlanner._budget_from_resolved``: SGLang's budget planner runs as usual
    (its lag state advances); the step's budget becomes the shared one. ``None`` (no confidence
    this step), a forced budget fraction and a verify-all planner pass through."""
    budget = original(self, *args, **kwargs)
    try:
        shared = int(settings()["shared_budget"])
        rows = kwargs.get("req_pool_indices_cpu")
        planner = getattr(self, "_budget_planner", None)
        if (budget is None or shared <= 0 or rows is None or planner is None or args or not _compact(self)
                or getattr(self, "_is_verify_all", False) or getattr(planner, "forced_budget_frac", None) is not None):
            return budget
        cfg = self._schedule_cfg
        out = shared_extra_budget(int(rows.shape[0]), shared, max(int(cfg.min_verify_len), 1),
                                  int(cfg.resolved_max_verify_len()))
        decision = getattr(planner, "last_decision", None)
        if decision is not None:
            planner.last_decision = type(decision)(budget=out)
        return out
    except Exception:
        _fallback("shared budget")
        return budget


def around_schedule_verify_lens(original, self, *args, **kwargs):
    """AROUND ``DSparkVerifyPlanner._schedule_verify_lens``: each request's confidence past its
    block is zeroed, then SGLang's own top-k (Triton on CUDA, torch on CPU) schedules the verify
    lengths: int32 [bs] as stock, each at most floor + block."""
    confidence = kwargs.get("confidence")
    rows = kwargs.get("req_pool_indices")
    if args or confidence is None or rows is None or not _compact(self):
        return original(self, *args, **kwargs)
    try:
        policy = block_policy()
        gamma = int(confidence.shape[1])
        if policy.sizes[-1] < gamma:  # some block is shorter than the draft: caps matter
            pool = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
            caps = _history.caps_for(self, rows, pool, policy.sizes[0])
            kwargs = dict(kwargs, confidence=mask_confidence(confidence, caps))
    except Exception:
        _fallback("per-request block")
        kwargs = dict(kwargs, confidence=confidence)
    return original(self, *args, **kwargs)


def after_resolve_spec_v2_tokens(tokens, self, *args, **kwargs):
    """AFTER ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens(result, batch)``: note each
    request's accepted draft tokens of this step (SGLang put them on the host there). Returns None."""
    try:
        result = args[0] if args else kwargs.get("result")
        batch = args[1] if len(args) > 1 else kwargs.get("batch")
        accepted = getattr(result, "num_correct_drafts_per_req_cpu", None)
        if accepted is None:
            return None
        values = settings()
        policy = block_policy(values)
        window = int(values["block_window"])
        for req, n in zip(getattr(batch, "reqs", []), accepted):
            slot = getattr(getattr(req, "kv", None), "req_pool_idx", None)
            if slot is None or getattr(req, "is_retracted", False) or req.finished():
                continue
            _history.observe(int(slot), getattr(req, "rid", None), int(n), policy, window)
    except Exception:
        _fallback("accepted-length history")
    return None


# ------------------------------------------------------ SGLang 0.5.23 hooks: prompt admission

_ADMIT_ATTR = "_specpilot_admit"


def around_should_defer_prefill(original, self, running_batch, *args, **kwargs):
    """AROUND ``Scheduler._should_defer_prefill``: where SGLang makes every waiting prompt wait
    this step, the short ones :func:`admit_prompts` picks are admitted instead (False: do not
    defer, and the next prefill sees only them). Not under DP attention, not during a chunked
    prefill."""
    defer = original(self, running_batch, *args, **kwargs)
    if not defer:
        return defer
    try:
        values = settings()
        max_prompt, rows = int(values["admit_max_prompt"]), int(values["admit_rows"])
        if (max_prompt <= 0 or rows <= 0 or getattr(self, "require_mlp_sync", False)
                or getattr(self, "chunked_req", None) is not None):
            return defer
        queue = list(self.waiting_queue)
        chosen = admit_prompts([len(r.origin_input_ids) for r in queue], free_rows=rows, max_prompt=max_prompt)
        if not chosen:
            return defer
        setattr(self, _ADMIT_ATTR, [queue[i] for i in chosen])
        return False
    except Exception:
        _fallback("prompt admission")
        return defer


def around_get_new_batch_prefill_raw(original, self, *args, **kwargs):
    """AROUND ``Scheduler._get_new_batch_prefill_raw``: in a step opened by
    :func:`around_should_defer_prefill`, SGLang's prefill adder sees only the admitted prompts;
    the others keep their places in the waiting queue. Newly admitted requests start with the
    largest draft block. Returns stock's (new batch, running batch)."""
    chosen = getattr(self, _ADMIT_ATTR, None)
    if chosen is not None:
        setattr(self, _ADMIT_ATTR, None)
    if not chosen:
        result = original(self, *args, **kwargs)
    else:
        full = list(self.waiting_queue)
        keep = {id(r) for r in chosen}
        self.waiting_queue = [r for r in full if id(r) in keep]
        try:
            result = original(self, *args, **kwargs)
        finally:
            self.waiting_queue = merge_queue(full, chosen, self.waiting_queue)
    try:
        new_batch = result[0] if isinstance(result, tuple) else None
        if new_batch is not None:
            policy = block_policy()
            decoding = {id(r) for r in (getattr(new_batch, "decoding_reqs", None) or [])}
            for req in new_batch.reqs:
                slot = getattr(getattr(req, "kv", None), "req_pool_idx", None)
                if slot is not None and id(req) not in decoding:
                    _history.forget(int(slot), policy)
    except Exception:
        _fallback("new-request block reset")
    return result


def merge_queue(full: list, shown: list, remaining: list) -> list:
    """The waiting queue after a prefill that saw only ``shown`` (a sub-list of ``full``) and left
    ``remaining``: every request of ``full`` that was not admitted, in its old order, then the
    requests SGLang queued during the call (requeued preemptions, grammars that became ready)."""
    left = {id(r) for r in remaining}
    admitted = {id(r) for r in shown if id(r) not in left}
    old = {id(r) for r in full}
    return [r for r in full if id(r) not in admitted] + [r for r in remaining if id(r) not in old]
