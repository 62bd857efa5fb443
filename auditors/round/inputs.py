"""What a new round runs on, checked before anything runs: its options (:func:`check_config`:
the output folder, the budget, the deployment, the candidates, the memory, the scorer and the
prompts, each refused at the start rather than by the stage that would fail on it), the cache
room the round's engines take past a prompt (:func:`draft_room`), and the prompts a round runs
(:func:`round_prompts`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from specpilot.errors import InputError, did_you_mean

from . import measure as ms
from . import plan as pl
from . import remember as rm
from .deployment import parse_deployment
from .state import LOCK_FILE

if TYPE_CHECKING:
    from .run import RoundConfig


def _check_candidate_servers(dep, known: set[str]) -> None:
    """Each ``servers.candidates`` entry names a candidate the memory knows."""
    for cid in (dep.servers.get("candidates") or {}):
        if cid not in known:
            raise InputError(f"{dep.path}: servers.candidates: unknown candidate {cid!r}"
                             f"{did_you_mean(cid, sorted(known))}; the candidates: "
                             f"{', '.join(sorted(known))}")


def check_config(cfg: RoundConfig):
    """Refuse, before anything runs, a new round's options that would fail a later stage: a
    non-empty --out-dir, a budget that is not positive, a deployment, --candidates, --memory-dir,
    --prompts or --scorer that cannot be read; the parsed deployment."""
    from specpilot.auditors.outputs import read_prompt_rows
    from specpilot.bundles.memory import load_memory

    from .propose import check_names, check_runnable

    out = Path(cfg.out_dir) if cfg.out_dir else None
    if out is not None and out.exists() and not out.is_dir():   # a file or a device: no round to continue
        raise InputError(f"--out-dir {out} exists and is not a folder; choose another --out-dir")
    if out is not None and out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise InputError(f"{out} exists and is not an empty folder; continue a round there with --resume {out} "
                         "or choose another --out-dir")
    if out is not None:
        from specpilot.fileio import check_output_folder

        check_output_folder(out, "--out-dir")
    if cfg.remember:   # found at the start, not after the whole round ran (a resume could not fix it)
        from specpilot.fileio import check_output_folder

        check_output_folder(cfg.records_dir or rm.default_records_dir(), "--records")
    if not (math.isfinite(cfg.budget_min) and cfg.budget_min > 0):
        raise InputError(f"--budget {cfg.budget_min}: give the minutes the round may take (> 0)")
    dep = parse_deployment(cfg.deployment)
    memory = load_memory(cfg.memory_dir)
    check_names(cfg.candidates, dep.kind, cfg.memory_dir)
    if dep.kind == "sglang":   # a misspelt id there would be found only when its candidate is judged
        _check_candidate_servers(dep.sglang, set(memory))
    if dep.kind == "engine":
        check_runnable(cfg.candidates, dep.facts.device, cfg.control, cfg.memory_dir)
    rows = read_prompt_rows(cfg.prompts) if cfg.prompts else None
    if cfg.prompts and not rows:
        raise InputError(f"{cfg.prompts}: no prompts in the file")
    if rows and dep.kind == "engine":   # a prompt the engine cannot run would fail only after the measure stage
        _check_prompt_ids(rows, dep, cfg)
    if dep.kind == "engine":
        _check_prompt_room(rows, dep, cfg)
    if cfg.scorer:
        from specpilot.auditors.scorer import check_scorer_spec

        check_scorer_spec(cfg.scorer)
        if dep.kind == "engine":
            _check_scorer_vocab(cfg.scorer, dep.engine_spec)
    return dep


def _check_scorer_vocab(scorer: str, spec) -> None:
    """The scorer forces the engine's outputs: a scorer of another vocabulary cannot score them,
    which the approve stage's audit would find only after the timed runs."""
    from specpilot.auditors.scorer import scorer_vocab_size
    from specpilot.engine.api import model_vocab

    vocab = scorer_vocab_size(scorer)   # None: not known without loading it (the audit says so)
    own = model_vocab(spec)
    if vocab is not None and vocab != own:
        raise InputError(f"--scorer {scorer}: its vocabulary ({vocab} tokens) is not that of the deployment's model "
                         f"{spec.model} ({own} tokens): the audit cannot score its outputs; give the model's own "
                         "scorer, or leave --scorer out")


def draft_room(spec) -> int:
    """The most cache slots past a prompt and its new tokens that an engine the round runs takes
    (``EngineSpec.cache_room``): the current system's, its recordings' and the candidates' the
    round can propose (trees of up to the largest measured budget, TLV at its recording budget,
    chains as deep as the recorded drafts)."""
    depth = max(spec.depth, ms.RECORD_DEPTH)
    shapes = [{}, {"mode": "tree", "nodes": max(ms.NODES), "depth": depth},
              {"mode": "tlv", "nodes": spec.nodes if spec.mode == "tlv" else ms.TLV_NODES, "depth": depth},
              {"mode": "chain", "depth": depth}]
    rooms = []
    for change in shapes:
        try:
            rooms.append(spec.with_(**change).cache_room())
        except InputError:   # a shape this deployment cannot take (its rules refuse it): never run
            pass
    return max(rooms)


