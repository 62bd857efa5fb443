"""The dry run (``specpilot round --dry-run``): what a round would do and how long, without
loading the model or running anything; its options are checked as a round checks them. Before a
round has measured anything, the engine's load time and decode speed are rough estimates from
the model's weight bytes (or the rate the deployment's previous round measured).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from . import measure as ms
from . import plan as pl
from . import remember as rm
from .inputs import check_config
from .plan import DEFAULT_LOAD_S, score_s
from .state import check_record_file, record_spec

if TYPE_CHECKING:
    from .run import RoundConfig


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
    rec = check_record_file(rec_path)   # as the round refuses it (the last round's rate is read even with --fresh)
    start = record_spec(rec, rec_path, dep.engine_spec) if (rec and rec.get("current") and not cfg.fresh) else dep.text
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
    notes: list[str] = []
    if cfg.prompts:
        from specpilot.auditors.outputs import read_prompt_rows

        n_avail = len(read_prompt_rows(cfg.prompts))
    else:
        n_avail = cfg.n_prompts or max(s.prompts for s in pl.SHAPES["cuda" if device == "cuda" else "cpu"])
        from specpilot.engine.api import has_tokenizer

        if has_tokenizer(spec.model, spec.random):   # text prompts: the built-in ones, as Round.prompts runs them
            from specpilot.auditors.prompts_builtin import PROMPTS

            from .inputs import short_prompts_note

            short = short_prompts_note(cfg, None, PROMPTS[:n_avail])
            notes += [short] if short else []
            n_avail = min(n_avail, len(PROMPTS))
    fixed = pl.Shape(min(cfg.n_prompts or shape0.prompts, n_avail), cfg.max_new_tokens or shape0.max_new_tokens) \
        if (cfg.n_prompts or cfg.max_new_tokens) else None
    rec_shape = fixed or shape0
    measure_s = min(pl.MEASURE_SHARE * budget, 3 * load_s + rec_shape.prompts * rec_shape.max_new_tokens
                    / max(rate * 0.7, 1e-3) + 20)
    sc = score_s(shape0, rate, 0.2)
    shape, pairs = pl.choose_shape(device, budget - measure_s - 10, [rate] * len(fits), rate, 0.2, load_s, sc,
                                   max_prompts=n_avail, fixed=fixed)
    # stage 4 as the round walks it: before each candidate its pairs from the time left (the
    # reference outputs collected first); one for which not even PAIRS_MIN fit is skipped
    refs_s = shape.run_s(rate, 0.2) * 2
    left = budget - measure_s - 2.0 - refs_s
    planned, over, approve_s = [], [], refs_s
    for i, c in enumerate(fits):
        n = pl.pairs_for(shape, left - 2.0, len(fits) - i, rate, rate, 0.2, load_s, sc)
        if n is None:
            over.append({"id": c, "reason": f"about {max(left, 0):.0f} s left, not enough for "
                                            f"{pl.PAIRS_MIN} paired runs of {shape.prompts} prompts x "
                                            f"{shape.max_new_tokens} tokens"})
            continue
        cost = pl.candidate_cost(shape, n, rate, rate, 0.2, load_s, sc)
        planned.append(f"{c} {n}")
        approve_s += cost
        left -= cost
    # what judging every candidate takes at the fewest pairs (the shape is the smallest when one was skipped)
    every_s = measure_s + 3.0 + refs_s + sum(pl.candidate_cost(shape, pl.PAIRS_MIN, rate, rate, 0.2, load_s, sc)
                                             for _ in fits)
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
                {"stage": "approve", "seconds": approve_s,
                 "work": (f"{len(planned)} candidate(s) ({', '.join(planned)} paired runs) of {shape.prompts} "
                          f"prompts x {shape.max_new_tokens} tokens, each audited against stock" if planned
                          else "no candidate: the reference outputs only")
                         + (f"; skipped for the budget: {', '.join(x['id'] for x in over)}" if over else "")},
                {"stage": "remember", "seconds": 1.0,
                 "work": f"deployment record {rec_path}" if cfg.remember
                 else "baseline.json only; the deployment record is not written (--no-remember)"}],
            "not_runnable": not_fit, "current_family": same_family, "over_budget": over, "every_candidate_s": every_s,
            "shape": asdict(shape),
            "pairs": pairs, "notes": notes}
