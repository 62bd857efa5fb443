"""``specpilot profile``: what its options mean and when they are refused (the GPU of the floors,
options no step or floor reads, .nsys-rep exports, the notes on what the tables show)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from conftest import one_error
from test_profile_real_world import llama_step, write_trace

LOCAL = Path(__file__).parent / "fixtures"
H200_EAGER = LOCAL / "nsys_h200_decode_eager.sqlite"
H200_GRAPH = LOCAL / "nsys_h200_decode_graph.sqlite"
H200_REP = LOCAL / "nsys_h200_decode_eager.nsys-rep"
PDL = LOCAL / "kineto_specpilot_h200_batch16_pdl.json.gz"
CONFIG = LOCAL / "decode_target_config.json"
DRAFTER = LOCAL / "decode_drafter_config.json"


def _refused(run_cli, *args) -> str:
    code, out, err = run_cli("profile", *args)
    assert code == 2 and not out, (code, out, err)
    return one_error(err)


# ---- the GPU of the floors ---------------------------------------------------------------------
def test_gpu_names_the_floors_gpu_and_keeps_the_trace_gpu(run_cli):
    args = (H200_EAGER, "--model", CONFIG, "--gpu", "h100", "--top", 0)
    code, out, err = run_cli("profile", *args, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    g = d["gpu"]
    assert g["name"] == "NVIDIA H200" and g["source"] == "TARGET_INFO_GPU" and g["sm_count"] == 132
    assert g["floors_gpu"] == "NVIDIA H100 SXM5 80GB" and g["key"] == "h100-sxm" and g["bandwidth_tbs"] == 3.35
    assert "trace_name" not in g
    warn = [w for w in d["warnings"] if "another GPU" in w]
    assert len(warn) == 1 and "NVIDIA H100 SXM5 80GB (--gpu h100)" in warn[0] and "NVIDIA H200" in warn[0], d["warnings"]
    code, text, err = run_cli("profile", *args)
    assert code == 0, err
    title = text.splitlines()[0]
    assert " on NVIDIA H200 (floors for NVIDIA H100 SXM5 80GB, --gpu)," in title, title
    assert f"warning: {warn[0]}" in text
    # the trace's own GPU named again: no warning, nothing in the title
    code, text, err = run_cli("profile", H200_EAGER, "--model", CONFIG, "--gpu", "h200", "--top", 0)
    assert code == 0 and "floors for" not in text and "another GPU" not in text, text


# ---- the floor above the measured time ---------------------------------------------------------
def test_a_floor_above_the_busy_time_is_warned_of(run_cli):
    args = (PDL, "--model", "llama-3.1-8b", "--batch", 16, "--context", 1024, "--top", 0)
    code, out, err = run_cli("profile", *args, "--bw-fraction", 0.5, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["kernel_factor"] < 1
    warn = [w for w in d["warnings"] if w.startswith("kernel busy time")]
    assert len(warn) == 1, d["warnings"]
    assert warn[0].startswith("kernel busy time 4.866 ms is below the byte floor 7.225 ms (kernel factor 0.6735) but "
                              "not below it at the GPU's full peak (3.613 ms): the kernels reach more of the peak "
                              "than the floor's fractions assume (--bw-fraction 0.5, --flops-fraction 0.6)"), warn[0]
    assert "do not describe this trace" in warn[0]
    code, text, err = run_cli("profile", *args, "--bw-fraction", 0.5)
    assert code == 0 and f"warning: {warn[0]}" in text, text
    # the default fraction: the floor is below the busy time, nothing to say
    code, out, err = run_cli("profile", *args, "--format", "json")
    assert code == 0 and not [w for w in json.loads(out)["warnings"] if w.startswith("kernel busy time")]


# ---- --diff with an unknown efficiency ---------------------------------------------------------
def test_diff_prints_an_unknown_efficiency_as_a_dash(run_cli):
    code, out, err = run_cli("profile", H200_EAGER, H200_GRAPH, "--diff", "--model", CONFIG, "--context", 512,
                             "--top", 0)
    assert code == 0, err
    assert "None" not in out, out
    line = next(x for x in out.splitlines() if x.startswith("linear "))
    assert line.rstrip().endswith("21.5% -> -"), line


# ---- options no step or floor reads ------------------------------------------------------------
@pytest.mark.parametrize("opt", [("--draft-rows", 2), ("--draft-passes", 3), ("--draft-passes", 1)])
def test_drafter_shape_without_a_drafter_is_refused(run_cli, opt):
    err = _refused(run_cli, H200_EAGER, "--model", CONFIG, *opt)
    assert f"{opt[0]}: it shapes the drafter's floor, which needs --drafter MODEL" in err, err
    code, _, err = run_cli("profile", H200_EAGER, "--model", CONFIG, "--drafter", DRAFTER, *opt, "--top", 0)
    assert code == 0, err


@pytest.mark.parametrize("mode", ["whole", "graph", "gap"])
def test_step_range_with_another_step_mode_is_refused(run_cli, mode):
    err = _refused(run_cli, H200_EAGER, "--step-mode", mode, "--step-range", "^decode_step")
    assert f"--step-range: --step-mode {mode} does not read step ranges" in err, err


def test_gap_us_where_steps_do_not_come_from_gaps_is_refused(run_cli, tmp_path):
    for args in (("--step-range", "^decode_step"), ("--step-mode", "range", "--step-range", "^decode_step"),
                 ("--step-mode", "graph"), ("--step-mode", "whole")):
        err = _refused(run_cli, H200_EAGER, *args, "--gap-us", 50)
        assert "--gap-us: " in err and "idle gaps" in err, err
    # auto: the trace's annotations are the steps (known once it is read)
    out = tmp_path / "p.json"
    code, stdout, err = run_cli("profile", H200_EAGER, "--gap-us", 50, "--out", out)
    assert code == 2 and not out.exists(), err
    assert (f"--gap-us: the steps of {H200_EAGER} are 12 decode/verify step ranges found in the trace, not GPU work "
            "between idle gaps") in one_error(err)
    # where gaps make the steps it is read
    code, stdout, err = run_cli("profile", H200_EAGER, "--step-mode", "gap", "--gap-us", 50, "--top", 0)
    assert code == 0 and "idle gaps > 50.0 us" in stdout, err


@pytest.mark.parametrize("opt", [("--gpu", "h100"), ("--bandwidth", "3"), ("--flops", "900")])
def test_gpu_options_without_floors_are_refused(run_cli, opt):
    err = _refused(run_cli, H200_EAGER, *opt)
    assert f"{opt[0]}: it sets the GPU of the byte floors, which need --model" in err, err
    err = _refused(run_cli, H200_EAGER, H200_EAGER, *opt)   # tensor-parallel ranks: no floors either
    assert f"{opt[0]}: " in err and "--link-bandwidth" in err, err


# ---- .nsys-rep exports -------------------------------------------------------------------------
def _fake_nsys(tmp_path: Path, payload: Path | None) -> Path:
    """An ``nsys`` that exits 0 and writes ``payload`` (garbage when None) to its ``-o`` path."""
    exe = tmp_path / "bin" / "nsys"
    exe.parent.mkdir(exist_ok=True)
    body = (f"shutil.copy({str(payload)!r}, out)" if payload else "open(out, 'wb').write(b'not an export' * 100)")
    exe.write_text(f"#!{sys.executable}\nimport shutil, sys\nout = sys.argv[sys.argv.index('-o') + 1]\n{body}\n")
    exe.chmod(0o755)
    return exe


def _report(tmp_path: Path) -> Path:
    rep = tmp_path / "rep" / "run.nsys-rep"
    rep.parent.mkdir()
    shutil.copy(H200_REP, rep)
    return rep


def test_nsys_rep_reuses_its_export_without_nsys(run_cli, tmp_path, monkeypatch):
    import specpilot.probes.traces.nsys_rep as nr

    rep = _report(tmp_path)
    beside = rep.with_suffix(".sqlite")
    shutil.copy(H200_EAGER, beside)
    os.utime(beside, (time.time() + 10, time.time() + 10))
    monkeypatch.setattr(nr, "find_nsys", lambda: None)
    code, out, err = run_cli("profile", rep, "--top", 0, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["steps"] == 12 and f"read the export beside it, {beside} (newer than the report)" in d["notes"]
    assert not any("exported with nsys" in n for n in d["notes"])   # nothing was exported


def test_nsys_rep_export_that_is_not_an_export_is_refused_and_not_kept(run_cli, tmp_path, monkeypatch):
    import specpilot.probes.traces.nsys_rep as nr

    rep = _report(tmp_path)
    nsys = _fake_nsys(tmp_path, None)
    monkeypatch.setattr(nr, "find_nsys", lambda: str(nsys))
    err = _refused(run_cli, rep)
    assert f"{rep}: nsys export wrote no readable Nsight Systems export" in err, err
    assert "run.sqlite" not in err.replace(str(rep), "")
    assert sorted(p.name for p in rep.parent.iterdir()) == ["run.nsys-rep"]   # nothing kept, no .part
    # a good export is written beside the report and read
    monkeypatch.setattr(nr, "find_nsys", lambda: str(_fake_nsys(tmp_path, H200_EAGER)))
    code, out, err = run_cli("profile", rep, "--top", 0, "--format", "json")
    assert code == 0 and json.loads(out)["steps"] == 12, err
    assert sorted(p.name for p in rep.parent.iterdir()) == ["run.nsys-rep", "run.sqlite"]


def test_nsys_rep_does_not_reuse_a_file_beside_it_that_is_not_an_export(run_cli, tmp_path, monkeypatch):
    import specpilot.probes.traces.nsys_rep as nr

    rep = _report(tmp_path)
    beside = rep.with_suffix(".sqlite")
    beside.write_bytes(b"garbage" * 100)
    os.utime(beside, (time.time() + 10, time.time() + 10))
    monkeypatch.setattr(nr, "find_nsys", lambda: None)   # not reusable: exported again, which needs nsys
    code, _, err = run_cli("profile", rep)
    assert code == 3 and "nsys" in one_error(err)
    monkeypatch.setattr(nr, "find_nsys", lambda: str(_fake_nsys(tmp_path, H200_EAGER)))
    code, out, err = run_cli("profile", rep, "--top", 0, "--format", "json")
    assert code == 0 and json.loads(out)["steps"] == 12, err
    assert beside.read_bytes() == b"garbage" * 100   # not the profile's to overwrite


# ---- the help ----------------------------------------------------------------------------------
def test_help_names_bzip2_and_the_catalog_gpus(run_cli):
    from specpilot.gpus import gpu_keys

    code, out, _ = run_cli("profile", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "bzip2" in flat
    gpu_help = flat[flat.index("--gpu NAME"):flat.index("--bandwidth")].replace("- ", "-")   # wrapped at a hyphen
    assert all(k in gpu_help for k in gpu_keys()), gpu_help


# ---- what the tables show ---------------------------------------------------------------------
def test_gap_steps_say_what_their_medians_show(run_cli):
    code, out, err = run_cli("profile", H200_EAGER, "--step-mode", "gap", "--top", 3)
    assert code == 0, err
    flat = " ".join(out.split())
    assert ("medians over steps, each taken alone: the classes' add up to 0.001216 ms per step against a busy-time "
            "median of 0.0272 ms, as the steps differ (a class in fewer than half of them has a median of 0") in flat, out
    assert "0 ms: the kernel runs in fewer than half of the steps (medians per step)" in flat, out
    # steps alike (the trace's annotations): the medians add up, nothing to say
    code, out, err = run_cli("profile", H200_EAGER, "--top", 3)
    assert code == 0 and "each taken alone" not in out and "0 ms:" not in out, out


# ---- damaged step annotations -----------------------------------------------------------------
def test_kineto_step_annotations_of_negative_duration_are_warned_of(run_cli, tmp_path):
    p = write_trace(tmp_path / "t.json.gz", [llama_step(2)] * 4)
    doc = json.loads(gzip.decompress(p.read_bytes()))
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"]
    for e in steps[:2]:
        e["dur"] = -e["dur"]
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    code, out, err = run_cli("profile", p, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["steps"] == 2 and d["step_mode"] == "range"
    assert ("2 step annotation ranges ('decode_step_N') end before they start (a negative duration) and were "
            "left out") in " ".join(d["warnings"]), d["warnings"]
    for e in steps[2:]:
        e["dur"] = -e["dur"]
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    code, out, err = run_cli("profile", p, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["step_mode"] != "range"
    assert any("4 step annotation ranges ('decode_step_N') end before they start" in w for w in d["warnings"]), d


def _mirrored_profiler_steps(path, bad_cpu: int, bad_gpu: int):
    """Four ``ProfilerStep#N`` steps, each a CPU user annotation and its GPU mirror (a
    gpu_user_annotation over the step's kernels, as Kineto records it); the first ``bad_cpu`` and
    ``bad_gpu`` of each side end before they start."""
    p = write_trace(path, [llama_step(2)] * 4, step_name="ProfilerStep#{}")
    doc = json.loads(gzip.decompress(p.read_bytes()))
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"]
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    mirrors = []
    for s in steps:
        ks = [k for k in kernels if s["ts"] <= k["ts"] <= s["ts"] + s["dur"]]
        t0, t1 = min(k["ts"] for k in ks), max(k["ts"] + k["dur"] for k in ks)
        mirrors.append({"ph": "X", "cat": "gpu_user_annotation", "name": s["name"], "pid": 0, "tid": 7, "ts": t0,
                        "dur": t1 - t0})
    for e in steps[:bad_cpu] + mirrors[:bad_gpu]:
        e["dur"] = -e["dur"]
    doc["traceEvents"] += mirrors
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return p


@pytest.mark.parametrize("bad_cpu,bad_gpu,steps,warned", [
    (2, 2, 4 - 2, 2),   # two steps damaged on both sides: two annotations left out, not four
    (4, 4, 4, 4),       # all of them: counted once each, and the steps found by gaps
    (0, 2, 4, 0),       # the GPU mirrors alone: the CPU annotations are read, nothing is left out
    (4, 0, 4, 0),       # the CPU annotations alone: their GPU mirrors are read
])
def test_a_mirrored_step_annotation_of_negative_duration_is_counted_once(run_cli, tmp_path, bad_cpu, bad_gpu,
                                                                         steps, warned):
    p = _mirrored_profiler_steps(tmp_path / "t.json.gz", bad_cpu, bad_gpu)
    code, out, err = run_cli("profile", p, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["steps"] == steps and (d["step_mode"] == "range") == (bad_cpu + bad_gpu < 8), d["step_detail"]
    bad = [w for w in d["warnings"] if "(a negative duration)" in w]
    if warned:
        assert len(bad) == 1 and bad[0].startswith(f"{warned} step annotation ranges ('ProfilerStep#N') end before "
                                                   "they start"), bad
    else:
        assert not bad, bad
