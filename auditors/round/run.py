"""One round of the paper's procedure (section 3): re-measure, model, propose, approve, remember.

:func:`run_round` runs the stages in order, each writing its files into the round's folder and
``round.json`` (``specpilot.round/1``: configuration, deployment facts, each stage's status, time
and what it skipped) after every step, so ``resume=True`` continues a stopped round where it
stopped. The budget is planned (:mod:`.plan`) from what the round measures; a stage that runs out
of time stops cleanly and records what it did not do. :func:`plan_round` is the dry run: the plan
and its time estimate, nothing run.

Nothing here prints: ``notify(stage, message)`` receives progress lines, ``progress`` is a
tqdm-like factory for bars.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specpilot.errors import InputError
from specpilot.fileio import is_int, is_num, read_json, write_json_atomic

from . import approve as ap
from . import measure as ms
from . import plan as pl
from . import remember as rm
from .deployment import Deployment, parse_deployment
from .engines import EnginePool, EngineScorer, PooledSystem, generate_outputs, outputs_from
from .modeling import ModelResult, build_model
from .propose import Proposal, propose_engine

SCHEMA = "specpilot.round/1"
BASELINE_SCHEMA = "specpilot.baseline/1"
STAGES = ("measure", "model", "propose", "approve", "remember")
DEFAULT_LOAD_S = {"cpu": 12.0, "cuda": 45.0}


def score_s(shape: pl.Shape, tokens_per_s: float, prefill_s: float) -> float:
    """The audit's teacher forcing of three systems' outputs: a few prefill-like forwards."""
    return 0.5 + 0.5 * shape.run_s(tokens_per_s * 20.0, prefill_s)


@dataclass
class RoundConfig:
    deployment: str | None = None
    out_dir: str = "specpilot-round"
    budget_min: float = 20.0
    prompts: str | None = None          # prompts file (text or token ids); default: built-in chat prompts
    n_prompts: int | None = None        # fix the prompts per run (default: planned)
    max_new_tokens: int | None = None   # fix the new tokens per prompt (default: planned)
    candidates: list[str] | None = None  # only these candidates
    control: bool = False               # add a no-op candidate (the current system again)
    scorer: str | None = None           # audit scorer model (default: the stock engine's target)
    memory_dir: str | None = None
    records_dir: str | None = None
    fresh: bool = False                 # ignore the deployment's record: start from DEPLOYMENT
    remember: bool = True               # write the deployment record
    seed: int = 0


@dataclass
class RoundResult:
    dir: Path
    state: dict
    measurement: ms.Measurement | None = None
    model: ModelResult | None = None
    proposal: Proposal | None = None
    decisions: list[ap.Decision] = field(default_factory=list)
    record: str | None = None
    complete: bool = False   # a resume found nothing left to do

    @property
    def approved(self) -> list[ap.Decision]:
        return [d for d in self.decisions if d.verdict == "approved"]

    @property
    def final(self) -> str | None:
        return self.state.get("final")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without it
        return None


def check_config(cfg: RoundConfig):
    """Refuse, before anything runs, a new round's options that would fail a later stage: a
    non-empty --out-dir, a budget that is not positive, a deployment, --candidates, --memory-dir,
    --prompts or --scorer that cannot be read; the parsed deployment."""
    from specpilot.auditors.outputs import read_prompt_rows
    from specpilot.bundles.memory import load_memory

    from .propose import check_names, check_runnable

    out = Path(cfg.out_dir) if cfg.out_dir else None
    if out is not None and out.exists() and (not out.is_dir() or any(p.name != LOCK_FILE for p in out.iterdir())):
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
    load_memory(cfg.memory_dir)
    check_names(cfg.candidates, dep.kind, cfg.memory_dir)
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
                         + (f", give --max-new-tokens {fewer} or fewer" if fewer >= 1 else "")
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


class _Round:
    def __init__(self, cfg: RoundConfig, *, resume: bool, budget_min: float | None, progress, notify,
                 lock: list | None = None):
        self.progress = progress
        self.notify = notify or (lambda stage, msg: None)
        self.dir = Path(cfg.out_dir)
        self._running = None   # (stage, its start, its seconds before this session)
        if resume:
            # a budget that is not a positive number of minutes is refused before the folder is read
            # or written, as a new round's is (nan/inf would be written into round.json, <= 0 judges nothing)
            if budget_min is not None and not (math.isfinite(budget_min) and budget_min > 0):
                raise InputError(f"--budget {budget_min}: give the minutes the round may take (> 0)")
            path = self.dir / "round.json"
            if not path.is_file():
                raise InputError(f"{self.dir}: no round.json here; nothing to resume")
            if lock is not None:   # before the state is read: another session may be rewriting it
                lock.append(hold_folder(self.dir))
            self.state = read_json(path, kind="round")
            check_state(self.state, path)
            check_stage_files(self.dir, self.state)
            read_stage_files(RoundResult(self.dir, self.state))   # a damaged one refuses before anything is written
            self.cfg = RoundConfig(**self.state["config"])
            self.cfg.out_dir = str(self.dir)
            try:
                self.dep = parse_deployment(self.state["deployment"], strict=False)
            except InputError as e:
                raise InputError(f"{path}: deployment: {e}") from None
            if stages_left(self.state) or budget_min is not None:   # what the stages left read back, before
                check_round_inputs(self.dir, self.state)              # anything is written
                if self.cfg.remember:   # the remember stage appends to the deployment record
                    check_record_file(rm.record_path(self.cfg.records_dir, self.dep.facts.identity()))
            # spent and budget add up over the sessions: --budget gives that many more minutes
            spent = float(self.state.get("spent_s") or 0.0)
            budget_s = float(self.state.get("budget_s") or self.cfg.budget_min * 60.0)
            if budget_min is not None:
                budget_s = spent + budget_min * 60.0
                self._reopen_skipped_for_budget()
            self.cfg.budget_min = budget_s / 60.0
            self.state["budget_s"] = budget_s
            self.state.pop("stopped", None)
            self.clock = pl.Clock(budget_s, spent_before=spent)
            # nothing left to do (with --budget, no candidate skipped for time reopened): nothing is rewritten
            self.complete = all(v["status"] in ("done", "stopped") for v in self.state["stages"].values())
            if not self.complete:   # the report names each session that continued the round
                self.state.setdefault("resumes", []).append({"budget_min": budget_min})
        else:
            self.complete = False
            self.cfg = cfg
            self.dep = check_config(cfg)
            if cfg.remember:   # absolute: a resume from another folder writes the same record
                self.cfg.records_dir = str(Path(cfg.records_dir or rm.default_records_dir()).resolve())
            self.clock = pl.Clock(cfg.budget_min * 60.0)
            self.state = self._new_state()
            self.dir.mkdir(parents=True, exist_ok=True)
            if lock is not None:   # two new rounds that both found the folder empty: the second stops here
                lock.append(hold_folder(self.dir))
                if any(p.name != LOCK_FILE for p in self.dir.iterdir()):   # or the first ended before it got here
                    raise InputError(f"{self.dir} is not an empty folder any more (another round wrote there); "
                                     f"continue that round with --resume {self.dir} or choose another --out-dir")
            self._save()
        self.pool = EnginePool()
        self.facts = self.dep.facts

    # ---------------------------------------------------------------------------- state
    def _reopen_skipped_for_budget(self) -> None:
        """Candidates an earlier session skipped for want of time are judged in this one (with the
        minutes it was given); the record then gets this round's entry again, replaced."""
        dpath = self.dir / "approve" / "decisions.json"
        if not dpath.is_file():
            return
        doc = read_json(dpath, kind="round-decisions")
        rows = doc.get("decisions") if isinstance(doc, dict) else None
        if not isinstance(rows, list):
            return
        again = {r.get("id") for r in rows if isinstance(r, dict) and r.get("verdict") == "skipped"
                 and str(r.get("reason", "")).startswith("budget:")}
        if not again:
            return
        write_json_atomic(dpath, dict(doc, decisions=[r for r in rows if r.get("id") not in again]))
        st = self.state["stages"]["approve"]
        st["skipped"] = [n for n in st.get("skipped", []) if not any(n.startswith(f"{i}: budget:") for i in again)]
        for stage in ("approve", "remember"):
            if self.state["stages"][stage]["status"] in ("done", "stopped"):
                self.state["stages"][stage]["status"] = "pending"
        self.state["notes"].append(f"resumed with more time: {', '.join(sorted(again))} judged again (skipped for "
                                   "budget before)")

    def _new_state(self) -> dict:
        sglang = self.dep.kind == "sglang"
        stock = "stock" if sglang else self.dep.text
        start, notes, bundles = stock, [], []
        rec_path = rm.record_path(self.cfg.records_dir, self.dep.facts.identity())
        check_record_file(rec_path)   # read for the start and the plan, added to at the end: a damaged record
                                      # is refused before the round's folder is made
        rec = rm.read_record(rec_path)
        if rec and rec.get("current") and not self.cfg.fresh:
            if sglang:
                bundles = list((rec.get("bundles") or []))
                start = rec["current"]
            else:
                start = record_spec(rec, rec_path)
            notes.append(f"starts from the previous round's final system {start} (deployment record; --fresh "
                         "starts from DEPLOYMENT)")
        return {"bundles": bundles, "settings": {}, "schema": SCHEMA, "round_id": uuid.uuid4().hex,
                "deployment": self.dep.text, "kind": self.dep.kind, "facts": self.dep.facts.to_json(),
                "stock": stock, "start": start, "current": start, "final": None, "config": asdict(self.cfg),
                "budget_s": self.cfg.budget_min * 60.0, "spent_s": 0.0, "started_at": _now(), "updated_at": _now(),
                "load_average_start": _load(), "notes": notes, "shape": None,
                "stages": {s: {"status": "pending", "seconds": 0.0, "notes": [], "skipped": []} for s in STAGES},
                "versions": rm.versions()}

    def _save(self) -> None:
        self.state["updated_at"] = _now()
        if hasattr(self, "clock"):
            self.state["spent_s"] = self.clock.spent()
        running = self._running
        if running:   # a round killed mid-stage still shows the stage's time up to its last save
            name, t0, before = running
            self._stage(name)["seconds"] = before + (time.perf_counter() - t0)
        write_json_atomic(self.dir / "round.json", self.state)

    def _stage(self, name: str) -> dict:
        return self.state["stages"][name]

    def _done(self, name: str) -> bool:
        return self._stage(name)["status"] in ("done", "stopped")

    def _start(self, name: str) -> float:
        st = self._stage(name)
        t0 = time.perf_counter()
        self._running = (name, t0, float(st.get("seconds") or 0.0))
        st["status"] = "running"
        self._save()
        return t0

    def _finish(self, name: str, t0: float, status: str = "done") -> None:
        self._save()   # the stage's seconds, up to now
        self._running = None
        self._stage(name)["status"] = status
        self._save()

    def _stop_running(self, status: str) -> None:
        """The stage under way when the round stops early keeps its time and says why it stopped."""
        running = self._running
        if running:
            self._save()
            self._running = None
            self._stage(running[0])["status"] = status

    def _note(self, stage: str, msg: str, skipped: bool = False) -> None:
        kept = self._stage(stage)["skipped" if skipped else "notes"]
        if msg not in kept:   # a resumed stage that runs again says the same once
            kept.append(msg)
        self._step(stage, ("skipped: " if skipped else "") + msg)

    def _step(self, stage: str, msg: str) -> None:
        """A step of a running stage is done or starts: round.json gets its status and time first
        (one small atomic write), so a round killed mid-stage shows the time it had spent in it."""
        if self._running:
            self._save()
        self.notify(stage, msg)

    # ---------------------------------------------------------------------------- prompts
    def prompts(self):
        from specpilot.auditors.outputs import read_prompt_rows

        path = self.dir / "prompts.jsonl"
        if path.is_file():
            return read_round_prompts(path, self.state)
        eng = self.pool.get(self.state["stock"])
        rows = read_prompt_rows(self.cfg.prompts) if self.cfg.prompts else None
        prompts = round_prompts(self.cfg, rows, eng, eng.model.spec.vocab_size, self.facts.device)
        short = short_prompts_note(self.cfg, rows, prompts)
        if short:
            self._note("measure", short)
        from specpilot.fileio import write_jsonl_atomic

        write_jsonl_atomic(path, [{"schema": "specpilot.prompts/1", "id": p.id, "prompt_ids": list(p.prompt_ids)}
                                  for p in prompts])
        return prompts

    # ---------------------------------------------------------------------------- stage 1
    def measure(self) -> ms.Measurement:
        path = self.dir / "measure" / "measure.json"
        if self._done("measure") and path.is_file():
            return read_json(path, kind="round-measure", build=ms.Measurement.from_json)
        from specpilot.engine.spec import EngineSpec

        st = self._stage("measure")   # a stage cut short runs again from its start: its notes with it
        st["notes"], st["skipped"] = [], []
        t0 = self._start("measure")
        d = self.dir / "measure"
        d.mkdir(exist_ok=True)
        if self.dep.kind == "sglang":
            from .sglang import measure_sglang

            meas = measure_sglang(self.dep.sglang, d, self.notify)
            for s in meas.skipped:
                self._note("measure", s, skipped=True)
            write_json_atomic(path, meas.to_json())
            self._finish("measure", t0)
            return meas
        current = self.state["current"]
        spec = EngineSpec.parse(current)
        allowance = min(self.clock.left(), pl.MEASURE_SHARE * self.clock.budget_s)
        deadline = time.monotonic() + allowance
        self._step("measure", f"loading the current system {current}")
        prompts = self.prompts()
        eng = self.pool.get(current)
        cal = ms.calibrate(eng, prompts[0])
        rows, policy = ms.system_rows(spec)
        cuda = self.facts.device == "cuda"
        shape0 = pl.SHAPES["cuda" if cuda else "cpu"][0]
        max_new = self.cfg.max_new_tokens or shape0.max_new_tokens
        context = min(ms.median_prompt_len(prompts) + max_new // 2, eng.model.max_seq - max(ms.NODES) - 40)
        meas = ms.Measurement(system=current, tokens_per_s=cal["tokens_per_s"], calibration=cal, context=context,
                              current_rows=rows, current_policy=policy)
        self._step("measure", f"current system: {cal['tokens_per_s']:.3g} tokens/s (calibration, "
                               f"{cal['tokens']} tokens)")
        # T_step(N)
        try:
            probe_rows = ms.probe_rows_set(rows)
            t1 = time.perf_counter()
            doc, step_ms, ar_ms = ms.rows_probe(eng, probe_rows, context, reps=30 if cuda else 5,
                                                progress=self.progress)
            write_json_atomic(d / "rows.json", doc)
            meas.step_ms, meas.ar_ms, meas.rows_method = step_ms, ar_ms, doc.get("method")
            meas.files["rows"] = "measure/rows.json"
            meas.seconds["rows"] = time.perf_counter() - t1
            self._step("measure", f"T_AR {ar_ms:.3g} ms, T_step({max(probe_rows)} rows) "
                                   f"{step_ms[max(probe_rows)]:.3g} ms at context {context}")
        except InputError as e:
            self._note("measure", f"rows probe: {e}", skipped=True)
        # profile of the engine's own steps (before the lattice: the kernel factor is what W12 attacks)
        if not cuda:
            self._note("measure", "profile: no GPU kernels to profile on the CPU; the kernel and outside factors "
                                  "stay unknown", skipped=True)
        elif time.monotonic() > deadline:
            self._note("measure", "profile: the stage's time is spent", skipped=True)
        else:
            try:
                trace = d / "trace.json.gz"
                n = ms.capture_step_trace(eng, prompts[0], 32, trace)
                prof = ms.profile_trace(trace, eng.model.spec, self.facts.gpu_key, rows, context, spec.w12,
                                        annotated=n > 0)
                write_json_atomic(d / "profile.json", prof)
                meas.profile = prof
                meas.files.update(trace="measure/trace.json.gz", profile="measure/profile.json")
                # the steps profiled (the report's count), not the annotations the capture made
                self._step("measure", f"profile of {prof.get('steps', n)} steps: step {prof['step_wall_ms']:.3g} ms, "
                                      f"GPU busy {prof['kernel_busy_ms']:.3g} ms, floor "
                                      f"{prof.get('total_floor_ms') or 0:.3g} ms")
            except Exception as e:  # the profile informs the model; a round goes on without it
                self._note("measure", f"profile: {type(e).__name__}: {e}", skipped=True)
        # tau(N): record a lattice on the prompts, replay it
        rec_spec = ms.record_spec(spec)
        rate = max(cal["tokens_per_s"] * 0.7, 1e-3)
        left = deadline - time.monotonic()
        n_rec, tok_rec = len(prompts), max_new
        while n_rec > 1 and n_rec * (cal["prefill_s"] + tok_rec / rate) > 0.6 * left:
            if tok_rec > 24:
                tok_rec = max(24, tok_rec * 2 // 3)
            else:
                n_rec -= 1
        if n_rec * (cal["prefill_s"] + tok_rec / rate) > left:
            self._note("measure", f"lattice recording: needs ~{n_rec * tok_rec / rate:.0f} s, "
                                  f"{max(left, 0):.0f} s left in the stage: tau(N) unknown", skipped=True)
        else:
            self._step("measure", f"recording the lattice: {n_rec} prompts x {tok_rec} tokens, {rec_spec}")
            rec = self.pool.get(str(rec_spec))
            meas.lattice = ms.record_lattice(rec, prompts[:n_rec], tok_rec, d / "lattice.jsonl", progress=self.progress)
            if str(rec_spec) != current:
                self.pool.drop(str(rec_spec))
            meas.files["lattice"] = "measure/lattice.jsonl"
            rp = ms.replay_lattice(d / "lattice.jsonl", policy, d / "replay.json")
            meas.replay = rp
            meas.verify_rows = ms.verify_rows(d / "lattice.jsonl", policy)
            meas.lattice.update({"steps": rp["steps"], "requests": rp["requests"], "m": rp["positions"],
                                 "k": rp["candidates"]})
            meas.files["replay"] = "measure/replay.json"
            taus = ", ".join(f"{p['policy']} {p['tau']:.3f}" for p in rp["policies"])
            self._step("measure", f"replayed {rp['steps']} steps: {taus}")
        self._measure_tlv(meas, spec, prompts[:n_rec], tok_rec, deadline, d)
        write_json_atomic(path, meas.to_json())
        self._finish("measure", t0)
        return meas

    def _measure_tlv(self, meas, spec, prompts, max_new: int, deadline: float, d: Path) -> None:
        """TLV cycles recorded on the prompts (tau per exact pass, the passes' ms), when the round
        may propose TLV or the current system is TLV, the engine can run it and the stage has time."""
        wanted = spec.mode == "tlv" or (self.cfg.candidates is None or "tlv" in self.cfg.candidates)
        why = ms.tlv_unavailable(spec)
        if not wanted or (why and spec.mode != "tlv"):
            if wanted:
                self._note("measure", f"TLV recording: {why}", skipped=True)
            return
        need = 1.5 * (meas.lattice or {}).get("seconds", float("inf"))   # TLV's cycles against the tree recording
        if spec.mode != "tlv" and time.monotonic() + need > deadline:
            self._note("measure", f"TLV recording: needs ~{need:.0f} s (1.5x the tree recording), "
                                  f"{max(deadline - time.monotonic(), 0):.0f} s left in the stage", skipped=True)
            return
        tspec = ms.tlv_spec(spec)
        self._step("measure", f"recording TLV cycles: {len(prompts)} prompts x {max_new} tokens, {tspec}")
        eng = self.pool.get(str(tspec))
        meas.tlv = ms.record_tlv(eng, prompts, max_new, d / "tlv.lattice.jsonl", progress=self.progress)
        if str(tspec) != self.state["current"]:
            self.pool.drop(str(tspec))
        meas.files["tlv_lattice"] = "measure/tlv.lattice.jsonl"
        t = meas.tlv
        self._step("measure", f"TLV at N={t['nodes']}: tau {t['tau']:.3f} per exact pass, Q pass "
                               f"{t['time_ms']['qpass']:.3g} ms + exact pass {t['time_ms']['exact']:.3g} ms per cycle")

    # ---------------------------------------------------------------------------- stages 2, 3
    def model(self, meas) -> ModelResult:
        path = self.dir / "model" / "model.json"
        if self._done("model") and path.is_file():
            return read_json(path, kind="round-model", build=ModelResult.from_json)
        t0 = self._start("model")
        res = build_model(meas)
        (self.dir / "model").mkdir(exist_ok=True)
        write_json_atomic(path, res.to_json())
        f = res.factors
        known = ", ".join(f"{k} {v:.3g}x" for k, v in f.items() if v is not None) or "none known"
        largest = res.largest or ("none above 1" if any(v is not None for v in f.values()) else "unknown")
        self.notify("model", f"factors: {known}; largest: {largest}"
                    + (f"; best predicted: {res.best['family']} N={res.best['nodes']} at {res.best['speedup']:.3g}x "
                       "over AR" if res.best else ""))
        for n in res.notes:
            self._stage("model")["notes"].append(n)
        self._finish("model", t0)
        return res

    def propose(self, meas, model) -> Proposal:
        path = self.dir / "propose" / "candidates.json"
        if self._done("propose") and path.is_file():
            return read_json(path, kind="round-candidates", build=Proposal.from_json)
        from specpilot.bundles.memory import load_memory
        from specpilot.engine.spec import EngineSpec

        t0 = self._start("propose")
        if self.dep.kind == "sglang":
            from .sglang import propose_sglang

            prop = propose_sglang(self.dep.sglang, list(self.state.get("bundles") or []), model, meas,
                                  only=self.cfg.candidates, memory_dir=self.cfg.memory_dir)
        else:
            memory_ids = set(load_memory(self.cfg.memory_dir))
            prop = propose_engine(EngineSpec.parse(self.state["current"]), self.facts, model, meas,
                                  only=self.cfg.candidates, control=self.cfg.control, memory_ids=memory_ids)
        (self.dir / "propose").mkdir(exist_ok=True)
        write_json_atomic(path, prop.to_json())
        self.notify("propose", f"{len(prop.candidates)} candidate(s): "
                    + (", ".join(f"{c.id} ({c.system})" for c in prop.candidates) or "none")
                    + f"; {len(prop.not_proposed)} listed as not runnable here")
        self._finish("propose", t0)
        return prop

    # ---------------------------------------------------------------------------- stage 4
    def _rate(self, meas, cand) -> float:
        g = cand.predicted_gain or 1.0
        return meas.tokens_per_s * min(max(g, 0.5), 2.0)

    def approve(self, meas, model, prop) -> list[ap.Decision]:
        from specpilot.auditors.outputs import Outputs, read_outputs

        d = self.dir / "approve"
        d.mkdir(exist_ok=True)
        dpath = d / "decisions.json"
        decisions = read_json(dpath, kind="round-decisions", build=ap.decisions_from_json) \
            if dpath.is_file() else []
        if self._done("approve"):
            return decisions
        t0 = self._start("approve")
        if self.dep.kind == "sglang":
            from .sglang import approve_sglang

            decisions = approve_sglang(self.dep.sglang, d, self.cfg, self.clock, self.notify, prop, meas, self.state,
                                       self._save)
            self._finish("approve", t0)
            return decisions
        prompts = self.prompts()
        device = self.facts.device
        cal = meas.calibration
        load_s = self.pool.typical_load_s(DEFAULT_LOAD_S.get(device, 12.0))
        todo = [c for c in prop.candidates if c.id not in {x.id for x in decisions}]
        if self.state.get("shape"):
            shape = pl.Shape(**self.state["shape"])
        else:
            fixed = None
            if self.cfg.n_prompts or self.cfg.max_new_tokens:
                shape0 = pl.SHAPES["cuda" if device == "cuda" else "cpu"][0]
                fixed = pl.Shape(min(self.cfg.n_prompts or shape0.prompts, len(prompts)),
                                 self.cfg.max_new_tokens or shape0.max_new_tokens)
            sc = score_s(pl.SHAPES["cuda" if device == "cuda" else "cpu"][0], meas.tokens_per_s, cal["prefill_s"])
            shape, planned = pl.choose_shape(device, self.clock.left() - 5.0, [self._rate(meas, c) for c in todo],
                                             meas.tokens_per_s, cal["prefill_s"], load_s, sc,
                                             max_prompts=len(prompts), fixed=fixed)
            self.state["shape"] = asdict(shape)
            self.state["planned_pairs"] = planned
            self._save()
        run_prompts = prompts[:shape.prompts]
        self.notify("approve", f"runs of {shape.prompts} prompts x {shape.max_new_tokens} new tokens; "
                               f"{len(todo)} candidate(s) to judge")
        stock = self.state["stock"]
        from specpilot.engine.spec import EngineSpec

        stock_spec = EngineSpec.parse(stock)
        ar_text = str(stock_spec.with_(mode="ar"))
        refs = {}
        for role, text in (("stock", stock), ("ar", ar_text)):
            f = d / f"{role}.outputs.jsonl"
            if f.is_file():
                refs[role] = read_outputs(f, name=role)
            elif role == "ar" and ar_text == stock:
                refs["ar"] = Outputs("ar", refs["stock"].rows, str(d / "stock.outputs.jsonl"))
            else:
                self.notify("approve", f"collecting {role}'s outputs ({text})")
                refs[role], _ = generate_outputs(self.pool.get(text), run_prompts, shape.max_new_tokens, role,
                                                 save_to=str(f), progress=self.progress)
        scorer = self._scorer(stock)
        current = self.state["current"]
        for cand in todo:
            dec = self._judge(cand, current, run_prompts, shape, meas, refs, scorer, len(todo) - todo.index(cand))
            decisions.append(dec)
            if dec.verdict == "approved":
                current = cand.system
                self.state["current"] = current
            write_json_atomic(dpath, {"schema": ap.SCHEMA, "decisions": [x.to_json() for x in decisions]})
            self._save()
            self.pool.keep_only([current, stock, ar_text])
        if not dpath.is_file():   # nothing to judge: the stage's file says so (as an SGLang round's does)
            write_json_atomic(dpath, {"schema": ap.SCHEMA, "decisions": []})
        self.state["final"] = current
        self._finish("approve", t0)
        return decisions

    def _scorer(self, stock: str):
        if self.cfg.scorer:
            from specpilot.auditors.scorer import Scorer

            return Scorer.load(self.cfg.scorer)
        return EngineScorer(self.pool.get(stock), "stock engine's target, FP32 LM head")

    def _judge(self, cand, current: str, prompts, shape, meas, refs, scorer, remaining: int) -> ap.Decision:
        d = self.dir / "approve"
        t0 = time.perf_counter()
        base = current
        load_s = 0.0 if self.pool.loaded(cand.system, "control" if cand.control else "") else \
            self.pool.typical_load_s(DEFAULT_LOAD_S.get(self.facts.device, 12.0))
        pairs = pl.pairs_for(shape, self.clock.left() - 2.0, remaining, meas.tokens_per_s, self._rate(meas, cand),
                             meas.calibration["prefill_s"], load_s,
                             score_s(shape, meas.tokens_per_s, meas.calibration["prefill_s"]))
        dec = ap.Decision(id=cand.id, memory=cand.memory, system=cand.system, base=base, verdict="skipped",
                          reason="", control=cand.control)
        if pairs is None:
            dec.reason = (f"budget: {max(self.clock.left(), 0):.0f} s left, not enough for {pl.PAIRS_MIN} paired runs "
                          f"of {shape.prompts} prompts x {shape.max_new_tokens} tokens")
            self._note("approve", f"{cand.id}: {dec.reason}", skipped=True)
            return dec
        self.notify("approve", f"{cand.id}: {pairs} paired runs against {base}")
        try:
            base_sys = PooledSystem(base, self.pool.get(base), prompts, shape.max_new_tokens)
            cand_eng = self.pool.get(cand.system, "control" if cand.control else "")
            cand_sys = PooledSystem(cand.system + (" (control copy)" if cand.control else ""), cand_eng, prompts,
                                    shape.max_new_tokens)

            def tick(_n):
                self.clock.check(f"the paired runs of {cand.id}")

            load_before = _load()
            timing = ap.compare_engines(base_sys, cand_sys, pairs, self.cfg.seed, tick=tick).to_json()
            timing["load_average"] = [load_before, _load()]
        except pl.OutOfBudget as e:
            dec.reason = f"budget: {e}; the comparison was stopped and is not judged"
            self._note("approve", f"{cand.id}: {dec.reason}", skipped=True)
            dec.seconds = time.perf_counter() - t0
            return dec
        except InputError as e:
            dec.verdict, dec.reason = "refused", f"could not run: {e}"
            dec.seconds = time.perf_counter() - t0
            return dec
        write_json_atomic(d / f"{cand.id}.timing.json", timing)
        outs = outputs_from(cand_sys, prompts, cand.id, save_to=str(d / f"{cand.id}.outputs.jsonl"))
        result = ap.run_audit(outs, refs["stock"], refs["ar"], scorer, seed=self.cfg.seed)
        audit = ap.audit_data(result, getattr(scorer, "info", None))
        write_json_atomic(d / f"{cand.id}.audit.json", audit)
        dec.timing, dec.audit, dec.pairs = timing, audit, len(timing.get("samples", []))
        dec.verdict, dec.reason = ap.decide(timing, audit)
        dec.files = {"timing": f"approve/{cand.id}.timing.json", "audit": f"approve/{cand.id}.audit.json",
                     "outputs": f"approve/{cand.id}.outputs.jsonl"}
        dec.seconds = time.perf_counter() - t0
        self.notify("approve", f"{cand.id}: {dec.verdict.upper()}: {dec.reason}")
        if dec.verdict == "approved":
            self.state["final_samples"] = {"system": cand.system, "samples": [s["candidate"] for s in timing["samples"]],
                                           "noise": timing["noise"], "outputs": f"approve/{cand.id}.outputs.jsonl"}
        elif not self.state.get("final_samples") or self.state["final_samples"].get("system") == base:
            # the base's fresh samples; its outputs stay those its own approval saved (None: stock's)
            kept = (self.state.get("final_samples") or {}).get("outputs")
            self.state["final_samples"] = {"system": base, "samples": [s["base"] for s in timing["samples"]],
                                           "noise": timing["noise"], "outputs": kept}
        return dec

    # ---------------------------------------------------------------------------- stage 5
    def remember(self, decisions) -> str | None:
        if self._done("remember"):
            return self.state.get("record")
        t0 = self._start("remember")
        d = self.dir / "remember"
        d.mkdir(exist_ok=True)
        final = self.state.get("final") or self.state["current"]
        self.state["final"] = final
        if self.dep.kind == "engine":
            self._write_baseline(final)
        if not self.cfg.remember:
            self._note("remember", "not recorded (--no-remember)", skipped=True)
            self._finish("remember", t0)
            return None
        machine = self.facts.gpu or self.facts.cpu or self.facts.device
        extra = {}
        entries = None
        for x in decisions:
            if x.verdict != "approved":
                continue
            if self.dep.kind == "sglang":
                from specpilot.bundles.memory import load_memory

                entries = entries or load_memory(self.cfg.memory_dir)
                extra[x.id] = [f"{x.memory}: {u}" for u in entries[x.memory].unverified] if x.memory in entries else []
                continue
            la = (x.timing or {}).get("load_average")
            extra[x.id] = ["measured in the embedded engine; an SGLang server running the memory entry's bundle "
                           "has not been measured by this round" if x.memory else
                           "measured in the embedded engine",
                           f"timed on {machine}" + (f" (load average {la[0]} -> {la[1]})" if la and la[0] is not None
                                                     else "")]
        entry = rm.build_entry(self.dir, self.facts, self.state["stock"], self.state["start"], final, decisions, extra,
                               f"{self.clock.budget_s / 60:.1f} min budget, {self.clock.spent() / 60:.1f} min used",
                               round_id=self.state.get("round_id"))
        entry["tokens_per_s"] = (self.state.get("final_samples") or {}).get("samples")
        if self.dep.kind == "sglang":
            entry["bundles"], entry["settings"] = self.state.get("bundles") or [], self.state.get("settings") or {}
        path = rm.record_path(self.cfg.records_dir, self.facts.identity())
        doc, before = rm.remember(path, self.facts, self.state["stock"], entry, legacy_key=str(self.dir))
        shutil.copyfile(path, d / "record.yaml")
        changes = {"schema": "specpilot.round-memory/1", "record": str(path),
                   "before": {"current": (before or {}).get("current"), "rounds": len((before or {}).get("rounds") or [])},
                   "after": {"current": doc["current"], "rounds": len(doc["rounds"])},
                   "approved": [{"id": a["id"], "memory": a["memory"], "system": a["system"], "gain": a["gain"]}
                                for a in entry["approved"]],
                   "refused": [{"id": r["id"], "reason": r["reason"]} for r in entry["refused"]]}
        write_json_atomic(d / "changes.json", changes)
        self.state["record"] = str(path)
        self.notify("remember", f"recorded in {path}: the next round starts from {final}")
        self._finish("remember", t0)
        return str(path)

    def _write_baseline(self, final: str) -> None:
        from specpilot.auditors.outputs import read_outputs
        from specpilot.engine.spec import EngineSpec

        a = self.dir / "approve"
        fs = self.state.get("final_samples") or {}
        outs = {}
        stock = self.state["stock"]
        # a stock that decodes AR writes no AR file: its outputs are AR's (the round's own audits used them)
        ar_role = "stock" if str(EngineSpec.parse(stock).with_(mode="ar")) == stock else "ar"
        for role, f in (("stock", a / "stock.outputs.jsonl"), ("ar", a / f"{ar_role}.outputs.jsonl"),
                        ("system", self.dir / fs["outputs"] if fs.get("outputs") else (
                            a / "stock.outputs.jsonl" if final == stock else None))):
            if f is not None and Path(f).is_file():
                outs[role] = [r.to_json() for r in read_outputs(f).rows]
        shape = self.state.get("shape") or {}
        doc = {"schema": BASELINE_SCHEMA, "kind": "engine", "system": final, "stock": self.state["stock"],
               "facts": self.state["facts"], "max_new_tokens": shape.get("max_new_tokens"),
               "samples": fs.get("samples") if fs.get("system") == final else None,
               "noise": fs.get("noise") if fs.get("system") == final else None,
               "outputs": outs, "round": str(self.dir), "date": _now(), "versions": rm.versions()}
        write_json_atomic(self.dir / "baseline.json", doc)

    # ---------------------------------------------------------------------------- all
    def run(self) -> RoundResult:
        res = RoundResult(self.dir, self.state)
        if self.complete:
            read_stage_files(res)
            res.complete = True
            return res
        try:
            res.measurement = self.measure()
            res.model = self.model(res.measurement)
            res.proposal = self.propose(res.measurement, res.model)
            res.decisions = self.approve(res.measurement, res.model, res.proposal)
            res.record = self.remember(res.decisions)
        except pl.OutOfBudget as e:
            self._stop_running("pending")
            for s in STAGES:
                if self._stage(s)["status"] == "pending":
                    self._stage(s)["status"] = "not run"
                    self._stage(s)["skipped"].append(str(e))
            self.state["stopped"] = str(e)
            self._save()
        except KeyboardInterrupt as e:
            self._stop_running("interrupted")
            # said after "interrupted by SIGINT": where the round is and how to go on
            e.add_note(f"the round's files are in {self.dir}; continue it with {resume_command(self.state, self.dir)}")
            raise
        except BaseException:
            self._stop_running("failed")
            raise
        finally:
            self.state["load_average_end"] = _load()
            self._save()
        res.state = self.state
        return res


def run_round(cfg: RoundConfig, *, resume: bool = False, budget_min: float | None = None,
              progress: Callable | None = None, notify: Callable[[str, str], None] | None = None) -> RoundResult:
    """Run (or, with ``resume``, continue) one round in ``cfg.out_dir``; one round at a time in a
    folder (:func:`hold_folder`)."""
    lock: list = []
    try:
        return _Round(cfg, resume=resume, budget_min=budget_min, progress=progress, notify=notify,
                      lock=lock).run()
    finally:
        for fd in lock:
            os.close(fd)   # closing the descriptor releases the lock


LOCK_FILE = ".round.lock"


def hold_folder(folder: Path) -> int:
    """An exclusive lock on ``folder``'s :data:`LOCK_FILE` (the descriptor; closing it releases
    the lock, as the process's end does): a second round or resume in the same folder is refused
    (InputError) instead of rewriting the first one's files beside it."""
    import fcntl

    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InputError(f"{folder}: another specpilot round is running in this folder; let it finish (or stop "
                         f"it) before resuming it") from None
    return fd


# a stage's status in round.json; a resume redoes every one but done and stopped (which it has
# always read as done)
STATUSES = ("pending", "running", "done", "stopped", "not run", "interrupted", "failed")


def stages_left(state: dict) -> list[str]:
    """The stages a round has not finished (a resume runs them); none for a finished round."""
    return [s for s, v in (state.get("stages") or {}).items() if v.get("status") not in ("done", "stopped")]


def resume_command(state: dict, folder) -> str:
    """How to finish a round that stopped early: more minutes when its budget ran out."""
    return f"specpilot round --resume {folder}" + (" --budget MINUTES" if state.get("stopped") else "")


# the file each stage leaves (the report and the CI gate read them)
STAGE_FILES = {"measure": "measure/measure.json", "model": "model/model.json", "propose": "propose/candidates.json",
               "approve": "approve/decisions.json"}


def check_state(state, path: Path) -> None:
    """round.json's fields have the types a round writes (a damaged file is bad input, not a crash
    of the report or of a resume)."""
    def bad(field: str, want: str):
        raise InputError(f"{path}: {field} must be {want}; the round's files are damaged (run the round again)")

    if not isinstance(state, dict):
        bad("the file", "a JSON object")
    stages = state.get("stages")
    if not isinstance(stages, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("status"), str) and isinstance(v.get("notes", []), list)
            and isinstance(v.get("skipped", []), list) for v in stages.values()):
        bad("stages", "a map of stage to {status, notes, skipped}")
    for name, v in stages.items():
        if v["status"] not in STATUSES:
            bad(f"stages.{name}.status", "one of " + ", ".join(STATUSES))
        secs = v.get("seconds", 0.0)
        if not (is_num(secs) and secs >= 0):
            bad(f"stages.{name}.seconds", "a number of seconds")
        for key in ("notes", "skipped"):
            if not all(isinstance(x, str) for x in v.get(key, [])):
                bad(f"stages.{name}.{key}", "a list of text")
    for key in ("load_average_start", "load_average_end"):   # null: a platform without one
        v = state.get(key)
        if v is not None and not is_num(v):
            bad(key, "a number or null")
    for key in ("budget_s", "spent_s"):
        v = state.get(key)
        if not (is_num(v) and v >= 0):
            bad(key, "a number of seconds")
    if state["budget_s"] == 0:   # round --budget takes only minutes > 0 (and a resume reads 0 as none given)
        bad("budget_s", "a number of seconds > 0")
    if not isinstance(state.get("facts"), dict):
        bad("facts", "a map")
    for key in ("current", "start", "stock", "deployment"):
        if not isinstance(state.get(key), str):
            bad(key, "a system (text)")
    if state.get("final") is not None and not isinstance(state["final"], str):
        bad("final", "a system (text)")
    if not isinstance(state.get("config"), dict):
        bad("config", "a map")
    for key, kind in (("settings", dict), ("bundles", list), ("notes", list)):
        if state.get(key) is not None and not isinstance(state[key], kind):
            bad(key, f"a {'map' if kind is dict else 'list'}")
    if state.get("kind") not in ("engine", "sglang"):
        bad("kind", "engine or sglang")
    # what the report prints and a resume's approve and remember stages read back
    if not all(isinstance(x, str) for x in state.get("notes") or []):
        bad("notes", "a list of text")
    for key in ("record", "stopped", "round_id"):   # the record's entry for the round is found by its id
        if state.get(key) is not None and not isinstance(state[key], str):
            bad(key, "text or null")
    if state.get("versions") is not None and not isinstance(state["versions"], dict):
        bad("versions", "a map")
    resumes = state.get("resumes", [])
    if not (isinstance(resumes, list) and all(
            isinstance(r, dict) and set(r) == {"budget_min"}
            and (r["budget_min"] is None or (is_num(r["budget_min"]) and r["budget_min"] > 0)) for r in resumes)):
        bad("resumes", "a list of {budget_min: minutes > 0 or null}")
    if state.get("planned_pairs") is not None and not (is_int(state["planned_pairs"]) and state["planned_pairs"] >= 0):
        bad("planned_pairs", "a whole number >= 0 or null")
    shape = state.get("shape")
    if shape is not None and not (isinstance(shape, dict) and set(shape) == {"prompts", "max_new_tokens"}
                                  and all(is_int(v) and v >= 1 for v in shape.values())):
        bad("shape", "null or {prompts, max_new_tokens}, whole numbers >= 1")
    fs = state.get("final_samples")
    if fs is not None:
        if not isinstance(fs, dict):
            bad("final_samples", "a map {system, samples, noise, outputs} or null")
        if not isinstance(fs.get("system"), str):
            bad("final_samples.system", "a system (text)")
        if fs.get("samples") is not None and not (isinstance(fs["samples"], list)
                                                  and all(is_num(v) and v > 0 for v in fs["samples"])):
            bad("final_samples.samples", "a list of tokens/s above 0, or null")
        if fs.get("noise") is not None and not (is_num(fs["noise"]) and fs["noise"] >= 0):
            bad("final_samples.noise", "a number >= 0 or null")
        if fs.get("outputs") is not None and not isinstance(fs["outputs"], str):
            bad("final_samples.outputs", "a file in the round's folder (text) or null")
    _check_config_fields(state["config"], bad)
    if state["kind"] == "engine":   # a spec that does not parse would run, or be recorded for every later round
        from specpilot.engine.spec import EngineSpec

        for key in ("stock", "start", "current", "final"):
            if state.get(key) is None:
                continue
            try:
                EngineSpec.parse(state[key])
            except InputError as e:
                raise InputError(f"{path}: {key}: {e}; the round's files are damaged (run the round again)") from None


def _optional(check):
    return lambda v: v is None or check(v)


# RoundConfig's fields as round.json stores them: the check each value gets, and what it must be
_CONFIG_TYPES = {
    "deployment": (_optional(lambda v: isinstance(v, str)), "text"),
    "out_dir": (lambda v: isinstance(v, str), "text"),
    "budget_min": (lambda v: is_num(v) and v > 0, "a number of minutes > 0"),
    "prompts": (_optional(lambda v: isinstance(v, str)), "a file name"),
    "n_prompts": (_optional(lambda v: is_int(v) and v >= 1), "a whole number >= 1"),
    "max_new_tokens": (_optional(lambda v: is_int(v) and v >= 1), "a whole number >= 1"),
    "candidates": (_optional(lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)),
                   "a list of candidate names"),
    "control": (lambda v: isinstance(v, bool), "true or false"),
    "scorer": (_optional(lambda v: isinstance(v, str)), "text"),
    "memory_dir": (_optional(lambda v: isinstance(v, str)), "a folder"),
    "records_dir": (_optional(lambda v: isinstance(v, str)), "a folder"),
    "fresh": (lambda v: isinstance(v, bool), "true or false"),
    "remember": (lambda v: isinstance(v, bool), "true or false"),
    "seed": (is_int, "a whole number"),
}


