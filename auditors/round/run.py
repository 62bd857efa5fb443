"""One round of the paper's procedure (section 3): re-measure, model, propose, approve, remember.

:func:`run_round` runs the stages in order, each writing its files into the round's folder and
``round.json`` (``specpilot.round/1``: configuration, deployment facts, each stage's status, time
and what it skipped) after every step, so ``resume=True`` continues a stopped round where it
stopped. The budget is planned (:mod:`.plan`) from what the round measures; a stage that runs out
of time stops cleanly and records what it did not do. A new round's options are checked first
(:mod:`.inputs`); a resume reads the folder back through :mod:`.state`.

Nothing here prints: ``notify(stage, message)`` receives progress lines, ``progress`` is a
tqdm-like factory for bars.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from specpilot.errors import InputError
from specpilot.fileio import read_json, write_json_atomic

from . import approve as ap
from . import measure as ms
from . import plan as pl
from . import remember as rm
from .baseline import BASELINE_SCHEMA
from .deployment import parse_deployment
from .engines import EnginePool, EngineScorer, PooledSystem, generate_outputs, outputs_from
from .inputs import check_config, round_prompts, short_prompts_note
from .modeling import ModelResult, build_model
from .plan import DEFAULT_LOAD_S, score_s
from .propose import Proposal, propose_engine
from .state import (LOCK_FILE, RoundResult, check_record_file, check_round_inputs, check_stage_files, check_state,
                    hold_folder, read_round_prompts, read_stage_files, record_spec, resume_command, stages_left)

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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without it
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
        again = {r.get("id") for r in rows if isinstance(r, dict) and r.get("verdict") == "skipped"
                 and str(r.get("reason", "")).startswith("budget:")}
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
