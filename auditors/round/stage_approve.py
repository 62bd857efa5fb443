"""The round's fourth stage: judge each proposed candidate against the current system by paired
timing runs (:func:`.approve.compare_engines`) and a loss audit of its outputs against the stock
and AR references, in the shape the budget allows; an approved candidate becomes the base of the
next. A mixin of the round (:mod:`.run`).
"""

from __future__ import annotations

import time
from dataclasses import asdict

from specpilot.errors import InputError
from specpilot.fileio import read_json, write_json_atomic

from . import approve as ap
from . import plan as pl
from .engines import EngineScorer, PooledSystem, generate_outputs, outputs_from
from .plan import DEFAULT_LOAD_S, score_s
from .state import load_average


class ApproveStage:
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

            load_before = load_average()
            timing = ap.compare_engines(base_sys, cand_sys, pairs, self.cfg.seed, tick=tick).to_json()
            timing["load_average"] = [load_before, load_average()]
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