def _check_config_fields(cfg: dict, bad) -> None:
    for key in cfg:
        if key not in _CONFIG_TYPES:
            bad(f"config.{key}", f"one of the round's settings ({', '.join(_CONFIG_TYPES)})")
    for key, (ok, want) in _CONFIG_TYPES.items():
        if key in cfg and not ok(cfg[key]):
            bad(f"config.{key}", want)


def check_stage_files(d: Path, state: dict) -> None:
    """A finished stage whose file is gone: a report would mislead, a resume would not redo it."""
    for stage, rel in STAGE_FILES.items():
        st = state["stages"].get(stage)
        if isinstance(st, dict) and st.get("status") == "done" and not (d / rel).is_file():
            raise InputError(f"{d / rel}: missing, though round.json says the {stage} stage is done; copy the "
                             "whole round folder (or run the round again)")


def read_round_prompts(path: Path, state: dict) -> list:
    """The round's ``prompts.jsonl``: token ids, in an engine round's vocabulary."""
    from specpilot.auditors.outputs import Prompt, read_prompt_rows
    from specpilot.fileio import iter_jsonl

    list(iter_jsonl(path, kind="prompts"))   # JSON Lines of prompts (a plain line is not a prompt here)
    rows = read_prompt_rows(path)
    bad = next((r for r in rows if r.prompt_ids is None), None)
    if bad:
        raise InputError(f"{path}: prompt {bad.id!r} has no prompt_ids; the round's files are damaged")
    if state.get("kind") == "engine":
        from specpilot.engine.api import check_prompts
        from specpilot.engine.spec import EngineSpec

        try:
            check_prompts(EngineSpec.parse(state["stock"]), [(r.id, r.prompt_ids) for r in rows], 1, fit=False)
        except InputError as e:
            raise InputError(f"{path}: {e}; the round's files are damaged") from None
    return [Prompt(r.id, r.prompt_ids) for r in rows]


