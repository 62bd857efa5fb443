"""``specpilot profile`` says what its inputs are and refuses what cannot mean anything: a ceiling
made for another GPU, floors for tensor-parallel ranks, a step mode asked for that finds no steps;
the step ranges it found are named for what they are; a diff keeps each side's top kernels; the
ranks' warnings are named by rank. Tiny traces are written here."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from conftest import one_error
from synthetic_traces import SynthSpec, truth, write_kineto, write_nsys_sqlite
from test_profile_real_world import AR, _json, llama_step, write_trace

REPO = Path(__file__).resolve().parents[1]

CLASSES = {"linear": {"bytes": 1e9, "flops": 2e9, "floor_ms": 0.2, "bound": "bytes"}}


def _ceiling(path, gpu: dict, model="llama-3.1-8b"):
    path.write_text(json.dumps({"schema": "specpilot.ceiling/1", "model": model, "gpu": gpu, "classes": CLASSES,
                                "total_floor_ms": 0.2, "fractions": {"bandwidth": 0.9, "flops": 0.6}}))
    return path


def test_a_ceiling_for_another_gpu_is_refused(run_cli, tmp_path):
    """The synthetic trace ran on an H200; floors made for an MI300X would put every efficiency off by
    the ratio of the two GPUs' bandwidths."""
    trace = write_kineto(tmp_path / "t.json", SynthSpec(steps=3, layers=1))
    other = _ceiling(tmp_path / "mi.json", {"key": "mi300x", "name": "AMD Instinct MI300X"})
    code, out, err = run_cli("profile", trace, "--ceiling", other)
    line = one_error(err)
    assert code == 2 and not out
    assert "its floors are for AMD Instinct MI300X (mi300x)" in line and "ran on NVIDIA H200 (h200)" in line
    assert "--gpu h200" in line
    # the trace's own GPU: no complaint, and the floors' model is named
    same = _ceiling(tmp_path / "h200.json", {"key": "h200", "name": "NVIDIA H200 SXM 141GB"})
    d = _json(run_cli, trace, "--ceiling", same)
    assert d["model"] == "llama-3.1-8b" and d["gpu"]["floors_gpu"] == "NVIDIA H200 SXM 141GB"
    assert not any("GPU" in n for n in d["notes"])
    code, out, err = run_cli("profile", trace, "--ceiling", same, "--top", 0)
    assert code == 0 and out.startswith("Profile: 3 steps (3 decode/verify step ranges found in the trace) on NVIDIA "
                                        "H200, llama-3.1-8b"), out
    # a GPU given by its figures cannot be compared: a note says so
    custom = _ceiling(tmp_path / "custom.json", {"key": "custom", "name": "custom", "bandwidth_tbs": 3.0})
    d = _json(run_cli, trace, "--ceiling", custom)
    assert any("a GPU given by its figures, which the GPU catalog cannot compare" in n for n in d["notes"])


def test_a_step_range_matching_nothing_lists_the_kineto_annotations(run_cli, tmp_path):
    trace = write_kineto(tmp_path / "t.json", SynthSpec(steps=3, layers=1))
    code, out, err = run_cli("profile", trace, "--step-range", "^nothing")
    assert code == 2 and "(ranges in the trace: 'decode_step_N' x3)" in one_error(err)


def _nvtx_renamed(path, old: str, new: str):
    con = sqlite3.connect(path)
    con.execute("UPDATE NVTX_EVENTS SET text = replace(text, ?, ?)", (old, new))
    con.commit()
    con.close()
    return path


def test_step_families_are_named_for_what_they_are(run_cli, tmp_path):
    nsys = _nvtx_renamed(write_nsys_sqlite(tmp_path / "n.sqlite", SynthSpec(steps=3, layers=1)), "decode_step", "step")
    assert _json(run_cli, nsys)["step_detail"] == "3 NVTX step ranges found in the trace"
    kin = write_trace(tmp_path / "k.json.gz", [llama_step()] * 3, step_name="step_{}")
    assert _json(run_cli, kin)["step_detail"] == "3 annotation step ranges found in the trace"
    sgl = write_trace(tmp_path / "s.json.gz", [llama_step()] * 3, step_name="step[DECODE bs=32]")
    assert _json(run_cli, sgl)["step_detail"] == "3 SGLang step ranges found in the trace"
    one = write_trace(tmp_path / "one.json.gz", [llama_step()], step_name="step[DECODE bs=32]")
    code, out, err = run_cli("profile", one)
    assert code == 0 and out.startswith("Profile: 1 step (1 SGLang step range found in the trace)"), err
    assert _json(run_cli, nsys, "--step-range", "step_1$")["step_detail"] == "1 range matching 'step_1$'"


