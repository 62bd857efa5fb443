"""Stage 1, re-measure (embedded engine): T_AR and T_step(N), a profile of a captured step, and
tau(N) by replay of lattices recorded on the deployment's prompts.

* **speed**: a short calibration run of the current system (tokens/s; the plan sizes every later
  run from it).
* **T_step(N)**: ``probe rows``' measurement (:func:`specpilot.engine.rows.measure_rows`) on the
  current system's target at rows 1 and N + 1 for every node budget N (a verify pass of N draft
  nodes has N + 1 rows: the pending token is row 0), at the context the round's requests reach.
* **profile** (CUDA only): the engine records its own decoding with the PyTorch profiler, each
  decode/verify step of the current system inside a ``decode_step_N`` annotation;
  :mod:`specpilot.probes.profile` reads the trace against the byte floors of the model on the GPU
  (kernel time per class, GPU busy time, step wall time). On the CPU there is no GPU kernel to profile: the kernel
  and outside factors stay unknown and the stage says so.
* **tau(N)**: the engine generates the prompts in tree mode with the deployment's drafter and
  records the lattice (``specpilot.lattice/1``: the drafter's top-K per position and the target's
  greedy continuation); :func:`specpilot.auditors.replay.replay` scores chain and best-first trees
  of every budget on it.
* **TLV**: the same prompts in TLV mode
  at one node budget (the current system's, else :data:`TLV_NODES`), recorded; ``tlv:N`` replayed
  on that lattice gives tau per exact pass and the run's own split gives the Q pass and the exact
  pass per cycle (:func:`record_tlv`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpilot.errors import InputError
from specpilot.fileio import is_int, is_num, need, need_fields, write_json_atomic, write_jsonl_atomic

NODES = (1, 2, 4, 8, 16, 32)
RECORD_NODES, RECORD_DEPTH, RECORD_TOPK = 8, 8, 8
TLV_NODES = 16   # the TLV recording's node budget when the current system is not TLV
SCHEMA = "specpilot.round-measure/1"


@dataclass
class Measurement:
    system: str                       # the engine spec measured (the current system)
    tokens_per_s: float               # calibration run of the current system
    calibration: dict                 # prompt, tokens, seconds, prefill_s
    context: int | None               # context T_step(N) was measured at (None: a given rows probe does not say)
    ar_ms: float | None = None
    step_ms: dict[int, float] = field(default_factory=dict)   # rows -> ms
    rows_method: str | None = None
    current_rows: int = 1
    current_policy: str = "ar"        # replay policy of the current system ("ar": tau = 1)
    replay: dict | None = None        # specpilot.replay/1
    verify_rows: dict = field(default_factory=dict)   # family -> N -> {rows: steps}: what each tree verifies
    lattice: dict | None = None       # steps, requests, m, k, tokens recorded, seconds
    profile: dict | None = None       # specpilot.profile/1 (CUDA)
    tlv: dict | None = None           # the TLV recording: spec, nodes, tau per exact pass, ms per cycle phase
    skipped: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["step_ms"] = {str(k): v for k, v in self.step_ms.items()}
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_json(cls, d: dict) -> "Measurement":
        need_fields(d, cls)
        d = {k: v for k, v in d.items() if k != "schema"}
        _check_numbers(d)
        d["step_ms"] = {int(k): float(v) for k, v in (d.get("step_ms") or {}).items()}
        return cls(**d)

    @property
    def taus(self) -> dict[str, float]:
        out = {p["policy"]: p["tau"] for p in (self.replay or {}).get("policies", [])}
        if self.tlv and self.tlv.get("tau") is not None:
            out[f"tlv:{self.tlv['nodes']}"] = self.tlv["tau"]
        return out

    @property
    def curves(self) -> dict[str, dict[int, float]]:
        return {k: {int(n): float(t) for n, t in v.items()} for k, v in ((self.replay or {}).get("curves") or {}).items()}


def _check_numbers(d: dict) -> None:
    """The numbers later stages compute with are finite numbers (JSON's NaN and Infinity are not
    measurements): a ValueError naming the field (the reader says the file is malformed)."""
    if "tokens_per_s" in d:   # a field missing is need_fields' to name
        need(is_num(d["tokens_per_s"]) and d["tokens_per_s"] >= 0, "tokens_per_s", "a number >= 0", d["tokens_per_s"])
    if d.get("context") is not None:
        need(is_int(d["context"]) and d["context"] >= 1, "context", "a whole number >= 1 or null", d["context"])
    if "current_rows" in d:
        need(is_int(d["current_rows"]) and d["current_rows"] >= 1, "current_rows", "a whole number >= 1",
             d["current_rows"])
    if d.get("ar_ms") is not None:
        need(is_num(d["ar_ms"]) and d["ar_ms"] > 0, "ar_ms", "a number of milliseconds above 0, or null", d["ar_ms"])
    for key, want in (("step_ms", "milliseconds per row count"), ("calibration", "an object"),
                      ("seconds", "seconds per part")):
        v = d.get(key)
        if key in d:   # the calibration is need_fields' to name when missing; the approve plan reads it
            need(isinstance(v, dict) or (v is None and key != "calibration"), key, want, v)
    for n, v in (d.get("step_ms") or {}).items():
        need(str(n).isdigit(), "step_ms", "milliseconds per row count", n)
        need(is_num(v) and v > 0, f"step_ms[{n!r}]", "a number of milliseconds above 0", v)
    for key in ("tokens", "seconds", "prefill_s", "tokens_per_s"):   # the plan sizes the runs from them
        if key in (d.get("calibration") or {}):
            v = d["calibration"][key]
            need(is_num(v) and v >= 0 and (key != "tokens" or is_int(v)), f"calibration.{key}",
                 "a whole number >= 0" if key == "tokens" else "a number >= 0", v)
    for key, v in (d.get("seconds") or {}).items():
        need(is_num(v) and v >= 0, f"seconds.{key}", "a number of seconds", v)
    # what the report prints and the model stage computes with: the replay's policies and curves, the TLV tau
    rep = d.get("replay")
    need(rep is None or isinstance(rep, dict), "replay", "an object (specpilot.replay/1) or null", rep)
    if rep is not None:
        pols = rep.get("policies")
        need(isinstance(pols, list), "replay.policies", "a list", pols)
        for i, pol in enumerate(pols):
            name = f"replay.policies[{i}]"
            need(isinstance(pol, dict), name, "an object", pol)
            need(isinstance(pol.get("policy"), str), f"{name}.policy", "a policy name", pol.get("policy"))
            need("nodes" in pol and (pol["nodes"] is None or is_int(pol["nodes"])), f"{name}.nodes",
                 "a whole number or null", pol.get("nodes"))
            need(is_num(pol.get("tau")) and pol["tau"] >= 1, f"{name}.tau", "a number >= 1", pol.get("tau"))
            ci = pol.get("tau_ci")   # null: a policy replayed without an interval (TLV's)
            need(ci is None or (isinstance(ci, list) and len(ci) == 2 and all(is_num(x) for x in ci)),
                 f"{name}.tau_ci", "two numbers or null", ci)
        for key in ("steps", "positions", "candidates"):   # the report prints them
            need(is_int(rep.get(key)) and rep[key] >= 0, f"replay.{key}", "a whole number >= 0", rep.get(key))
        curves = rep.get("curves") or {}
        need(isinstance(curves, dict), "replay.curves", "an object", curves)
        for fam, cur in curves.items():
            need(isinstance(cur, dict), f"replay.curves.{fam}", "an object of nodes -> tau", cur)
            for n, t in cur.items():
                need(str(n).isdigit(), f"replay.curves.{fam}", "an object of nodes -> tau", n)
                need(is_num(t) and t >= 1, f"replay.curves.{fam}[{n!r}]", "a number >= 1", t)
    tlv = d.get("tlv")
    need(tlv is None or isinstance(tlv, dict), "tlv", "an object or null", tlv)
    if tlv is not None:   # the model places TLV from these, the propose stage retunes from its spec
        need(is_num(tlv.get("tau")) and tlv["tau"] >= 1, "tlv.tau", "a number >= 1", tlv.get("tau"))
        need(is_int(tlv.get("nodes")) and tlv["nodes"] >= 1, "tlv.nodes", "a whole number >= 1", tlv.get("nodes"))
        need(isinstance(tlv.get("spec"), str), "tlv.spec", "an engine spec (text)", tlv.get("spec"))
        from specpilot.engine.spec import EngineSpec

        try:
            EngineSpec.parse(tlv["spec"])
        except InputError as e:
            raise ValueError(f"tlv.spec: {e}") from None
        tms = tlv.get("time_ms")
        need(isinstance(tms, dict), "tlv.time_ms", "an object of milliseconds per phase", tms)
        for key in ("qpass", "exact"):
            need(is_num(tms.get(key)) and tms[key] > 0, f"tlv.time_ms.{key}", "a number of milliseconds above 0",
                 tms.get(key))
    # what the report prints and the model and propose stages read besides
    for key, want in (("system", "a system (text)"), ("current_policy", "a policy name")):
        if key in d:
            need(isinstance(d[key], str), key, want, d[key])
    if d.get("rows_method") is not None:
        need(isinstance(d["rows_method"], str), "rows_method", "text or null", d["rows_method"])
    if d.get("skipped") is not None:
        need(isinstance(d["skipped"], list) and all(isinstance(x, str) for x in d["skipped"]), "skipped",
             "a list of text", d["skipped"])
    if d.get("files") is not None:
        need(isinstance(d["files"], dict) and all(isinstance(x, str) for x in d["files"].values()), "files",
             "an object of file names", d["files"])
    lat = d.get("lattice")
    need(lat is None or isinstance(lat, dict), "lattice", "an object or null", lat)
    for key in ("rows", "tokens", "prompts", "max_new_tokens", "steps", "requests", "m", "k", "seconds"):
        if key in (lat or {}):
            need((is_num if key == "seconds" else is_int)(lat[key]) and lat[key] >= 0, f"lattice.{key}",
                 "a number of seconds" if key == "seconds" else "a whole number >= 0", lat[key])
    if (lat or {}).get("files") is not None:   # a deployment's lattice files: the report names them
        need(isinstance(lat["files"], list) and all(isinstance(x, str) for x in lat["files"]), "lattice.files",
             "a list of file names", lat["files"])
    vr = d.get("verify_rows")
    need(vr is None or isinstance(vr, dict), "verify_rows", "an object of family -> nodes -> {rows: steps}", vr)
    for fam, by_n in (vr or {}).items():
        need(isinstance(by_n, dict), f"verify_rows.{fam}", "an object of nodes -> {rows: steps}", by_n)
        for n, hist in by_n.items():
            name = f"verify_rows.{fam}[{n!r}]"
            need(str(n).isdigit() and isinstance(hist, dict), name, "an object of rows -> steps", hist)
            for r, k in hist.items():
                need(str(r).isdigit(), name, "an object of rows -> steps", r)
                need(is_int(k) and k >= 1, f"{name}[{r!r}]", "a whole number of steps >= 1", k)
    prof = d.get("profile")
    need(prof is None or isinstance(prof, dict), "profile", "an object (specpilot.profile/1) or null", prof)
    if prof is not None:
        for key in ("step_wall_ms", "kernel_busy_ms", "total_floor_ms", "outside_ms", "kernel_factor",
                    "outside_factor"):
            v = prof.get(key)
            need(v is None or (is_num(v) and v >= 0), f"profile.{key}", "a number >= 0 or null", v)
        if prof.get("steps") is not None:
            need(is_int(prof["steps"]) and prof["steps"] >= 0, "profile.steps", "a whole number >= 0 or null",
                 prof["steps"])
        gpu = prof.get("gpu")
        need(gpu is None or (isinstance(gpu, dict) and isinstance(gpu.get("name", ""), (str, type(None)))),
             "profile.gpu", "an object {name, ...} or null", gpu)
        classes = prof.get("classes") or {}
        need(isinstance(classes, dict), "profile.classes", "an object of class -> figures", classes)
        for k, v in classes.items():
            need(isinstance(v, dict), f"profile.classes.{k}", "an object", v)
            for key in ("ms", "floor_ms", "efficiency"):
                need(v.get(key) is None or (is_num(v[key]) and v[key] >= 0), f"profile.classes.{k}.{key}",
                     "a number >= 0 or null", v.get(key))


def probe_rows_set(current_rows: int) -> list[int]:
    """Row counts T_step is measured at: every count up to 9 (an n-gram chain's steps verify any of
    them; on a CPU small row counts do not cost in order), N + 1 for every budget, the current."""
    return sorted(set(range(1, 10)) | {n + 1 for n in NODES} | {current_rows})


def system_rows(spec) -> tuple[int, str]:
    """(verify rows per step, replay policy) of an engine spec's decoding mode. A batched tree
    replays under its batching rules: a shared budget as ``adaptive:N`` (``block=adaptive``) or
    ``shared:N``, equal trees as ``best-first:N`` (with ``block=adaptive`` the nearest policy:
    replay has none that cuts blocks of equal trees)."""
    if spec.mode == "chain":
        return spec.depth + 1, f"chain:{spec.depth}" if spec.depth else "chain"
    if spec.mode == "tree":
        family = "best-first"
        if spec.batch > 1 and spec.budget == "shared":
            family = "adaptive" if spec.block == "adaptive" else "shared"
        return spec.nodes + 1, f"{family}:{spec.nodes}"
    if spec.mode == "tlv":   # the exact pass: C + subtree under the pending token, up to N + 2 rows
        return spec.nodes + 2, f"tlv:{spec.nodes}"
    return 1, "ar"


def tlv_spec(spec):
    """The spec that records TLV cycles: the current system's when it is TLV, else TLV mode at
    :data:`TLV_NODES` nodes with the tree recording's draft shape."""
    if spec.mode == "tlv":
        return spec
    return spec.with_(mode="tlv", nodes=TLV_NODES, depth=RECORD_DEPTH, topk=RECORD_TOPK)