def check_record_file(path: Path) -> None:
    """A deployment record as the report and the remember stage read it (a missing one is none)."""
    doc = rm.read_record(path)
    try:
        if doc is not None:
            rm.check_record(doc)
    except ValueError as e:
        raise InputError(f"{path}: malformed deployment-record ({e})") from None


def check_round_inputs(d: Path, state: dict) -> None:
    """The files a resumed round's stages read as they were written: its prompts and the outputs
    its approve and remember stages reuse (read_outputs names the file and line)."""
    from specpilot.auditors.outputs import key, read_outputs

    prompts = read_round_prompts(d / "prompts.jsonl", state) if (d / "prompts.jsonl").is_file() else None
    refs = [d / "approve" / "stock.outputs.jsonl", d / "approve" / "ar.outputs.jsonl"]
    outs = refs + ([d / state["final_samples"]["outputs"]] if (state.get("final_samples") or {}).get("outputs") else [])
    n = (state.get("shape") or {}).get("prompts")
    for f in outs:
        if f.is_file():
            got = read_outputs(f)
            if f in refs and prompts is not None and n:   # the approve stage pairs every run prompt against them
                missing = [p.id for p in prompts[:n] if key(p.id) not in got.by_id]
                if missing:
                    raise InputError(f"{f}: no output for prompt {missing[0]!r} ({len(missing)} of the round's {n} "
                                     "run prompts); the round's files are damaged")