def test_gap_mode_asked_for_finds_steps_or_says_why_not(run_cli, tmp_path):
    """One step whose kernels sit 0.5 us apart: no idle gap repeats. Asked for by name, gap mode fails
    as graph mode does; auto still falls back."""
    spec = SynthSpec(steps=1, layers=1, gap_ns=500)
    for trace in (write_kineto(tmp_path / "t.json", spec), write_nsys_sqlite(tmp_path / "t.sqlite", spec)):
        code, out, err = run_cli("profile", trace, "--step-mode", "gap")
        assert code == 2 and not out
        assert "--step-mode gap found no idle gaps that separate repeating steps" in one_error(err)
        assert "--gap-us" in err
        assert _json(run_cli, trace, "--step-mode", "gap", "--gap-us", 0.1)["step_mode"] == "gap"
        assert _json(run_cli, trace, "--step-mode", "whole")["steps"] == 1


def test_a_diff_lists_each_sides_top_kernels(run_cli, tmp_path):
    """'gone' is the base's second kernel, removed by the change; the candidate's second and third
    kernels are larger. With --top 2 it stays listed (the union's top 2 dropped it)."""
    base = write_trace(tmp_path / "b.json.gz", [[("kern_a", 100), ("gone", 50)]] * 3)
    cand = write_trace(tmp_path / "c.json.gz", [[("kern_a", 100), ("kern_c", 90), ("kern_d", 80)]] * 3)
    d = _json(run_cli, base, cand, "--diff", "--top", 2)
    assert [k["name"] for k in d["kernels"]] == ["kern_a", "kern_c", "gone"]
    gone = d["kernels"][2]
    assert gone["base_ms"] > 0 and gone["candidate_ms"] == 0
    assert _json(run_cli, base, cand, "--diff", "--top", 0)["kernels"] == []
    code, out, err = run_cli("profile", base, cand, "--diff", "--top", 0)
    assert code == 0 and "Top kernels" not in out


def test_tensor_parallel_ranks_refuse_floors_and_name_their_warnings(run_cli, tmp_path):
    r0 = write_trace(tmp_path / "rank0.json.gz", [llama_step()] * 3)
    r1 = write_trace(tmp_path / "rank1.json.gz", [llama_step()] * 3, slow=1.5)
    for opt in (["--model", "llama-3.1-8b"], ["--ceiling", _ceiling(tmp_path / "c.json", {"key": "h100-sxm"})]):
        code, out, err = run_cli("profile", r0, r1, *opt)
        assert code == 2 and not out
        assert f"{opt[0]}: tensor-parallel mode" in one_error(err) and "leave it out" in err
    # every kernel its own step: each rank's implausible-steps warnings, named by the rank
    args = (r0, r1, "--step-mode", "gap", "--gap-us", 1)
    d = _json(run_cli, *args)
    assert d["warnings"] and all(w.startswith(("rank0.json.gz: ", "rank1.json.gz: ")) for w in d["warnings"])
    assert {w.split(":")[0] for w in d["warnings"]} == {"rank0.json.gz", "rank1.json.gz"}
    assert not any("implausible" in n for n in d["notes"])
    code, out, err = run_cli("profile", *args)
    assert code == 0 and "warning: rank1.json.gz: steps look implausible" in out
    assert "note: rank" not in out and "Communication (NCCL" not in out   # no collectives: no empty table
    # with message sizes the table is there
    c0 = write_trace(tmp_path / "c0.json.gz", [llama_step() + [(AR, 40)]] * 3, comm_nelems=1_000_000)
    c1 = write_trace(tmp_path / "c1.json.gz", [llama_step() + [(AR, 40)]] * 3, comm_nelems=1_000_000)
    code, out, err = run_cli("profile", c0, c1)
    assert code == 0 and "Communication (NCCL" in out


