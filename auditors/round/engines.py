"""Embedded engines for a round: loaded once and shared by the stages, timed as ``compare``
systems, and the stock engine's target as the audit's scorer.

* :class:`EnginePool` loads each spec once (a round times, audits and generates with the same
  engines; on a GPU a load with W12 conversion and graph capture costs tens of seconds).
* :class:`PooledSystem` is ``compare``'s engine system (tokens/s over the prompt set, outputs
  kept) over a pooled engine.
* :class:`EngineScorer` is paper 3.4's scorer: "the target of a stock engine using an FP32 LM
  head", teacher-forced on a system's own tokens. It has the ``score`` method of
  :class:`specpilot.auditors.scorer.Scorer`, so the audit library takes it as it is.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from specpilot.auditors.pairing import GenerateSystem
from specpilot.auditors.scorer import ScorerInfo, TokenScores


class EnginePool:
    """Engines by spec text; ``copy`` loads a second, independent engine of the same spec (the
    no-op control must not be the very object it is compared with)."""

    def __init__(self):
        self._engines: dict[tuple[str, str], object] = {}
        self.load_seconds: dict[str, float] = {}

    def get(self, spec: str, copy: str = ""):
        key = (spec, copy)
        if key not in self._engines:
            from specpilot.engine.api import load_engine

            t0 = time.perf_counter()
            self._engines[key] = load_engine(spec)
            self.load_seconds[spec + (f"#{copy}" if copy else "")] = time.perf_counter() - t0
        return self._engines[key]

    def loaded(self, spec: str, copy: str = "") -> bool:
        return (spec, copy) in self._engines

    def drop(self, spec: str, copy: str = "") -> None:
        eng = self._engines.pop((spec, copy), None)
        if eng is not None:
            del eng
            _free_cuda()

    def keep_only(self, specs: Sequence[str]) -> None:
        """Drop every engine not named (memory: a GPU holds a few 8B-class engines, not many)."""
        for key in [k for k in self._engines if k[0] not in specs or k[1]]:
            self.drop(*key)

    def typical_load_s(self, default: float) -> float:
        return max(self.load_seconds.values()) if self.load_seconds else default


def _free_cuda() -> None:
    """Hand a dropped engine's GPU memory back now: collect the cycles that may still hold its
    tensors, then empty torch's cache. Without CUDA in use there is nothing to hand back (a CPU
    engine's memory goes with its last reference, or with the next automatic collection where
    cycles hold it), and a full collection of a large heap costs a few tenths of a second."""
    import gc

    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
    except Exception:  # pragma: no cover
        pass


class _EngineGenerator:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids, max_new_tokens):
        return list(self.engine.generate(list(prompt_ids), max_new_tokens).output_ids)

    def close(self):
        pass


class PooledSystem(GenerateSystem):
    """``compare``'s engine system over an already loaded engine (same measure: output tokens/s
    over the prompt set, one request at a time; same outputs bookkeeping)."""

    def __init__(self, label: str, engine, prompts, max_new_tokens: int):  # noqa: D107 - no super().__init__
        self.system = None
        self.label = label
        self.metric, self.unit, self.higher_is_better = "throughput", "tok/s", True
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.concurrency = 1
        self.gen = _EngineGenerator(engine)
        self.reset_outputs()


def generate_outputs(engine, prompts, max_new_tokens: int, name: str, save_to: str | None = None,
                     progress: Callable | None = None):
    """Run every prompt once; the outputs (``specpilot.outputs/1`` rows) and tokens/s of the run."""
    from specpilot.auditors.outputs import OutputRow, Outputs, write_outputs

    rows, tokens = [], 0
    t0 = time.perf_counter()
    it = prompts if progress is None else progress(prompts, total=len(prompts), desc=name, unit="prompt")
    for p in it:
        out = list(engine.generate(list(p.prompt_ids), max_new_tokens).output_ids)
        rows.append(OutputRow(p.id, list(p.prompt_ids), out))
        tokens += len(out)
    wall = time.perf_counter() - t0
    if save_to:
        write_outputs(save_to, rows)
    return Outputs(name, rows, save_to or name), (tokens / wall if wall > 0 else 0.0)


def outputs_from(system: PooledSystem, prompts, name: str, save_to: str | None = None):
    """The outputs a timed system produced in its first measured run (what ``compare`` compared)."""
    from specpilot.auditors.outputs import OutputRow, Outputs, write_outputs

    rows = [OutputRow(p.id, list(p.prompt_ids), list(o)) for p, o in zip(prompts, system.outputs or [])]
    if save_to:
        write_outputs(save_to, rows)
    return Outputs(name, rows, save_to or name)


class EngineScorer:
    """Teacher forcing through an engine's target: hidden states in the engine's dtype, the LM head
    in FP32 (the same rules as :class:`specpilot.auditors.scorer.Scorer`: a token exactly tied with
    the argmax in FP32 is not a mismatch)."""

    def __init__(self, engine, name: str, head_chunk: int = 1024):
        import torch

        model = engine.model
        self.model = model
        self.head_chunk = head_chunk
        self._w32 = model.lm_head.weight.detach().to(torch.float32)
        self.vocab_size = int(self._w32.shape[0])
        self.info = ScorerInfo(name=name, path=f"the stock engine's target ({engine.model_name})",
                               device=str(model.device), dtype=str(model.dtype).replace("torch.", ""),
                               lm_head="float32", vocab_size=self.vocab_size)
        self._memo: dict = {}

    def _hidden(self, ids: list[int]):
        import torch

        from specpilot.engine.step_input import StepInput

        m, dev = self.model, self.model.device
        n = len(ids)
        if n > m.max_seq:
            from specpilot.errors import InputError

            raise InputError(f"a scored sequence of {n} tokens exceeds the engine's cache ({m.max_seq} slots)")
        m.reset()
        t = torch.tensor(ids, device=dev)
        parts = []
        for a in range(0, n, 512):
            b = min(n, a + 512)
            pos = torch.arange(a, b, device=dev)
            kv = min(m.max_seq, ((b + 63) // 64) * 64)
            mask = torch.arange(kv, device=dev)[None] <= pos[:, None]
            parts.append(m.hidden(StepInput(t[a:b], pos, pos, mask, "seq"), kv_len=kv))
        return torch.cat(parts)

    def score(self, sequences, batch_tokens: int = 8192, head_chunk: int | None = None,
              progress: Callable | None = None) -> list[TokenScores]:
        import torch

        out: list[TokenScores] = []
        it = sequences if progress is None else progress(sequences, total=len(sequences), desc="scoring")
        with torch.inference_mode():
            for p, o in it:
                key = (tuple(p), tuple(o))
                if key in self._memo:
                    out.append(self._memo[key])
                    continue
                if not o:
                    out.append(TokenScores(np.zeros(0, np.int64), np.zeros(0, np.float32)))
                    continue
                h = self._hidden(list(p) + list(o)[:-1])[len(p) - 1:]
                tgt = torch.tensor(list(o), device=h.device)
                amax, margin = [], []
                for s in range(0, h.shape[0], head_chunk or self.head_chunk):
                    logits = h[s: s + (head_chunk or self.head_chunk)].to(torch.float32) @ self._w32.T
                    best, am = logits.max(dim=-1)
                    tok = logits.gather(1, tgt[s: s + logits.shape[0], None])[:, 0]
                    margin.append((best - tok).clamp_min(0.0))
                    amax.append(am)
                a = torch.cat(amax).cpu().numpy().astype(np.int64)
                mg = torch.cat(margin).cpu().numpy().astype(np.float32)
                a = np.where(mg <= 0, np.asarray(o, dtype=np.int64), a)
                ts = TokenScores(a, mg)
                self._memo[key] = ts
                out.append(ts)
        return out