def load_round(path: str | Path) -> RoundResult:
    """A round's files, for the report and the CI gate."""
    d = Path(path)
    state = read_json(d / "round.json", kind="round")
    check_state(state, d / "round.json")
    res = RoundResult(d, state)
    check_stage_files(d, state)
    return read_stage_files(res)


def read_stage_files(res: RoundResult) -> RoundResult:
    """The stage files a round has written, read into ``res`` (a damaged one is bad input)."""
    d, state = res.dir, res.state
    f = d / "measure" / "measure.json"
    if f.is_file():
        res.measurement = read_json(f, kind="round-measure", build=ms.Measurement.from_json)
        if state.get("kind") == "engine" and "prefill_s" not in res.measurement.calibration:   # the approve plan's
            raise InputError(f"{f}: malformed round-measure (calibration.prefill_s must be a number >= 0, not "
                             "missing)")
    f = d / "model" / "model.json"
    if f.is_file():
        res.model = read_json(f, kind="round-model", build=ModelResult.from_json)
    f = d / "propose" / "candidates.json"
    if f.is_file():
        res.proposal = read_json(f, kind="round-candidates", build=Proposal.from_json)
        if state.get("kind") == "engine":   # the approve stage runs them
            from specpilot.engine.spec import EngineSpec

            for i, c in enumerate(res.proposal.candidates):
                try:
                    if not isinstance(c.system, str):
                        raise InputError("an engine spec is needed, not null")
                    EngineSpec.parse(c.system)
                except InputError as e:
                    raise InputError(f"{f}: malformed round-candidates (candidates[{i}] ({c.id}).system: {e})") \
                        from None
    f = d / "approve" / "decisions.json"
    if f.is_file():
        res.decisions = read_json(f, kind="round-decisions", build=ap.decisions_from_json)
    f = d / "remember" / "changes.json"   # the report reads these two as they are
    if f.is_file():
        read_json(f, kind="round-memory", build=rm.check_changes)
    f = d / "remember" / "record.yaml"
    if f.is_file():
        check_record_file(f)
    res.record = state.get("record")
    return res


