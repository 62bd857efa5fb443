"""A round's baseline (``baseline.json``: the final system, its timed samples and noise, the
outputs of it, stock and AR), as the CI gate (``specpilot check``) reads it: every field it reads
checked for the type a round writes, and an unfinished round's folder refused with how to finish
it.
"""

from __future__ import annotations

from pathlib import Path

from specpilot.errors import InputError
from specpilot.fileio import is_int, is_num, read_json
from specpilot.limits import MAX_RUNS, MAX_TPS, MIN_TPS

from .state import check_state, resume_command, stages_left

BASELINE_SCHEMA = "specpilot.baseline/1"


def read_baseline(path: str | Path) -> dict:
    """A baseline for ``check``: ``baseline.json`` of a round folder, or that file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / "baseline.json"
    if (p.parent / "round.json").is_file():   # a round's own: finished (a resume may have reopened it)
        _refuse_unfinished(p.parent, stale=p.exists())
    doc = read_json(p, kind="baseline")
    if not isinstance(doc, dict):
        raise InputError(f"{p}: a baseline is a JSON object")
    for k in ("system", "outputs"):
        if k not in doc:
            raise InputError(f"{p}: baseline lacks {k!r}")
    _check_baseline(doc, p)
    doc["_path"] = str(p)
    return doc


def _refuse_unfinished(d: Path, stale: bool = False) -> None:
    """Refuse the baseline of a round with stages left; ``stale``: its baseline.json is there, written
    before the round stopped in its last stage or before a resume reopened it."""
    state = read_json(d / "round.json", kind="round")
    check_state(state, d / "round.json")
    left = stages_left(state)
    if not left and not stale and state.get("kind") == "sglang":
        raise InputError(f"{d}: a round of an SGLang deployment writes no baseline.json (its systems are servers "
                         "started by the deployment's commands, which check does not start); check gates an engine "
                         "round's baseline")
    if left:
        what = ("its baseline.json was written before the round stopped (or before a resume reopened it)" if stale
                else "so it has no baseline.json yet")
        raise InputError(f"{d}: the round is unfinished (stages left: {', '.join(left)}), {what}; finish it with "
                         f"{resume_command(state, d)}")


def _check_baseline(doc: dict, p: Path) -> None:
    """Every field ``check`` reads has the type a round writes: a damaged baseline is bad input,
    not a crash after the timed runs, nor a gate that passes having checked nothing."""
    def bad(field: str, want: str):
        raise InputError(f"{p}: baseline field {field!r} must be {want}")

    for k in ("system", "stock", "kind"):
        if k in doc and doc[k] is not None and not (isinstance(doc[k], str) and doc[k].strip()):
            bad(k, "a non-empty string")
    if doc.get("samples") is not None and not (isinstance(doc["samples"], list) and len(doc["samples"]) <= MAX_RUNS
                                               and all(is_num(x) and MIN_TPS <= x <= MAX_TPS
                                                       for x in doc["samples"])):
        bad("samples", f"a list of at most {MAX_RUNS} throughputs in [{MIN_TPS:g}, {MAX_TPS:g}] tokens/s (check runs "
                       "as many by default)")
    if doc.get("noise") is not None and not (is_num(doc["noise"]) and 0 <= doc["noise"] < 1):
        bad("noise", "a fraction in [0, 1)")
    if doc.get("samples") and doc.get("noise") is None:   # a round writes both: without it the rule loosens
        bad("noise", "the samples' A/A noise, a fraction in [0, 1), beside the samples")
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
            limit = doc.get("max_new_tokens")
            if limit and len(r["output_ids"]) > limit:   # the check would generate fewer and audit a prefix
                raise InputError(f"{p}: baseline field 'outputs.{role}': row {r['id']!r} holds "
                                 f"{len(r['output_ids'])} tokens, more than the baseline's max_new_tokens {limit}")
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
