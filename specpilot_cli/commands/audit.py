"""``specpilot audit``: token-forcing loss audit against stock and output collection; the self-test
(:mod:`._audit_selftest`, a helper module, not a verb) is registered here too."""

from __future__ import annotations

import os

import click

from specpilot.errors import InputError
from specpilot.options import FiniteRange, device_option, seed_option, NonEmptyPath, not_blank
from specpilot.output import Report, Section, emit, fmt_num, output_options, progress

SUBCOMMANDS = ("check", "collect", "selftest")


class _AuditGroup(click.Group):
    """``specpilot audit SYSTEM --against STOCK`` is ``specpilot audit check SYSTEM --against STOCK``."""

    def parse_args(self, ctx, args):
        if not args:
            click.echo(ctx.get_help())
            ctx.exit(0)
        if args[0] not in self.commands and args[0] not in ("-h", "--help"):
            self._typo(ctx, args[0])
            args = ["check", *args]
        return super().parse_args(ctx, args)

    def _typo(self, ctx, word: str) -> None:
        """A bare word close to a subcommand that names no file is a misspelt subcommand, not a
        SYSTEM (a system is an outputs file, an engine: spec or an http:// URL)."""
        import difflib
        import os

        if os.path.exists(word) or ":" in word or "/" in word or "." in word or word.startswith("-"):
            return
        close = difflib.get_close_matches(word, list(self.commands), n=1)
        if close:
            raise click.UsageError(f"No such command {word!r}. Did you mean {close[0]!r}?", ctx)


@click.group("audit", cls=_AuditGroup)
def command():
    """Is it still lossless? Token-forcing audit of systems against stock (paper 3.4).

    \b
      specpilot audit SYSTEM... --against STOCK [--ar AR] --scorer MODEL [--prompts FILE]
      specpilot audit collect SYSTEM --prompts FILE --save outputs.jsonl
      specpilot audit selftest

    SYSTEM, STOCK and AR are outputs JSONL files, embedded-engine specs
    (engine:model=smollm2,mode=tree,nodes=32) or SGLang-compatible servers (http://host:port).
    Exit 0 when every system passes, 1 when one is rejected. The first form is `audit check`: its
    options (--scorer, --prompts, --delta and the rest) are in `specpilot audit check --help`.
    """


def _pct(x):
    return None if x is None else f"{100 * x:.2f}%"


def _pp(x):
    return None if x is None else f"{100 * x:+.2f}"


def _ci(ci, scale=100, unit="%"):
    return None if ci is None else f"[{scale * ci[0]:.2f}, {scale * ci[1]:.2f}]{unit}"


def audit_report(result, scorer_info: dict | None) -> Report:
    ph = result.phase0
    data = result.to_json(scorer_info)
    rows, mrows = [], []
    for s in result.systems:
        verdict = s.verdict.upper() if s.verdict else f"({s.role})"
        rows.append([s.name, s.role, s.prompts, s.tokens, s.mismatches, _pct(s.mismatch_rate), _ci(s.mismatch_ci),
                     _pp(s.diff_vs_stock), s.events, s.unexplained_events, verdict])
        m = s.margins
        mrows.append([s.name, m.near_ties, m.delta_to_2delta, m.events_2_to_4_delta, m.events_4_delta_plus,
                      fmt_num(m.p50), fmt_num(m.p90), fmt_num(m.max)])
    d = result.delta
    if ph.source == "phase0":
        how = (f"phase 0: stock diverged from AR on {ph.diverged} of {ph.prompts} prompts"
               + (f", max margin at the first divergence {ph.max_margin:.4g}" if ph.max_margin is not None else "")
               + ", rounded up to a multiple of 1/8")
    elif ph.source == "given":
        how = "given with --delta"
    else:
        how = "default 1/8 (no --ar outputs for phase 0)"
    lines = [f"delta = {d:g} ({how}); events are mismatches with margin >= 2 delta = {2 * d:g}",
             "mismatch 95% intervals resample prompts; 'vs stock' is the mismatch-rate difference in pp"]
    for s in result.systems:
        for r in s.reasons:
            lines.append(f"REJECT {s.name}: {r}")
    for w in result.warnings:
        lines.append(f"warning: {w}")
    lines.append(f"verdict: {result.verdict.upper()}")
    title = "Token-forcing audit" + (f" (scorer {scorer_info['name']}, {scorer_info['dtype']} hidden states, "
                                     f"FP32 LM head, {scorer_info['device']})" if scorer_info else "")
    return Report(data=data, title=title, lines=lines, sections=[
        Section("Systems", ["system", "role", "prompts", "tokens", "mismatches", "rate", "95% CI", "vs stock (pp)",
                            "events", "unexplained", "verdict"], rows),
        Section(f"Mismatch margins (delta = {d:g})", ["system", "< delta (near ties)", "delta..2delta",
                                                      "2..4 delta", ">= 4 delta", "p50", "p90", "max"], mrows),
    ])


