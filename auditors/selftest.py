"""``specpilot audit selftest``: the paper's validation of the audit (3.4) on the real SmolLM2.

Systems, all greedy on the same chat prompts:

- ``ar``: batch 1, KV cache (the plain autoregressive reference for phase 0);
- ``stock``: batches of 8 with left padding and a KV cache (a serving engine's numerics);
- lossless ``batch4``: batches of 4 (other padding, other matmul shapes);
- lossless ``eager-attention``: batches of 8 with the eager attention kernel instead of SDPA;
- lossless embedded-engine systems (``engine:model=smollm2,mode=chain`` / ``mode=tree,nodes=32``)
  on the first ``engine_prompts`` prompts (the engine is slow on a small CPU), audited against
  stock and AR on those prompts, beside the largest planted bias as a positive control;
- defective ``bias=b``: stock with ``b`` added to the logits of a fixed random subset of the
  vocabulary before the argmax - a real, planted defect of the kind that accuracy misses.

The scorer is SmolLM2 teacher-forced with an FP32 LM head. The full audit runs once on all
prompts; then the prompts are split into ``repeats`` disjoint subsets and each subset is audited
on its own (phase 0 included) to measure the false-reject rate of the lossless systems and the
detection rate of each bias.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specpilot.errors import InputError

from .forcing import AuditResult, Scored, audit, score_outputs
from .outputs import OutputRow, Outputs
from specpilot.machine import cpu_name


@dataclass
class RepeatRow:
    system: str
    kind: str  # "lossless" | "defective"
    bias: float | None
    audits: int
    rejected: int
    rate: float
    mean_mismatch_rate: float
    mean_events: float


@dataclass
class SelftestResult:
    model: str
    device: str
    cpu: str
    prompts: int
    max_new_tokens: int
    repeats: int
    prompts_per_repeat: int
    bias_fraction: float
    biases: list[float]
    engine_systems: list[str]
    engine_note: str | None
    engine_prompts: int
    engine_audit: AuditResult | None
    full: AuditResult
    repeated: list[RepeatRow]
    false_reject_rate: float
    false_reject_audits: int
    detection: dict  # bias -> rate
    generation_s: dict
    ok: bool
    problems: list[str] = field(default_factory=list)


def greedy(model, prompts: list[list[int]], max_new_tokens: int, *, batch_size: int = 1, use_cache: bool = True,
           bias=None, eos: int | None = None, progress: Callable | None = None, desc: str = "") -> list[list[int]]:
    """Greedy generation with a Hugging Face causal LM; optional additive logit ``bias`` [V].

    Sequences are left-padded within a batch (attention mask + positions); a sequence stops after
    its EOS token.
    """
    import torch

    import inspect

    dev = next(model.parameters()).device
    # transformers >= 5.2x names the KV cache ``cache``; earlier releases ``past_key_values``
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outs: list[list[int]] = [[] for _ in prompts]
    chunks = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    it = progress(chunks, total=len(chunks), desc=desc) if progress else chunks
    with torch.inference_mode():
        for chunk in it:
            L = max(len(prompts[i]) for i in chunk)
            ids = torch.zeros((len(chunk), L), dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for b, i in enumerate(chunk):
                p = prompts[i]
                ids[b, L - len(p):] = torch.tensor(p)
                mask[b, L - len(p):] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            done = torch.zeros(len(chunk), dtype=torch.bool, device=dev)
            past = None
            cur_ids = ids
            for step in range(max_new_tokens):
                pos = (mask.cumsum(-1) - 1).clamp_min(0)
                if use_cache and past is not None:
                    out = model(input_ids=cur_ids[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                                use_cache=True, **{cache_kw: past})
                else:
                    out = model(input_ids=cur_ids, attention_mask=mask, position_ids=pos, use_cache=use_cache,
                                logits_to_keep=1)
                if use_cache:
                    past = out.get("cache", None) if "cache" in out else out.get("past_key_values", None)
                    if past is None:
                        raise RuntimeError("the model returned no KV cache")
                logits = out.logits[:, -1].float()
                if bias is not None:
                    logits = logits + bias
                nxt = logits.argmax(-1)
                for b, i in enumerate(chunk):
                    if not done[b]:
                        outs[i].append(int(nxt[b]))
                if eos is not None:
                    done |= nxt == eos
                if bool(done.all()):
                    break
                cur_ids = torch.cat([cur_ids, nxt[:, None]], 1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return outs


def _set_attn(model, impl: str) -> bool:
    """Switch the attention implementation (sdpa <-> eager) in place; False when not supported."""
    try:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(impl)
        else:
            model.config._attn_implementation = impl
        return True
    except Exception:
        return False


def _subset(s: Scored, ids: list) -> Scored:
    keep = set(map(str, ids))
    idx = [i for i, r in enumerate(s.outputs.rows) if str(r.id) in keep]
    return Scored(Outputs(s.outputs.name, [s.outputs.rows[i] for i in idx], s.outputs.source), s.role,
                  [s.scores[i] for i in idx])


def _engine_specs(device: str) -> tuple[list[str], str | None]:
    """Embedded-engine lossless systems (SmolLM2, chain and best-first tree), or why there are none."""
    try:
        from specpilot.engine.api import EngineSpec, load_engine  # noqa: F401
    except ImportError as e:
        return [], f"embedded engine not available ({e})"
    dev = "cuda" if device.startswith("cuda") else "cpu"
    extra = f",device={dev}" + (",threads=1" if dev == "cpu" else "")
    return [f"engine:model=smollm2,mode=chain{extra}", f"engine:model=smollm2,mode=tree,nodes=32{extra}"], None


def _bias_name(b: float) -> str:
    return f"bias={b:g}"


def _save_path(save_dir: str, name: str) -> str:
    """Where ``--save-outputs`` keeps system ``name``'s outputs."""
    from pathlib import Path

    safe = "".join(c if c.isalnum() or c in "=.-" else "_" for c in name)
    return str(Path(save_dir) / f"{safe}.jsonl")