def test_profile_and_ceiling_judge_a_step_against_one_floor_at_peak(run_cli, tmp_path):
    """A step with a link floor (its collectives' bytes over the H100's NVLink, which assumes no
    fraction of a peak): its busy time (6.0 ms) lies between the step floor at the GPU's full peak
    (6.34 ms) and the link floor scaled as a GPU class's would be (5.63 ms). The profile records the
    floor at peak it judged by (floor_peak_ms), and ceiling reads it: both call the step a
    model/config mismatch."""
    trace = write_trace(tmp_path / "t.json.gz", [llama_step(2) + [(AR, 40)]] * 3, comm_nelems=400_000_000,
                        slow=6.0 / 0.404)
    out = tmp_path / "p.json"
    code, _, err = run_cli("profile", trace, "--model", "llama-3.1-8b", "--gpu", "h100", "--format", "json",
                           "--out", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["classes"]["communication"]["floor_ms"] > 0
    assert doc["kernel_busy_ms"] < doc["floor_peak_ms"] < doc["total_floor_ms"], doc["floor_peak_ms"]
    assert any(w.startswith("model/config mismatch: kernel busy time") for w in doc["warnings"]), doc["warnings"]
    plain = tmp_path / "plain.json"   # the same step, not named one rank's (ceiling names a rank as the cause)
    plain.write_text(json.dumps({**doc, "distributed": None}))
    code, text, err = run_cli("ceiling", "--profile", plain, "--tau", "3", "--ar-ms", "5", "--format", "json")
    assert code == 0, err
    c = json.loads(text)
    assert c["cost_model"]["inputs"]["floor_peak_ms"] == doc["floor_peak_ms"]
    assert any(w.startswith("model/config mismatch: the kernel factor") for w in c["warnings"]), c["warnings"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "floor_peak_ms": -1}))
    code, _, err = run_cli("ceiling", "--profile", bad, "--tau", "3", "--ar-ms", "5")
    assert code == 2 and "'floor_peak_ms' must be null or a finite number" in one_error(err)


def test_a_profile_of_a_huge_shape_is_read_back_by_ceiling(run_cli, tmp_path):
    """Every option in range: profile writes floors past an hour, and ceiling reads that file (its
    cap for measured step times refused the computed floor as if the file were damaged)."""
    trace = REPO / "tests" / "fixtures" / "nsys_h200_decode_eager.sqlite"
    out = tmp_path / "big.json"
    code, _, err = run_cli("profile", trace, "--model", "qwen3.5-27b", "--rows", "65536", "--batch", "65536",
                           "--context", "16777216", "--format", "json", "--out", out)
    assert code == 0, err
    assert json.loads(out.read_text())["total_floor_ms"] > 3.6e6
    code, text, err = run_cli("ceiling", "--profile", out, "--tau", "3", "--ar-ms", "5", "--format", "json")
    assert code == 0, err
    assert json.loads(text)["total_floor_ms"] > 3.6e6
    for bad in (float("inf"), -1.0, "5"):
        f = tmp_path / "bad.json"
        f.write_text(json.dumps({**json.loads(out.read_text()), "total_floor_ms": bad}).replace("Infinity", "1e999"))
        code, _, err = run_cli("ceiling", "--profile", f, "--tau", "3", "--ar-ms", "5")
        assert code == 2 and "'total_floor_ms' must be a finite number >= 0 ms" in one_error(err), err


def test_steps_a_host_queues_ahead_of_the_gpu_count_their_own_wall(run_cli, tmp_path):
    """A host that launches each step before the GPU finished the ones before it opens every step's
    range early: counted from the range's start, the walls grew with the queue, step after step
    (an outside factor of several x on a GPU that was never idle). Each step counts from the previous
    step's end, in both readers."""
    spec = SynthSpec(steps=6, layers=2, ahead=True, memcpy=False, step_gap_ns=1000)
    truth_ = truth(spec)
    ends = [max(t["cpu"][1], t["gpu"][1]) for t in truth_]
    walls = [ends[0] - truth_[0]["cpu"][0]] + [ends[i] - max(truth_[i]["cpu"][0], ends[i - 1])
                                              for i in range(1, len(ends))]
    assert truth_[-1]["cpu"][0] < truth_[-2]["gpu"][1]   # the host really runs ahead
    for trace in (write_kineto(tmp_path / "t.json", spec), write_nsys_sqlite(tmp_path / "t.sqlite", spec)):
        d = _json(run_cli, trace)
        got = [s["wall_ms"] for s in d["per_step"]]
        assert got == [w / 1e6 for w in walls], trace
        busy = [s["busy_ms"] for s in d["per_step"]]
        assert max(g / b for g, b in zip(got[1:], busy[1:])) < 1.1
        assert any("the host queues steps ahead of the GPU" in n for n in d["notes"]), d["notes"]