def _read_prompts(path, tokenizer_spec):
    from specpilot.auditors.outputs import read_prompts_tokenized

    return read_prompts_tokenized(path, tokenizer_spec)


def _common_run_options(f=None, *, prompts_required: bool = False):
    if f is None:   # @_common_run_options(prompts_required=True)
        return lambda g: _common_run_options(g, prompts_required=prompts_required)
    f = click.option("--concurrency", type=click.IntRange(1, 4096), default=1, show_default=True,
                     help="Requests in flight at once to an http:// server (an engine: spec batches by its "
                          "own batch=B, else runs one request at a time).")(f)
    f = click.option("--timeout", type=FiniteRange(0, 1e6, min_open=True), default=120.0, show_default=True,
                     help="Seconds to wait for a server's answer to one request.")(f)
    f = click.option("--max-new-tokens", type=click.IntRange(1, 1 << 20), default=128, show_default=True,
                     help="Tokens to generate per prompt when running a system.")(f)
    # no default=None beside required: click 8.3+ takes an explicit None as a given value
    f = click.option("--prompts", "prompts_path", type=NonEmptyPath(dir_okay=False), required=prompts_required,
                     help="Prompts for systems that are run: specpilot.prompts/1 (token ids or text) "
                          "or an outputs file.")(f)
    return f


def _model_inputs(scorer_spec: str | None, engine_specs) -> list[str]:
    """The scorer's (or tokenizer's) and the engines' model files given as paths: inputs no output
    may replace."""
    from specpilot.engine.spec import EngineSpec
    from specpilot.models import model_inputs

    out = model_inputs(scorer_spec)
    for text in engine_specs:
        out += EngineSpec.parse(text).inputs()
    return out


@command.command("check")
@click.argument("systems", nargs=-1, required=True)
@click.option("--against", "stock_spec", required=True, help="Stock: outputs file, engine: spec or http:// server.")
@click.option("--ar", "ar_spec", default=None, callback=not_blank, help="Plain autoregressive run for phase 0 (sets delta).")
@click.option("--scorer", "scorer_spec", required=True, callback=not_blank,
              help="Target model for teacher forcing: smollm2, a Hugging Face folder, a .gguf file, or an "
                   "engine built-in (tiny, tiny-hybrid: the engine's target with an FP32 head).")
@_common_run_options
@click.option("--save-outputs", "save_dir", type=NonEmptyPath(file_okay=False), default="specpilot-audit-outputs",
              show_default=True, help="Folder for the outputs of systems that are run (kept on failure).")
@click.option("--delta", type=FiniteRange(0, 1e6, min_open=True), default=None,
              help="Near-tie threshold (> 0); skips phase 0.")
@click.option("--max-increase", type=FiniteRange(0, 100), default=0.5, show_default=True,
              help="Reject when the mismatch rate exceeds stock's by more than this many percentage points.")
@device_option("Scorer device: cpu, cuda or cuda:N (default: cuda when present, else cpu).")
@click.option("--scorer-dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Dtype of the scorer's hidden states (auto: checkpoint dtype on GPU, float32 on CPU).")
@click.option("--batch-tokens", type=int, default=8192, show_default=True, help="Scorer batch size in tokens.")
@click.option("--bootstrap", type=int, default=2000, show_default=True,
              help="Prompt resamples for intervals (at least 100).")