def tlv_unavailable(spec) -> str | None:
    """Why the round cannot record TLV cycles for this deployment (None: it can)."""
    if spec.device.startswith("cuda") and spec.decode == "layers":
        return "on CUDA the Q pass runs through the fused verify kernels (decode=fused), not decode=layers"
    if spec.torch_dtype_name == "float16":
        return "the Q pass's 8-bit view is of bf16 or float32 weights, not float16"
    return None


def record_tlv(engine, prompts, max_new_tokens: int, path: Path, progress=None) -> dict:
    """The prompts through ``engine`` (TLV mode) with its lattice recorded to ``path``, replayed as
    ``tlv:N``: tau per exact pass, and the mean ms of each phase (draft 1, Q pass, draft 2, exact
    pass, append) per cycle (a batched engine: per batched step) from the run's own clock."""
    from specpilot.auditors.replay import read_lattice, replay
    from specpilot.engine.tlv import run_totals

    nodes = engine.spec.nodes
    t0 = time.perf_counter()
    run = engine.run([{"id": p.id, "ids": list(p.prompt_ids)} for p in prompts], max_new_tokens,
                     record_lattice=True, progress=progress)
    write_jsonl_atomic(path, run.lattice_rows)
    res = replay(read_lattice(path), [f"tlv:{nodes}"], n_boot=200).to_json()
    stats = run_totals(run.results, run.batch)   # a batched engine's phases are per batched step
    return {"spec": str(engine.spec), "nodes": nodes, "tau": res["policies"][0]["tau"], "cycles": stats["cycles"],
            "q_top1_agreement": stats["q_top1_agreement"], "mean_commit_chain": stats["mean_commit_chain"],
            "time_ms": stats["time_ms"], "cycle_ms": stats["cycle_ms"], "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "seconds": time.perf_counter() - t0}


def record_spec(spec):
    """The spec that records lattices: tree mode with the deployment's drafter, K candidates per
    position (a small verify budget keeps the recording cheap; replay scores any tree on it)."""
    return spec.with_(mode="tree", nodes=RECORD_NODES, depth=RECORD_DEPTH, topk=RECORD_TOPK)


def calibrate(engine, prompt) -> dict:
    t0 = time.perf_counter()
    r = engine.generate(list(prompt.prompt_ids), 24)
    wall = time.perf_counter() - t0
    toks = len(r.output_ids)
    return {"prompt": str(prompt.id), "tokens": toks, "seconds": wall, "prefill_s": r.prefill_seconds,
            "tokens_per_s": toks / max(wall - r.prefill_seconds, 1e-9)}


def rows_probe(engine, rows: list[int], context: int, reps: int, progress=None) -> tuple[dict, dict[int, float], float]:
    """T_step(N) on the engine's target, with the CPU threads the engine generates with."""
    from specpilot.engine.rows import measure_rows
    from specpilot.machine import torch_threads

    threads = getattr(engine.decoder, "threads", 0) if engine.model.device.type == "cpu" else 0
    with torch_threads(threads):
        measure_rows(engine.model, [1], context, reps=3, warmup=3)  # the first forwards after a load are slow
        res = measure_rows(engine.model, rows, context, reps=reps, warmup=2, progress=progress)
    res.model = engine.model_name
    return res.to_json(), {int(p["rows"]): float(p["step_ms"]) for p in res.points}, res.ar_ms


def noisy_probe(doc: dict) -> bool:
    """A rows probe with a step of more rows timed faster than the one-row step (c below the cost
    model's noise bound): a busy machine's timing, which a cost model would read high."""
    from specpilot.probes.costmodel import C_NOISE

    return any(p.get("rows", 1) > 1 and p.get("c", 1.0) < C_NOISE for p in doc.get("points") or [])


def record_lattice(engine, prompts, max_new_tokens: int, path: Path, progress=None) -> dict:
    t0 = time.perf_counter()
    run = engine.run([{"id": p.id, "ids": list(p.prompt_ids)} for p in prompts], max_new_tokens,
                     record_lattice=True, progress=progress)
    write_jsonl_atomic(path, run.lattice_rows)
    return {"rows": len(run.lattice_rows), "tokens": sum(r["tokens"] for r in run.results),
            "seconds": time.perf_counter() - t0, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def verify_rows(path: Path, current_policy: str) -> dict[str, dict[str, dict[str, int]]]:
    """For every chain and best-first budget N (and the current system's), how many steps of the
    recorded lattice verify how many rows: 1 + the tree's size, which is below N + 1 when the
    drafter proposed fewer candidates (an n-gram drafter often proposes none)."""
    from collections import Counter

    from specpilot.auditors.policies import best_first_tree, chain_tree
    from specpilot.auditors.replay import read_lattice

    lat = read_lattice(path)
    wanted = {("chain", n) for n in NODES} | {("best-first", n) for n in NODES}
    fam, _, arg = current_policy.partition(":")
    if fam in ("chain", "best-first"):
        wanted.add((fam, int(arg) if arg else lat.m))
    out: dict[str, dict[str, dict[str, int]]] = {}
    for family, n in sorted(wanted):
        build = chain_tree if family == "chain" else best_first_tree
        hist = Counter(1 + len(build(s, n)) for s in lat.steps)
        out.setdefault(family, {})[str(n)] = {str(k): v for k, v in sorted(hist.items())}
    return out


def replay_lattice(path: Path, current_policy: str, out: Path) -> dict:
    from specpilot.auditors.replay import read_lattice, replay

    lat = read_lattice(path)
    policies = ["chain", f"oracle:{max(lat.k, 1)}"] + [f"best-first:{n}" for n in NODES]
    if current_policy not in ("ar", *policies) and not current_policy.startswith("tlv:"):   # tlv: its own lattice
        policies.append(current_policy)
    res = replay(lat, policies, nodes=list(NODES), n_boot=500).to_json()
    res["lattice"] = path.name
    write_json_atomic(out, res)
    return res


def capture_step_trace(engine, prompt, max_new_tokens: int, path: Path) -> int:
    """The current system decoding ``prompt`` under the PyTorch profiler, each decode/verify step
    inside a ``decode_step_N`` annotation (real steps: the host work between kernels is in their
    wall time); the Kineto trace goes to ``path`` (gzip). Returns the steps annotated: none where
    the decoder's pipelined AR loop runs, whose steps are replays of one CUDA graph, queued ahead
    without a call per step (:func:`profile_trace` then takes the graph launches as the steps)."""
    import gzip
    import itertools
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    dec = engine.decoder
    original = dec.step
    counter = itertools.count()

    def annotated(*args, **kwargs):
        with record_function(f"decode_step_{next(counter)}"):
            return original(*args, **kwargs)

    ids = list(prompt.prompt_ids)
    engine.generate(ids, 8)  # graphs captured and kernels compiled before the profiler starts
    dec.step = annotated
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(ids, max_new_tokens)
            torch.cuda.synchronize()
    finally:
        del dec.step  # back to the class's method
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as src, gzip.open(str(path) + ".part", "wb") as dst:
            dst.write(src.read())
        os.replace(str(path) + ".part", path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return next(counter)


def profile_trace(path: Path, model_spec, gpu_key: str | None, rows: int, context: int, w12: bool,
                  annotated: bool = True) -> dict:
    """The trace read by the profile library, with the byte floors of ``model_spec`` (the engine's
    target) on the catalog GPU ``gpu_key`` (None: no floors, the kernel factor stays unknown).
    ``annotated``: the steps are the ``decode_step_N`` annotations; else the profile library finds
    them (the pipelined AR loop's graph launches)."""
    from specpilot.gpus import get_gpu
    from specpilot.probes.classify import load_rules
    from specpilot.probes.profile import build_profile, floors_from_model
    from specpilot.probes.traces import StepRequest, read_trace

    table = load_rules()
    agg = read_trace(path, StepRequest(range_regex="^decode_step_" if annotated else None,
                                       mode="auto" if annotated else "graph", tag_regex=table.range_regex))
    skip = 2 if len(getattr(agg, "steps", []) or []) > 6 else 0
    floors = None
    gpu = {"name": agg.gpu.name if agg.gpu else None}
    if gpu_key:
        gspec = get_gpu(gpu_key)
        floors = floors_from_model(model_spec, gspec, rows=rows, batch=1, context=context,
                                   weight_dtype="w12" if w12 else "bf16")
        gpu.update({"key": gspec.key, "bandwidth_tbs": gspec.bandwidth_tbs, "bf16_tflops": gspec.bf16_tflops})
    prof = build_profile(agg, table, floors=floors, vocab=model_spec.vocab_size,
                         model=model_spec.name, gpu=gpu, skip_steps=skip)
    return prof.to_json()


def median_prompt_len(prompts) -> int:
    return int(statistics.median(len(p.prompt_ids) for p in prompts)) if prompts else 1
