"""The round's last stage: the deployment record gets the round's entry (approved and refused
candidates, the final system and its samples), and an engine round writes ``baseline.json`` for
``specpilot check``. A mixin of the round (:mod:`.run`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specpilot.fileio import write_json_atomic

from . import remember as rm
from .baseline import BASELINE_SCHEMA
from .state import now_iso


class RememberStage:
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
               "outputs": outs, "round": str(self.dir), "date": now_iso(), "versions": rm.versions()}
        write_json_atomic(self.dir / "baseline.json", doc)
