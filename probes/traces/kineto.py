"""PyTorch profiler (Kineto) Chrome traces: ``.json`` / ``.json.gz``, CUDA and ROCm.

One streaming pass keeps only what the profile needs, in compact columns: GPU events
(``kernel``, ``gpu_memcpy``, ``gpu_memset``), ranges (``user_annotation`` on the CPU,
``gpu_user_annotation`` on the GPU), runtime launches (``cuda_runtime``/``cuda_driver``: launch
time and CUDA/HIP graph launches, joined to kernels by ``correlation``) and, when the trace was
recorded with shapes, the ``Input Dims``) of the ``cpu_op`` that launched each kernel (joined by
``External id``), the message sizes of collectives (``record_param_comms``) and ``nn.Module``
scopes (``python_function`` events of traces recorded with ``with_modules``), which rules may test
as ranges. Aggregation per step then runs in numpy.

A kernel whose launch is not in the trace (its runtime call has no event: it was launched before
the profiler started) is left out unless ``include_orphans`` is set, and counted in the notes; so is
a GPU event that ends before it starts (damage). A time, duration or id that is not finite or does
not fit the integer columns, or a kernel name that is not a string, is an InputError.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable

import numpy as np

from specpilot.errors import InputError
from specpilot.fileio import require_file

from .. import steps as st
from .jsonstream import iter_chrome_trace
from .model import Aggregate, GPUInfo, KernelGroup, Range, StepInfo, StepRequest

GPU_CATS = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2, "Kernel": 0, "Memcpy": 1, "Memset": 2}
RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "runtime")
GRAPH_LAUNCH = ("cudaGraphLaunch", "hipGraphLaunch", "cuGraphLaunch")
MODULE_PREFIX = "nn.Module: "
COMM_OP = re.compile(r"record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
                     r"nccl|c10d::|send|recv", re.IGNORECASE)
DTYPE_BYTES = {"float": 4, "float32": 4, "float16": 2, "half": 2, "bfloat16": 2, "c10::bfloat16": 2,
               "c10::half": 2, "double": 8, "int": 4, "int32": 4, "long": 8, "int64": 8, "char": 1, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "c10::float8_e4m3fn": 1,
               "float8_e4m3fnuz": 1, "c10::float8_e4m3fnuz": 1, "float8_e5m2": 1}


MAX_MSG_NELEMS = 2 ** 48   # elements of one collective's message: far past any GPU's memory


def comm_bus_bytes(a: dict, name: str, world: int | None, where: str = "") -> int:
    """Bytes one rank sends over its links for a collective op's args (ring algorithms): all-reduce
    2 (n-1)/n S, all-gather (n-1)/n S_out, reduce-scatter (n-1)/n S_in, all-to-all (n-1)/n S.
    InputError (naming ``where``) for a message size that is negative, not finite or past
    :data:`MAX_MSG_NELEMS`."""
    for k in ("In msg nelems", "Out msg nelems"):
        v = a.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (
                math.isfinite(v) and 0 <= v <= MAX_MSG_NELEMS):
            raise InputError(f"{where}: collective {name!r}: {k!r} must be a count of elements in "
                             f"[0, {MAX_MSG_NELEMS:.3g}], got {v!r}")
    coll = str(a.get("Collective name") or name).lower()
    dt = DTYPE_BYTES.get(str(a.get("dtype") or "").lower())
    if dt is None:
        types = a.get("Input type") or []
        dt = DTYPE_BYTES.get(str(types[0]).lower(), 2) if types else 2
    n_in, n_out = a.get("In msg nelems"), a.get("Out msg nelems")
    if not isinstance(n_in, (int, float)):
        dims = a.get("Input Dims") or []
        first = dims[0] if dims and isinstance(dims[0], list) else []
        ok = first and all(isinstance(x, (int, float)) and math.isfinite(x) and 0 <= x <= MAX_MSG_NELEMS
                           for x in first)
        n_in = min(math.prod(int(x) for x in first), MAX_MSG_NELEMS) if ok else 0
    if not isinstance(n_out, (int, float)):
        n_out = n_in
    n = a.get("Group size") if isinstance(a.get("Group size"), int) else world
    frac = (n - 1) / n if n and n > 1 else 1.0
    if "gather" in coll:
        return int(frac * n_out * dt)
    if "scatter" in coll or "all_to_all" in coll or "alltoall" in coll:
        return int(frac * n_in * dt)
    if "reduce" in coll:
        return int(2 * frac * n_in * dt)
    return int(max(n_in, n_out) * dt)  # broadcast, send/recv


FLUSH = 8_192


# bounds on the magnitude of each column of a row as read (times in us): what the integer columns
# hold; a time stays below 2**62 ns so that start + duration fits int64 too
TIME_US_MAX = 2.0 ** 62 / 1000.0
GPU_ROW_MAX = np.array([np.inf, TIME_US_MAX, TIME_US_MAX, 2.0 ** 31, 2.0 ** 63, np.inf, 2.0 ** 63, 2.0 ** 15])
RT_ROW_MAX = np.array([2.0 ** 63, TIME_US_MAX])


def _block(rows: list[tuple], ncols: int, path, limits: np.ndarray) -> np.ndarray:
    try:
        arr = np.array(rows, dtype=np.float64).reshape(-1, ncols)
    except (TypeError, ValueError) as e:
        raise InputError(f"{path}: malformed event field ({e})") from None
    if not np.isfinite(arr).all():
        raise InputError(f"{path}: an event has a non-finite time or id")
    if (np.abs(arr) >= limits).any():
        raise InputError(f"{path}: an event has a time, duration or id out of range")
    return arr


COLUMNS = {"kind": np.int8, "start": np.int64, "dur": np.int64, "stream": np.int32, "corr": np.int64,
           "name": np.int32, "ext": np.int64, "device": np.int16}


def _gpu_columns(arr: np.ndarray) -> dict[str, np.ndarray]:
    """Float rows (kind, ts us, dur us, stream, corr, name, ext, device) -> compact integer columns."""
    out = {}
    for i, (k, dt) in enumerate(COLUMNS.items()):
        col = np.rint(arr[:, i] * 1000.0) if k in ("start", "dur") else arr[:, i]
        out[k] = col.astype(dt)
    return out


class _OutOfRange(ValueError):
    """A time that is not finite or does not fit the integer nanosecond columns."""


NUMBER = (int, float)   # a JSON number (bool is no time: ``type`` is checked, not ``isinstance``)


def _time(x, what: str):
    """A time or duration as the trace gives it (us): a JSON number, else TypeError."""
    if type(x) not in NUMBER:
        raise TypeError(f"{what} {x!r} is not a number")
    return x


def _ns(x) -> int:
    us = float(_time(x, "time"))
    if not abs(us) < TIME_US_MAX:  # NaN too
        raise _OutOfRange
    return int(round(us * 1000.0))


class KinetoTrace:
    """The columns of one Kineto trace that profiling needs."""

    def __init__(self, path: str | os.PathLike, on_read: Callable[[int], None] | None = None):
        self.path = str(path)
        p = Path(path)
        require_file(p)
        if p.stat().st_size == 0:
            raise InputError(f"{path}: empty file")
        self.header: dict = {}
        names: dict[str, int] = {}
        dims_ids: dict[str, int] = {}
        gpu_rows: list[tuple] = []  # kind, ts, dur, stream, corr, name, ext, device (floats, us)
        gpu_blocks: list[dict] = []  # gpu_rows moved to compact numpy columns every FLUSH rows (memory)
        rt_rows: list[tuple] = []  # (correlation, launch ts) of runtime calls
        rt_blocks: list[np.ndarray] = []
        graph_corr: list[int] = []
        op_dims: dict[int, int] = {}
        comm_args: dict[int, tuple[dict, str]] = {}
        ranges: list[Range] = []
        n_events = 0
        append = gpu_rows.append

        def header(key, value):
            self.header[key] = value

        for ev in iter_chrome_trace(path, header, on_read):
            n_events += 1
            cat = ev.get("cat")
            if cat is None or ev.get("ph") != "X":
                continue
            try:
                kind = GPU_CATS.get(cat)
                if kind is not None:
                    a = ev.get("args") or {}
                    if not isinstance(a, dict):
                        raise TypeError(f"args {a!r} is not an object")
                    nm = ev.get("name")
                    if not isinstance(nm, str):
                        raise TypeError(f"name {nm!r} is not a string")   # absent: None
                    nid = names.get(nm)
                    if nid is None:
                        nid = names[nm] = len(names)
                    append((kind, _time(ev["ts"], "ts"), _time(ev["dur"], "dur"), a.get("stream", -1),
                            a.get("correlation", -1), nid, a.get("External id", -1), a.get("device", -1)))
                    if len(gpu_rows) >= FLUSH:
                        gpu_blocks.append(_gpu_columns(_block(gpu_rows, 8, path, GPU_ROW_MAX)))
                        gpu_rows.clear()
                elif cat in RUNTIME_CATS:
                    a = ev.get("args") or {}
                    c = a.get("correlation")
                    if c is not None:
                        rt_rows.append((c, _time(ev["ts"], "ts")))
                        if len(rt_rows) >= FLUSH:
                            rt_blocks.append(_block(rt_rows, 2, path, RT_ROW_MAX))
                            rt_rows.clear()
                        if ev.get("name", "").startswith(GRAPH_LAUNCH):
                            graph_corr.append(int(c))
                elif cat == "user_annotation" or cat == "gpu_user_annotation":
                    s = _ns(ev["ts"])
                    ranges.append(Range(name=str(ev.get("name", "")), start=s, end=s + _ns(ev.get("dur", 0)),
                                        thread=(ev.get("pid"), ev.get("tid")), gpu=(cat == "gpu_user_annotation")))
                elif cat == "cpu_op":
                    a = ev.get("args")
                    if a and "External id" in a:
                        nm = ev.get("name", "")
                        d = json.dumps(a["Input Dims"], separators=(",", ":")) if "Input Dims" in a else ""
                        ext = int(a["External id"])
                        op_dims[ext] = dims_ids.setdefault(f"{nm}{d}", len(dims_ids))
                        if COMM_OP.search(nm) or "Collective name" in a:
                            comm_args[ext] = (a, nm)
                elif cat == "python_function":
                    nm = ev.get("name", "")
                    if nm.startswith(MODULE_PREFIX):
                        s = _ns(ev["ts"])
                        ranges.append(Range(name=nm, start=s, end=s + _ns(ev.get("dur", 0)),
                                            thread=(ev.get("pid"), ev.get("tid"))))
            except _OutOfRange:
                raise InputError(f"{path}: an event has a non-finite or out-of-range time ({cat} "
                                 f"{str(ev)[:120]})") from None
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
                raise InputError(f"{path}: malformed {cat} event ({type(e).__name__}: {e}) in {str(ev)[:120]}") from None
        if not isinstance(self.header.get("traceEvents", []), list):
            raise InputError(f"{path}: traceEvents is not a list")
        self.n_events = n_events
        self.names = list(names)
        self.dims = list(dims_ids)
        gpu_blocks.append(_gpu_columns(_block(gpu_rows, 8, path, GPU_ROW_MAX)))
        cols = {k: np.concatenate([b[k] for b in gpu_blocks]) for k in COLUMNS}
        del gpu_blocks, gpu_rows
        # a GPU event ending before it starts is damage: left out, and counted in a note per device
        bad = cols["dur"] < 0
        self.left_out = cols["device"][bad]
        # an event without its device among events with one is damage too, not a GPU of its own
        nodev = cols["device"] < 0
        self.no_device = int(np.count_nonzero(nodev & ~bad)) if (~nodev).any() else 0
        if self.no_device:
            bad = bad | nodev
        self.cols = {k: v[~bad] for k, v in cols.items()} if bad.any() else cols
        rt = np.concatenate(rt_blocks + [_block(rt_rows, 2, path, RT_ROW_MAX)])
        order = np.argsort(rt[:, 0], kind="stable")
        self.rt_corr = rt[order, 0].astype(np.int64)
        self.rt_ts = np.rint(rt[order, 1] * 1000.0).astype(np.int64)
        self.graph_corr = sorted(set(graph_corr))
        self.op_dims = op_dims
        dist = self.header.get("distributedInfo")
        world = dist.get("world_size") if isinstance(dist, dict) and isinstance(dist.get("world_size"), int) else None
        self.rank = dist.get("rank") if isinstance(dist, dict) and isinstance(dist.get("rank"), int) else None
        self.world_size = world
        self.group_size = max((a["Group size"] for a, _ in comm_args.values()
                               if isinstance(a.get("Group size"), int) and not isinstance(a["Group size"], bool)),
                              default=None)
        self.comm_bytes = {ext: comm_bus_bytes(a, nm, world, str(path)) for ext, (a, nm) in comm_args.items()}
        self.ranges = ranges
        if n_events == 0:
            raise InputError(f"{path}: the trace has no events")

    def gpu(self) -> GPUInfo | None:
        props = self.header.get("deviceProperties")
        if not isinstance(props, list) or not props:
            return gpu_from_names(self.names, rocm=any(k in self.header for k in ROCM_KEYS))
        devs = self.cols["device"]
        on = devs >= 0   # the busiest device's properties (the one aggregate_kineto profiles)
        want = int(np.bincount(devs[on], weights=self.cols["dur"][on]).argmax()) if on.any() else None
        chosen = next((p for p in props if isinstance(p, dict) and p.get("id") == want), None) or props[0]
        if not isinstance(chosen, dict):
            return gpu_from_names(self.names, rocm=any(k in self.header for k in ROCM_KEYS))
        mem = chosen.get("totalGlobalMem")
        mem_gb = mem / 1e9 if isinstance(mem, (int, float)) else None
        name = chosen.get("name") or amd_name(chosen, mem_gb)
        if not name:
            return gpu_from_names(self.names, rocm=any(k in self.header for k in ROCM_KEYS))
        return GPUInfo(name=str(name), sm_count=chosen.get("numSms"), memory_gb=mem_gb,
                       source="deviceProperties" if chosen.get("name") else "deviceProperties (ROCm: no name; from "
                       "compute capability, CUs and memory)")


ROCM_KEYS = ("roctracer_version", "hip_runtime_version", "hip_driver_version")
ISA_GPUS = {"942": "MI300 series", "90a": "MI200 series", "950": "MI350 series", "908": "MI100", "1100": "Radeon RX 7900",
            "1201": "Radeon RX 9070"}
_ISA = re.compile(r"_ISA(9\d\w|1\d{3})_")


AMD_GPUS = {  # (compute major, minor, CUs): [(memory GB at most, name)]
    (9, 4, 304): [(210, "AMD Instinct MI300X"), (300, "AMD Instinct MI325X")],
    (9, 4, 228): [(140, "AMD Instinct MI300A")],
    (9, 5, 256): [(300, "AMD Instinct MI355X")],
    (9, 0, 104): [(70, "AMD Instinct MI210")],
}


def amd_name(props: dict, mem_gb: float | None) -> str | None:
    """A ROCm device's model from what deviceProperties keep when its name is empty (warp size 64)."""
    if props.get("warpSize") != 64:
        return None
    major, minor, cus = props.get("computeMajor"), props.get("computeMinor"), props.get("numSms")
    for limit, name in AMD_GPUS.get((major, minor, cus), []):
        if mem_gb is not None and mem_gb <= limit:
            return name
    return f"AMD gfx{major}{minor}x GPU ({cus} CUs)" if major is not None else None