@seed_option("the bootstrap intervals")
@output_options
def check(systems, stock_spec, ar_spec, scorer_spec, prompts_path, max_new_tokens, timeout, concurrency, save_dir, delta,
          max_increase, device, scorer_dtype, batch_tokens, bootstrap, seed, fmt, out):
    """Audit SYSTEM(s) against stock by token forcing; exit 1 when one is rejected.

    \b
    Example (files):
      specpilot audit tree.jsonl --against stock.jsonl --ar ar.jsonl --scorer smollm2
    Example (run the systems):
      specpilot audit engine:model=smollm2,mode=tree,nodes=32 --against engine:model=smollm2,mode=chain \\
          --ar engine:model=smollm2,mode=ar --scorer smollm2 --prompts prompts.jsonl
    """
    from specpilot.auditors.systems import (check_engine_prompts, default_save_path, load_system, parse_system,
                                            save_path_of)

    if batch_tokens < 1:
        raise InputError(f"--batch-tokens {batch_tokens}: must be >= 1")
    if bootstrap < 100:
        raise InputError(f"--bootstrap {bootstrap}: must be >= 100 (fewer resamples give no interval worth the name)")
    from specpilot.limits import MAX_BOOTSTRAP

    if bootstrap > MAX_BOOTSTRAP:
        raise InputError(f"--bootstrap {bootstrap}: at most {MAX_BOOTSTRAP} (more resamples move no interval, "
                         "and take memory)")
    if not max_increase >= 0:
        raise InputError("--max-increase must be >= 0")
    from specpilot.auditors.scorer import check_scorer_spec

    check_scorer_spec(scorer_spec)  # fail before spending time running systems
    vocab_of = _scorer_vocab(scorer_spec)
    specs = [("system", parse_system(s)) for s in systems]
    specs = [("stock", parse_system(stock_spec))] + ([("ar", parse_system(ar_spec))] if ar_spec else []) + specs
    _refuse_stock_as_system(specs)
    inputs = [s.spec for _, s in specs if s.kind == "file"] + ([prompts_path] if prompts_path else [])
    inputs += _model_inputs(scorer_spec, [s.spec for _, s in specs if s.kind == "engine"])
    if out:   # the systems run and the scorer scores for minutes before the report is written
        from specpilot.fileio import check_output_path

        check_output_path(out, "--out", protect=inputs)
    prompts = None
    if any(s.needs_prompts for _, s in specs) and not prompts_path:
        raise InputError("systems to run (engine:/http://) need --prompts FILE")
    if prompts_path:   # with files only too: each must answer these prompts, or --prompts means nothing
        prompts = _read_prompts(prompts_path, scorer_spec)
        check_engine_prompts([(s.spec, s.spec) for _, s in specs if s.kind == "engine"], prompts, max_new_tokens)
    # files first: one that answers other prompts is refused before any system runs for minutes
    order = sorted(specs, key=lambda rs: rs[1].needs_prompts)
    slots: dict[int, tuple[str, int]] = {}   # a system that runs: its role and index in --save-outputs
    for role, spec in order:
        if spec.needs_prompts:
            slots[id(spec)] = (role, sum(1 for r, _ in slots.values() if r == role))
    for role, index in slots.values():   # a file an earlier run kept is not replaced by this one
        save = save_path_of(save_dir, role, index)
        if out and os.path.realpath(out) == os.path.realpath(save):   # nor by the report
            raise InputError(f"--out {out}: where --save-outputs {save_dir} keeps the {role} outputs; write the "
                             "report elsewhere")
        _check_not_an_input(save, save_dir, role, inputs)
        _check_kept_outputs(save_path_of(save_dir, role, index), prompts, save_dir, prompts_path, max_new_tokens,
                            tokenizer=scorer_spec)
    loaded = {}
    for role, spec in order:
        save = None
        if spec.kind == "engine":   # the files are checked by now; an engine's vocabulary before it runs
            _check_engine_vocab(spec.spec, scorer_spec, vocab_of())
        if spec.needs_prompts:
            save = default_save_path(save_dir, *slots[id(spec)])
        loaded[id(spec)] = load_system(spec, prompts, max_new_tokens, save_to=save, timeout=timeout,
                                       progress=progress, protect=inputs, concurrency=concurrency,
                                       save_option="--save-outputs")
        if prompts is not None and not spec.needs_prompts:
            _check_same_prompts(loaded[id(spec)], prompts, spec.spec, prompts_path)
        if not spec.needs_prompts:   # a file: was it written by a model of the scorer's vocabulary?
            _check_scorer_vocab(loaded[id(spec)], spec.spec, scorer_spec, vocab_of)
    result, info = run_audit(
        [loaded[id(s)] for r, s in specs if r == "system"], loaded[id(specs[0][1])],
        loaded[id(specs[1][1])] if ar_spec else None, scorer_spec, device=device, dtype=scorer_dtype,
        batch_tokens=batch_tokens, delta=delta, max_increase=max_increase / 100.0, bootstrap=bootstrap, seed=seed)
    emit(audit_report(result, info), fmt, out, protect=inputs)
    return 0 if result.verdict == "pass" else 1


