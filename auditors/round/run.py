"""One round of the paper's procedure (section 3): re-measure, model, propose, approve, remember.

:func:`run_round` runs the stages in order, each writing its files into the round's folder and
``round.json`` (``specpilot.round/1``: configuration, deployment facts, each stage's status, time
and what it skipped) after every step, so ``resume=True`` continues a stopped round where it
stopped. The budget is planned (:mod:`.plan`) from what the round measures; a stage that runs out
of time stops cleanly and records what it did not do. A new round's options are checked first
(:mod:`.inputs`); a resume reads the folder back through :mod:`.state`. The longer stages are
mixins of the round in their own modules (:mod:`.stage_measure`, :mod:`.stage_approve`,
:mod:`.stage_remember`).

Nothing here prints: ``notify(stage, message)`` receives progress lines, ``progress`` is a
tqdm-like factory for bars.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from specpilot.errors import InputError
from specpilot.fileio import read_json, write_json_atomic

from . import plan as pl
from . import remember as rm
from .deployment import parse_deployment
from .engines import EnginePool
from .inputs import check_config, round_prompts, short_prompts_note
from .modeling import ModelResult, build_model
from .propose import Proposal, propose_engine
from .stage_approve import ApproveStage
from .stage_measure import MeasureStage
from .stage_remember import RememberStage
from .state import (LOCK_FILE, RoundResult, check_record_file, check_round_inputs, check_stage_files, check_state,
                    hold_folder, load_average, now_iso, read_round_prompts, read_stage_files, record_spec,
                    resume_command, stages_left)

SCHEMA = "specpilot.round/1"
STAGES = ("measure", "model", "propose", "approve", "remember")


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


class _Round(MeasureStage, ApproveStage, RememberStage):
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
                cut = pl.cut_for_time(self.state)
                if cut and all(v["status"] == "done" for v in self.state["stages"].values()):
                    raise InputError(f"{self.dir}: the round is complete, but its measure stage skipped "
                                     f"{'; '.join(c.split(':')[0] for c in cut)} for want of time, which a resume "
                                     "does not measure again (its candidates were judged without them); start a "
                                     "new round with a larger --budget")
            self.cfg.budget_min = budget_s / 60.0
            self.state["budget_s"] = budget_s
            self.state.pop("stopped", None)
            self.clock = pl.Clock(budget_s, spent_before=spent)
            # nothing left to do (with --budget, no candidate skipped for time reopened): nothing is rewritten
            self.complete = all(v["status"] == "done" for v in self.state["stages"].values())
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
        again = set(pl.unjudged_for_time([r for r in rows if isinstance(r, dict)]))
        if not again:
            return
        write_json_atomic(dpath, dict(doc, decisions=[r for r in rows if r.get("id") not in again]))
        st = self.state["stages"]["approve"]
        st["skipped"] = [n for n in st.get("skipped", []) if not any(n.startswith(f"{i}: budget:") for i in again)]
        for stage in ("approve", "remember"):
            if self.state["stages"][stage]["status"] == "done":
                self.state["stages"][stage]["status"] = "pending"
        self.state["notes"].append(f"resumed with more time: {', '.join(sorted(again))} judged again (skipped for "
                                   "budget before)")

    def _new_state(self) -> dict:
        sglang = self.dep.kind == "sglang"
        stock = "stock" if sglang else self.dep.text
        start, notes, bundles = stock, [], []
        rec_path = rm.record_path(self.cfg.records_dir, self.dep.facts.identity())
        # read for the start and the plan, added to at the end: a damaged record is refused before
        # the round's folder is made
        rec = check_record_file(rec_path)
        if rec and rec.get("current") and not self.cfg.fresh:
            if sglang:
                bundles = list((rec.get("bundles") or []))
                start = rec["current"]
            else:
                start = record_spec(rec, rec_path, self.dep.engine_spec)
            notes.append(f"starts from the previous round's final system {start} (deployment record; --fresh "
                         "starts from DEPLOYMENT)")
        return {"bundles": bundles, "settings": {}, "schema": SCHEMA, "round_id": uuid.uuid4().hex,
                "deployment": self.dep.text, "kind": self.dep.kind, "facts": self.dep.facts.to_json(),
                "stock": stock, "start": start, "current": start, "final": None, "config": asdict(self.cfg),
                "budget_s": self.cfg.budget_min * 60.0, "spent_s": 0.0, "started_at": now_iso(), "updated_at": now_iso(),
                "load_average_start": load_average(), "notes": notes, "shape": None,
                "stages": {s: {"status": "pending", "seconds": 0.0, "notes": [], "skipped": []} for s in STAGES},
                "versions": rm.versions()}

    def _save(self) -> None:
        self.state["updated_at"] = now_iso()
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
        return self._stage(name)["status"] == "done"

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

    # ---------------------------------------------------------------------------- stages 2, 3 (1: .stage_measure)
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

    # ---------------------------------------------------------------------------- all (4, 5: .stage_*)
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
            self.state["load_average_end"] = load_average()
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
