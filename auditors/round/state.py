"""A round folder's saved state, read back and checked: ``round.json`` (each stage's status, the
round's configuration as it stores it), the file each finished stage leaves (read into a
:class:`RoundResult` for the report, the CI gate and a resume), the prompts and outputs a resumed
round reuses, the deployment record a round starts from, and the lock that keeps one round at a
time in a folder. A damaged file is bad input (InputError), never a crash of what reads it.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.errors import InputError
from specpilot.fileio import is_int, is_num, read_json

from . import approve as ap
from . import measure as ms
from . import remember as rm
from .modeling import ModelResult
from .propose import Proposal


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


LOCK_FILE = ".round.lock"


def now_iso() -> str:
    """The time now, UTC, to the second (round.json's stamps)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def load_average() -> float | None:
    """The machine's one-minute load average (recorded beside timings), None where there is none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without it
        return None


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


# a stage's status in round.json; a resume redoes every one but done
STATUSES = ("pending", "running", "done", "not run", "interrupted", "failed")


def stages_left(state: dict) -> list[str]:
    """The stages a round has not finished (a resume runs them); none for a finished round."""
    return [s for s, v in (state.get("stages") or {}).items() if v.get("status") != "done"]


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
    wanted = list(STAGE_FILES.items())
    if state.get("record"):   # a stage 5 that recorded the round kept the record's copy and what changed
        wanted += [("remember", "remember/record.yaml"), ("remember", "remember/changes.json")]
    for stage, rel in wanted:
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


def check_record_file(path: Path) -> dict | None:
    """A deployment record as the report and the remember stage read it, checked (None: there is
    none)."""
    doc = rm.read_record(path)
    try:
        if doc is not None:
            rm.check_record(doc)
    except ValueError as e:
        raise InputError(f"{path}: malformed deployment-record ({e})") from None
    return doc


def check_round_inputs(d: Path, state: dict) -> None:
    """The files a resumed round's stages read as they were written: its prompts and the outputs
    its approve and remember stages reuse (read_outputs names the file and line), each row of the
    round's prompts, with its prompt_ids and with token ids in an engine round's vocabulary."""
    from specpilot.auditors.outputs import key, read_outputs

    prompts = read_round_prompts(d / "prompts.jsonl", state) if (d / "prompts.jsonl").is_file() else None
    refs = [d / "approve" / "stock.outputs.jsonl", d / "approve" / "ar.outputs.jsonl"]
    outs = refs + ([d / state["final_samples"]["outputs"]] if (state.get("final_samples") or {}).get("outputs") else [])
    n = (state.get("shape") or {}).get("prompts")
    vocab = None
    if state.get("kind") == "engine":   # the scorer indexes its logits with them: one outside crashed the audit
        from specpilot.engine.api import model_vocab

        vocab = model_vocab(state["stock"])
    for f in outs:
        if f.is_file():
            got = read_outputs(f)
            _check_output_rows(f, got, prompts, vocab)
            if f in refs and prompts is not None and n:   # the approve stage pairs every run prompt against them
                missing = [p.id for p in prompts[:n] if key(p.id) not in got.by_id]
                if missing:
                    raise InputError(f"{f}: no output for prompt {missing[0]!r} ({len(missing)} of the round's {n} "
                                     "run prompts); the round's files are damaged")


def _check_output_rows(f: Path, got, prompts, vocab: int | None) -> None:
    """Each row of a reused outputs file is of one of the round's prompts, with that prompt's
    token ids, and (``vocab``) holds token ids the model has: named by the file's line."""
    from specpilot.auditors.outputs import key

    asked = {key(p.id): list(p.prompt_ids) for p in prompts} if prompts is not None else None
    for row in got.rows:
        where = f"{f}:{row.line}: prompt {row.id!r}"
        if asked is not None and key(row.id) not in asked:
            raise InputError(f"{where} is not one of the round's prompts (prompts.jsonl); the round's files are "
                             "damaged")
        if asked is not None and row.prompt_ids != asked[key(row.id)]:
            raise InputError(f"{where}: prompt_ids differ from those of the prompt in prompts.jsonl; the round's "
                             "files are damaged")
        bad = next((t for t in row.prompt_ids + row.output_ids if t >= vocab), None) if vocab else None
        if bad is not None:
            raise InputError(f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1}); the round's "
                             "files are damaged")


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


def record_spec(rec: dict, path: Path, deployment=None) -> str:
    """The engine system a deployment record says a round starts from; with ``deployment`` (the
    round's EngineSpec) one of its model, weights and device: a round changes none of them, so a
    record naming others is not this deployment's."""
    from specpilot.engine.spec import EngineSpec

    try:
        if not isinstance(rec["current"], str):
            raise InputError("not an engine spec (text)")
        spec = EngineSpec.parse(rec["current"])
        if deployment is not None:
            other = next(((k, getattr(spec, k), getattr(deployment, k)) for k in ("model", "random", "device")
                          if getattr(spec, k) != getattr(deployment, k)), None)
            if other is not None:
                raise InputError(f"{spec} is not a system of this deployment ({other[0]} {other[1]} against "
                                 f"{other[2]})")
        return str(spec)
    except InputError as e:
        raise InputError(f"{path}: current: {e} (edit the record, or --fresh starts from DEPLOYMENT)") from None