def check_options(n_prompts: int, max_new_tokens: int, repeats: int, biases, bias_fraction: float,
                  engine_prompts: int) -> list[float]:
    """InputError naming every option of the self-test that does not fit, at once; else the biases,
    largest first."""
    from .prompts_builtin import PROMPTS

    biases = sorted({float(b) for b in biases}, reverse=True)
    wrong = []
    if not 1 <= n_prompts <= len(PROMPTS):
        wrong.append(f"--n-prompts {n_prompts}: choose 1..{len(PROMPTS)} (the built-in set)")
    if repeats < 1 or n_prompts // repeats < 1:
        wrong.append(f"--repeats {repeats}: need at least one prompt per repeat (choose 1..{max(1, n_prompts)} for "
                     f"--n-prompts {n_prompts})")
    if max_new_tokens < 1:
        wrong.append(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if not biases or not all(math.isfinite(b) and b > 0 for b in biases):
        wrong.append("--biases: give positive finite numbers, e.g. 4,2,1,0.5")
    if not 0 < bias_fraction <= 1:
        wrong.append(f"--bias-fraction {bias_fraction}: must be in (0, 1]")
    if not 0 <= engine_prompts <= n_prompts:
        wrong.append(f"--engine-prompts {engine_prompts}: choose 0..{n_prompts} (of the --n-prompts)")
    if wrong:
        raise InputError("; ".join(wrong))
    return biases


def run_selftest(*, n_prompts: int = 24, max_new_tokens: int = 32, repeats: int = 6, biases=(2.0, 1.0, 0.5, 0.25, 0.125),
                 bias_fraction: float = 0.1, engine_prompts: int = 4, device: str | None = None, seed: int = 0,
                 bootstrap: int = 1000, progress: Callable | None = None, scorer=None,
                 save_dir: str | None = None, check_save: Callable | None = None) -> SelftestResult:
    """The self-test. With ``save_dir`` every system's outputs are written there as
    ``NAME.jsonl``; ``check_save(path, prompts, option)``, called for each such file before any
    system runs (``prompts`` the :class:`Prompt` list that file will answer, ``option`` the one
    that sets them), may refuse (raise) to replace a file kept there."""
    import time

    import torch

    from specpilot.machine import torch_threads

    from .prompts_builtin import PROMPTS
    from .scorer import Scorer
    from .systems import EngineGenerator, collect
    from .outputs import Prompt

    biases = check_options(n_prompts, max_new_tokens, repeats, biases, bias_fraction, engine_prompts)

    if scorer is None:
        scorer = Scorer.load("smollm2", device=device)
    model, tok = scorer.model, scorer.tokenizer
    if tok is None:
        raise InputError("the SmolLM2 tokenizer could not be loaded")
    eos = tok.eos_token_id
    prompt_ids = []
    for text in PROMPTS[:n_prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        prompt_ids.append([int(t) for t in ids])
    pids = [f"p{i}" for i in range(n_prompts)]

    def as_outputs(name, outs):
        return Outputs(name, [OutputRow(pid, p, o) for pid, p, o in zip(pids, prompt_ids, outs)], "selftest")

    k_eng = min(engine_prompts, n_prompts)
    specs, engine_note = _engine_specs(str(scorer.device)) if k_eng > 0 else ([], "left out (--engine-prompts 0)")
    prev = getattr(model.config, "_attn_implementation", None)
    if save_dir and check_save is not None:   # before any system runs: a file kept there may not be replaced
        every = [Prompt(pid, p) for pid, p in zip(pids, prompt_ids)]
        names = ["ar", "stock", "batch4"] + (["eager-attention"] if prev and prev != "eager" else [])
        for name in names + [_bias_name(float(b)) for b in biases]:
            check_save(_save_path(save_dir, name), every, "--n-prompts")
        for spec in specs:
            check_save(_save_path(save_dir, spec), every[:k_eng], "--engine-prompts")

    gen_s: dict[str, float] = {}
    systems: dict[str, Outputs] = {}

    def run(name, **kw):
        t0 = time.perf_counter()
        with torch_threads(scorer.threads):
            outs = greedy(model, prompt_ids, max_new_tokens, eos=eos, progress=progress, desc=name, **kw)
        gen_s[name] = round(time.perf_counter() - t0, 2)
        systems[name] = as_outputs(name, outs)

    run("ar", batch_size=1)
    run("stock", batch_size=8)
    run("batch4", batch_size=4)
    lossless = ["batch4"]
    if prev and prev != "eager" and _set_attn(model, "eager"):
        try:
            run("eager-attention", batch_size=8)
            lossless.append("eager-attention")
        finally:
            _set_attn(model, prev)

    engine_specs: list[str] = []
    engine_outputs: dict[str, Outputs] = {}
    if k_eng > 0:
        for spec in specs:
            try:
                t0 = time.perf_counter()
                gen = EngineGenerator(spec)
                out = collect(gen, [Prompt(pid, p) for pid, p in zip(pids[:k_eng], prompt_ids[:k_eng])],
                              max_new_tokens, name=spec, progress=progress)
                gen_s[spec] = round(time.perf_counter() - t0, 2)
                engine_outputs[spec] = out
                engine_specs.append(spec)
            except Exception as e:  # the engine is optional here; say why it was left out
                engine_note = f"{spec}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    V = scorer.vocab_size
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(V, generator=g)[: max(1, int(round(bias_fraction * V)))]
    defective = []
    for b in biases:
        vec = torch.zeros(V, dtype=torch.float32, device=scorer.device)
        vec[chosen.to(scorer.device)] = b
        name = _bias_name(b)
        run(name, batch_size=8, bias=vec)
        defective.append((name, b))

    if save_dir:
        from pathlib import Path

        from .outputs import write_outputs

        Path(save_dir).mkdir(parents=True, exist_ok=True)
        for name, o in list(systems.items()) + list(engine_outputs.items()):
            write_outputs(_save_path(save_dir, name), o.rows, option="--save-outputs")

    kw = {"progress": progress}
    scored: dict[str, Scored] = {}
    for name, o in systems.items():
        role = "stock" if name == "stock" else "ar" if name == "ar" else "system"
        scored[name] = score_outputs(scorer, o, role, **kw)
    cands = [scored[n] for n in lossless] + [scored[n] for n, _ in defective]
    full = audit(cands, scored["stock"], scored["ar"], bootstrap=bootstrap, seed=seed)
    by_name = {s.name: s for s in full.systems}
    engine_audit = None
    if engine_outputs:
        sub = pids[:k_eng]
        eng_scored = [score_outputs(scorer, o, "system", **kw) for o in engine_outputs.values()]
        engine_audit = audit(eng_scored + [_subset(scored[n], sub) for n, _ in defective[:1]],
                             _subset(scored["stock"], sub), _subset(scored["ar"], sub), bootstrap=bootstrap, seed=seed)

    per = n_prompts // repeats
    rng = np.random.default_rng(seed)
    order = list(rng.permutation(pids))
    subsets = [order[k * per:(k + 1) * per] for k in range(repeats)]
    tallies = {n: [0, 0, [], []] for n in lossless + [n for n, _ in defective]}
    for sub in subsets:
        res = audit([_subset(c, sub) for c in cands], _subset(scored["stock"], sub), _subset(scored["ar"], sub),
                    bootstrap=200, seed=seed)
        for s in res.systems:
            if s.role != "system":
                continue
            t = tallies[s.name]
            t[0] += 1
            t[1] += s.verdict == "reject"
            t[2].append(s.mismatch_rate)
            t[3].append(s.events)
    repeated = []
    for n in lossless:
        a, r, mr, ev = tallies[n]
        repeated.append(RepeatRow(n, "lossless", None, a, r, r / a, float(np.mean(mr)), float(np.mean(ev))))
    for n, b in defective:
        a, r, mr, ev = tallies[n]
        repeated.append(RepeatRow(n, "defective", b, a, r, r / a, float(np.mean(mr)), float(np.mean(ev))))
    fr_a = sum(x.audits for x in repeated if x.kind == "lossless")
    fr_r = sum(x.rejected for x in repeated if x.kind == "lossless")
    detection = {f"{x.bias:g}": x.rate for x in repeated if x.kind == "defective"}

    problems = []
    for n in lossless:
        if by_name[n].verdict != "pass":
            problems.append(f"lossless system {n} was rejected on the full prompt set")
    if engine_audit is not None:
        for sa in engine_audit.systems:
            if sa.name in engine_specs and sa.verdict != "pass":
                problems.append(f"lossless engine system {sa.name} was rejected")
    top = defective[0][0]
    if by_name[top].verdict != "reject":
        problems.append(f"the largest planted bias ({top}) was not rejected")
    return SelftestResult(
        model=scorer.info.path, device=str(scorer.device), cpu=cpu_name(), prompts=n_prompts,
        max_new_tokens=max_new_tokens, repeats=repeats, prompts_per_repeat=per, bias_fraction=bias_fraction,
        biases=biases, engine_systems=engine_specs, engine_note=engine_note, engine_prompts=k_eng,
        engine_audit=engine_audit, full=full, repeated=repeated,
        false_reject_rate=fr_r / fr_a if fr_a else 0.0, false_reject_audits=fr_a, detection=detection,
        generation_s=gen_s, ok=not problems, problems=problems)