def gpu_from_names(names: list[str], rocm: bool = False) -> GPUInfo | None:
    """A GPU named from what the kernels were compiled for, for traces without deviceProperties:
    Tensile/hipBLASLt GEMMs carry the gfx ISA (``..._ISA942_...``)."""
    for n in names:
        m = _ISA.search(n)
        if m:
            isa = m.group(1)
            return GPUInfo(name=f"AMD gfx{isa} GPU ({ISA_GPUS.get(isa, 'model not named')}, from kernel names)",
                           source="kernel names")
    if rocm:
        return GPUInfo(name="AMD GPU (ROCm trace; the model is not named)", source="trace header")
    return None


def read_kineto(path: str | os.PathLike, req: StepRequest | None = None,
                on_read: Callable[[int], None] | None = None) -> Aggregate:
    req = req or StepRequest()
    tr = KinetoTrace(path, on_read)
    return aggregate_kineto(tr, req)


def aggregate_kineto(tr: KinetoTrace, req: StepRequest) -> Aggregate:
    c = tr.cols
    notes: list[str] = []
    n = len(c["start"])
    if n == 0:
        if len(tr.left_out):
            raise InputError(f"{tr.path}: every GPU event ends before it starts (a damaged trace)")
        raise InputError(f"{tr.path}: the trace has no GPU events (kernel, gpu_memcpy, gpu_memset); "
                         "profile with ProfilerActivity.CUDA")
    sel = np.ones(n, dtype=bool)
    devs = c["device"]
    present = sorted({int(d) for d in np.unique(devs)})
    device = None
    if req.device is not None:
        if req.device not in present:
            raise InputError(f"{tr.path}: no kernels on device {req.device} (devices: {', '.join(map(str, present))})")
        sel = devs == req.device
        device = req.device
    elif len(present) > 1:
        main = int(np.bincount(devs - devs.min(), weights=c["dur"]).argmax() + devs.min())   # the busiest
        sel = devs == main
        device = main
        notes.append(f"kernels on {len(present)} GPUs; profiling device {main} (choose with --device)")
    damaged = int(len(tr.left_out) if device is None else np.count_nonzero(tr.left_out == device))
    if damaged:
        notes.append(f"{damaged} GPU event(s) ending before they start were left out (a damaged trace)")
    if tr.no_device:
        notes.append(f"{tr.no_device} GPU event(s) without their device (args.device) were left out (a damaged trace)")
    # a kernel whose runtime call is not in the trace was launched before the profiler started
    corr_all = c["corr"]
    orphan = np.zeros(n, dtype=bool)
    if len(tr.rt_corr):
        j = np.clip(np.searchsorted(tr.rt_corr, corr_all), 0, len(tr.rt_corr) - 1)
        orphan = tr.rt_corr[j] != corr_all
    orphans = (0, 0)
    if orphan.any():
        k = sel & orphan
        orphans = (int(k.sum()), int(c["dur"][k].sum()))
        if not req.include_orphans and orphans[0]:
            sel = sel & ~orphan
            notes.append(f"{orphans[0]} GPU events ({orphans[1] / 1e6:.3f} ms) launched before the trace began were "
                         "left out (their launch is not in the trace); --include-orphans keeps them")
        elif orphans[0]:
            notes.append(f"{orphans[0]} GPU events ({orphans[1] / 1e6:.3f} ms) launched before the trace began are "
                         "included (--include-orphans): they are attributed by their start time")
    if not sel.any():
        raise InputError(f"{tr.path}: no GPU events left to profile (every one was launched before the trace began; "
                         "--include-orphans keeps them)")
    pick = (lambda a: a) if sel.all() else (lambda a: a[sel])  # no copies when every event is kept
    kind, start, dur = pick(c["kind"]), pick(c["start"]), pick(c["dur"])
    end = start + dur
    stream, corr, name, ext = pick(c["stream"]), pick(c["corr"]), pick(c["name"]), pick(c["ext"])
    launch = np.full(len(corr), -1, dtype=np.int64)
    if len(tr.rt_corr):
        j = np.clip(np.searchsorted(tr.rt_corr, corr), 0, len(tr.rt_corr) - 1)
        hit = tr.rt_corr[j] == corr
        launch[hit] = tr.rt_ts[j[hit]]
    no_launch = launch < 0
    if no_launch.any():
        launch = np.where(no_launch, start, launch)
    if not len(tr.rt_corr):
        notes.append("no cuda_runtime events: kernels are attributed to ranges by GPU time, not launch")

    cpu_ranges = [r for r in tr.ranges if not r.gpu and not r.name.startswith(MODULE_PREFIX)]
    gpu_ranges = [r for r in tr.ranges if r.gpu]
    annotations = st.families(cpu_ranges or gpu_ranges)
    mode, regex, found = req.mode, req.range_regex, ""
    asked = req.mode
    if mode == "auto":
        if regex is None:
            auto = st.auto_step_range(cpu_ranges, "annotation") or st.auto_step_range(gpu_ranges, "GPU annotation")
            if auto is not None:
                regex, found = auto
        mode = "range" if regex else ("graph" if len(tr.graph_corr) >= 2 else "gap")
    if mode == "range" and not regex:
        raise InputError("--step-mode range needs --step-range REGEX")
    step = np.full(len(start), -1, dtype=np.int64)
    labels: list[str] = []
    step_ranges: list[Range] = []
    step_pool: list[Range] = []   # the annotations the step ranges were chosen among
    detail = ""
    if mode == "range":
        rx = st.compile_regex(regex, "--step-range")
        # a side whose matching ranges all end before they start has no step to give (its GPU
        # mirrors may have them)
        on_cpu = any(rx.search(r.name) and r.end > r.start for r in cpu_ranges)
        on_gpu = not on_cpu and any(rx.search(r.name) and r.end > r.start for r in gpu_ranges)
        # matching neither: the error lists the annotation ranges of both kinds
        pool = gpu_ranges if on_gpu else cpu_ranges if on_cpu else cpu_ranges + gpu_ranges
        step_ranges, step_pool = st.select_step_ranges(pool, regex, tr.path), pool
        key = start if on_gpu else launch
        step = _assign(key, [(r.start, r.end, i) for i, r in enumerate(step_ranges)])
        labels = [r.name for r in step_ranges]
        detail = (f"{st.count(len(step_ranges), found.removesuffix('s'), found)} found in the trace" if found else
                  f"{st.count(len(step_ranges), ('GPU' if on_gpu else 'CPU') + ' annotation range')} matching '{regex}'")
        if found and not (step >= 0).any():  # the annotations hold no GPU work: fall back
            mode, step_ranges, labels = ("graph" if len(tr.graph_corr) >= 2 else "gap"), [], []
    if mode == "graph":
        if not tr.graph_corr:
            raise InputError(f"{tr.path}: no CUDA/HIP graph launches in the trace; use --step-range or --step-mode gap")
        first_name = {}
        for cc, nm in zip(corr.tolist(), name.tolist()):
            first_name.setdefault(cc, nm)
        launches = [(cc, first_name.get(cc, -1)) for cc in tr.graph_corr]
        starters = st.graph_step_starters(launches)
        idx = np.searchsorted(np.asarray(starters), corr, side="right") - 1
        step = np.where(corr >= starters[0], idx, -1)
        labels = [f"graph launch {x}" for x in starters]
        detail = (f"{st.count(len(starters), 'launch', 'launches')} of the most frequent CUDA graph "
                  f"({st.count(len(tr.graph_corr), 'graph launch', 'graph launches')})")
    elif mode == "gap":
        gap_ns = int(req.gap_us * 1e3) if req.gap_us else st.gap_threshold_ns(start, end, name)
        b = st.gap_boundaries(start, end, gap_ns) if gap_ns is not None else []
        if len(b) >= 2 or (req.gap_us and b):
            step = np.searchsorted(np.asarray(b), start, side="right") - 1
            labels = [f"gap step {i}" for i in range(len(b))]
            us = gap_ns / 1e3
            shown = f"{us:.1f}" if us >= 0.1 else f"{us:.3g}"
            detail = f"{len(b)} step{'' if len(b) == 1 else 's'} separated by GPU idle gaps > {shown} us"
        elif asked == "gap":   # asked for, it finds steps or says why not (as graph mode does)
            raise InputError(st.no_gap_steps(tr.path))
        else:
            mode = "whole"
    if mode == "whole":
        step[:] = 0
        labels = ["whole trace"]
        if asked == "whole":
            detail = "the whole trace as one step, as --step-mode whole asks"
        else:
            detail = "no step ranges, graph launches or repeating gaps: the whole trace is one step"
            notes.append("steps not found; pass --step-range REGEX to profile per step")

    tag = np.full(len(start), -1, dtype=np.int64)
    tag_names: list[str] = []
    if req.tag_regex and tr.ranges:
        rx = st.compile_regex(req.tag_regex, "rule range")
        sset = set(step_ranges)
        cpu_tagged = [r for r in tr.ranges if not r.gpu]
        for rs, key in ((cpu_tagged, launch), (gpu_ranges, start)):
            tagged = [r for r in rs if r not in sset and rx.search(r.name)]
            if not tagged:
                continue
            segs = st.innermost_segments(tagged)
            for nm in sorted({x for _, _, x in segs}):
                if nm not in tag_names:
                    tag_names.append(nm)
            t = _assign(key, [(s, e - 1, tag_names.index(nm)) for s, e, nm in segs])
            tag = np.where(tag < 0, t, tag)

    dims = np.array([tr.op_dims.get(int(x), -1) for x in ext], dtype=np.int64) if tr.op_dims else np.full(len(start), -1)
    comm = (np.array([tr.comm_bytes.get(int(x), 0) for x in ext], dtype=np.int64) if tr.comm_bytes
            else np.zeros(len(start), dtype=np.int64))

    excl = st.exclusive_ns(step, stream, start, end)
    keep = step >= 0
    groups: list[KernelGroup] = []
    steps: list[StepInfo] = []
    if keep.any():
        kp = (lambda a: a) if keep.all() else (lambda a: a[keep])
        cols = [kp(step), kp(tag), kp(name), kp(kind), kp(stream), kp(dims)]
        # one int64 key per event: mixed radix over each column's distinct values (sorting one
        # integer column takes far less memory than np.unique over rows of six)
        uniques = [np.unique(col, return_inverse=True) for col in cols]
        values = [u for u, _ in uniques]
        if np.prod([float(len(u)) for u in values]) >= 2.0 ** 62:
            raise InputError(f"{tr.path}: too many distinct kernel keys to aggregate")
        key = np.zeros(int(keep.sum()), dtype=np.int64)
        for u, r in uniques:
            key = key * len(u) + r.reshape(-1)
        del uniques, cols
        ukey, inv = np.unique(key, return_inverse=True)
        inv = inv.reshape(-1)
        cnt = np.bincount(inv)
        tot = np.bincount(inv, weights=kp(dur)).astype(np.int64)
        exc = np.bincount(inv, weights=kp(excl)).astype(np.int64)
        cb = np.bincount(inv, weights=kp(comm)).astype(np.int64) if tr.comm_bytes else np.zeros(len(cnt), np.int64)
        digits = []
        rest = ukey.copy()
        for u in reversed(values):
            digits.append(u[rest % len(u)])
            rest //= len(u)
        uniq = np.stack(digits[::-1], axis=1)
        for (s_, t_, n_, k_, str_, d_), cn, to, by, ex in zip(uniq.tolist(), cnt.tolist(), tot.tolist(), cb.tolist(),
                                                              exc.tolist()):
            groups.append(KernelGroup(step=s_, name=tr.names[n_], kind=("kernel", "memcpy", "memset")[k_],
                                      stream=str_, tag=(tag_names[t_] if t_ >= 0 else None),
                                      dims=(tr.dims[d_] if d_ >= 0 else None), count=cn, total_ns=to, comm_bytes=by,
                                      excl_ns=ex))
        ks, kst, ken = kp(step), kp(start), kp(end)
        order = np.argsort(ks, kind="stable")
        ks, kst, ken = ks[order], kst[order], ken[order]
        cuts = np.nonzero(np.diff(ks))[0] + 1
        bounds = np.concatenate([[0], cuts, [len(ks)]])
        present_steps = [int(ks[b]) for b in bounds[:-1]]
        for j, i in enumerate(present_steps):
            a, b = bounds[j], bounds[j + 1]
            g0, g1 = int(kst[a:b].min()), int(ken[a:b].max())
            if mode == "range":
                r = step_ranges[i]
                w0, w1 = (r.start, max(r.end, g1))
            else:
                w0 = g0
                w1 = int(kst[bounds[j + 1]:bounds[j + 2]].min()) if j + 1 < len(present_steps) else g1
            steps.append(StepInfo(index=i, label=labels[i] if i < len(labels) else str(i), start=w0, end=w1,
                                  gpu_start=g0, gpu_end=g1, busy_ns=st.union_ns(kst[a:b], ken[a:b]), events=int(b - a)))
    if mode == "range" and (note := st.untangle_range_walls(steps)):
        notes.append(note)
    empty = len(labels) - len(steps)
    if empty > 0:
        notes.append(f"{empty} step(s) launched no GPU work and were left out")

    def locate_last(accept) -> dict[int, tuple]:
        ok_name = np.array([bool(accept(nm)) for nm in tr.names], dtype=bool)
        m = (step >= 0) & (tag < 0) & (kind == 0) & ok_name[name]
        out: dict[int, tuple] = {}
        if not m.any():
            return out
        idx = np.nonzero(m)[0]
        order = np.lexsort((start[idx], launch[idx], step[idx]))  # by step, then launch, then start
        idx = idx[order]
        last = idx[np.append(np.nonzero(np.diff(step[idx]))[0], len(idx) - 1)]
        for i in last.tolist():
            out[int(step[i])] = (tr.names[name[i]], "kernel", int(stream[i]),
                                 tr.dims[dims[i]] if dims[i] >= 0 else None, int(dur[i]), int(excl[i]))
        return out

    # the step annotations read (range mode), else each side's: a CPU annotation and its GPU mirror
    # are one step annotation
    sides = [step_pool] if mode == "range" else [cpu_ranges, gpu_ranges]
    warnings = _negative_step_ranges(sides, req.range_regex, mode, detail)
    version = str(tr.header.get("schemaVersion", "unknown"))
    distributed = {k: v for k, v in (("rank", tr.rank), ("world_size", tr.world_size), ("group_size", tr.group_size),
                                     ("gpus", len(present) if len(present) > 1 else None)) if v is not None}
    return Aggregate(path=tr.path, format="kineto", format_version=version, gpu=tr.gpu(), step_mode=mode,
                     step_detail=detail, steps=steps, groups=groups, total_events=int(n), notes=notes, warnings=warnings,
                     locate_last=locate_last, orphans=orphans, annotations=annotations, distributed=distributed)