def _check_prompt_ids(rows, dep, cfg) -> None:
    """Token-id prompts against the engine's vocabulary (text prompts are checked as they are
    encoded; the context, for every engine the round runs: :func:`_check_prompt_room`)."""
    from specpilot.engine.api import check_prompts

    max_new = cfg.max_new_tokens or pl.SHAPES["cuda" if dep.facts.device == "cuda" else "cpu"][0].max_new_tokens
    try:
        check_prompts(dep.engine_spec, [(r.id, r.prompt_ids) for r in rows if r.prompt_ids], max_new, fit=False)
    except InputError as e:
        raise InputError(f"{cfg.prompts}: {e}") from None


def _check_prompt_room(rows, dep, cfg) -> None:
    """The round's longest prompt (of ``rows``, the --prompts file's, else of the prompts the round
    makes), its new tokens (--max-new-tokens, else the most the plan gives) and the draft rows of
    the engines it runs (:func:`draft_room`) must fit the engine's cache (ctx): a prompt that does
    not would fail only once a stage runs it. Text is encoded by the deployment's tokenizer,
    loaded alone."""
    from specpilot.engine.api import Engine, model_tokenizer, resolve_model

    spec = dep.engine_spec
    max_new = cfg.max_new_tokens or pl.SHAPES["cuda" if dep.facts.device == "cuda" else "cpu"][0].max_new_tokens
    if rows and all(r.prompt_ids is not None for r in rows):   # no text: no tokenizer to load
        prompts = [(r.id, r.prompt_ids) for r in rows]
    else:
        model_spec, folder, display = resolve_model(spec.model, spec.random)
        eng = Engine(spec, None, None, model_tokenizer(folder, display), display)
        try:
            prompts = [(p.id, p.prompt_ids) for p in round_prompts(cfg, rows, eng, model_spec.vocab_size,
                                                                    dep.facts.device)]
        except InputError as e:
            raise InputError(f"{cfg.prompts}: {e}" if cfg.prompts else str(e)) from None
    pid, ids = max(prompts, key=lambda p: len(p[1]))
    ctx, room = spec.ctx, draft_room(spec)
    if len(ids) + max_new + room > ctx:
        where = f"{cfg.prompts}: " if cfg.prompts else "the round's built-in "
        fewer = ctx - len(ids) - room
        raise InputError(f"{where}prompt {pid!r}: {len(ids)} tokens + {max_new} new tokens + {room} cache slots for "
                         f"draft rows do not fit the engine's cache (ctx={ctx}); "
                         + ("shorten it" if cfg.prompts else "give shorter prompts (--prompts)")
                         + (f", give --max-new-tokens {fewer} or fewer" if fewer >= 2 else "")
                         + ", or raise ctx= in the deployment")


def round_prompts(cfg: RoundConfig, rows, eng, vocab: int, device: str) -> list:
    """The prompts a round runs (``Prompt``: id, token ids): the --prompts file's ``rows``, text
    through ``eng``'s tokenizer (with its chat template when it has one); else the built-in chat
    prompts; else (a model without a tokenizer: random weights) seeded token-id prompts."""
    from specpilot.auditors.outputs import Prompt

    want = cfg.n_prompts or max(s.prompts for s in pl.SHAPES["cuda" if device == "cuda" else "cpu"])
    if rows is not None:
        chat = bool(eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None))
        return [Prompt(r.id, r.prompt_ids if r.prompt_ids is not None else eng.encode(r.text, chat=chat))
                for r in rows]
    if eng.tokenizer is not None:
        from specpilot.auditors.prompts_builtin import PROMPTS

        chat = bool(getattr(eng.tokenizer, "chat_template", None))
        return [Prompt(f"p{i}", eng.encode(t, chat=chat)) for i, t in enumerate(PROMPTS[:want])]
    import random

    rng = random.Random(cfg.seed)
    return [Prompt(f"p{i}", [rng.randrange(vocab) for _ in range(32)]) for i in range(want)]


def short_prompts_note(cfg: RoundConfig, rows, prompts: list) -> str | None:
    """The note for ``--n-prompts`` above the built-in prompts a model with a tokenizer runs (a
    --prompts file's count is warned of when the round starts)."""
    if rows is None and cfg.n_prompts and len(prompts) < cfg.n_prompts:
        return (f"--n-prompts {cfg.n_prompts}: the built-in prompts are {len(prompts)}; the round runs those "
                f"(--prompts FILE for more)")
    return None