def record_spec(rec: dict, path: Path) -> str:
    """The engine system a deployment record says a round starts from."""
    from specpilot.engine.spec import EngineSpec

    try:
        if not isinstance(rec["current"], str):
            raise InputError("not an engine spec (text)")
        return str(EngineSpec.parse(rec["current"]))
    except InputError as e:
        raise InputError(f"{path}: current: {e} (edit the record, or --fresh starts from DEPLOYMENT)") from None


def _weight_bytes(facts, spec) -> float:
    from specpilot.engine.api import resolve_model

    model_spec, _, _ = resolve_model(spec.model, spec.random)
    return model_spec.total_params() * {"fp32": 4, "bf16": 2, "fp16": 2}.get(facts.dtype, 2)


def estimate_load_s(facts, spec) -> float:
    """A rough engine load time for the dry run (a tiny model loads in a fraction of a second, an
    8B one in tens): half a second, then its weight bytes at 100 MB/s on the CPU (read and
    converted), 0.5 GB/s onto a GPU; capped at the defaults a round assumes before it has loaded
    anything."""
    per_s = 0.5e9 if facts.device == "cuda" else 1e8
    return min(0.5 + _weight_bytes(facts, spec) / per_s, DEFAULT_LOAD_S.get(facts.device, 12.0))