def _refuse_stock_as_system(specs) -> None:
    """A SYSTEM that is the --against file itself (by path, link or hard link) passes whatever it
    holds: refused as the slip it is. Two runs of one engine spec are a fair check and stay."""
    from specpilot.fileio import same_file

    stock = specs[0][1]
    if stock.kind != "file":
        return
    for role, s in specs[1:]:
        if role == "system" and s.kind == "file" and same_file(s.spec, stock.spec):
            raise InputError(f"SYSTEM {s.spec} is the --against file {stock.spec}: an audit of outputs against "
                             "themselves finds nothing; give the stock system's outputs to --against")



def _check_not_an_input(save: str, save_dir: str, role: str, inputs) -> None:
    """A system that runs would save its outputs over an input file (an outputs file in
    --save-outputs given as a SYSTEM, --against or --ar): refused before any system runs, not after
    its generation, which would then be lost."""
    from specpilot.fileio import same_file

    for p in inputs:
        if same_file(save, p):
            raise InputError(f"--save-outputs {save_dir}: the {role} system's outputs would replace input file {p}; "
                             "choose another --save-outputs")


def _check_kept_outputs(save: str, prompts, save_dir: str, prompts_path: str | None, max_new_tokens: int,
                        prompts_option: str = "--prompts", tokenizer: str | None = None) -> None:
    """Refuse to replace outputs a run would overwrite but not reproduce: a file that does not
    answer every prompt of --prompts (what a run that failed or was stopped keeps, or another
    prompt set's outputs) or answers others besides. A file answering exactly them is rewritten,
    as a new run of the system.
    Without ``prompts_path`` (the self-test's built-in prompts, set by ``prompts_option``) there
    is no 'audit collect --resume' to name; ``tokenizer``: the model that turned the file's text
    prompts into ids (the scorer), which that command needs too where the file has text prompts."""
    from shlex import quote as q

    from specpilot.auditors.outputs import key, read_outputs
    from specpilot.auditors.systems import holds_rows

    if not holds_rows(save):
        return
    what = "remove it or give another --save-outputs"
    try:
        rows = read_outputs(save).rows
    except InputError as e:
        raise InputError(f"--save-outputs {save_dir}: {save} is not an outputs file this audit may replace ({e}); "
                         f"{what}") from None
    have = {key(r.id): list(r.prompt_ids) for r in rows}
    answered = sum(1 for p in prompts if have.get(key(p.id)) == list(p.prompt_ids))
    if answered == len(prompts) == len(rows):   # this prompt set's outputs: a new run replaces them
        return
    systems, limits = {r.system for r in rows}, {r.max_new_tokens for r in rows}
    system = next(iter(systems)) if len(systems) == 1 and None not in systems else "SYSTEM"
    limit = next(iter(limits)) if len(limits) == 1 and None not in limits else max_new_tokens
    held = f"{save} holds an earlier run's outputs for {answered} of the {len(prompts)} prompts of {prompts_option}"
    if len(rows) > answered or prompts_path is None:   # another prompt set's, or no file: nothing --resume can finish
        n_other = len(rows) - answered
        other = f" and {n_other} other prompt{'s' if n_other != 1 else ''}" if n_other > 0 else ""
        raise InputError(f"--save-outputs {save_dir}: {held}{other}; {what}")
    from specpilot.auditors.outputs import read_prompt_rows

    if not any(r.prompt_ids is None for r in read_prompt_rows(prompts_path)):
        tokenizer = None   # prompts of token ids: collect needs no tokenizer
    raise InputError(f"--save-outputs {save_dir}: {held} (a run that stops keeps its outputs there); finish it with "
                     f"'specpilot audit collect {q(system)} --prompts {q(prompts_path)} --max-new-tokens {limit}"
                     f"{f' --tokenizer {q(tokenizer)}' if tokenizer else ''} --save {q(save)} --resume' and audit "
                     f"that file, or {what}")


