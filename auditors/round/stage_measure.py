"""The round's first stage: re-measure the current system (calibration, T_step(N) by the rows probe,
a profile of its steps on a GPU, a lattice recorded and replayed for tau(N), TLV's cycles), within
the stage's share of the budget. A mixin of the round (:mod:`.run`): it uses the round's state,
clock, engine pool and progress notes.
"""

from __future__ import annotations

import time
from pathlib import Path

from specpilot.errors import InputError
from specpilot.fileio import read_json, write_json_atomic

from . import measure as ms
from . import plan as pl


class MeasureStage:
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

            def probe():
                return ms.rows_probe(eng, probe_rows, context, reps=30 if cuda else 5, progress=self.progress)

            doc, step_ms, ar_ms = probe()
            took = time.perf_counter() - t1
            if ms.noisy_probe(doc) and time.monotonic() + took < deadline:   # a busy machine: once more
                self._step("measure", "rows probe: a step of more rows timed faster than one row (noise); "
                                      "probing again")
                doc, step_ms, ar_ms = probe()
            for w in doc.get("warnings") or []:   # what the cost model stands on, in the report's notes
                self._note("measure", f"rows probe: {w}")
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
            self._note("measure", f"{pl.BUDGET_SKIP}profile: the stage's time is spent", skipped=True)
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
        load_s = self._load_s(str(rec_spec))   # the recording engine's load is the stage's time too
        left = deadline - time.monotonic() - load_s
        n_rec, tok_rec = len(prompts), max_new
        while n_rec > 1 and n_rec * (cal["prefill_s"] + tok_rec / rate) > 0.6 * left:
            if tok_rec > 24:
                tok_rec = max(24, tok_rec * 2 // 3)
            else:
                n_rec -= 1
        need = n_rec * (cal["prefill_s"] + tok_rec / rate) + load_s
        left += load_s
        if need > left:
            self._note("measure", f"{pl.BUDGET_SKIP}lattice recording: needs ~{need:.3g} s, {max(left, 0):.3g} s left "
                                  "in the stage: tau(N) unknown", skipped=True)
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

    def _load_s(self, system: str) -> float:
        """What loading ``system`` for a recording costs: nothing where it is loaded, else the
        slowest load the round has seen (the current system's at least)."""
        if self.pool.loaded(system):
            return 0.0
        return self.pool.typical_load_s(pl.DEFAULT_LOAD_S.get(self.facts.device, 12.0))

    def _measure_tlv(self, meas, spec, prompts, max_new: int, deadline: float, d: Path) -> None:
        """TLV cycles recorded on the prompts (tau per exact pass, the passes' ms), when the round
        may propose TLV or the current system is TLV, the engine can run it and the stage has time."""
        wanted = spec.mode == "tlv" or (self.cfg.candidates is None or "tlv" in self.cfg.candidates)
        why = ms.tlv_unavailable(spec)
        if not wanted or (why and spec.mode != "tlv"):
            if wanted:
                self._note("measure", f"TLV recording: {why}", skipped=True)
            return
        if spec.mode != "tlv":   # a candidate: recorded if its cycles (about 1.5x the tree recording's) fit
            if meas.lattice is None:
                self._note("measure", f"{pl.BUDGET_SKIP}TLV recording: the tree recording it is sized by did not "
                                      "fit in the stage's time", skipped=True)
                return
            need = 1.5 * meas.lattice.get("seconds", 0.0) + self._load_s(str(ms.tlv_spec(spec)))
            if time.monotonic() + need > deadline:
                self._note("measure", f"{pl.BUDGET_SKIP}TLV recording: needs ~{need:.3g} s (1.5x the tree "
                                      f"recording, and its engine's load), {max(deadline - time.monotonic(), 0):.3g} s "
                                      "left in the stage",
                           skipped=True)
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
