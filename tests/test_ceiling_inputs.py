"""`specpilot ceiling`: files of different deployments (model, GPU, rows, shape) are refused; where
two files time the same step, the one used is named; the GPU and shape default to the profile's."""

import json
from pathlib import Path

import pytest

from conftest import one_error, refused

REPO = Path(__file__).resolve().parents[1]
ROUNDS = REPO / "examples" / "rounds"
H200_PROFILE = ROUNDS / "llama8b-h200" / "measure" / "profile.json"   # llama-3.1-8b on an H200, 1 row
H200_ROWS = ROUNDS / "llama8b-h200" / "measure" / "rows.json"         # llama-3.1-8b on an H200
CPU_ROWS = ROUNDS / "smollm2-cpu" / "measure" / "rows.json"           # smollm2-135m-instruct on the CPU


@pytest.fixture
def cpu_run(run_cli, tmp_path):
    run = tmp_path / "tree16.json"
    code, _, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--nodes", "16", "--prompt", "abcabcabcabc",
                           "--max-new-tokens", "12", "--format", "json", "--out", run)
    assert code == 0, err
    return run


def test_a_profile_beside_another_deployments_run_is_refused(run_cli, cpu_run):
    code, _, err = run_cli("ceiling", "--run", cpu_run, "--profile", H200_PROFILE, "--ar-ms", "57")
    refused(code, err, f"--profile {H200_PROFILE}", f"--run {cpu_run}", "model")


def test_a_profile_beside_another_deployments_rows_probe_is_refused(run_cli):
    code, _, err = run_cli("ceiling", "--rows-probe", CPU_ROWS, "--profile", H200_PROFILE, "--tau", "2")
    refused(code, err, f"--profile {H200_PROFILE}", f"--rows-probe {CPU_ROWS}", "model")


def test_a_cpu_probe_of_the_profiles_model_is_refused(run_cli, tmp_path):
    probe = json.loads(CPU_ROWS.read_text())
    probe["model"] = "llama-3.1-8b"
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(probe))
    code, _, err = run_cli("ceiling", "--rows-probe", rows, "--profile", H200_PROFILE, "--tau", "2")
    refused(code, err, f"--rows-probe {rows}", "GPU", "CPU")


def test_a_profile_and_floors_of_another_model_or_gpu_are_refused(run_cli):
    code, _, err = run_cli("ceiling", "--profile", H200_PROFILE, "--model", "qwen3-8b", "--gpu", "h100", "--tau",
                           "4.2", "--ar-ms", "5")
    refused(code, err, f"--profile {H200_PROFILE}", "--model qwen3-8b", "model")
    code, _, err = run_cli("ceiling", "--profile", H200_PROFILE, "--model", "llama-3.1-8b", "--gpu", "h100", "--tau",
                           "4.2", "--ar-ms", "5")
    refused(code, err, f"--profile {H200_PROFILE}", "--gpu", "GPU", "H200", "H100")


H200_EAGER = REPO / "tests" / "fixtures" / "nsys_h200_decode_eager.sqlite"   # traced on an H200


