"""Bundle ``lattice-trace``: record the DFlash2 candidate lattice of every verify step, observe only.

SGLang 0.5.23's DFLASH worker (``DFlashWorkerV2``) drafts a block, scores it with
``CandidateSelector.build_lattice`` (``score[b, e, p, c]``: unary + predecessor-conditioned pair
term over the top-K candidates), walks one path (``sample_path``), verifies it and commits the
accepted tokens plus the bonus (``_accept_block``), all inside one ``forward_batch_generation``
call. Three hooks observe that call and never change a value:

* AROUND ``DFlashWorkerV2.forward_batch_generation``: notes the batch's request ids, then, after
  the call, hands the step to the :class:`LatticeRecorder`;
* AFTER ``CandidateSelector.build_lattice``: keeps candidate ids, unary logits and edge scores;
* AFTER ``DFlashWorkerV2._accept_block``: keeps the committed tokens of each row.

The recorder writes ``specpilot.lattice/1`` rows (the ``specpilot replay`` input): ``tokens[i]``
the K candidates of draft position i, sorted best first by ``logprobs[i]`` (the transitions
permuted with them), ``logprobs[0]`` the log-softmax of the anchor-conditioned
first-edge scores, ``logprobs[i>0]`` the log-softmax of the unary logits, ``transitions[i-1][k][j]``
the log-softmax over j of ``score[b, i, k, j]``, and ``target`` the target's greedy continuation,
filled from the request's committed tokens of this and the following steps (a row is written once
m+1 target tokens are known). Only greedy requests are recorded (the target is the greedy
continuation), only on TP rank 0, and only outside CUDA-graph capture: launch with
``SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1`` so the selector runs eagerly (the launch command says so).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field

logger = logging.getLogger("specpilot.lattice_trace")

LATTICE_SCHEMA = "specpilot.lattice/1"
ENV_DIR = "SPECPILOT_LATTICE_DIR"
STALE_CALLS = 256  # forget a request not seen for this many decode calls

_step: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specpilot_lattice_step", default=None)


@dataclass
class _Pending:
    step: int
    batch_step: int   # the decode call it came from: the requests of one call verified together
    tokens: list
    logprobs: list
    transitions: list | None
    target: list = field(default_factory=list)


class LatticeRecorder:
    """Turns per-step candidates, scores and committed tokens into lattice rows.

    ``observe(rid, tokens, logprobs, transitions, committed)`` is called once per verify step of
    request ``rid``; rows come out through ``sink(row)`` as soon as their target is complete, with
    ``batch_step`` the decode call (:meth:`end_call` ends each) the step came from, under the
    recorder's random ``run`` prefix, so that ``replay``'s batch policies take the requests SGLang
    verified together as one batch.
    """

    def __init__(self, sink, run: int | None = None):
        self.sink = sink
        # batch_step = run << 32 | decode call: files of several processes (DP workers, restarts
        # appending to a reused pid's file) concatenate without two processes' calls meeting
        self.run = secrets.randbits(30) if run is None else int(run)
        self.pending: dict[str, list[_Pending]] = {}
        self.steps: dict[str, int] = {}
        self.last_seen: dict[str, int] = {}
        self.calls = 0
        self.written = 0
        self.dropped = 0
        self.lock = threading.Lock()

    def observe(self, rid: str, tokens, logprobs, transitions, committed) -> None:
        with self.lock:
            rid = str(rid)
            committed = [int(t) for t in committed]
            queue = self.pending.setdefault(rid, [])
            for p in queue:
                p.target.extend(committed)
            step = self.steps.get(rid, 0)
            self.steps[rid] = step + 1
            queue.append(_Pending(step, self.run << 32 | self.calls, tokens, logprobs, transitions, list(committed)))
            self.last_seen[rid] = self.calls
            keep = []
            for p in queue:
                need = len(p.tokens) + 1
                if len(p.target) >= need:
                    self.sink({"schema": LATTICE_SCHEMA, "request": rid, "step": p.step, "batch_step": p.batch_step,
                               "tokens": p.tokens, "logprobs": p.logprobs, "transitions": p.transitions,
                               "target": p.target[:need]})
                    self.written += 1
                else:
                    keep.append(p)
            self.pending[rid] = keep

    def end_call(self) -> None:
        with self.lock:
            self.calls += 1
            for rid in [r for r, seen in self.last_seen.items() if self.calls - seen > STALE_CALLS]:
                self.finish(rid)

    def finish(self, rid: str) -> None:
        """The request ended: its last steps never got m+1 target tokens and are dropped."""
        self.dropped += len(self.pending.pop(rid, []))
        self.last_seen.pop(rid, None)
        self.steps.pop(rid, None)


def lattice_rows_from_scores(candidate_ids, unary_logits, scores):
    """Per batch row: (tokens [m][K], logprobs [m][K], transitions [m-1][K][K]) as lists.

    ``candidate_ids`` [b, m, K], ``unary_logits`` [b, m, K], ``scores`` [b, m, K, K] (SGLang's
    ``build_lattice`` output, ``scores[:, 0, p]`` identical over p: the anchor is the predecessor).
    """
    import torch

    scores = scores.detach().float().cpu()
    first = torch.log_softmax(scores[:, 0, 0, :], dim=-1)                      # [b, K]
    unary = torch.log_softmax(unary_logits.detach().float().cpu(), dim=-1)     # [b, m, K]
    logprobs = torch.cat([first[:, None, :], unary[:, 1:, :]], dim=1)
    transitions = torch.log_softmax(scores[:, 1:], dim=-1)                    # [b, m-1, K, K]
    ids = candidate_ids.detach().cpu().long()
    # a lattice row's candidates are sorted best first by their position's score (replay's chain and
    # oracle:K read the order); the first edge's scores need not follow the unary order of the ids
    logprobs, perm = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, perm)
    if transitions.shape[1]:
        k = perm.shape[-1]
        transitions = transitions.gather(2, perm[:, :-1, :, None].expand(-1, -1, -1, k))   # parents' order
        transitions = transitions.gather(3, perm[:, 1:, None, :].expand(-1, -1, k, -1))    # children's order
    return [(ids[b].tolist(), logprobs[b].tolist(), transitions[b].tolist() if transitions.shape[1] else None)
            for b in range(ids.shape[0])]


# --------------------------------------------------------------------------------- the live hooks

_recorder: LatticeRecorder | None = None
_file = None
_file_lock = threading.Lock()


def _out_dir() -> str:
    from .plugin import current_settings

    return os.environ.get(ENV_DIR) or str(current_settings().get("lattice_dir", "specpilot-lattice"))


def _write_row(row: dict) -> None:
    global _file
    with _file_lock:
        if _file is None:
            d = _out_dir()
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"lattice-{os.getpid()}.jsonl")
            _file = open(path, "a", encoding="utf-8", buffering=1)
            logger.info("SpecPilot lattice-trace writes %s", path)
        _file.write(json.dumps(row) + "\n")


def recorder() -> LatticeRecorder:
    global _recorder
    if _recorder is None:
        _recorder = LatticeRecorder(_write_row)
    return _recorder


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def around_forward_batch_generation(original, self, batch, *args, **kwargs):
    """AROUND DFlashWorkerV2.forward_batch_generation: scope one step, record it afterwards."""
    mode = getattr(batch, "forward_mode", None)
    decode = mode is not None and not (mode.is_extend() or getattr(batch, "is_extend_in_batch", False))
    if not decode or getattr(self, "_target_tp_rank", 0) != 0:
        return original(self, batch, *args, **kwargs)
    step = {"lattice": None, "commit": None}
    token = _step.set(step)
    try:
        result = original(self, batch, *args, **kwargs)
    finally:
        _step.reset(token)
    try:
        _record(batch, step)
    except Exception:  # observing must never break serving
        logger.exception("SpecPilot lattice-trace could not record a step")
    return result


def _record(batch, step) -> None:
    rec = recorder()
    info = getattr(batch, "sampling_info", None)
    greedy = info is None or getattr(info, "is_all_greedy", True)
    if step["lattice"] is None or step["commit"] is None or not greedy:
        rec.end_call()
        return
    rows = lattice_rows_from_scores(*step["lattice"])
    out_tokens, commit_lens = step["commit"]
    out_tokens, commit_lens = out_tokens.detach().cpu().tolist(), commit_lens.detach().cpu().tolist()
    for b, req in enumerate(getattr(batch, "reqs", [])[: len(rows)]):
        tokens, logprobs, transitions = rows[b]
        rec.observe(getattr(req, "rid", b), tokens, logprobs, transitions, out_tokens[b][: int(commit_lens[b])])
    rec.end_call()


def after_build_lattice(result, self, *args, candidate_ids=None, unary_logits=None, **kwargs):
    """AFTER CandidateSelector.build_lattice: keep (candidate ids, unary logits, scores). Returns None:
    the scores SGLang uses are untouched."""
    step = _step.get()
    if step is not None and not _capturing():
        step["lattice"] = (candidate_ids, unary_logits, result)
    return None


def after_accept_block(result, self, *args, **kwargs):
    """AFTER DFlashWorkerV2._accept_block: keep (out_tokens, commit_lens). Returns None."""
    step = _step.get()
    if step is not None:
        step["commit"] = (result[3], result[1])
    return None
