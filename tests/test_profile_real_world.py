"""``specpilot profile`` on what real traces do: kernels launched before the trace, step
annotations, the LM head by position, efficiencies above 100 %, compressed inputs, two-trace
diffs and tensor-parallel ranks. Small Kineto traces are written here event by event."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from specpilot.probes import steps as st
from specpilot.probes.traces.kineto import amd_name, gpu_from_names
from conftest import one_error

LOCAL = Path(__file__).parent / "fixtures"
H200_EAGER = LOCAL / "nsys_h200_decode_eager.sqlite"
ROPE = "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_align1::Params)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
ATTN = "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64, 128, 128, 4>>(Flash_fwd_params)"
AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def write_trace(path: Path, steps: list[list[tuple]], step_name="decode_step_{}", orphans: int = 0,
                header: dict | None = None, comm_nelems: int = 0, slow: float = 1.0) -> Path:
    """Steps of (kernel name, duration us) launched one after the other; the first ``orphans``
    kernels of the first step lose their runtime event (launched before the trace began)."""
    ev, t, corr = [], 1000.0, 0
    for i, kernels in enumerate(steps):
        t0 = t
        body = []
        for j, (name, dur) in enumerate(kernels):
            corr += 1
            dur *= slow
            if not (i == 0 and j < orphans):
                body.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                             "ts": t, "dur": 1, "args": {"correlation": corr, "External id": corr}})
            if name == AR:
                body.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": t - 1,
                             "dur": 3, "args": {"External id": corr, "Collective name": "allreduce", "dtype": "BFloat16",
                                                "In msg nelems": comm_nelems, "Out msg nelems": comm_nelems,
                                                "Group size": 2}})
            body.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": t + 5, "dur": dur,
                         "args": {"correlation": corr, "External id": corr, "device": 0, "stream": 7}})
            t += dur + 2
        ev.append({"ph": "X", "cat": "user_annotation", "name": step_name.format(i), "pid": 1, "tid": 1, "ts": t0 - 1,
                   "dur": t - t0 + 20})
        ev += body
        t += 300
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}],
           **(header or {}), "traceEvents": ev}
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    return path


def llama_step(layers=4):
    return [(ROPE, 4)] + [(GEMM, 30), (ATTN, 20), (GEMM, 25), (GEMM, 60)] * layers + [(GEMM, 90)]


def _json(run_cli, *args):
    code, out, err = run_cli("profile", *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_orphans_left_out_by_default_and_counted(run_cli, tmp_path):
    p = write_trace(tmp_path / "o.json.gz", [llama_step()] * 3, orphans=5)
    d = _json(run_cli, p)
    assert d["trace"]["orphans"]["events"] == 5
    assert any("launched before the trace began were left out" in n for n in d["notes"])
    assert d["per_step"][0]["events"] == len(llama_step()) - 5
    kept = _json(run_cli, p, "--include-orphans")
    assert kept["per_step"][0]["events"] == len(llama_step())
    assert any("--include-orphans" in n for n in kept["notes"])


def test_lm_head_is_the_last_gemm_not_the_once_per_step_rope_gemm(run_cli, tmp_path):
    p = write_trace(tmp_path / "hf.json.gz", [llama_step()] * 3)
    d = _json(run_cli, p, "--explain")
    assert d["classes"]["lm_head"]["ms"] == pytest.approx(0.090) and d["classes"]["lm_head"]["calls"] == 1
    assert d["classes"]["linear"]["calls"] == 1 + 3 * 4  # the RoPE sgemm stays linear
    rope = [e for e in d["explain"] if "simt_sgemm" in e["name"]]
    assert rope and all(e["class"] == "linear" for e in rope)
    assert any(e["class"] == "lm_head" and "last in step" in e["rule"] for e in d["explain"])


def test_steps_from_annotations_and_implausible_steps_warned(run_cli, tmp_path):
    p = write_trace(tmp_path / "s.json.gz", [llama_step()] * 4, step_name="ProfilerStep#{}")
    d = _json(run_cli, p)
    assert d["steps"] == 4 and "ProfilerStep ranges" in d["step_detail"] and not d["warnings"]
    gap = _json(run_cli, p, "--step-mode", "gap", "--gap-us", 1)  # every kernel its own step
    assert any("implausible" in w and "--step-range" in w and "ProfilerStep#N" in w for w in gap["warnings"])
    warns = st.plausibility([100, 100, 100], [5_000, 6_000, 2_000_000], {"decode_step_N": 3})
    assert len(warns) == 1 and "spans" in warns[0] and "'decode_step_N' x3" in warns[0]


def test_a_class_may_beat_its_floor_by_the_peak_fraction(run_cli, tmp_path):
    """A floor counts a fraction of the GPU's peak: a class up to 1 / fraction of it is fast, not a
    mismatch; past that it is flagged. Without the fractions the floor itself is the limit."""
    ms = _json(run_cli, H200_EAGER)["classes"]["linear"]["ms"]

    def profile(fractions, efficiency):
        ceil = tmp_path / "c.json"
        doc = {"schema": "specpilot.ceiling/1", "classes": {
            "linear": {"bytes": 1e10, "flops": 0, "floor_ms": efficiency * ms, "bound": "bytes"}}}
        ceil.write_text(json.dumps({**doc, **({"fractions": fractions} if fractions else {})}))
        return _json(run_cli, H200_EAGER, "--ceiling", ceil)

    def flag(fractions, efficiency):
        return profile(fractions, efficiency)["classes"]["linear"].get("flag")

    assert flag({"bandwidth": 0.5, "flops": 0.6}, 1.5) is None
    # the step's busy time (more than the linear kernels' time) against its floor at the full peak
    assert not any("kernel busy time" in w for w in profile({"bandwidth": 0.5, "flops": 0.6}, 1.5)["warnings"])
    assert any("kernel busy time" in w for w in profile({"bandwidth": 0.5, "flops": 0.6}, 100)["warnings"])
    assert "at the GPU's full peak" in flag({"bandwidth": 0.5, "flops": 0.6}, 2.5)
    assert "below its floor" in flag(None, 1.5)


def test_efficiency_above_100_percent_is_flagged_with_the_likely_field(run_cli, tmp_path):
    ceil = tmp_path / "c.json"
    ceil.write_text(json.dumps({"schema": "specpilot.ceiling/1", "total_floor_ms": 5.0, "classes": {
        "linear": {"bytes": 1e10, "flops": 0, "floor_ms": 5.0}}}))
    code, out, err = run_cli("profile", H200_EAGER, "--ceiling", ceil)
    assert code == 0, err
    assert "(!)" in out and "warning: linear: model/config mismatch" in out and "--weight-dtype" in out
    d = _json(run_cli, H200_EAGER, "--ceiling", ceil)
    assert d["classes"]["linear"]["efficiency"] > 1 and "mismatch" in d["classes"]["linear"]["flag"]


def test_compressed_inputs_by_content(run_cli, tmp_path):
    gz = tmp_path / "run.sqlite.gz"
    with open(H200_EAGER, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    d = _json(run_cli, gz)
    assert d["steps"] == 12 and any("gzip-compressed" in n for n in d["notes"])
    junk = tmp_path / "junk.gz"
    junk.write_bytes(gzip.compress(b"hello world, no trace here"))
    code, _, err = run_cli("profile", junk)
    assert code == 2 and "gzip-compressed, but not" in err and len(err.strip().splitlines()) == 1
    if shutil.which("zstd"):
        zst = tmp_path / "run.json.zst"
        plain = gzip.decompress((LOCAL / "kineto_h200_decode_eager.json.gz").read_bytes())
        subprocess.run(["zstd", "-q", "-o", str(zst)], input=plain, check=True)
        assert _json(run_cli, zst)["steps"] == 12


def test_rocm_gpu_named_without_device_name():
    props = {"id": 0, "name": "", "computeMajor": 9, "computeMinor": 4, "warpSize": 64, "numSms": 304}
    assert amd_name(props, 206.1) == "AMD Instinct MI300X"
    assert amd_name({**props, "numSms": 80}, 64.0) == "AMD gfx94x GPU (80 CUs)"
    assert amd_name({**props, "warpSize": 32}, 80.0) is None
    g = gpu_from_names(["Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT32x32x256_GSUAMB_GLS0_ISA942_IU1_K1"])
    assert g.name.startswith("AMD gfx942 GPU")
    assert gpu_from_names(["nvjet_tst"], rocm=True).name.startswith("AMD GPU")


def test_diff_of_two_traces(run_cli, tmp_path):
    base = write_trace(tmp_path / "base.json.gz", [llama_step()] * 3)
    faster = [(n, d / 2 if n == ATTN else d) for n, d in llama_step()]
    cand = write_trace(tmp_path / "cand.json.gz", [faster] * 3)
    d = _json(run_cli, base, cand, "--diff")
    assert d["schema"] == "specpilot.profile_diff/2"
    att = next(r for r in d["classes"] if r["class"] == "attention")
    assert att["base_ms"] == pytest.approx(0.080) and att["candidate_ms"] == pytest.approx(0.040)
    assert att["delta_ms"] == pytest.approx(-0.040) and att["relative"] == pytest.approx(-0.5)
    assert "delta" not in att and all("relative" in t and "delta" in t for t in d["totals"])
    lin = next(r for r in d["classes"] if r["class"] == "linear")
    assert lin["delta_ms"] == pytest.approx(0.0)
    assert d["kernels"][0]["name"] == GEMM and any(k["name"] == ATTN and k["delta_ms"] < 0 for k in d["kernels"])
    code, out, err = run_cli("profile", base, cand, "--diff")
    assert code == 0 and "Kernel time per class (ms per step)" in out and "-50.0%" in out
    code, _, err = run_cli("profile", base, "--diff")
    assert code == 2 and "two traces" in err


def test_tensor_parallel_ranks_with_communication_floor(run_cli, tmp_path):
    step = llama_step(2) + [(AR, 40)]
    r0 = write_trace(tmp_path / "rank0.json.gz", [step] * 3, comm_nelems=4_000_000)
    r1 = write_trace(tmp_path / "rank1.json.gz", [step] * 3, comm_nelems=4_000_000, slow=1.5)
    d = _json(run_cli, r0, r1, "--link-bandwidth", 400)
    assert d["schema"] == "specpilot.profile_ranks/1" and d["steps"] == 3
    assert d["slowest"] == {"rank1.json.gz": 3}
    # a rank of the same steps ties with rank 0: no rank is credited; one file given twice is refused
    twin = tmp_path / "twin.json.gz"
    twin.write_bytes(r0.read_bytes())
    tied = _json(run_cli, r0, twin)
    assert tied["slowest"] == {"tie": 3} and [s["slowest"] for s in tied["per_step"]] == [None] * 3
    code, _, err = run_cli("profile", r0, r0)
    assert code == 2 and err.strip() == f"specpilot: error: {r0}: given twice (as {r0}); each rank is its own trace file"
    assert d["imbalance"] == pytest.approx(1 / 3, rel=0.02)
    c0 = d["ranks"][0]
    # all-reduce of 4 M bf16 elements over 2 ranks: 2 (n-1)/n x 8 MB = 8 MB sent per rank
    assert c0["communication_bytes"] == pytest.approx(8e6)
    assert c0["communication_floor_ms"] == pytest.approx(8e6 / 400e9 * 1e3)
    assert c0["communication_efficiency"] == pytest.approx(0.020 / 0.040)
    code, out, err = run_cli("profile", r0, r1, "--link-bandwidth", 400)
    assert code == 0 and "Slowest rank per step" in out and "communication" in out
    assert not any("different GPUs" in w for w in d["warnings"])
    # a trace of another GPU is no rank of this group: its imbalance is the GPUs' difference
    other = write_trace(tmp_path / "h200.json.gz", [step] * 3, comm_nelems=4_000_000,
                        header={"deviceProperties": [{"id": 0, "name": "NVIDIA H200", "numSms": 132}]})
    w = _json(run_cli, r0, other)["warnings"][0]
    assert w.startswith("the ranks' traces come from different GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200)"), w


def _two_gpu_export(tmp_path):
    """A synthetic Nsight export whose attention kernels ran on a second GPU."""
    import sqlite3

    from synthetic_traces import SynthSpec, write_nsys_sqlite

    p = write_nsys_sqlite(tmp_path / "two.sqlite", SynthSpec(steps=4, layers=1))
    con = sqlite3.connect(p)
    con.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 1, 'NVIDIA H200', 4814304000000, 132, 0, 0)")
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET deviceId = 1 WHERE demangledName IN "
                "(SELECT id FROM StringIds WHERE value LIKE 'flash%')")
    con.commit()
    con.close()
    return p


def test_ranks_of_one_multi_gpu_nsight_export(run_cli, tmp_path):
    p = _two_gpu_export(tmp_path)
    d = _json(run_cli, p, "--ranks")
    assert [r["rank"] for r in d["ranks"]] == ["GPU 0", "GPU 1"]
    assert d["ranks"][1]["classes"]["attention"] > 0 and d["ranks"][0]["classes"]["attention"] == 0
    assert d["slowest"] == {"GPU 0": 4}


def test_one_rank_with_floors_says_the_floors_are_the_whole_models(run_cli, tmp_path):
    """One tensor-parallel rank's trace with --model: the floors are the whole model's (no rule here
    splits them by rank), which the output and the JSON say, with what shows the trace to be a rank."""
    step = llama_step(2) + [(AR, 40)]
    rank = write_trace(tmp_path / "rank1.json.gz", [step] * 3, comm_nelems=4_000_000,
                       header={"distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2}})
    d = _json(run_cli, rank, "--model", "llama-3.1-8b")
    assert d["distributed"] == {"rank": 1, "world_size": 2, "group_size": 2, "collectives_ms": pytest.approx(0.04),
                                "floors": "whole model"}
    assert d["warnings"][0].startswith("the floors are the whole model's on one GPU, and this trace is one rank of "
                                       "a multi-GPU job (rank 1 of 2, collectives over 2 ranks, 0.04 ms of "
                                       "collectives per step)") and "up to 2x high" in d["warnings"][0]
    code, out, err = run_cli("profile", rank, "--model", "llama-3.1-8b", "--top", 0)
    assert code == 0 and "warning: the floors are the whole model's on one GPU" in out, err
    # no floors, nothing to warn of; a one-GPU trace with floors: neither
    plain = _json(run_cli, rank)
    assert plain["distributed"]["rank"] == 1 and "floors" not in plain["distributed"] and not plain["warnings"]
    alone = _json(run_cli, write_trace(tmp_path / "one.json.gz", [llama_step(2)] * 3,
                                       header={"distributedInfo": {"rank": 0, "world_size": 1}}), "--model", "llama-3.1-8b")
    assert alone["distributed"] is None and not any("whole model" in w for w in alone["warnings"])


def test_one_gpu_of_a_multi_gpu_nsight_export_with_floors_is_warned(run_cli, tmp_path):
    p = _two_gpu_export(tmp_path)
    d = _json(run_cli, p, "--device", 0, "--model", "llama-3.1-8b")
    assert d["distributed"] == {"gpus": 2, "floors": "whole model"}
    assert "(kernels on 2 GPUs)" in d["warnings"][0] and "up to 2x high" in d["warnings"][0]


def test_traces_that_say_they_are_no_group_are_refused_as_ranks(run_cli, tmp_path):
    """Two traces that each ran alone (world size 1), or that both say they are rank 0, were profiled
    as a tensor-parallel group: a tie on every step, or another workload's difference as imbalance."""
    alone = {"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1}}
    a = write_trace(tmp_path / "a.json.gz", [llama_step()] * 3, header=alone)
    b = write_trace(tmp_path / "b.json.gz", [llama_step()] * 3, header=alone, slow=1.2)
    code, out, err = run_cli("profile", a, b)
    assert code == 2 and not out and "a.json.gz: the trace says it ran alone (world size 1)" in one_error(err)
    both0 = {"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}}
    a = write_trace(tmp_path / "a.json.gz", [llama_step()] * 3, header=both0)
    b = write_trace(tmp_path / "b.json.gz", [llama_step()] * 3, header=both0, slow=1.2)
    code, out, err = run_cli("profile", a, b)
    assert code == 2 and not out and "both say they are rank 0" in one_error(err)
    b = write_trace(tmp_path / "b.json.gz", [llama_step()] * 3,
                    header={"distributedInfo": {"rank": 1, "world_size": 2}})
    code, out, err = run_cli("profile", a, b)
    assert code == 0 and "2 ranks" in out, err


def test_kernel_events_without_their_device_or_name_are_damage(run_cli, tmp_path):
    """A kernel event without ``args`` (or ``args.device``) among kernels of device 0 was a second GPU
    ("kernels on 2 GPUs", the multi-GPU warning) and dropped silently; one without a name was a
    kernel of class 'other' named ''."""
    path = write_trace(tmp_path / "t.json.gz", [llama_step(2)] * 4)
    doc = json.loads(gzip.open(path, "rt").read())
    for variant, edit in (("noargs", lambda e: e.pop("args")), ("nullargs", lambda e: e.update(args=None)),
                          ("nodevice", lambda e: e["args"].pop("device"))):
        d = json.loads(json.dumps(doc))
        edit([e for e in d["traceEvents"] if e.get("cat") == "kernel"][3])
        p = tmp_path / f"{variant}.json"
        p.write_text(json.dumps(d))
        code, out, err = run_cli("profile", p, "--model", "llama-3.1-8b", "--top", "0")
        assert code == 0, err
        assert "GPUs" not in out + err and "multi-GPU" not in out + err
        assert "1 GPU event(s) without their device (args.device) were left out" in out + err
    d = json.loads(json.dumps(doc))
    [e for e in d["traceEvents"] if e.get("cat") == "kernel"][3].pop("name")
    p = tmp_path / "noname.json"
    p.write_text(json.dumps(d))
    code, _, err = run_cli("profile", p, "--model", "llama-3.1-8b")
    assert code == 2 and str(p) in one_error(err) and "name None is not a string" in one_error(err)
