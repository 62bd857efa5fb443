"""The checks that keep the inputs of ``specpilot ceiling`` (and ``ceiling --check``) one
deployment's. Results of different deployments (model, GPU, rows, batch, floor shape) are refused
(:func:`check_one_deployment`, a run and a profile whose step times differ by more than
``SAME_STEP_TOLERANCE`` too); a rows probe or AR run of another model or device than the run is refused
(:func:`files_from_other_models`); a rows probe measured on the CPU beside a GPU's floors is
refused, and one of another GPU or model than the floors gives a warning
(:func:`check_rows_probe_hardware`, :func:`probe_model_mismatch`). Models compare by
:func:`same_model` (:func:`model_key`), GPUs by their catalog key.
"""

from __future__ import annotations

import re

from specpilot.errors import InputError
from specpilot.gpus import GPUSpec

from .ceiling_inputs import CeilingRequest, ProfileFigures, RowsProbeFigures, RunFigures, run_step_ms
from .floors import lm_head_dtype_of


def check_rows_probe_hardware(probe: RowsProbeFigures | None, gpu: GPUSpec | None) -> str | None:
    """A rows probe measured on the CPU cannot stand beside a GPU's floors: InputError naming both.
    A probe from another GPU than the floors' gives a warning (returned)."""
    if probe is None or gpu is None:
        return None
    if probe.on_cpu:
        raise InputError(f"--rows-probe {probe.source} was measured on {probe.hardware}, but the floors are for "
                         f"{gpu.name} (--gpu): a CPU's T_step(N) says nothing about a GPU; run 'specpilot probe rows' "
                         f"on the {gpu.name}, or leave out --model and the GPU (--gpu, --bandwidth, --flops) for the "
                         "measured figures alone")
    if probe.gpu and gpu.key not in ("custom",):
        from specpilot.gpus import match_gpu_name

        m = match_gpu_name(probe.gpu)
        same = (m is not None and m.key == gpu.key) or probe.gpu.lower() == gpu.name.lower()
        if not same:
            return (f"--rows-probe {probe.source} was measured on {probe.gpu}, the floors are for {gpu.name}: "
                    "c(N) and the floors come from different GPUs")
    return None


# what a folder or Hugging Face name adds to the model's own name: its size, a tuning or a dtype
# (``smollm2`` / ``SmolLM2-135M-Instruct``), never another model (``tiny`` / ``tiny-hybrid``)
VARIANT_TAIL = re.compile(r"(?:-(?:\d+(?:\.\d+)?[kmbt]|instruct|chat|it|base|hf|bf16|fp16|fp32|w12))+")


def same_model(a: str | None, b: str | None) -> bool:
    """Two files' model names as one model (unknown: no objection; a catalog name and its
    -instruct folder name are one, as are a Hugging Face id and its last part)."""
    if not a or not b:
        return True
    short, long = sorted((model_key(a), model_key(b)), key=len)
    return long.startswith(short) and (long == short or VARIANT_TAIL.fullmatch(long[len(short):]) is not None)


def files_from_other_models(run: RunFigures | None, probe: RowsProbeFigures | None,
                            ar_run: RunFigures | None = None) -> None:
    """A run's speedup over AR cannot be modelled from another model's step times, nor from a
    rows probe or an AR run on another device (the CPU against a GPU): InputError."""
    for other, what in ((probe, "--rows-probe"), (ar_run, "--ar-run")):
        if run is not None and other is not None and not same_model(run.model, other.model):
            raise InputError(f"{what} {other.source} was measured on {other.model}, the run {run.source} decoded "
                             f"{run.model}: give files of the same deployment")
    if run is None or not run.device:
        return
    run_cpu = run.device.startswith("cpu")
    where = "the CPU" if run_cpu else run.device
    probe_known = probe is not None and (probe.on_cpu or bool(probe.gpu) or (probe.device or "").startswith("cuda"))
    if probe_known and probe.on_cpu != run_cpu:
        _refuse(f"--rows-probe {probe.source}", f"--run {run.source}", "device", probe.hardware, where,
                "give a rows probe of the run's device")
    if ar_run is not None and ar_run.device and ar_run.device.startswith("cpu") != run_cpu:
        _refuse(f"--ar-run {ar_run.source}", f"--run {run.source}", "device",
                "the CPU" if ar_run.device.startswith("cpu") else ar_run.device, where,
                "give an AR run of the run's device")


def probe_model_mismatch(probe: RowsProbeFigures | None, model) -> str | None:
    """A warning when a rows probe's model is not the one whose floors stand beside it."""
    if probe is None or model is None or not probe.model:
        return None
    from specpilot.models import load_model_spec

    try:
        theirs = load_model_spec(probe.model).name
    except Exception:   # a folder or name this machine does not have: compared as written
        theirs = probe.model
    if same_model(theirs, model.name):
        return None
    return (f"--rows-probe {probe.source} was measured on {theirs}, the floors are for {model.name}: c(N) and the "
            "floors come from different models")