def estimate_tokens_per_s(facts, spec) -> tuple[float, str]:
    """A rough decode speed for the dry run: weight bytes over an assumed bandwidth."""
    weights = _weight_bytes(facts, spec)
    if facts.device == "cuda":
        from specpilot.gpus import get_gpu

        bw = (get_gpu(facts.gpu_key).bandwidth_tbs * 1e12 * 0.6) if facts.gpu_key else 1e12
        return 1.0 / (weights / bw + 0.3e-3), ("assumed: 60% of the GPU's catalog bandwidth over the weight bytes, "
                                              "plus 0.3 ms a step")
    # a small model's step is the framework's own time, not its weight reads
    return 1.0 / (weights / 5e9 + 1.5e-3), "assumed: 5 GB/s of weight reads on the CPU, plus 1.5 ms a step"


def plan_round(cfg: RoundConfig) -> dict:
    """The dry run: what the round would do and how long, without running anything; its options are
    checked as the round checks them (:func:`check_config`)."""
    from specpilot.engine.spec import EngineSpec

    dep = check_config(cfg)
    if dep.kind != "engine":
        from .sglang import plan_sglang

        return plan_sglang(dep, cfg)
    facts = dep.facts
    rec_path = rm.record_path(cfg.records_dir, facts.identity())
    check_record_file(rec_path)   # as the round refuses it (the last round's rate is read even with --fresh)
    rec = rm.read_record(rec_path)
    start = record_spec(rec, rec_path) if (rec and rec.get("current") and not cfg.fresh) else dep.text
    spec = EngineSpec.parse(start)
    rate, how = estimate_tokens_per_s(facts, spec)
    last = ((rec or {}).get("rounds") or [{}])[-1].get("tokens_per_s") if rec else None
    if last:
        rate, how = sum(last) / len(last), "measured by the previous round of this deployment"
    from specpilot.bundles.memory import load_memory

    from .propose import cannot_run_here, engine_catalog, memory_gap

    fits, not_fit, same_family = [], [], []
    memory_ids = set(load_memory(cfg.memory_dir))
    for c in engine_catalog():
        if cfg.candidates is not None and c["id"] not in cfg.candidates:
            continue
        mode = (c.get("change") or {}).get("mode")
        if mode and mode == spec.mode and not memory_gap(c, memory_ids):
            # the propose stage retunes it from the current system: the same spec again is not proposed
            same_family.append(c["id"])
            continue
        why = cannot_run_here(c, memory_ids, facts.device)   # as the round's propose stage skips it
        if why:
            not_fit.append({"id": c["id"], "reason": why})
        else:
            fits.append(c["id"])
    if cfg.control:
        fits.append("no-op")
    budget = cfg.budget_min * 60.0
    device = facts.device
    load_s = estimate_load_s(facts, spec)
    # the prompts and the run shape as the round fixes them (Round.prompts, Round.approve)
    shape0 = pl.SHAPES["cuda" if device == "cuda" else "cpu"][0]
    if cfg.prompts:
        from specpilot.auditors.outputs import read_prompt_rows

        n_avail = len(read_prompt_rows(cfg.prompts))
    else:
        n_avail = cfg.n_prompts or max(s.prompts for s in pl.SHAPES["cuda" if device == "cuda" else "cpu"])
    fixed = pl.Shape(min(cfg.n_prompts or shape0.prompts, n_avail), cfg.max_new_tokens or shape0.max_new_tokens) \
        if (cfg.n_prompts or cfg.max_new_tokens) else None
    rec_shape = fixed or shape0
    measure_s = min(pl.MEASURE_SHARE * budget, 3 * load_s + rec_shape.prompts * rec_shape.max_new_tokens
                    / max(rate * 0.7, 1e-3) + 20)
    sc = score_s(shape0, rate, 0.2)
    shape, pairs = pl.choose_shape(device, budget - measure_s - 10, [rate] * len(fits), rate, 0.2, load_s, sc,
                                   max_prompts=n_avail, fixed=fixed)
    per = pl.candidate_cost(shape, pairs, rate, rate, 0.2, load_s, sc)
    return {"schema": "specpilot.round-plan/1", "deployment": dep.text, "facts": facts.to_json(),
            "start": start, "stock": dep.text, "record": str(rec_path) if rec else None,
            "budget_s": budget, "tokens_per_s": rate, "tokens_per_s_source": how,
            "stages": [
                {"stage": "measure", "seconds": measure_s,
                 "work": "calibration run, T_step at " + ",".join(str(n) for n in ms.probe_rows_set(1))
                         + " rows (1-9 and N+1 for N = " + ",".join(str(n) for n in ms.NODES)
                         + "), lattice recording and replay" + (", a profile of the decode steps" if device == "cuda"
                                                                    else " (no profile on the CPU)")},
                {"stage": "model", "seconds": 1.0, "work": "cost model, three factors, tau(N)/c(N) per node budget"},
                {"stage": "propose", "seconds": 1.0, "work": f"candidates that fit: {', '.join(fits) or 'none'}"},
                {"stage": "approve", "seconds": shape.run_s(rate, 0.2) * 2 + per * len(fits),
                 "work": f"{len(fits)} candidate(s) x {pairs} paired runs of {shape.prompts} prompts x "
                         f"{shape.max_new_tokens} tokens, each audited against stock"},
                {"stage": "remember", "seconds": 1.0,
                 "work": f"deployment record {rec_path}" if cfg.remember
                 else "baseline.json only; the deployment record is not written (--no-remember)"}],
            "not_runnable": not_fit, "current_family": same_family, "shape": asdict(shape), "pairs": pairs}


