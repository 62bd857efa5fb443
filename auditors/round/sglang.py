"""A round on an SGLang deployment: the deployment file, measurements from the files the user
captured, and candidates run as servers started with the user's own commands.

The deployment file's form is in :mod:`.deployment_file`.

Start commands run in a shell in the deployment file's folder (``{launch}``: the launch command
``specpilot apply`` prints for the candidate's bundles on top of the current ones, written for the
deployment's drafter; ``{port}``, ``{python}``, ``{model}``). The round starts only what those
commands start, waits for ``/health``, and stops them (their process group) afterwards; the stock
server is started only when its URL does not answer. Activations are checked by ``apply`` but
not written into the SGLang environment at all: each server's plugin reads its own activation file
in the round's folder (``SPECPILOT_ACTIVATION``), so stock, the current system and a candidate run
side by side from one environment.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.fileio import is_int, read_json, write_json_atomic

from .deployment_file import SGLangDeployment
from .servers import Server, healthy, start_server


# --------------------------------------------------------------------------------------- measure
def measure_sglang(dep: SGLangDeployment, out: Path, notify) -> "object":
    """Stage 1 from the files the user captured (what is missing is recorded as skipped)."""
    from specpilot.fileio import iter_jsonl, write_jsonl_atomic

    from .measure import Measurement, replay_lattice, verify_rows

    m = dep.measurements
    meas = Measurement(system="stock", tokens_per_s=0.0, calibration={}, context=dep.context,
                       current_rows=dep.rows, current_policy=dep.policy)
    rp = dep.file(m.get("rows_probe"))
    if rp is not None:
        from specpilot.readers import read_rows_probe

        fig = read_rows_probe(str(rp))
        meas.step_ms, meas.ar_ms, meas.rows_method = dict(fig.step_ms), fig.ar_ms, f"rows probe {rp.name}"
        doc = read_json(rp, kind="rows")
        # T_step(N) is the probe's, at the context it was probed at (None: the file does not say), not the deployment's
        meas.context = doc.get("context")
        if meas.context is not None and not (is_int(meas.context) and meas.context >= 1):
            raise InputError(f"{rp}: rows probe 'context' must be a whole number >= 1, got {meas.context!r}")
        write_json_atomic(out / "rows.json", doc)
        meas.files["rows"] = "measure/rows.json"
    elif m.get("ar_ms") and m.get("step_ms"):
        meas.ar_ms = float(m["ar_ms"])
        meas.step_ms = {1: meas.ar_ms, dep.rows: float(m["step_ms"])}
        meas.rows_method = "given in the deployment file"
    else:
        meas.skipped.append("T_AR / T_step(N): no rows_probe file or ar_ms/step_ms in the deployment")
    lats = m.get("lattices") or []
    if isinstance(lats, str):
        lats = [lats]
    if lats:
        rows = []
        for rel in lats:
            f = dep.file(rel)
            rows.extend(iter_jsonl(f, kind="lattice"))
        write_jsonl_atomic(out / "lattice.jsonl", rows)
        res = replay_lattice(out / "lattice.jsonl", dep.policy, out / "replay.json")
        meas.replay = res
        meas.verify_rows = verify_rows(out / "lattice.jsonl", dep.policy)
        meas.lattice = {"rows": len(rows), "steps": res["steps"], "requests": res["requests"], "m": res["positions"],
                        "k": res["candidates"], "files": [str(x) for x in lats]}
        meas.files.update(lattice="measure/lattice.jsonl", replay="measure/replay.json")
        notify("measure", f"replayed {res['steps']} recorded steps ({len(lats)} lattice file(s))")
    else:
        meas.skipped.append("tau(N): no lattices (record them with 'specpilot apply lattice-trace')")
    tr = dep.file(m.get("profile"))
    if tr is not None:
        meas.profile = profile_file(tr, dep)
        write_json_atomic(out / "profile.json", meas.profile)
        meas.files["profile"] = "measure/profile.json"
        notify("measure", f"profile {tr.name}: step {meas.profile['step_wall_ms']:.4g} ms, GPU busy "
                          f"{meas.profile['kernel_busy_ms']:.4g} ms")
    else:
        meas.skipped.append("profile: no trace of decode/verify steps in the deployment (kernel and outside "
                            "factors unknown)")
    return meas


def profile_file(path: Path, dep: SGLangDeployment) -> dict:
    from specpilot.gpus import get_gpu
    from specpilot.probes.classify import load_rules
    from specpilot.probes.profile import build_profile, floors_from_model
    from specpilot.probes.traces import StepRequest, read_trace

    table = load_rules()
    agg = read_trace(path, StepRequest(tag_regex=table.range_regex))
    floors = None
    if dep.model_spec is not None and dep.gpu_key:
        floors = floors_from_model(dep.model_spec, get_gpu(dep.gpu_key), rows=dep.rows, batch=dep.facts.batch,
                                   context=dep.context, weight_dtype=dep.facts.dtype if dep.facts.dtype in
                                   ("bf16", "fp16", "fp8", "w12", "int8", "int4") else "bf16")
    prof = build_profile(agg, table, floors=floors,
                         vocab=dep.model_spec.vocab_size if dep.model_spec is not None else None,
                         model=dep.model_spec.name if dep.model_spec is not None else None,
                         gpu={"name": agg.gpu.name if agg.gpu else dep.facts.gpu, "key": dep.gpu_key})
    return prof.to_json()


# --------------------------------------------------------------------------------------- propose
def propose_sglang(dep: SGLangDeployment, current: list[str], model, meas, *, only=None, memory_dir=None):
    """Memory entries that fit the deployment, retuned; the others with the reason."""
    from specpilot.bundles import memory as mem

    from .propose import Candidate, Proposal

    entries = mem.load_memory(memory_dir)
    f = dep.facts
    proposed, skipped = [], []
    best = max((r for r in model.by_nodes if r["family"] == "best-first"), key=lambda r: r["speedup"], default=None)
    for e in entries.values():
        if only is not None and e.id not in only:
            continue
        why = []
        if e.status == "observe":
            why.append("an observer (changes no output, no speed)")
        if e.status == "library":
            why.append("not wired into SGLang yet (status library)")
        if e.status == "experimental" and not dep.experimental:
            why.append("experimental (set experimental: true in the deployment to try it)")
        if f.sglang and e.sglang_checked and f.sglang not in e.sglang_checked:
            why.append(f"checked against SGLang {', '.join(e.sglang_checked)}, the deployment runs {f.sglang}")
        why += e.fits.misfits(drafter=f.drafter, target=f.target, dtype=f.dtype, batch=f.batch)
        if e.id in current:
            why.append("already applied in the current system")
        else:
            closure = mem.closure(entries, current + [e.id])
            why += mem.composition_problems(entries, closure, f.drafter)
        if why:
            skipped.append({"id": e.id, "memory": e.id, "reason": "; ".join(why)})
            continue
        settings, retuned = {}, None
        if e.id == "tree" and f.drafter in ("eagle", "eagle3") and best is not None:
            settings["node_budget"] = best["nodes"] + 1
            retuned = (f"node_budget = {best['nodes'] + 1} (root + N = {best['nodes']}): the highest predicted "
                       f"tau(N)/c(N) here ({best['speedup']:.3g}x over AR)")
        elif e.id == "tree" and f.drafter == "dflash2":
            retuned = "DFLASH: the tree has N = the draft block size nodes (nothing to retune)"
        elif e.id == "tlv":
            settings["tlv_max_batch"] = max(1, f.batch)
            retuned = f"tlv_max_batch = {max(1, f.batch)} (the deployment's batch)"
        elif e.id == "batching" and best is not None:
            settings["shared_budget"] = f.batch * (best["nodes"] + 1)
            retuned = (f"shared_budget = {f.batch} requests x {best['nodes'] + 1} rows (the best predicted per-request "
                       "budget)")
        proposed.append(Candidate(id=e.id, memory=e.id, what=e.summary.split(". ")[0], attacks=e.fits.attacks,
                                  system="stock + " + " + ".join(current + [e.id]), change=settings, retuned=retuned,
                                  predicted_speedup=None, predicted_gain=None, changes_output=e.fits.changes_output))
    factors = model.factors or {}
    proposed.sort(key=lambda c: -(factors.get(c.attacks or "") or 1.0))
    order = "largest factor first (" + ", ".join(f"{k} {v:.3g}x" if v is not None else f"{k} unknown"
                                                 for k, v in factors.items()) + ")"
    return Proposal(proposed, skipped, order, model.largest)


# --------------------------------------------------------------------------------------- servers


def fill(template: str, **values) -> str:
    out = str(template)
    for k, v in values.items():
        out = out.replace("{" + k + "}", str(v))
    return out


def plan_sglang(dep, cfg) -> dict:
    """The dry run of an SGLang deployment's round: its start read from the deployment record as
    the round reads it; the decode speed is not known before the stock server runs, and the approve
    stage takes what the budget leaves."""
    from . import remember as rm
    from .state import check_record_file

    sg = dep.sglang
    rec_path = rm.record_path(cfg.records_dir, dep.facts.identity())
    rec = check_record_file(rec_path)
    start = str(rec["current"]) if (rec and rec.get("current") and not cfg.fresh) else "stock"
    return {"schema": "specpilot.round-plan/1", "deployment": dep.text, "facts": dep.facts.to_json(), "start": start,
            "stock": (sg.servers.get("stock") or {}).get("url"), "record": str(rec_path) if rec else None,
            "budget_s": cfg.budget_min * 60, "approve_takes_the_rest": True,
            "tokens_per_s": None, "tokens_per_s_source": "measured by the stock server at the start of stage 4",
            "stages": [{"stage": "measure", "seconds": 5.0, "work": "read the rows probe, profile trace and lattices "
                                                                    "named in the deployment file"},
                       {"stage": "model", "seconds": 1.0, "work": "cost model"},
                       {"stage": "propose", "seconds": 1.0, "work": "memory entries that fit the deployment"},
                       {"stage": "approve", "seconds": cfg.budget_min * 60 - 10,
                        "work": "per candidate: apply, start its server, paired runs against stock, audit, stop"},
                       {"stage": "remember", "seconds": 1.0, "work": "deployment record"}],
            "not_runnable": [], "shape": None, "pairs": None}


def quote(s: str) -> str:
    return shlex.quote(s)


# --------------------------------------------------------------------------------------- approve
def activation_launch(dep: SGLangDeployment, bundles: list[str], settings: dict, out: Path, name: str) -> tuple[str, list[str]]:
    """The launch command of a server running ``bundles``: ``apply``'s checks and launch command
    (drafter-right flags), with the activation written to a file of the round (the SGLang
    environment itself is not touched: ``SPECPILOT_ACTIVATION`` points that server's plugin at it),
    so stock, the current system and a candidate can run side by side from one environment."""
    import json as _json

    from specpilot.bundles.activation import apply
    from specpilot.bundles.contract import ACTIVATION_ENV
    from specpilot.fileio import write_text_atomic

    res = apply(",".join(bundles), python=dep.python, experimental=dep.experimental, dry_run=True,
                settings=[f"{k}={_json.dumps(v)}" for k, v in settings.items()],
                model=str(dep.raw.get("model_path", "MODEL")), drafter=dep.facts.drafter)
    path = (out / f"{name}.activation.json").resolve()
    write_text_atomic(path, _json.dumps(res.activation, indent=2) + "\n")
    # a setting or bundle that will not act (apply's warnings) belongs in the candidate's record too
    return f"{ACTIVATION_ENV}={quote(str(path))} {res.launch}", res.notes + [f"warning: {w}" for w in res.warnings]


def server_command(dep: SGLangDeployment, cand_id: str, bundles: list[str], settings: dict, port: int,
                   out: Path) -> tuple[str, str, list[str]]:
    """(start command, url, notes) of the server for candidate ``cand_id`` running ``bundles``."""
    srv = dep.servers.get("candidate") or {}
    per = (dep.servers.get("candidates") or {}).get(cand_id) or {}
    template = per.get("start") or srv.get("start")
    if not template:
        raise InputError(f"{dep.path}: no start command for candidate {cand_id} (servers.candidate.start or "
                         f"servers.candidates.{cand_id}.start)")
    url = fill(per.get("url") or srv.get("url") or "http://127.0.0.1:{port}", port=port)
    launch, notes = "", []
    if "{launch}" in str(template):
        if not dep.python:
            raise InputError(f"{dep.path}: the start command uses {{launch}}, which needs sglang.python (the "
                             "environment the bundles are checked against)")
        launch, notes = activation_launch(dep, bundles, settings, out, cand_id)
    cmd = fill(template, launch=launch, port=port, python=dep.python or sys.executable,
               model=dep.raw.get("model_path", "MODEL"))
    return cmd, url, notes


def approve_sglang(dep: SGLangDeployment, out: Path, cfg, clock, notify, prop, meas, state: dict, save) -> list:
    """Stage 4 on servers: each candidate's server (started with the user's command) against the
    current system's, paired; its outputs audited against stock's with the deployment's scorer."""
    from specpilot.auditors.outputs import read_outputs, read_prompts_tokenized, write_outputs
    from specpilot.auditors.pairing import GenerateSystem, paired_compare
    from specpilot.auditors.systems import collect, make_generator, parse_system

    from . import approve as ap
    from . import plan as pl
    from .engines import outputs_from

    decisions = read_json(out / "decisions.json", kind="round-decisions", build=ap.decisions_from_json) \
        if (out / "decisions.json").is_file() else []
    prompts = read_prompts_tokenized(dep.file(dep.prompts), dep.scorer)
    prompts = prompts[:cfg.n_prompts or 8]
    max_new = cfg.max_new_tokens or dep.max_new_tokens
    stock_srv = dep.servers.get("stock") or {}
    stock_url = stock_srv["url"]
    started: list[Server] = []
    timeout = float(stock_srv.get("ready_timeout", 900))
    if not healthy(stock_url):
        if not stock_srv.get("start"):
            raise EnvironmentMissing(f"the stock server {stock_url} does not answer and the deployment gives no "
                                     "servers.stock.start command")
        notify("approve", f"starting the stock server ({stock_url})")
        from urllib.parse import urlsplit

        started.append(start_server(fill(stock_srv["start"], python=dep.python or sys.executable,
                                         port=urlsplit(stock_url).port or ""), stock_url, dep.path.parent,
                                    out / "stock.server.log", timeout))
    try:
        refs = {}
        given = (dep.measurements.get("outputs") or {})
        for role in ("stock", "ar"):
            f = out / f"{role}.outputs.jsonl"
            if f.is_file():
                refs[role] = read_outputs(f, name=role)
            elif given.get(role):
                refs[role] = read_outputs(dep.file(given[role]), name=role)
                write_outputs(f, refs[role].rows)
            elif role == "stock":
                notify("approve", "collecting stock's outputs from the stock server")
                refs["stock"] = collect(make_generator(parse_system(stock_url)), prompts, max_new, save_to=str(f),
                                        name="stock")
        scorer = None
        if dep.scorer:
            from specpilot.auditors.scorer import Scorer

            scorer = Scorer.load(str(dep.file(dep.scorer)) if Path(str(dep.file(dep.scorer))).exists() else dep.scorer)
        base = {"url": stock_url, "server": None, "label": "stock"}
        bundles = list(state.get("bundles") or [])
        settings = dict(state.get("settings") or {})
        port0 = int((dep.servers.get("candidate") or {}).get("port", 30001))
        start_s = float((dep.servers.get("candidate") or {}).get("expected_start_s", 120))
        rate = meas.tokens_per_s or 0.0
        todo = [c for c in prop.candidates if c.id not in {x.id for x in decisions}]

        def record(dec) -> None:   # every verdict kept at once, a refusal or a skip too
            decisions.append(dec)
            write_json_atomic(out / "decisions.json", {"schema": ap.SCHEMA,
                                                       "decisions": [x.to_json() for x in decisions]})
            save()

        for i, cand in enumerate(todo):
            t0 = time.perf_counter()
            dec = ap.Decision(id=cand.id, memory=cand.memory, system="stock + " + " + ".join(bundles + [cand.id]),
                              base=base["label"], verdict="skipped", reason="")
            shape = pl.Shape(len(prompts), max_new)
            pairs = pl.pairs_for(shape, clock.left() - 5.0, len(todo) - i, rate or 50.0, rate or 50.0, 0.1, start_s,
                                 ap_score_s()) if rate else pl.PAIRS_MIN
            if pairs is None:
                dec.reason = f"budget: {max(clock.left(), 0):.0f} s left, not enough for {pl.PAIRS_MIN} paired runs"
                record(dec)
                continue
            server = None
            try:
                cmd, url, notes = server_command(dep, cand.id, bundles + [cand.id], {**settings, **cand.change},
                                                 port0 + i, out)
                notify("approve", f"{cand.id}: starting its server: {cmd}")
                server = start_server(cmd, url, dep.path.parent, out / f"{cand.id}.server.log",
                                      float((dep.servers.get("candidate") or {}).get("ready_timeout", 900)))
                started.append(server)  # stopped in the end whatever happens (an interrupt included)
                a = GenerateSystem(base["url"], prompts, max_new)
                a.label = base["label"]
                b = GenerateSystem(url, prompts, max_new)
                b.label = dec.system

                def tick(_n):
                    clock.check(f"the paired runs of {cand.id}")

                timing = paired_compare(a, b, runs=pairs, warmup=1, seed=cfg.seed, tick=tick).to_json()
                rate = rate or (timing["samples"][0]["base"] if timing["samples"] else 0.0)
            except pl.OutOfBudget as e:
                dec.reason = f"budget: {e}"
                record(dec)
                if server:
                    server.stop()
                continue
            except (EnvironmentMissing, InputError) as e:
                dec.verdict, dec.reason = "refused", f"could not run: {e}"
                record(dec)
                if server:
                    server.stop()
                continue
            write_json_atomic(out / f"{cand.id}.timing.json", timing)
            outs = outputs_from(b, prompts, cand.id, save_to=str(out / f"{cand.id}.outputs.jsonl"))
            audit = None
            if scorer is not None:
                result = ap.run_audit(outs, refs["stock"], refs.get("ar"), scorer, seed=cfg.seed)
                audit = ap.audit_data(result, scorer.info)
                write_json_atomic(out / f"{cand.id}.audit.json", audit)
            dec.timing, dec.audit, dec.pairs = timing, audit, len(timing["samples"])
            dec.verdict, dec.reason = ap.decide(timing, audit)
            if audit is None and dec.verdict == "approved":
                dec.verdict, dec.reason = "refused", "faster, but not audited: give scorer: in the deployment"
            dec.files = {"timing": f"approve/{cand.id}.timing.json", "outputs": f"approve/{cand.id}.outputs.jsonl",
                         **({"audit": f"approve/{cand.id}.audit.json"} if audit else {}),
                         "server_log": f"approve/{cand.id}.server.log"}
            dec.seconds = time.perf_counter() - t0
            notify("approve", f"{cand.id}: {dec.verdict.upper()}: {dec.reason}")
            record(dec)
            if dec.verdict == "approved":
                if base["server"] is not None:
                    base["server"].stop()
                base = {"url": url, "server": server, "label": dec.system}
                bundles.append(cand.id)
                settings.update(cand.change)
                state.update(bundles=bundles, settings=settings, current=dec.system)
            else:
                server.stop()
            save()
        if base["server"] is not None:
            base["server"].stop()
    finally:
        for s in started:
            s.stop()  # a no-op for servers already stopped
    if not (out / "decisions.json").is_file():   # nothing to judge: the stage's file says so
        write_json_atomic(out / "decisions.json", {"schema": ap.SCHEMA, "decisions": []})
    state["final"] = state.get("current")
    return decisions


def ap_score_s() -> float:
    return 10.0
