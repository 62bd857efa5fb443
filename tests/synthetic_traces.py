"""Synthetic decode traces with known answers, for tests and the reader benchmark.

``SynthSpec`` describes a decode loop: ``steps`` steps of ``layers`` layers (RMSNorm, QKV GEMM,
attention, O GEMM, RMSNorm, gate/up GEMM, SiLU-and-mul, down GEMM), an LM-head GEMM and an argmax.
``write_nsys_sqlite`` writes it with the tables and columns of an Nsight Systems 3.x export (or
2.x metadata), ``write_kineto`` as a PyTorch profiler trace; ``truth`` gives what a correct reader
must report: per-step busy ns, wall ns, kernel counts and ns per kernel name.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

LAYER = [("rms_norm_kernel", 1500), ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 9000),
         ("flash_fwd_splitkv_kernel", 6000), ("nvjet_sm90_tst_8x64_64x16_2x1_v_bz_TNN", 5000),
         ("rms_norm_kernel", 1500), ("nvjet_sm90_tst_128x8_64x6_2x1_v_bz_TNT", 21000),
         ("act_and_mul_kernel", 1200), ("nvjet_sm90_tst_16x64_64x16_4x1_v_bz_TNN", 11000)]
TAIL = [("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT_lmhead", 40000),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", 3000)]


@dataclass
class SynthSpec:
    steps: int = 4
    layers: int = 2
    gap_ns: int = 800  # idle gap between kernels inside a step
    step_gap_ns: int = 250_000  # idle time between steps (CPU: scheduler, sampling readback)
    graphs: bool = False  # launch each step as one CUDA graph
    memcpy: bool = True  # one 8-byte DtoH copy per step (the accepted token)
    second_stream: bool = False  # run the attention kernels on stream 13 ...
    overlap_ns: int = 0  # ... starting this much before the previous kernel ends (concurrent streams)
    pdl_ns: int = 0  # each stream-7 kernel after a step's first starts this much before the one before it
    # ends, on the same stream: launched early under programmatic dependent launch, waiting for it
    schema2: bool = False  # EXPORT_META_DATA (2.x) instead of META_DATA_EXPORT (3.x)
    nvtx_text_ids: bool = False  # NVTX names through textId -> StringIds instead of text
    ahead: bool = False  # the host queues steps ahead of the GPU: a step's range ends after its launches
    start_ns: int = 1_000_000_000

    def kernels(self):
        return [k for _ in range(self.layers) for k in LAYER] + TAIL


def timeline(spec: SynthSpec):
    """Yield per step: (cpu_start, cpu_end, [(name, gpu_start, gpu_end, stream, launch_t, kind)])."""
    t = spec.start_ns
    g = 0
    for _ in range(spec.steps):
        cpu0 = t
        launch = t + 2000
        g = max(t + 10_000, g + spec.gap_ns) if spec.ahead else t + 10_000
        evs = []
        for name, dur in spec.kernels():
            stream = 13 if (spec.second_stream and name.startswith("flash")) else 7
            s0 = g - (spec.gap_ns + spec.overlap_ns if stream == 13 else spec.gap_ns + spec.pdl_ns if evs else 0)
            evs.append((name, s0, s0 + dur, stream, launch, "kernel"))
            launch += 3000 if not spec.graphs else 0
            g = s0 + dur + spec.gap_ns
        if spec.memcpy:
            evs.append(("Memcpy DtoH", g, g + 1500, 7, launch + 100, "memcpy"))
            g += 1500
        # the CPU waits for the token (the step range ends after the GPU), or runs on to the next step
        cpu1 = launch + 1000 if spec.ahead else g + 5000
        yield cpu0, cpu1, evs
        t = cpu1 + spec.step_gap_ns


def truth(spec: SynthSpec) -> list[dict]:
    out = []
    for cpu0, cpu1, evs in timeline(spec):
        per = {}
        for name, s, e, *_ in evs:
            per.setdefault(name, [0, 0])
            per[name][0] += 1
            per[name][1] += e - s
        busy, cur_s, cur_e = 0, None, None
        for _, s, e, *_ in sorted(evs, key=lambda x: x[1]):
            if cur_e is None or s > cur_e:
                busy += 0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        excl, ends = {}, {}   # per name, its kernels' time no earlier kernel of their stream covers
        for name, s, e, stream, *_ in sorted(evs, key=lambda x: (x[1], x[2])):
            excl[name] = excl.get(name, 0) + max(0, e - max(s, ends.get(stream, s)))
            ends[stream] = max(ends.get(stream, e), e)
        out.append({"cpu": (cpu0, cpu1), "busy_ns": busy, "names": per, "excl": excl,
                    "gpu": (min(x[1] for x in evs), max(x[2] for x in evs))})
    return out


META3 = [("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"), ("EXPORT_SCHEMA_VERSION", "3.20.3")]
META2 = [("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"), ("EXPORT_SCHEMA_VERSION", "2.9.1")]


def write_nsys_sqlite(path: str | Path, spec: SynthSpec, batch: int = 200_000) -> Path:
    """Write ``spec`` as a minimal Nsight Systems SQLite export (the tables SpecPilot reads)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    meta = "EXPORT_META_DATA" if spec.schema2 else "META_DATA_EXPORT"
    con.executescript(f"""
        PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;
        CREATE TABLE {meta} (name TEXT NOT NULL, value TEXT);
        CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE TARGET_INFO_GPU (vmId INTEGER NOT NULL, id INTEGER NOT NULL, name TEXT, memoryBandwidth INTEGER,
            smCount INTEGER, totalMemory INTEGER, l2CacheSize INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
            contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
            demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, gridX INTEGER, blockX INTEGER,
            graphNodeId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
            contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, bytes INTEGER NOT NULL,
            copyKind INTEGER NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
            globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, text TEXT,
            globalTid INTEGER, textId INTEGER, domainId INTEGER);
    """)
    con.executemany(f"INSERT INTO {meta} VALUES (?, ?)", META2 if spec.schema2 else META3)
    con.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 0, 'NVIDIA H200', 4814304000000, 132, 150109880320, 62914560)")
    strings: dict[str, int] = {}

    def sid(s):
        if s not in strings:
            strings[s] = len(strings)
        return strings[s]

    launch_name = sid("cudaGraphLaunch_v10000" if spec.graphs else "cudaLaunchKernel_v7000")
    memcpy_name = sid("cudaMemcpyAsync_v3020")
    tid = 281482375463353
    corr = 100
    k_rows, r_rows, m_rows, n_rows = [], [], [], []

    def flush():
        if k_rows:
            con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,0,1,?,?,1,?,?,1,256,?)", k_rows)
        if r_rows:
            con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,1,?,?,?,0)", r_rows)
        if m_rows:
            con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,0,1,?,?,8,2)", m_rows)
        k_rows.clear(), r_rows.clear(), m_rows.clear()

    for i, (cpu0, cpu1, evs) in enumerate(timeline(spec)):
        label = f"decode_step_{i}"
        if spec.nvtx_text_ids:
            n_rows.append((cpu0, cpu1, 59, None, tid, sid(label), 0))
        else:
            n_rows.append((cpu0, cpu1, 59, label, tid, None, 0))
        graph_corr = None
        for node, (name, s, e, stream, launch, kind) in enumerate(evs):
            if kind == "memcpy":
                corr += 1
                r_rows.append((launch, launch + 500, tid, corr, memcpy_name))
                m_rows.append((s, e, stream, corr))
                continue
            if spec.graphs:
                if graph_corr is None:
                    corr += 1
                    graph_corr = corr
                    r_rows.append((launch, launch + 500, tid, corr, launch_name))
                k_rows.append((s, e, stream, graph_corr, sid(name), sid(name.split("<")[0][:40]), 1000 + node))
            else:
                corr += 1
                r_rows.append((launch, launch + 500, tid, corr, launch_name))
                k_rows.append((s, e, stream, corr, sid(name), sid(name.split("<")[0][:40]), None))
        if len(k_rows) >= batch:
            flush()
    flush()
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?)", n_rows)
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(v, k) for k, v in strings.items()])
    con.commit()
    con.close()
    return path