def read_baseline(path: str | Path) -> dict:
    """A baseline for ``check``: ``baseline.json`` of a round folder, or that file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / "baseline.json"
    if not p.exists() and (p.parent / "round.json").is_file():   # the round writes its baseline last
        _refuse_unfinished(p.parent)
    doc = read_json(p, kind="baseline")
    if not isinstance(doc, dict):
        raise InputError(f"{p}: a baseline is a JSON object")
    for k in ("system", "outputs"):
        if k not in doc:
            raise InputError(f"{p}: baseline lacks {k!r}")
    _check_baseline(doc, p)
    doc["_path"] = str(p)
    return doc


def _refuse_unfinished(d: Path) -> None:
    state = read_json(d / "round.json", kind="round")
    check_state(state, d / "round.json")
    left = stages_left(state)
    if left:
        raise InputError(f"{d}: the round is unfinished (stages left: {', '.join(left)}), so it has no baseline.json "
                         f"yet; finish it with {resume_command(state, d)}")


def _check_baseline(doc: dict, p: Path) -> None:
    """Every field ``check`` reads has the type a round writes: a damaged baseline is bad input,
    not a crash after the timed runs, nor a gate that passes having checked nothing."""
    def bad(field: str, want: str):
        raise InputError(f"{p}: baseline field {field!r} must be {want}")

    for k in ("system", "stock", "kind"):
        if k in doc and doc[k] is not None and not (isinstance(doc[k], str) and doc[k].strip()):
            bad(k, "a non-empty string")
    if doc.get("samples") is not None and not (isinstance(doc["samples"], list)
                                               and all(is_num(x) and x > 0 for x in doc["samples"])):
        bad("samples", "a list of positive throughputs")
    if doc.get("noise") is not None and not (is_num(doc["noise"]) and 0 <= doc["noise"] < 1):
        bad("noise", "a fraction in [0, 1)")
    if doc.get("max_new_tokens") is not None and not (is_int(doc["max_new_tokens"]) and doc["max_new_tokens"] >= 1):
        bad("max_new_tokens", "a whole number >= 1")
    if doc.get("facts") is not None and not isinstance(doc["facts"], dict):
        bad("facts", "an object")
    outs = doc["outputs"]
    if not isinstance(outs, dict):
        bad("outputs", "an object of output rows per role (system, stock, ar)")

    def ids(x, empty_ok: bool) -> bool:
        return (isinstance(x, list) and (empty_ok or bool(x))
                and all(is_int(t) and t >= 0 for t in x))

    for role, rows in outs.items():
        if rows is None:
            continue
        if not isinstance(rows, list):
            bad(f"outputs.{role}", "a list of output rows")
        if not rows and any(outs.values()):   # a round leaves a role out, never empty: its prompts are the others'
            raise InputError(f"{p}: baseline field 'outputs.{role}' is empty, though every role holds the same "
                             "prompts (a round leaves out a role it has no outputs for)")
        for i, r in enumerate(rows):
            if not (isinstance(r, dict) and isinstance(r.get("id"), (str, int)) and ids(r.get("prompt_ids"), False)
                    and ids(r.get("output_ids"), True)):
                bad(f"outputs.{role}[{i}]", "a row with an id, non-empty prompt_ids and output_ids (token ids)")
    # the audit pairs the roles' rows by prompt id: a duplicate or a prompt one role lacks would fail
    # only after the timed runs
    prompts: dict = {}
    for role, rows in outs.items():
        seen = set()
        for r in rows or []:
            if r["id"] in seen:
                raise InputError(f"{p}: baseline field 'outputs.{role}' holds prompt id {r['id']!r} twice")
            seen.add(r["id"])
            first = prompts.setdefault(r["id"], (role, r["prompt_ids"]))
            if first[1] != r["prompt_ids"]:
                raise InputError(f"{p}: baseline field 'outputs.{role}': prompt {r['id']!r} has other prompt_ids "
                                 f"than in 'outputs.{first[0]}' (every role ran the same token ids)")
    for role, rows in outs.items():
        missing = [i for i in prompts if rows and i not in {r["id"] for r in rows}]
        if missing:
            raise InputError(f"{p}: baseline field 'outputs.{role}' lacks prompt id {missing[0]!r}, which another "
                             f"role's rows have (every role holds the same prompts)")
    if doc.get("kind", "engine") == "engine":   # a spec that does not parse would fail only as the gate ran
        from specpilot.engine.spec import EngineSpec

        for k in ("system", "stock"):
            if doc.get(k) is not None:
                try:
                    EngineSpec.parse(doc[k])
                except InputError as e:
                    raise InputError(f"{p}: baseline field {k!r}: {e}") from None


def dumps(obj) -> str:
    return json.dumps(obj, indent=2)