def _scorer_vocab(scorer: str):
    """The scorer's vocabulary, read on first call (None: not known without loading it). Reading it
    imports transformers (seconds), so a malformed outputs file is refused before that."""
    from functools import cache

    from specpilot.auditors.scorer import scorer_vocab_size

    @cache
    def vocab() -> int | None:
        try:
            return scorer_vocab_size(scorer)
        except InputError:   # a scorer transformers cannot read: its load says so, after the inputs' own checks
            return None

    return vocab


def _check_engine_vocab(spec_text: str, scorer: str, vocab: int | None) -> None:
    """An engine system whose model has another vocabulary than the scorer's: InputError."""
    from specpilot.engine.api import model_vocab

    if vocab is not None and (own := model_vocab(spec_text)) != vocab:
        raise InputError(f"{spec_text}: its vocabulary ({own} tokens) is not that of --scorer {scorer} ({vocab} "
                         "tokens): the scorer cannot force its tokens")


def _check_scorer_vocab(outputs, name: str, scorer: str, vocab_of) -> None:
    """The scorer forces these outputs: outputs a model of another vocabulary wrote (the rows'
    recorded ``system``, an engine spec) cannot be scored, though every id may be in range (such an
    audit reads a mismatch rate near 100% on stock and may pass). Ids out of range: the scorer's
    own check. ``vocab_of()``: the scorer's vocabulary (None: unknown), asked only for such rows."""
    systems = dict.fromkeys(r.system for r in outputs.rows if r.system and r.system.startswith("engine:"))
    vocab = vocab_of() if systems else None
    if vocab is None:
        return
    from specpilot.engine.api import model_vocab

    for system in systems:
        try:
            own = model_vocab(system)
        except InputError:   # a recorded spec this install cannot resolve: the scorer's own id check stays
            continue
        if own != vocab:
            raise InputError(f"{name}: written by {system}, whose vocabulary ({own} tokens) is not that of --scorer "
                             f"{scorer} ({vocab} tokens): the scorer cannot force its tokens")


def _check_same_prompts(outputs, prompts, name: str, prompts_path: str) -> None:
    """Refuse an outputs file whose prompts (ids and token ids) are not those of --prompts."""
    from specpilot.auditors.outputs import key

    want = {key(p.id): list(p.prompt_ids) for p in prompts}
    have = {key(r.id): list(r.prompt_ids) for r in outputs.rows}
    if want != have:
        missing = sorted(set(want) - set(have))
        other = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        extra = sorted(set(have) - set(want))
        what = "; ".join(f"{len(v)} {label} (first: {v[0]})" for v, label in
                         ((missing, "missing"), (other, "with other token ids"), (extra, "not in --prompts")) if v)
        raise InputError(f"{name}: its prompts are not those of --prompts {prompts_path}: {what}")


def run_audit(system_outputs, stock_outputs, ar_outputs, scorer_spec, *, device=None, dtype="auto",
              batch_tokens=8192, delta=None, max_increase=0.005, bootstrap=2000, seed=0, scorer=None):
    """Score every system with the scorer and audit them (library glue shared with selftest)."""
    from dataclasses import asdict

    from specpilot.auditors.forcing import audit, score_outputs
    from specpilot.auditors.outputs import align
    from specpilot.auditors.scorer import Scorer

    for o in list(system_outputs) + ([ar_outputs] if ar_outputs is not None else []):
        align(stock_outputs, o)  # fail on mismatched prompt sets before loading the model
    if scorer is None:
        scorer = Scorer.load(scorer_spec, device=device, dtype=dtype)
    kw = {"batch_tokens": batch_tokens, "progress": progress}
    stock = score_outputs(scorer, stock_outputs, "stock", **kw)
    ar = score_outputs(scorer, ar_outputs, "ar", **kw) if ar_outputs is not None else None
    scored = [score_outputs(scorer, o, "system", **kw) for o in system_outputs]
    result = audit(scored, stock, ar, delta=delta, max_increase=max_increase, bootstrap=bootstrap, seed=seed)
    return result, asdict(scorer.info)