def test_a_profile_made_with_gpu_checks_probes_by_the_traced_gpu_and_gpu_by_the_floors(run_cli, tmp_path):
    """`profile --gpu h100` of an H200 trace: its floors are the H100's, its step ran on the H200. A
    rows probe is of the GPU the step ran on (an H200 one is taken, an H100 one refused); --gpu sets
    floors, compared with the floors' GPU (h100 taken, h200 refused naming the H100)."""
    prof = tmp_path / "p.json"
    code, _, err = run_cli("profile", H200_EAGER, "--model", "llama-3.1-8b", "--gpu", "h100", "--format", "json",
                           "--out", prof)
    assert code == 0, err
    gpu = json.loads(prof.read_text())["gpu"]
    assert gpu["name"] == "NVIDIA H200" and gpu["key"] == "h100-sxm", gpu
    code, _, err = run_cli("ceiling", "--profile", prof, "--rows-probe", H200_ROWS, "--tau", "2")
    assert code == 0, err
    h100_rows = tmp_path / "rows-h100.json"
    h100_rows.write_text(H200_ROWS.read_text().replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    code, _, err = run_cli("ceiling", "--profile", prof, "--rows-probe", h100_rows, "--tau", "2")
    refused(code, err, f"--rows-probe {h100_rows}", "GPU (NVIDIA H200 against NVIDIA H100 80GB HBM3)")
    code, _, err = run_cli("ceiling", "--profile", prof, "--model", "llama-3.1-8b", "--gpu", "h100", "--tau", "2",
                           "--ar-ms", "4")
    assert code == 0, err
    code, _, err = run_cli("ceiling", "--profile", prof, "--model", "llama-3.1-8b", "--gpu", "h200", "--tau", "2",
                           "--ar-ms", "4")
    refused(code, err, "--gpu", "floors' GPU (NVIDIA H100 SXM5 80GB against NVIDIA H200")


def test_a_profile_of_other_rows_is_refused_and_its_rows_are_the_default(run_cli, tmp_path):
    code, _, err = run_cli("ceiling", "--profile", H200_PROFILE, "--rows", "8", "--tau", "4.2", "--ar-ms", "5")
    refused(code, err, f"--profile {H200_PROFILE}", "--rows 8", "rows")
    doc = json.loads(H200_PROFILE.read_text())
    doc["shape"]["rows"] = 17
    prof = tmp_path / "p17.json"
    prof.write_text(json.dumps(doc))
    code, out, err = run_cli("ceiling", "--profile", prof, "--tau", "4.2", "--ar-ms", "5")
    assert code == 0 and out.splitlines()[0] == "Cost model at 17 rows", out + err


def test_the_gpu_and_shape_come_from_the_profile(run_cli):
    """No GPU here, none named: the profile's (an H200), and its shape (context 96) for the floors."""
    code, out, err = run_cli("ceiling", "--profile", H200_PROFILE, "--model", "llama-3.1-8b", "--tau", "4.2",
                             "--ar-ms", "5", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["gpu"]["key"] == "h200" and doc["shape"]["context"] == 96
    assert doc["total_floor_ms"] == pytest.approx(json.loads(H200_PROFILE.read_text())["total_floor_ms"])
    code, _, err = run_cli("ceiling", "--profile", H200_PROFILE, "--model", "llama-3.1-8b", "--context", "2048",
                           "--tau", "4.2", "--ar-ms", "5")
    refused(code, err, f"--profile {H200_PROFILE}", "--context 2048", "context")


def _gpu_run(tmp_path, wall, gpu):
    run = tmp_path / f"run_{wall}.json"
    run.write_text(json.dumps({"schema": "specpilot.run/1", "model": "llama-3.1-8b", "mode": "ar", "device": "cuda",
                               "tau": 1.0, "steps": 10,
                               "step_timing": {"steps": 10, "wall_ms": wall, "gpu_ms": gpu,
                                               "by_rows": [{"rows": 1, "steps": 10, "verify_ms": gpu}]}}))
    return run


def test_a_run_and_a_profile_of_one_deployment_share_the_step(run_cli, tmp_path):
    """Both time the step: the run's is T_step (it delivered tau, and no profiler slowed it), the
    profile's kernel busy time is the GPU time (its floor is of the same trace); a note says so.
    Beyond 25% apart they are not one deployment's step: refused."""
    run = _gpu_run(tmp_path, 5.2, 4.0)
    code, out, err = run_cli("ceiling", "--run", run, "--profile", H200_PROFILE, "--ar-ms", "3.9", "--format", "json")
    assert code == 0, err
    cm = json.loads(out)["cost_model"]
    assert cm["step_ms"] == 5.2 and cm["sources"]["step_ms"].startswith(f"run {run}")
    assert cm["sources"]["profile_ms"] == f"profile {H200_PROFILE}"
    assert any(n.startswith(f"T_step is run {run}'s 5.2 ms") and "4.918 ms" in n for n in cm["notes"]), cm["notes"]
    slow = _gpu_run(tmp_path, 8.0, 4.0)
    code, _, err = run_cli("ceiling", "--run", slow, "--profile", H200_PROFILE, "--ar-ms", "3.9")
    refused(code, err, f"--run {slow}", f"--profile {H200_PROFILE}", "step", "25%")


def test_a_probe_point_of_other_rows_is_not_the_runs_step(run_cli, tmp_path):
    """A tree run's steps of 1-17 rows beside a rows probe at the default --rows 1: the probe's
    1-row point is T_AR, not a step the run's could be compared with, so no note names it; a run
    whose steps were all of the probe's row count keeps the note."""
    by_rows = [{"rows": r, "steps": 2, "verify_ms": 5.0} for r in (1, 5, 17)]
    run = tmp_path / "tree.json"
    run.write_text(json.dumps({"schema": "specpilot.run/1", "model": "llama-3.1-8b", "mode": "tree", "nodes": 16,
                               "device": "cuda", "tau": 1.3, "steps": 6,
                               "step_timing": {"steps": 6, "wall_ms": 5.4, "gpu_ms": 5.0, "by_rows": by_rows}}))
    for r, noted in ((run, False), (_gpu_run(tmp_path, 5.4, 5.0), True)):
        code, out, err = run_cli("ceiling", "--run", r, "--rows-probe", H200_ROWS, "--format", "json")
        assert code == 0, err
        cm = json.loads(out)["cost_model"]
        assert cm["step_ms"] == 5.4 and cm["ar_ms"] == pytest.approx(3.926159977912903)
        assert any(f"rows probe {H200_ROWS}" in n for n in cm["notes"]) == noted, cm["notes"]


def test_a_gpu_probe_beside_the_profile_says_whose_step_is_used(run_cli):
    """The profile's step is the engine's whole step, the probe's T_AR a bare forward: T_AR is put
    on the profile's clock through the probe's c(N) at the profile's rows, as round models it (a
    profile of AR itself had c 1.25 and a speedup of 0.8 over itself)."""
    code, out, err = run_cli("ceiling", "--rows-probe", H200_ROWS, "--profile", H200_PROFILE, "--tau", "1.0",
                             "--format", "json")
    assert code == 0, err
    cm = json.loads(out)["cost_model"]
    assert cm["step_ms"] == pytest.approx(4.918425) and cm["ar_ms"] == pytest.approx(4.918425)
    assert cm["c"] == pytest.approx(1.0) and cm["speedup"] == pytest.approx(1.0)
    assert cm["sources"]["ar_ms"].endswith(f"rows probe {H200_ROWS} c(1)")
    assert any(n.startswith(f"T_step is profile {H200_PROFILE}'s 4.918 ms") and "3.926 ms" in n
               for n in cm["notes"]), cm["notes"]
    # the budgets' c stays the probe's own steps over its own T_AR
    code, out, err = run_cli("ceiling", "--rows-probe", H200_ROWS, "--profile", H200_PROFILE, "--replay",
                             H200_ROWS.parent / "replay.json", "--format", "json")
    assert code == 0, err
    probe = {p["rows"]: p["c"] for p in json.loads(H200_ROWS.read_text())["points"]}
    by_nodes = json.loads(out)["by_nodes"]
    assert by_nodes and all(r["c"] == pytest.approx(probe[r["rows"]]) for r in by_nodes), by_nodes


def test_a_profile_of_rows_the_probe_did_not_time_is_warned_about(run_cli, tmp_path):
    """A profile of 12-row steps beside a probe that timed 9 and 17 rows: T_AR stays the probe's
    bare forward and the warning says c counts the outside time, and how to fix it."""
    prof = json.loads(H200_PROFILE.read_text())
    prof["shape"]["rows"] = 12
    p = tmp_path / "p12.json"
    p.write_text(json.dumps(prof))
    code, out, err = run_cli("ceiling", "--rows-probe", H200_ROWS, "--profile", p, "--tau", "2", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["cost_model"]["ar_ms"] == pytest.approx(3.926159977912903)
    assert any("so c counts the outside time" in w and "not the profile's 12" in w for w in d["warnings"]), d




def test_a_run_of_no_passes_or_a_tau_below_one_is_named_as_the_files(run_cli, cpu_run, tmp_path):
    """A run whose only token came from the prefill was called a file from an older SpecPilot; a
    file's tau below 1 was blamed on a --tau that was not given."""
    one = tmp_path / "one.json"
    code, _, err = run_cli("run", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "1",
                           "--format", "json", "--out", one)
    assert code == 0 and json.loads(one.read_text())["steps"] == 0, err
    code, _, err = run_cli("ceiling", "--run", one, "--ar-ms", "3")
    refused(code, err, f"{one}: the run made no verification passes")
    for tau in (0.5, 0.0):
        bad = tmp_path / f"tau{tau}.json"
        bad.write_text(json.dumps({**json.loads(cpu_run.read_text()), "tau": tau}))
        code, _, err = run_cli("ceiling", "--run", bad, "--ar-ms", "20")
        refused(code, err, f"{bad}: the run's 'tau' must be a finite number in [1, 65536], got {tau}")


def test_a_profile_of_a_gpu_outside_the_catalog_sets_floors_with_model(run_cli, tmp_path):
    """A profile whose floors used --bandwidth/--flops for a GPU the catalog lacks was refused beside
    --model as disagreeing with a '--gpu' never given ('... against custom'); an unknown key beside a
    catalog name disagreed with itself. A real --gpu is named as the option that disagrees."""
    prof = json.loads(H200_PROFILE.read_text())
    h200 = dict(prof)
    prof["gpu"] = {"name": "NVIDIA A100-SXM4-40GB", "key": "custom", "bandwidth_tbs": 1.555, "bf16_tflops": 312.0}
    for k in ("total_floor_ms", "floor_peak_ms"):   # one row: every class bound by its bytes
        if prof.get(k):
            prof[k] *= 4.8 / 1.555
    p = tmp_path / "a100.json"
    p.write_text(json.dumps(prof))
    for extra in ((), ("--bandwidth", "1.555", "--flops", "312")):
        code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4",
                                 *extra, "--format", "json")
        assert code == 0, err
        assert json.loads(out)["gpu"]["name"] == "NVIDIA A100-SXM4-40GB"
    code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--gpu", "h100", "--tau", "2",
                             "--ar-ms", "4")
    assert code == 2 and "and --gpu h100-sxm disagree on the GPU's peak bandwidth (1.555 TB/s against 3.35 TB/s)" in \
        one_error(err)
    prof = h200
    prof["gpu"] = {"name": "NVIDIA H200", "key": "no-such-gpu", "bandwidth_tbs": 4.8, "bf16_tflops": 989.5}
    p.write_text(json.dumps(prof))
    code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4")
    assert code == 0, err


def test_a_profile_of_an_unknown_gpu_without_figures_is_named_not_this_machines(run_cli, tmp_path):
    """A profile of a GPU the catalog lacks, made without floors, gives no figures: ceiling --model probed
    this machine's GPU through NVML instead (exit 3 here; another card's floors on a GPU host)."""
    prof = json.loads(H200_PROFILE.read_text())
    prof["gpu"] = {"name": "NVIDIA A100-SXM4-40GB", "source": "TARGET_INFO_GPU"}
    for k in ("total_floor_ms", "floor_peak_ms", "kernel_factor"):   # profiled without floors
        prof[k] = None
    for c in prof["classes"].values():
        c.update({"bytes": None, "flops": None, "floor_ms": None, "efficiency": None})
    p = tmp_path / "a100.json"
    p.write_text(json.dumps(prof))
    code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4")
    assert code == 2 and out == ""
    assert one_error(err) == (f"specpilot: error: --profile {p}: the trace's GPU 'NVIDIA A100-SXM4-40GB' is not in the "
                              "GPU catalog; name one with --gpu, or give --bandwidth and --flops")
    code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--bandwidth", "1.555", "--flops",
                             "312", "--tau", "2", "--ar-ms", "4", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["gpu"]["name"] == "NVIDIA A100-SXM4-40GB"


def _profile(run_cli, tmp_path, name, *opts):
    out = tmp_path / name
    code, _, err = run_cli("profile", ROUNDS / "llama8b-h200" / "measure" / "trace.json.gz", "--model", "llama-3.1-8b",
                           "--context", "96", "--skip-steps", "2", *opts, "--format", "json", "--out", out)
    assert code == 0, err
    return out


def test_the_profiles_lm_head_dtype_sets_the_floors_beside_model(run_cli, tmp_path):
    """A profile of an int4 LM head beside --model: the floor table took a bf16 head (3.48 ms) while
    the kernel factor divided by the profile's 3.30 ms; a profile of a bf16 head beside
    --lm-head-dtype int4 showed the int4 floors and divided by the bf16 one."""
    p = _profile(run_cli, tmp_path, "lh4.json", "--lm-head-dtype", "int4")
    assert json.loads(p.read_text())["shape"]["lm_head_dtype"] == "int4"
    code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4",
                             "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["total_floor_ms"] == pytest.approx(doc["cost_model"]["inputs"]["floor_ms"], rel=1e-6)
    assert doc["total_floor_ms"] < 3.35
    code, _, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4",
                           "--lm-head-dtype", "bf16")
    refused(code, err, f"--profile {p}", "--lm-head-dtype bf16", "lm head dtype (int4 against bf16)")
    # a profile written without the field (a bf16 head): the two floors are compared
    old = json.loads(_profile(run_cli, tmp_path, "bf16.json").read_text())
    del old["shape"]["lm_head_dtype"]
    (p := tmp_path / "old.json").write_text(json.dumps(old))
    code, _, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4",
                           "--lm-head-dtype", "int4")
    refused(code, err, f"--profile {p}", "--model llama-3.1-8b", "byte floor at 1 row (3.48 against 3.3 ms)")