def write_kineto(path: str | Path, spec: SynthSpec, cpu_noise: int = 0, indent: int | None = None,
                 gz: bool | None = None) -> Path:
    """Write ``spec`` as a PyTorch profiler Chrome trace; ``cpu_noise`` python_function events per kernel
    pad it the way real traces are padded (they are skipped by the reader)."""
    path = Path(path)
    gz = path.suffix == ".gz" if gz is None else gz
    opener = gzip.open if gz else open
    pid, tid = 4242, 4242
    with opener(path, "wt", encoding="utf-8") as fh:
        fh.write('{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": '
                 '150109880320, "numSms": 132}], "traceEvents": [\n')
        first = True
        corr = 100
        ext = 1
        for i, (cpu0, cpu1, evs) in enumerate(timeline(spec)):
            out = [{"ph": "X", "cat": "user_annotation", "name": f"decode_step_{i}", "pid": pid, "tid": tid,
                    "ts": cpu0 / 1e3, "dur": (cpu1 - cpu0) / 1e3, "args": {"External id": ext}}]
            graph_corr = None
            for name, s, e, stream, launch, kind in evs:
                ext += 1
                if not (spec.graphs and kind == "kernel" and graph_corr is not None):
                    corr += 1
                    rname = "cudaGraphLaunch" if (spec.graphs and kind == "kernel") else (
                        "cudaMemcpyAsync" if kind == "memcpy" else "cudaLaunchKernel")
                    out.append({"ph": "X", "cat": "cuda_runtime", "name": rname, "pid": pid, "tid": tid,
                                "ts": launch / 1e3, "dur": 0.5, "args": {"External id": ext, "correlation": corr}})
                    if spec.graphs and kind == "kernel":
                        graph_corr = corr
                c = graph_corr if (spec.graphs and kind == "kernel") else corr
                out.append({"ph": "X", "cat": "kernel" if kind == "kernel" else "gpu_memcpy", "name": name,
                            "pid": 0, "tid": stream, "ts": s / 1e3, "dur": (e - s) / 1e3,
                            "args": {"External id": ext, "device": 0, "stream": stream, "correlation": c,
                                     "grid": [132, 1, 1], "block": [256, 1, 1]}})
                for j in range(cpu_noise):
                    out.append({"ph": "X", "cat": "python_function", "name": f"model.py({100 + j}): forward",
                                "pid": pid, "tid": tid, "ts": launch / 1e3 - 1, "dur": 0.9,
                                "args": {"Python parent id": ext, "Python id": ext * 10 + j}})
            for ev in out:
                if not first:
                    fh.write(",\n")
                fh.write(json.dumps(ev, indent=indent))
                first = False
        fh.write('\n], "traceName": "synthetic"}\n')
    return path