@command.command("collect")
@click.argument("system")
@_common_run_options(prompts_required=True)   # --resume too: it runs the prompts --save does not answer yet
@click.option("--save", "save", type=NonEmptyPath(dir_okay=False), required=True,
              help="Outputs JSONL to write (also written with the rows collected so far when a run fails).")
@click.option("--tokenizer", default=None, callback=not_blank,
              help="Model whose tokenizer turns text prompts into ids [default: an engine: SYSTEM's model].")
@click.option("--resume", is_flag=True,
              help="Keep the rows --save already holds (an interrupted collection of the same SYSTEM, --prompts "
                   "and --max-new-tokens; each row records its system and limit) and run only the other prompts.")
@output_options
def collect_cmd(system, prompts_path, max_new_tokens, timeout, concurrency, save, tokenizer, resume, fmt, out):
    """Run SYSTEM (engine: spec or http:// server) over --prompts and save its outputs file. An
    engine: spec with batch=B decodes B prompts at a time on its batch decoder.

    When the run fails or is interrupted (SIGINT, SIGTERM, SIGHUP) the outputs collected so far
    are kept in --save; --resume continues from them.

    A server takes token ids: text prompts need --tokenizer (the served model's).

    \b
    Example:
      specpilot audit collect http://127.0.0.1:30000 --prompts prompts.jsonl --tokenizer smollm2 \\
          --save sglang.outputs.jsonl
    """
    from pathlib import Path

    from specpilot.auditors.outputs import key, read_outputs
    from specpilot.auditors.systems import (Generator, collect, holds_rows, make_generator, parse_system,
                                            system_identity)
    from specpilot.fileio import check_output_path

    spec = parse_system(system)
    if spec.kind == "file":
        raise InputError(f"{system}: already an outputs file; collect runs an engine: spec or an http:// server")
    # before the collection: --save and --out may be neither its inputs nor each other
    inputs = [prompts_path] + _model_inputs(tokenizer, [spec.spec] if spec.kind == "engine" else [])
    check_output_path(save, "--save", protect=inputs)
    if out:
        if Path(out).resolve() == Path(save).resolve():
            raise InputError(f"--out {out}: the same file as --save; choose another --out (or leave it out)")
        check_output_path(out, "--out", protect=inputs)
    identity = system_identity(spec)
    if tokenizer is None and spec.kind == "engine":   # the engine's own model reads its text prompts
        from specpilot.engine.spec import EngineSpec

        tokenizer = EngineSpec.parse(spec.spec).model
    prompts = _read_prompts(prompts_path, tokenizer)
    if not resume and holds_rows(save):   # a new collection would replace them, whatever it gets to
        try:   # --resume is advice only where it would take them (it says why not, where not)
            _check_resumable(read_outputs(save).rows, prompts, max_new_tokens, save, identity, quiet=True)
        except InputError as e:
            if str(e).startswith(f"--save {save}: "):
                raise
            raise InputError(f"--save {save}: holds rows that are not a collection's outputs ({e}); remove the file "
                             "or give another --save") from None
        raise InputError(f"--save {save}: holds the rows of an earlier collection; continue it with --resume, or "
                         "remove the file or give another --save")
    # an empty --save (made, nothing collected yet) resumes from nothing
    already = read_outputs(save).rows if resume and holds_rows(save) else []
    _check_resumable(already, prompts, max_new_tokens, save, identity)
    answered = {key(r.id): list(r.prompt_ids) for r in already}
    # a save that answers every prompt needs no model loaded and no server up
    finished = all(answered.get(key(p.id)) == list(p.prompt_ids) for p in prompts)
    try:
        outputs = collect(Generator() if finished else make_generator(spec, timeout=timeout), prompts,
                          max_new_tokens, save_to=save, name=spec.name, progress=progress, protect=inputs,
                          concurrency=concurrency, already=already, system=identity)
    except BaseException as e:
        if getattr(e, "path", None) or (isinstance(e, KeyboardInterrupt) and Path(save).exists()):
            e.add_note(f"continue with --resume (same --save {save})" if getattr(e, "exit_code", 0) != 2 else
                       f"fix or leave out that prompt, then continue with --resume (same --save {save})")
        raise
    lens = [len(r.output_ids) for r in outputs.rows]
    data = {"schema": "specpilot.audit-collect/1", "system": identity, "prompts": len(prompts),
            "tokens": sum(lens), "max_new_tokens": max_new_tokens, "saved": save}
    emit(Report(data=data, sections=[Section(None, ["system", "prompts", "tokens", "mean tokens/prompt", "saved"],
                                             [[identity, len(prompts), sum(lens), sum(lens) / len(lens), save]])]),
         fmt, out, protect=inputs + [save])
    return 0