# two files that both time the step (a run's decode loop and a profile's traced steps) further
# apart than this are not one deployment's: run-to-run noise is a few percent, and a profiler adds
# launch overhead to the wall time of the steps it traces (up to some 15% on an eager step)
SAME_STEP_TOLERANCE = 0.25


def model_key(name: str) -> str:
    """A model name as files write it, compared case-blind by its last path part (a folder or a
    Hugging Face id names the same model as its catalog name)."""
    return name.strip().rstrip("/").rsplit("/", 1)[-1].lower()


def _gpu_key(name: str | None) -> str | None:
    from specpilot.gpus import match_gpu_name

    spec = match_gpu_name(name) if name else None
    return spec.key if spec is not None else None


def _same_gpu(a_key: str | None, a_name: str | None, b_key: str | None, b_name: str | None) -> bool:
    """Two GPUs as one (unknown: no objection): by catalog key (a key the catalog does not know is
    none), else by the names' catalog match."""
    a_key = (a_key if a_key not in (None, "custom") else None) and _gpu_key(a_key) or _gpu_key(a_name)
    b_key = (b_key if b_key not in (None, "custom") else None) and _gpu_key(b_key) or _gpu_key(b_name)
    if a_key and b_key:
        return a_key == b_key
    if a_name and b_name and not (a_key or b_key):
        return a_name.strip().lower() == b_name.strip().lower()
    return True


def _refuse(a: str, b: str, what: str, va, vb, advice: str) -> None:
    raise InputError(f"{a} and {b} disagree on the {what} ({va} against {vb}): they are not one deployment's; "
                     + advice)


def _profile_gpu_name(p: ProfileFigures) -> str:
    """The GPU the profile's trace ran on (what a run or a rows probe of its deployment ran on)."""
    g = p.gpu or {}
    return g.get("name") or g.get("key") or "an unnamed GPU"


def _profile_floors_gpu_name(p: ProfileFigures) -> str:
    """The GPU of the profile's floors: ``profile --gpu``'s (``floors_gpu``), else the trace's."""
    g = p.gpu or {}
    return g.get("floors_gpu") or g.get("name") or g.get("key") or "an unnamed GPU"