def _negative_step_ranges(sides: list[list[Range]], regex: str | None, mode: str, detail: str) -> list[str]:
    """A warning counting the step annotations (ranges ``--step-range`` or a step family matches)
    that end before they start: the step finder leaves them out, which drops those steps, or all of
    them and with them the range mode. ``sides``: the annotations the steps were read from, or each
    side's (CPU, GPU) where none were; a step annotation recorded on both sides (a CPU
    ``ProfilerStep#N`` and its GPU mirror) counts once, as the side with more of them."""
    pats = [st.compile_regex(regex, "--step-range")] if regex else [re.compile(rx) for _, rx in st.STEP_FAMILIES]
    bad = max(([r for r in ranges if r.end < r.start and any(p.search(r.name) for p in pats)] for ranges in sides),
              key=len, default=[])
    if not bad:
        return []
    fams = ", ".join(repr(f) for f in st.families(bad, top=3))
    then = ("the steps are the step annotations left" if mode == "range" else
            f"with no step annotation left, the steps are {detail or 'the whole trace'}")
    return [f"{st.count(len(bad), 'step annotation range')} ({fams}) end{'s' if len(bad) == 1 else ''} before "
            f"{'it starts' if len(bad) == 1 else 'they start'} (a negative duration) and "
            f"{'was' if len(bad) == 1 else 'were'} left out: {then}"]


def _assign(key: np.ndarray, intervals: list[tuple[int, int, int]]) -> np.ndarray:
    """Index of the interval (start, end inclusive, value) holding each key; -1 outside all."""
    out = np.full(len(key), -1, dtype=np.int64)
    if not intervals:
        return out
    iv = sorted(intervals)
    s = np.array([x[0] for x in iv], dtype=np.int64)
    e = np.array([x[1] for x in iv], dtype=np.int64)
    v = np.array([x[2] for x in iv], dtype=np.int64)
    j = np.searchsorted(s, key, side="right") - 1
    ok = j >= 0
    jj = np.where(ok, j, 0)
    ok &= key <= e[jj]
    out[ok] = v[jj[ok]]
    return out