def _same_system(stored: str | None, system: str) -> bool:
    """Whether a row's recorded system is ``system`` (canonical): unknown counts as the same; a
    stored engine spec is compared as the engine it names (``EngineSpec.resolved``), not as text."""
    if stored is None or stored == system:
        return True
    if stored.startswith("engine:") and system.startswith("engine:"):
        from specpilot.engine.spec import EngineSpec

        try:
            return EngineSpec.parse(stored).resolved() == EngineSpec.parse(system).resolved()
        except InputError:
            return False
    return False


def _check_resumable(already, prompts, max_new_tokens: int, save: str, system: str, quiet: bool = False) -> None:
    """Refuse to resume from rows the collection would drop or mix in: rows of other prompts (the
    file is rewritten with the prompts' rows only), rows of another system or collected under
    another --max-new-tokens (a row records both) or, for rows that do not record the limit,
    longer than --max-new-tokens; warn that rows recording neither cannot be checked (not where
    ``quiet``: the check only)."""
    from specpilot.auditors.outputs import key

    want = {key(p.id): list(p.prompt_ids) for p in prompts}
    stray = [r for r in already if want.get(key(r.id)) != list(r.prompt_ids)]
    if stray:
        changed = [r for r in stray if key(r.id) in want]
        what = (f"{len(changed)} of its {len(already)} rows have the id of a prompt of --prompts but other prompt "
                f"tokens (first: id {changed[0].id!r})") if changed else \
            f"{len(stray)} of its {len(already)} rows answer none of --prompts (first: id {stray[0].id!r})"
        raise InputError(f"--save {save}: {what}; --resume continues a collection of the same prompts, so choose "
                         "another --save")
    aliens = [r for r in already if not _same_system(r.system, system)]
    # a server may come back at another address with the same model: only a note for two URLs
    http = ("http://", "https://")
    refused = next((r for r in aliens if not (r.system.startswith(http) and system.startswith(http))), None)
    if refused is not None:
        raise InputError(f"--save {save}: row {refused.id!r} was collected from {refused.system}, not {system}; "
                         "resume with the SYSTEM it was collected from, or choose another --save")
    if aliens and not quiet:
        click.echo(f"specpilot: warning: --save {save}: {len(aliens)} of its rows "
                   f"{'was' if len(aliens) == 1 else 'were'} collected from "
                   f"{aliens[0].system}{' and others' if len({r.system for r in aliens}) > 1 else ''}, this "
                   f"collection runs {system}; resume only if that server runs the same model and settings", err=True)
    other = next((r for r in already if r.max_new_tokens not in (None, max_new_tokens)), None)
    if other is not None:
        raise InputError(f"--save {save}: row {other.id!r} was collected with --max-new-tokens "
                         f"{other.max_new_tokens}, not {max_new_tokens}; resume with the --max-new-tokens it was "
                         "collected with, or choose another --save")
    long = next((r for r in already if len(r.output_ids) > max_new_tokens), None)
    if long is not None:
        raise InputError(f"--save {save}: row {long.id!r} has {len(long.output_ids)} output tokens, more than "
                         f"--max-new-tokens {max_new_tokens}; resume with the --max-new-tokens it was collected with")
    unknown = sum(1 for r in already if r.max_new_tokens is None or r.system is None)
    if unknown and not quiet:
        click.echo(f"specpilot: warning: --save {save}: {unknown} of the {len(already)} rows kept do not record the "
                   "system or --max-new-tokens they were collected with (a file from an older SpecPilot); they "
                   "cannot be checked against this collection's", err=True)


# registered last: the self-test's module reads this one's report and checks
from ._audit_selftest import selftest_cmd  # noqa: E402

command.add_command(selftest_cmd)