def check_one_deployment(req: CeilingRequest, cost_rows: int | None) -> None:
    """Refuse (InputError, one line naming both inputs and the field) a profile of another model,
    GPU, row count, batch or floor shape than the other inputs, and a run whose step a profile
    times further apart than ``SAME_STEP_TOLERANCE``. A rows probe's own checks against a run
    (``files_from_other_models``: its model and device) and against the floors
    (``check_rows_probe_hardware``, ``probe_model_mismatch``) stay as they are."""
    p, run, probe, model, gpu = req.profile, req.run, req.rows_probe, req.model, req.gpu
    if p is None:
        return
    run_cpu = run is not None and (run.device or "").startswith("cpu")
    me = f"--profile {p.source}"
    # the model
    for other, label, theirs in ((model, f"--model {model.name}" if model else "", model.name if model else None),
                                 (run, f"--run {run.source}" if run else "", run.model if run else None),
                                 (probe, f"--rows-probe {probe.source}" if probe else "",
                                  probe.model if probe else None)):
        if other is not None and p.model and theirs and not same_model(p.model, theirs):
            advice = ("leave out --model to take the profile's floors, or profile that model" if other is model
                      else "give files of the same deployment")
            _refuse(me, label, "model", p.model, theirs, advice)
    # the GPU: --gpu, --bandwidth and --flops set floors, compared with the profile's floors' GPU
    # (``profile --gpu``'s where it named one); a run or a rows probe ran on the traced GPU
    pg = p.gpu or {}
    if gpu is not None:
        floors_name = pg.get("floors_gpu") or pg.get("name")
        if not _same_gpu(pg.get("key"), floors_name, gpu.key, gpu.name):
            _refuse(me, "--gpu", "floors' GPU", _profile_floors_gpu_name(p), gpu.name,
                    "leave out --gpu to take the profile's, or profile with that --gpu")
        if p.total_floor_ms is not None:   # the profile's floors are of its GPU's figures
            for k, what, unit in (("bandwidth_tbs", "peak bandwidth", "TB/s"), ("bf16_tflops", "dense bf16 peak",
                                                                                 "TFLOP/s")):
                mine, theirs = pg.get(k), getattr(gpu, k)
                if mine and abs(mine - theirs) > 1e-3 * mine:
                    option = "--bandwidth" if k == "bandwidth_tbs" else "--flops"
                    # the figure is --gpu's catalog one unless the option gave it
                    given = (f"{option} {theirs:g}" if option[2:] in gpu.measured or gpu.key == "custom"
                             else f"--gpu {gpu.key}")
                    _refuse(me, given, f"GPU's {what}",
                            f"{mine:g} {unit}", f"{theirs:g} {unit}",
                            "the profile's floor is of its figures; leave the option out to take them")
            if "fp8_tflops" in pg and pg.get("bf16_tflops"):   # fp8 floors: the fp8 peak, else the bf16 one
                mine = pg["fp8_tflops"] or pg["bf16_tflops"]
                theirs = gpu.fp8_tflops or gpu.bf16_tflops
                if abs(mine - theirs) > 1e-3 * mine:
                    _refuse(me, f"--fp8-flops {theirs:g}" if "fp8_flops" in gpu.measured else f"--gpu {gpu.key}",
                            "GPU's dense fp8 peak", f"{mine:g} TFLOP/s", f"{theirs:g} TFLOP/s",
                            "the profile's floor is of its figures; leave the option out to take them")
    if run_cpu:
        _refuse(me, f"--run {run.source}", "device", _profile_gpu_name(p), "the CPU",
                "give a run on the profile's GPU")
    if probe is not None:
        if probe.on_cpu:
            _refuse(me, f"--rows-probe {probe.source}", "device", _profile_gpu_name(p), probe.hardware,
                    "give a rows probe of the profile's GPU")
        if probe.gpu and pg.get("name") and not _same_gpu(None, pg["name"], None, probe.gpu):
            _refuse(me, f"--rows-probe {probe.source}", "GPU", _profile_gpu_name(p), probe.gpu,
                    "give a rows probe of the GPU the profile traced")
    # the rows and the batch
    if p.rows is not None:
        if cost_rows != p.rows:
            _refuse(me, f"--rows {','.join(str(r) for r in req.rows)}", "rows per request", p.rows,
                    ",".join(str(r) for r in req.rows),
                    f"the profiled step verified {p.rows} row{'s' if p.rows != 1 else ''} per request; leave out "
                    "--rows to take the profile's, or profile a step of those rows")
        if run is not None and run.verify_by_rows and not min(run.verify_by_rows) <= p.rows <= max(run.verify_by_rows):
            lo, hi = min(run.verify_by_rows), max(run.verify_by_rows)
            _refuse(me, f"--run {run.source}", "rows per request", p.rows, f"{lo}-{hi}" if hi > lo else lo,
                    "give a profile of the run's verify steps")
    pb = p.shape.get("batch")
    if pb is not None:
        for label, theirs in ((f"--batch {req.batch}", req.batch), (f"--run {run.source}" if run else None, 1),
                              (f"--rows-probe {probe.source}" if probe else None, probe.batch if probe else None)):
            if label and theirs != pb:
                _refuse(me, label, "requests per step", pb, theirs,
                        "leave out --batch to take the profile's" if label.startswith("--batch")
                        else "give files of the same deployment")
    # the floors' shape, where --model sets floors beside the profile's step (and its own floors)
    if model is not None and p.shape.get("weight_dtype"):
        drafter = req.drafter.name if req.drafter is not None else None
        for key, opt, mine, theirs in (
                ("context", "--context", p.shape.get("context"), req.context),
                ("weight_dtype", "--weight-dtype", p.shape.get("weight_dtype"), req.weight_dtype),
                ("lm_head_dtype", "--lm-head-dtype", p.shape.get("lm_head_dtype"),
                 lm_head_dtype_of(req.weight_dtype, req.lm_head_dtype)),
                ("kv_dtype", "--kv-dtype", p.shape.get("kv_dtype"), req.kv_dtype),
                ("flops_fraction", "--flops-fraction", p.shape.get("flops_fraction"), req.flops_fraction),
                ("bw_fraction", "--bw-fraction", p.shape.get("bw_fraction"), req.bw_fraction),
                ("drafter", "--drafter", p.shape.get("drafter"), drafter),
                ("draft_passes", "--draft-passes", p.shape.get("draft_passes"), req.draft_passes if drafter else None),
                ("draft_rows", "--draft-rows", p.shape.get("draft_rows"),
                 (req.draft_rows or cost_rows) if drafter else None)):
            if key == "drafter":
                differ = bool(mine) != bool(theirs) or not same_model(mine, theirs)
            else:
                differ = mine is not None and theirs is not None and mine != theirs
            if differ:
                _refuse(me, f"{opt} {theirs}" if theirs is not None else f"no {opt}", key.replace("_", " "),
                        mine if mine is not None else "none", theirs if theirs is not None else "none",
                        f"the profile's floor is of its own shape; leave out {opt} to take the profile's")
    # a run and a profile that both time the step
    if run is not None:
        for what, theirs, mine, opt in (("step wall time", run_step_ms(run), p.step_wall_ms, "--step-ms"),
                                        ("GPU time per step", run.step_gpu_ms, p.kernel_busy_ms, "--profile-ms")):
            given = req.measurements.step_ms if opt == "--step-ms" else req.measurements.profile_ms
            if theirs and mine and given is None and abs(theirs - mine) > SAME_STEP_TOLERANCE * min(theirs, mine):
                raise InputError(f"--run {run.source} and {me} differ on the {what} by more than "
                                 f"{SAME_STEP_TOLERANCE:.0%} (run {theirs:.4g} ms, profile {mine:.4g} ms): they are "
                                 f"not one deployment's step; give files of one deployment, or choose with {opt}")