def test_fp8_flops_is_checked_against_the_profiles_fp8_peak(run_cli, tmp_path):
    """--fp8-flops beside a profile of fp8 weights set the table's floors at that peak while the
    kernel factor divided by the profile's floor at the catalog's."""
    p = _profile(run_cli, tmp_path, "fp8.json", "--weight-dtype", "fp8", "--rows", "64")
    assert json.loads(p.read_text())["gpu"]["fp8_tflops"] == 1979
    code, _, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4",
                           "--fp8-flops", "50")
    refused(code, err, f"--profile {p}", "--fp8-flops 50", "dense fp8 peak (1979 TFLOP/s against 50 TFLOP/s)")
    code, out, err = run_cli("ceiling", "--profile", p, "--model", "llama-3.1-8b", "--tau", "2", "--ar-ms", "4",
                             "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["total_floor_ms"] == pytest.approx(doc["cost_model"]["inputs"]["floor_ms"], rel=1e-6)


def test_out_beside_a_model_config_file_is_refused(run_cli, tmp_path):
    """A model given as a config file: the weights and tokenizer beside it are inputs (formats.md),
    and profile/ceiling --out wrote over them."""
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text((REPO / "tests" / "fixtures" / "decode_target_config.json").read_text())
    for name in ("model.safetensors", "tokenizer.json"):
        (m / name).write_text("WEIGHTS")
    trace = REPO / "tests" / "fixtures" / "nsys_h200_decode_eager.sqlite"
    for args in (("profile", trace, "--model", m / "config.json"),
                 ("ceiling", "--model", "smollm2-135m", "--drafter", m / "config.json", "--gpu", "h100"),
                 ("ceiling", "--model", m / "config.json", "--gpu", "h100")):
        for name in ("model.safetensors", "tokenizer.json"):
            code, _, err = run_cli(*args, "--out", m / name)
            refused(code, err, f"--out {m / name}", "refusing to overwrite")
            assert (m / name).read_text() == "WEIGHTS"


def test_a_rows_probe_beside_floors_shows_its_c_next_to_the_floors(run_cli):
    """ceiling.md: a rows probe beside --model floors stands beside them, its c(N) next to the floor's;
    with several --rows it was refused as 'measurements apply to one row count ... --tau', and with
    one row it asked for --tau, and no form showed the probe's c."""
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--context", "96", "--rows",
                             "1,2,9", "--rows-probe", H200_ROWS, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    probe = json.loads(H200_ROWS.read_text())
    ar = probe["ar_ms"]
    steps = {p["rows"]: p["step_ms"] for p in probe["points"]}
    for n in (1, 2, 9):
        assert doc["by_rows"][str(n)]["c_probe"] == pytest.approx(steps[n] / ar if n in steps else 1.0)
    assert doc["cost_model"] is None
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--context", "96", "--rows", "9",
                             "--rows-probe", H200_ROWS)
    assert code == 0, err
    assert "beside the rows probe's c(N)" in out and "c probe" in out
    assert "note: no cost model: it needs tau (--tau or --replay) at one row count (--rows N)" in out
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--context", "96", "--rows", "16",
                             "--rows-probe", H200_ROWS)   # a probe that timed none of the rows: said, not dropped
    assert code == 0, err
    assert "timed none of --rows 16 (it timed 1,2,3,4,5,6,7,8,9,17,33)" in out + err
    assert "note: no cost model" in out
