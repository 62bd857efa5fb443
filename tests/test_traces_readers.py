"""Trace readers against real fixtures (two Nsight generations, MI300X/H200 Kineto) and synthetic
traces with known answers."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.probes.traces import StepRequest, read_trace, sniff
from specpilot.probes.traces.nsys_sqlite import describe
from synthetic_traces import SynthSpec, truth, write_kineto, write_nsys_sqlite

LOCAL = Path(__file__).parent / "fixtures"
H200_EAGER = LOCAL / "nsys_h200_decode_eager.sqlite"
H200_GRAPH = LOCAL / "nsys_h200_decode_graph.sqlite"
H200_KINETO = LOCAL / "kineto_h200_decode_eager.json.gz"
H200_REP = LOCAL / "nsys_h200_decode_eager.nsys-rep"


# ---- shared fixtures ------------------------------------------------------------------------
def test_nsys_3x_fixture_steps_by_nvtx_range(fixtures_dir):
    a = read_trace(fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite", StepRequest(range_regex=r"^step_\d+$"))
    assert a.format == "nsys-sqlite" and a.format_version.startswith("3.")
    assert a.gpu.name == "NVIDIA H200" and a.gpu.sm_count == 132
    assert a.gpu.bandwidth_tbs == pytest.approx(4.814304)
    assert [s.label for s in a.steps] == [f"step_{i}" for i in range(20)]
    # every step launched exactly the linear (nvjet + split-K reduce), a copy and a softmax
    for s in a.steps:
        names = [g.name for g in a.groups if g.step == s.index]
        assert s.events == 4 and len(names) == 4
        assert any("nvjet" in n for n in names) and any("SoftMaxForward" in n for n in names)
    # busy time is what the kernels took: compare with the raw table
    con = sqlite3.connect(fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite")
    total = con.execute("SELECT sum(end-start) FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE shortName IN "
                        "(SELECT id FROM StringIds WHERE value != 'distribution_elementwise_grid_stride_kernel')"
                        ).fetchone()[0]
    assert sum(s.busy_ns for s in a.steps) == total


def test_nsys_2x_fixture_memcpy_and_textid_ranges(fixtures_dir):
    path = fixtures_dir / "nsys_saxpy_a100_schema2.9.sqlite"
    a = read_trace(path, StepRequest())
    assert a.format_version.startswith("2.") and a.gpu.name == "NVIDIA A100-SXM4-40GB"
    assert a.gpu.bandwidth_tbs == pytest.approx(1.5552)
    kinds = Counter(g.kind for g in a.groups for _ in range(g.count))
    assert kinds == {"kernel": 5, "memcpy": 15}
    assert {g.name for g in a.groups if g.kind == "memcpy"} == {"Memcpy HtoD", "Memcpy DtoH"}
    assert a.step_mode == "gap" and len(a.steps) == 5  # five saxpy rounds, found from idle gaps
    d = describe(path)
    assert d["schema_version"] == "2.9.1" and d["counts"]["CUPTI_ACTIVITY_KIND_KERNEL"] == 5


def test_kineto_mi300x_sglang_decode(fixtures_dir):
    path = fixtures_dir / "kineto_sglang_qwen3-8b_decode_mi300x.json.gz"
    a = read_trace(path, StepRequest(range_regex=r"^step\["))
    assert a.format == "kineto" and a.gpu.name == "AMD Instinct MI300X" and a.gpu.sm_count == 304
    assert len(a.steps) == 1 and a.steps[0].label == "step[DECODE bs=32]"
    # 544 kernels of the HIP graph replay + the eager kernels and copies launched inside the range
    assert sum(g.count for g in a.groups) == a.steps[0].events == 551
    assert sum(g.count for g in a.groups if g.name.startswith("Cijk_")) == 36 * 4 + 1
    assert a.total_events == 558


def test_kineto_torch_compile_triton_shapes(fixtures_dir):
    a = read_trace(fixtures_dir / "kineto_torch_compile_triton.json.gz", StepRequest(range_regex="CompiledFxGraph"))
    assert len(a.steps) == 1 and a.steps[0].events == 12
    mm = [g for g in a.groups if g.name.startswith("Cijk_")]
    assert mm and all(g.dims and g.dims.startswith("aten::mm[") for g in mm)
    assert any(g.name.startswith("triton_") for g in a.groups)


# ---- our H200 captures: Nsight and Kineto of the same loop agree ------------------------------
def _by_tag(a):
    c = Counter()
    for g in a.groups:
        c[(g.tag, g.kind)] += g.count
    return c


def test_h200_nsys_and_kineto_agree_on_steps_and_ranges():
    req = StepRequest(range_regex=r"^decode_step_\d+$", tag_regex="draft|lm_head")
    n = read_trace(H200_EAGER, req)
    k = read_trace(H200_KINETO, req)
    assert len(n.steps) == len(k.steps) == 12
    assert [s.events for s in n.steps] == [s.events for s in k.steps] == [262] * 12
    assert _by_tag(n) == _by_tag(k)
    assert _by_tag(n)[("draft/lm_head", "kernel")] == 3 * 12  # the drafter's own LM head, 3 drafts a step
    assert _by_tag(n)[("lm_head", "kernel")] == 12
    # same GPU work, two profilers: busy time per step within 5%
    for a, b in zip(n.steps, k.steps):
        assert a.busy_ns == pytest.approx(b.busy_ns, rel=0.05)


def test_h200_graph_trace_whole_graph_records_are_steps():
    a = read_trace(H200_GRAPH, StepRequest(mode="graph"))
    assert a.step_mode == "graph" and len(a.steps) == 12
    auto = read_trace(H200_GRAPH, StepRequest())  # the decode_step_N annotations come first
    assert auto.step_mode == "range" and len(auto.steps) == 12 and "found in the trace" in auto.step_detail
    assert {g.kind for g in a.groups} == {"graph", "memcpy"}
    assert any("cuda-graph-trace=node" in n for n in a.notes)
    # wall (launch to launch) covers the busy time
    assert all(s.wall_ns >= s.busy_ns > 0 for s in a.steps[:-1])


def test_nsys_rep_needs_nsys(monkeypatch, tmp_path):
    import specpilot.probes.traces.nsys_rep as rep

    monkeypatch.setattr(rep, "find_nsys", lambda: None)
    assert sniff(H200_REP) == "nsys-rep"
    alone = tmp_path / H200_REP.name   # without the export beside it in tests/fixtures, which needs no nsys
    shutil.copy(H200_REP, alone)
    with pytest.raises(EnvironmentMissing, match="nsys"):
        read_trace(alone)


@pytest.mark.skipif(shutil.which("nsys") is None, reason="needs nsys")
def test_nsys_rep_export(tmp_path):
    dst = tmp_path / "r.nsys-rep"
    shutil.copy(H200_REP, dst)
    a = read_trace(dst, StepRequest(range_regex="^decode_step"))
    assert len(a.steps) == 12


# ---- synthetic traces with exact answers ------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"graphs": True}, {"second_stream": True, "overlap_ns": 3000},
                                {"schema2": True, "nvtx_text_ids": True}, {"pdl_ns": 400}])
@pytest.mark.parametrize("fmt", ["sqlite", "json", "json.gz"])
@pytest.mark.parametrize("mode", ["range", "auto", "no ranges"])
def test_synthetic_exact(tmp_path, kw, fmt, mode):
    spec = SynthSpec(steps=5, layers=2, **kw)
    path = tmp_path / f"t.{fmt}"
    (write_nsys_sqlite if fmt == "sqlite" else write_kineto)(path, spec)
    fallback = "graph" if kw.get("graphs") else "gap"
    # auto finds the decode_step_N annotations by itself; without ranges, graph launches or gaps
    req = StepRequest(range_regex="decode_step" if mode == "range" else None,
                      mode=fallback if mode == "no ranges" else "auto")
    a = read_trace(path, req)
    tr = truth(spec)
    assert a.step_mode == ("range" if mode != "no ranges" else fallback)
    if mode == "auto":
        assert "decode/verify step ranges found in the trace" in a.step_detail
    assert len(a.steps) == spec.steps
    for s, t in zip(a.steps, tr):
        assert s.busy_ns == t["busy_ns"]
        assert (s.gpu_start, s.gpu_end) == t["gpu"]
        names = {}
        for g in a.groups:
            if g.step == s.index:
                n = names.setdefault(g.name, [0, 0])
                n[0] += g.count
                n[1] += g.total_ns
        assert names == {k: list(v) for k, v in t["names"].items()}
        # overlaps split: each kernel from where the one before it on its stream ended (an Nsight
        # export only where a step's durations exceed its span: there the plain durations stand)
        if fmt != "sqlite" or kw.get("pdl_ns"):
            excl = {}
            for g in a.groups:
                if g.step == s.index:
                    excl[g.name] = excl.get(g.name, 0) + g.excl_ns
            assert excl == t["excl"]
        elif not kw.get("second_stream"):
            assert all(g.excl_ns is None for g in a.groups)
        if mode != "no ranges":
            assert (s.start, s.end) == t["cpu"]
    if mode == "no ranges":  # launch-to-launch period: GPU start of the next step
        assert a.steps[0].end == tr[1]["gpu"][0]


def test_step_range_that_matches_nothing_lists_ranges(tmp_path):
    p = write_nsys_sqlite(tmp_path / "t.sqlite", SynthSpec(steps=3))
    with pytest.raises(InputError, match=r"no NVTX/annotation range matches.*'decode_step_N' x3"):
        read_trace(p, StepRequest(range_regex="^verify"))
    with pytest.raises(InputError, match="not a valid regular expression"):
        read_trace(p, StepRequest(range_regex="("))


def test_gap_override_and_whole_mode(tmp_path):
    p = write_kineto(tmp_path / "t.json", SynthSpec(steps=3, layers=1))
    a = read_trace(p, StepRequest(mode="gap", gap_us=100))
    assert len(a.steps) == 3
    w = read_trace(p, StepRequest(mode="whole"))
    assert len(w.steps) == 1 and w.steps[0].events == 3 * (8 + 2 + 1)


def test_parallel_grouping_equals_serial(tmp_path, monkeypatch):
    import specpilot.probes.traces.nsys_export as nexp

    p = write_nsys_sqlite(tmp_path / "p.sqlite", SynthSpec(steps=12, layers=2, second_stream=True, overlap_ns=2000))
    g = write_nsys_sqlite(tmp_path / "g.sqlite", SynthSpec(steps=12, layers=2, graphs=True))

    def run():
        out = []
        for path, req in ((p, StepRequest(range_regex="decode", tag_regex="rms")), (p, StepRequest()), (g, StepRequest())):
            a = read_trace(path, req)
            out.append(([(s.busy_ns, s.start, s.end, s.events) for s in a.steps],
                        sorted((x.step, x.name, x.tag, x.kind, x.count, x.total_ns) for x in a.groups)))
        return out

    serial = run()
    monkeypatch.setattr(nexp, "PARALLEL_MIN_ROWS", 50)  # several threads, each on a slice of rowids
    assert run() == serial


def _two_gpus(tmp_path, moved: str = "deviceId = 1"):
    """A synthetic export whose attention kernels ran on GPU 1, an A100 (``moved``: what they get
    set to); everything else on GPU 0, an H200."""
    p = write_nsys_sqlite(tmp_path / "two.sqlite", SynthSpec(steps=4, layers=1))
    con = sqlite3.connect(p)
    con.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 1, 'NVIDIA A100-SXM4-80GB', 2039000000000, 108, 0, 0)")
    con.execute(f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET {moved} WHERE demangledName IN "
                "(SELECT id FROM StringIds WHERE value LIKE 'flash%')")
    con.commit()
    con.close()
    return p


def test_two_gpus_busiest_by_default_and_device_option(tmp_path):
    p = _two_gpus(tmp_path)
    a = read_trace(p, StepRequest(range_regex="decode"))
    assert a.gpu.name == "NVIDIA H200" and any("--device" in n for n in a.notes)
    assert not any(g.name.startswith("flash") for g in a.groups)
    b = read_trace(p, StepRequest(range_regex="decode", device=1))
    assert b.gpu.name == "NVIDIA A100-SXM4-80GB"
    assert {g.name for g in b.groups if g.kind == "kernel"} == {"flash_fwd_splitkv_kernel"}
    with pytest.raises(InputError, match="no kernels on device 5"):
        read_trace(p, StepRequest(device=5))


@pytest.mark.parametrize("comp", ["gzip", "xz"])
def test_compressed_nsys_export_profiles_as_the_plain_one(run_cli, fixtures_dir, tmp_path, monkeypatch, comp):
    """The LM-head rule reads the export again after the reader returned: the decompressed copy
    lives until then, and is deleted afterwards."""
    import gc
    import gzip
    import json
    import lzma
    import tempfile

    plain = tmp_path / "h.sqlite"
    shutil.copy(fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite", plain)
    packed = tmp_path / f"h.sqlite.{'gz' if comp == 'gzip' else 'xz'}"
    packed.write_bytes((gzip.compress if comp == "gzip" else lzma.compress)(plain.read_bytes()))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def profile(*args):
        code, out, err = run_cli("profile", *args, "--format", "json")
        assert code == 0, err
        return json.loads(out)

    want, got = profile(plain), profile(packed)
    assert got["notes"] == [*want["notes"], f"{comp}-compressed nsys-sqlite trace, decompressed to a temporary file"]
    for d in (want, got):
        d.pop("notes")
        d.pop("trace")
    assert got == want and got["steps"] == 20
    d = profile(plain, packed, "--diff")
    assert all(t["delta"] == 0 for t in d["totals"])
    gc.collect()
    assert list(scratch.iterdir()) == []


def test_string_ids_stored_as_blobs_read_as_text(run_cli, fixtures_dir, tmp_path):
    p = tmp_path / "blob.sqlite"
    shutil.copy(fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite", p)
    con = sqlite3.connect(p)
    con.execute("UPDATE StringIds SET value = x'ff00fe'")
    con.commit()
    con.close()
    a = read_trace(p)
    assert len(a.steps) == 20 and {g.name for g in a.groups if g.kind == "kernel"} == {"\ufffd\x00\ufffd"}
    code, _, err = run_cli("profile", p)
    assert code == 0, err


def test_the_busiest_gpu_is_profiled_not_the_one_with_most_kernels(tmp_path):
    """Many short kernels on GPU 0, few long ones on GPU 1: GPU 1 is the busiest (docs/profile.md)."""
    p = _two_gpus(tmp_path, "deviceId = 1, end = start + 40000000")
    a = read_trace(p, StepRequest())
    assert a.gpu.name == "NVIDIA A100-SXM4-80GB" and any("profiling device 1" in n for n in a.notes)
    events = []
    for step in range(3):   # Kineto: 20 x 1 us kernels on device 0, 2 x 1.9 ms on device 1, per step
        t = step * 10_000
        events += [{"ph": "X", "cat": "kernel", "name": f"small_{i}", "ts": t + i * 2, "dur": 1,
                    "args": {"device": 0, "stream": 7, "correlation": step * 100 + i}} for i in range(20)]
        events += [{"ph": "X", "cat": "kernel", "name": "big", "ts": t + 100 + i * 2000, "dur": 1900,
                    "args": {"device": 1, "stream": 7, "correlation": step * 100 + 50 + i}} for i in range(2)]
    k = tmp_path / "two.json"
    k.write_text(json.dumps({"traceEvents": events}))
    b = read_trace(k, StepRequest(mode="whole"))
    assert any("profiling device 1" in n for n in b.notes)
    assert {g.name for g in b.groups if g.kind == "kernel"} == {"big"}


def test_a_step_range_nested_in_another_threads_step_keeps_the_outer_steps_kernels(tmp_path):
    """Three steps on thread 1, each holding a same-named range of thread 2: the outermost are the
    steps, and every kernel thread 1 launched inside them is counted (the last third were lost)."""
    events = []
    for step in range(3):
        s = 10_000 + step * 2000
        events += [{"ph": "X", "cat": "user_annotation", "name": f"decode_step_{step}", "ts": s, "dur": 1000,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "user_annotation", "name": f"decode_step_{step}", "ts": s + 100, "dur": 100,
                    "pid": 1, "tid": 2}]
        for i, at in enumerate((50, 150, 500)):
            corr = step * 10 + i
            events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": s + at, "dur": 5,
                        "pid": 1, "tid": 1, "args": {"correlation": corr}},
                       {"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": s + at + 10, "dur": 3, "pid": 0, "tid": 7,
                        "args": {"device": 0, "stream": 7, "correlation": corr}}]
    p = tmp_path / "nested.json"
    p.write_text(json.dumps({"traceEvents": events}))
    a = read_trace(p, StepRequest(range_regex="decode_step"))
    assert len(a.steps) == 3 and [s.events for s in a.steps] == [3, 3, 3]


def test_decompressing_a_trace_leaves_no_copy_on_interrupt_and_blames_a_full_disk_on_the_disk(tmp_path, monkeypatch):
    import lzma
    import subprocess
    import sys
    import tempfile

    import specpilot.probes.traces as traces

    packed = tmp_path / "t.json.xz"
    event = b'{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": {"device": 0, "stream": 7}}'
    packed.write_bytes(lzma.compress(b'{"traceEvents": [' + event + b" " * 3_000_000 + b"]}"))
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))

    class Stopped:   # a stream the user interrupts after its first chunk
        def __init__(self, *a):
            self.n = 0

        def read(self, n=-1):
            self.n += 1
            if self.n > 1:
                raise KeyboardInterrupt
            return b"x" * 1000

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    with monkeypatch.context() as m:
        m.setattr(traces, "sniff", lambda path: "kineto+xz")
        m.setattr(traces, "_open_compressed", Stopped)
        with pytest.raises(KeyboardInterrupt):
            read_trace(packed)
    assert list(work.iterdir()) == []
    # a copy that cannot be written (a file size limit here, a full disk alike) is the machine's, exit 3
    code = ("import resource, signal, sys, tempfile; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"tempfile.tempdir = {str(work)!r}; resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000)); "
            "from specpilot.probes.traces import read_trace\n"
            "from specpilot.errors import EnvironmentMissing\n"
            f"try:\n    read_trace({str(packed)!r})\nexcept EnvironmentMissing as e:\n    print('MISSING', e)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.startswith(f"MISSING {packed}: cannot decompress it into"), res.stdout + res.stderr
    assert list(work.iterdir()) == []
