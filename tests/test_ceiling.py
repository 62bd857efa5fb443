"""Byte floors, the cost model and `specpilot ceiling` end to end."""

import json
import re

import pytest

from specpilot.errors import InputError
from specpilot.gpus import GPUSpec
from specpilot.models import spec_from_config
from specpilot.options import parse_int_list
from specpilot.probes.costmodel import cost_model
from specpilot.probes.floors import step_floor

from model_configs import HYBRID, LLAMA_8B

GPU = GPUSpec(key="test", name="Test GPU", bandwidth_tbs=3.35, bf16_tflops=989.4, fp8_tflops=1978.9)


def test_floor_rule_by_hand():
    m = spec_from_config(LLAMA_8B)
    f = step_floor(m, GPU, rows=1, batch=1, context=2048)
    lin = f.classes["linear"]
    # weights 13.96 GB + bf16 activations; floor = bytes / (0.9 x 3.35 TB/s)
    assert lin.bytes == pytest.approx(2 * 6979321856 + 2 * sum(
        c * (k + n) for _, k, n, c in __import__("specpilot.probes.floors", fromlist=["gemms"]).gemms(m)), rel=1e-12)
    assert lin.floor_ms == pytest.approx(lin.bytes / (0.9 * 3.35e12) * 1e3)
    assert lin.bound == "bytes"
    assert f.classes["lm_head"].bytes == pytest.approx(128256 * 4096 * 2 + (4096 + 128256) * 2)
    # attention at 2048 context: K+V of 2048 tokens x 32 layers x 8 kv heads x 128 x 2 bytes
    assert f.classes["attention"].bytes == pytest.approx(2048 * 131072 + 32 * (2 * 8 * 128 * 2 + 2 * 32 * 128 * 2))
    assert f.total_floor_ms == pytest.approx(sum(c.floor_ms for c in f.classes.values()))
    # fractions are options
    g = step_floor(m, GPU, rows=1, bw_fraction=0.45)
    assert g.classes["linear"].floor_ms == pytest.approx(2 * lin.floor_ms)


def test_flops_bound_at_many_rows():
    m = spec_from_config(LLAMA_8B)
    f = step_floor(m, GPU, rows=4096)
    lin = f.classes["linear"]
    assert lin.bound == "flops"
    assert lin.floor_ms == pytest.approx(lin.flops / (0.6 * 989.4e12) * 1e3)


def test_w12_and_fp8_weights():
    m = spec_from_config(LLAMA_8B)
    bf16 = step_floor(m, GPU, rows=1).classes["linear"].bytes
    w12 = step_floor(m, GPU, rows=1, weight_dtype="w12")
    assert w12.classes["linear"].bytes == pytest.approx(bf16 * 12.02 / 16, rel=0.001)
    assert w12.classes["lm_head"].bytes == pytest.approx(128256 * 4096 * 2, rel=0.01)  # head stays bf16
    fp8 = step_floor(m, GPU, rows=4096, weight_dtype="fp8")
    assert fp8.classes["linear"].floor_ms == pytest.approx(fp8.classes["linear"].flops / (0.6 * 1978.9e12) * 1e3)
    assert fp8.classes["lm_head"].floor_ms == pytest.approx(fp8.classes["lm_head"].flops / (0.6 * 1978.9e12) * 1e3)
    # the fp8 peak is the fp8 GEMMs' only: attention (bf16 queries) and a bf16 LM head keep the bf16 one
    k = fp8.classes["attention"]
    assert k.bound == "flops" and k.floor_ms == pytest.approx(k.flops / (0.6 * 989.4e12) * 1e3)
    head = step_floor(m, GPU, rows=4096, weight_dtype="fp8", lm_head_dtype="bf16").classes["lm_head"]
    assert head.floor_ms == pytest.approx(head.flops / (0.6 * 989.4e12) * 1e3)
    head8 = step_floor(m, GPU, rows=4096, lm_head_dtype="fp8").classes["lm_head"]
    assert head8.floor_ms == pytest.approx(head8.flops / (0.6 * 1978.9e12) * 1e3)


def test_gdn_state_bytes_and_drafter():
    m = spec_from_config(HYBRID)
    f1 = step_floor(m, GPU, rows=1, batch=1, context=0)
    f4 = step_floor(m, GPU, rows=1, batch=4, context=0)
    state = 32 * 128 * 128 * 4
    # state is read and written once per request and layer: grows with batch, not with rows
    assert f4.classes["gdn"].bytes - f1.classes["gdn"].bytes == pytest.approx(
        6 * 3 * (2 * state + 2 * 3 * (2 * 2048 + 4096) * 2) + 6 * 3 * ((2 * 2048 + 4096) + 4096 + 64) * 4, rel=1e-9)
    d = spec_from_config(dict(LLAMA_8B, num_hidden_layers=1))
    with_d = step_floor(m, GPU, rows=16, drafter=d, draft_rows=16)
    assert with_d.classes["drafter"].floor_ms > 0
    assert with_d.total_floor_ms == pytest.approx(step_floor(m, GPU, rows=16).total_floor_ms
                                                  + with_d.classes["drafter"].floor_ms)


def test_bad_shapes():
    m = spec_from_config(LLAMA_8B)
    with pytest.raises(InputError):
        step_floor(m, GPU, rows=0)
    with pytest.raises(InputError):
        step_floor(m, GPU, rows=1, batch=-1)
    with pytest.raises(InputError):
        step_floor(m, GPU, rows=1, bw_fraction=1.5)


def test_cost_model_factors():
    c = cost_model(tau=4.0, step_ms=20.0, ar_ms=16.0, tau_best=6.0, profile_ms=18.0, floor_ms=12.0)
    assert c.c == pytest.approx(1.25)
    assert c.speedup == pytest.approx(3.2)
    assert c.factors == {"tree": pytest.approx(1.5), "kernel": pytest.approx(1.5), "outside": pytest.approx(20 / 18)}
    # ceiling = tau_best / (floor / T_AR)
    assert c.ceiling == pytest.approx(6.0 / (12.0 / 16.0))
    assert c.largest in ("tree", "kernel")
    c2 = cost_model(tau=4.0, step_ms=20.0, ar_ms=16.0)
    assert c2.ceiling == pytest.approx(c2.speedup) and c2.largest is None
    assert any("unknown" in n for n in c2.notes)
    with pytest.raises(InputError):
        cost_model(tau=0.5, step_ms=1, ar_ms=1)


def test_parse_int_list():
    assert parse_int_list("1,8,32,64") == [1, 8, 32, 64]
    assert parse_int_list("1,2,4,...,256") == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert parse_int_list("8,16,32,...,64") == [8, 16, 32, 64]
    assert parse_int_list("1,2,4,...,16") == [1, 2, 4, 8, 16]
    assert parse_int_list("1,2,...,6") == [1, 2, 3, 4, 5, 6]  # only counting by one lands on 6
    assert parse_int_list("2,4,...,10") == [2, 4, 6, 8, 10]
    for bad in ("0", "1,x", "", "1,...,8", "-3", "1,,8", "1,8,", "1,2,...,16", "1,2,4,...,100", "4,2,...,8"):
        with pytest.raises(InputError):
            parse_int_list(bad)


def _cli_gpu():
    return ["--gpu", "auto", "--bandwidth", "3.35", "--flops", "989.4"]


def test_cli_what_if_table_and_json(run_cli, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    code, out, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--rows", "1,8,32,64", "--batch", "1",
                             "--context", "2048")
    assert code == 0, err
    assert "lm_head" in out and "c floor" in out
    ar = re.search(r"AR floor \(1 row, no drafter\): ([\d.]+) ms/token;", out)
    assert ar, out
    # a step of several requests gives each one token: its time per step and per token both
    code, out, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--batch", "3")
    step = re.search(r"AR floor \(1 row, no drafter\): ([\d.]+) ms/step of 3 requests, ([\d.]+) ms/token;", out)
    assert code == 0 and step and float(step[2]) == pytest.approx(float(step[1]) / 3, rel=1e-3), out
    assert float(step[1]) > float(ar[1])
    code, out, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--rows", "1,64", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "specpilot.ceiling/1"
    assert set(doc["classes"]) == {"linear", "lm_head", "attention", "gdn", "moe", "norm", "drafter"}
    assert all(isinstance(c["bytes"], float) and isinstance(c["flops"], float) for c in doc["classes"].values())
    assert set(doc["by_rows"]) == {"1", "64"}
    assert doc["by_rows"]["1"]["c_floor"] == pytest.approx(1.0)
    assert doc["by_rows"]["64"]["c_floor"] > 1.0
    assert doc["total_floor_ms"] == pytest.approx(doc["by_rows"]["1"]["total_floor_ms"])
    for fmt in ("yaml", "markdown"):
        code, out, _ = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--format", fmt)
        assert code == 0 and "lm_head" in out


def test_cli_measured_and_files(run_cli, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"schema": "specpilot.profile/1", "kernel_busy_ms": 5.0, "step_wall_ms": 6.0,
                                   "steps": 10, "classes": {}}))
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [
        {"policy": "chain", "tau": 4.25}, {"policy": "best-first:32", "tau": 5.38}, {"policy": "oracle:16", "tau": 6.42}]}))
    out_file = tmp_path / "ceiling.json"
    code, out, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--rows", "32", "--ar-ms", "4.5",
                             "--profile", profile, "--replay", replay, "--format", "json", "--out", out_file)
    assert code == 0, err
    doc = json.loads(out_file.read_text())
    cm = doc["cost_model"]
    assert cm["tau"] == 4.25 and cm["factors"]["tree"] == pytest.approx(6.42 / 4.25)
    assert cm["factors"]["outside"] == pytest.approx(6.0 / 5.0)
    assert cm["factors"]["kernel"] == pytest.approx(5.0 / doc["total_floor_ms"])
    assert cm["speedup"] == pytest.approx(4.25 / (6.0 / 4.5))
    assert cm["largest_factor"] in ("tree", "kernel", "outside")
    # table names the largest factor
    code, out, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--rows", "32", "--tau", "4", "--tau-best",
                             "6", "--step-ms", "6", "--ar-ms", "4.5", "--profile-ms", "5")
    assert code == 0 and "Largest factor" in out


@pytest.mark.parametrize("args,msg", [
    (["--rows", "0"], "--rows"),
    (["--rows", "1,8", "--tau", "4", "--step-ms", "5", "--ar-ms", "4"], "one row count"),
    (["--tau", "4"], "needs"),
    (["--batch", "0"], "--batch"),
    (["--gpu", "tpu-v9"], "unknown GPU"),
    (["--gpu", "mi"], "GPU 'mi' is the start of several: mi300x, mi325x; give one of them"),
])
def test_cli_bad_input(run_cli, tmp_path, args, msg):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    gpu = [] if "--gpu" in args else _cli_gpu()
    code, out, err = run_cli("ceiling", "--model", cfg, *gpu, *args)
    assert code == 2
    assert err.startswith("specpilot: error:") and msg in err
    assert len(err.strip().splitlines()) == 1


def test_cli_bad_files(run_cli, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text("{broken")
    code, _, err = run_cli("ceiling", "--model", cfg, *_cli_gpu())
    assert code == 2 and "not valid JSON" in err
    cfg.write_text(json.dumps(LLAMA_8B))
    wrong = tmp_path / "p.json"
    wrong.write_text(json.dumps({"schema": "other/1"}))
    code, _, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--profile", wrong, "--ar-ms", "1", "--tau", "2")
    assert code == 2 and "unknown schema" in err
    # --out never overwrites an input, and leaves no partial file
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"schema": "specpilot.profile/1", "kernel_busy_ms": 5.0, "step_wall_ms": 6.0}))
    before = prof.read_text()
    code, _, err = run_cli("ceiling", "--model", cfg, *_cli_gpu(), "--profile", prof, "--tau", "3", "--ar-ms", "5",
                           "--out", prof)
    assert code == 2 and "refusing to overwrite" in err
    assert prof.read_text() == before
    assert not list(tmp_path.glob("*.part"))


def test_version_and_help(run_cli):
    code, out, _ = run_cli("--version")
    assert code == 0 and "specpilot" in out
    code, out, _ = run_cli("ceiling", "--help")
    assert code == 0 and "byte floor" in out.lower()
    code, _, err = run_cli("no-such-verb")
    assert code == 2 and err.startswith("specpilot: error:")


def test_cli_predicted_speedup_by_nodes(run_cli, tmp_path):
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [{"policy": "chain", "tau": 4.0}],
                                  "curves": {"best-first": {"8": 4.5, "32": 5.4, "63": 5.6}}}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "points": [
        {"rows": 1, "step_ms": 10.0}, {"rows": 9, "step_ms": 10.2}, {"rows": 33, "step_ms": 10.8}]}))
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", "--rows", "33",
                             "--replay", replay, "--rows-probe", rows, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    by = {r["nodes"]: r for r in doc["by_nodes"]}
    # a budget of N nodes verifies N + 1 rows: its c is the probe's 33-row step
    assert by[32]["c_source"] == "measured" and by[32]["c"] == pytest.approx(1.08) and by[32]["rows"] == 33
    assert by[32]["speedup"] == pytest.approx(5.4 / 1.08)
    assert 63 not in by  # not probed: measured and floor c are never mixed
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", "--rows", "33",
                             "--replay", replay, "--format", "json")
    floor_by = {r["nodes"]: r for r in json.loads(out)["by_nodes"]}
    assert floor_by[63]["c_source"] == "floor" and floor_by[63]["c"] > floor_by[8]["c"] > 1.0
    # T_step(33) and T_AR came from the rows probe
    assert doc["cost_model"]["step_ms"] == 10.8 and doc["cost_model"]["ar_ms"] == 10.0
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h100", "--rows", "33",
                             "--replay", replay, "--rows-probe", rows)
    assert code == 0 and "Best in this table: best-first at 32 nodes" in out


def test_a_policys_tau_over_a_step_of_other_rows_is_flagged(run_cli, tmp_path):
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [
        {"policy": "chain", "tau": 1.5}, {"policy": "best-first:16", "tau": 1.7}]}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 16, "step_ms": 11.0},
                                           {"rows": 17, "step_ms": 12.0}]}))
    args = ("ceiling", "--replay", replay, "--rows-probe", rows, "--policy", "best-first:16", "--format", "json")
    doc = json.loads(run_cli(*args)[1])   # --rows 1 by default: a 16-node tree's tau over a 1-row step
    assert doc["cost_model"]["c"] == 1.0
    assert any("pairs best-first:16's tau with the 1-row step" in w and "--rows 17" in w for w in doc["warnings"])
    # 16 nodes and the pending token they hang from: 17 rows
    doc = json.loads(run_cli(*args, "--rows", "16")[1])
    assert any("--rows 17" in w for w in doc["warnings"])
    doc = json.loads(run_cli(*args, "--rows", "17")[1])
    assert doc["cost_model"]["c"] == pytest.approx(1.2) and doc["warnings"] == []
    doc = json.loads(run_cli(*args[:-4], "--policy", "chain", "--format", "json")[1])
    assert doc["warnings"] == []   # a file that names neither the chain's nodes nor the lattice's m


def test_a_chains_tau_over_the_one_row_step_is_flagged(run_cli, tmp_path):
    """A chain verifies its depth + 1 rows: the replay's nodes for it (else its m, or chain:N cut to m)."""
    replay = tmp_path / "replay.json"
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": 10 + 0.1 * r} for r in (1, 2, 5, 9)]}))
    for policies, positions, policy, want in (
            ([{"policy": "chain", "nodes": 8, "tau": 1.5}], 8, None, 9),   # ceiling's default policy
            ([{"policy": "chain", "tau": 1.5}], 8, "chain", 9),            # no nodes: the lattice's m
            ([{"policy": "chain:8", "nodes": 8, "tau": 1.4}], 8, "chain", 9),   # every position: chain
            ([{"policy": "chain:4", "tau": 1.4}], 8, "chain:4", 5),        # its depth
            ([{"policy": "chain:16", "tau": 1.5}], 8, "chain:16", 9)):     # cut to m
        replay.write_text(json.dumps({"schema": "specpilot.replay/1", "positions": positions, "policies": policies}))
        args = ("ceiling", "--replay", replay, "--rows-probe", rows, "--format", "json")
        args += ("--policy", policy) if policy else ()
        code, out, err = run_cli(*args)
        assert code == 0, err
        (w,) = json.loads(out)["warnings"]
        assert "with the 1-row step" in w and f"the pending token a step, {want} rows: give --rows {want}" in w, w
        doc = json.loads(run_cli(*args, "--rows", str(want))[1])
        assert doc["warnings"] == [] and doc["cost_model"]["step_ms"] == pytest.approx(10 + 0.1 * want)


def test_by_node_c_is_the_mean_over_the_rows_the_replayed_steps_verify(run_cli, tmp_path):
    """A budget of N verifies fewer than N + 1 rows where the drafter proposed fewer candidates: c is the
    mean step cost over the replay's curve_rows (as the round models it), not the cost at N + 1 rows."""
    from specpilot.auditors.round.modeling import expected_c

    replay = tmp_path / "replay.json"
    hist = {"1": 3, "5": 1, "9": 4}
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "positions": 8, "policies": [
        {"policy": "chain", "nodes": 8, "tau": 1.5}], "curves": {"chain": {"8": 1.5}},
        "curve_rows": {"chain": {"8": hist}}}))
    steps = {1: 10.0, 4: 10.4, 8: 11.0, 9: 11.2}
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": ms} for r, ms in steps.items()]}))
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows-probe", rows, "--rows", "9", "--format", "json")
    assert code == 0, err
    (row,) = json.loads(out)["by_nodes"]
    want = (3 * 10.0 + (10.4 + (11.0 - 10.4) / 4) + 4 * 11.2) / 8 / 10.0   # 5 rows: between the probe's 4 and 8
    assert row["c"] == pytest.approx(want) and row["rows"] == pytest.approx(44 / 8)
    assert row["c_source"] == "interpolated"
    assert row["c"] == pytest.approx(expected_c("chain", 8, steps, 10.0, {"chain": {"8": hist}})[0])
    code, out, err = run_cli("ceiling", "--replay", replay, "--model", "smollm2-135m", "--gpu", "h200", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["by_nodes"][0]["rows"] == pytest.approx(44 / 8)
    doc = json.loads(replay.read_text())
    doc["curve_rows"]["chain"]["8"] = {"12": 1}
    replay.write_text(json.dumps(doc))
    code, _, err = run_cli("ceiling", "--replay", replay, "--rows-probe", rows, "--rows", "9")
    assert code == 2 and "'curve_rows' must map each curve's node counts" in err, err


def test_a_shared_budgets_curve_rows_may_pass_its_nodes(run_cli, tmp_path):
    """A request's share of a shared budget reaches twice its nodes: replay writes rows up to 2N + 1 for
    shared and adaptive curves, which the reader refused as damage."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "positions": 8, "policies": [
        {"policy": "shared:4", "nodes": 4, "tau": 1.5}], "curves": {"shared": {"4": 1.5}},
        "curve_rows": {"shared": {"4": {"1": 2, "9": 1}}}}))
    args = ("ceiling", "--replay", replay, "--model", "smollm2-135m", "--gpu", "h200", "--rows", "5", "--policy",
            "shared:4", "--format", "json")
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert json.loads(out)["by_nodes"][0]["rows"] == pytest.approx(11 / 3)
    doc = json.loads(replay.read_text())
    doc["curve_rows"]["shared"]["4"] = {"10": 1}
    replay.write_text(json.dumps(doc))
    code, _, err = run_cli(*args)
    assert code == 2 and "twice its nodes + 1" in err, err


def test_budgets_the_probe_did_not_time_are_named(run_cli, tmp_path):
    """The by-node table leaves out budgets whose N + 1 rows the probe lacks, and says which."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "positions": 8, "policies": [
        {"policy": "chain", "nodes": 8, "tau": 1.5}, {"policy": "best-first:32", "nodes": 32, "tau": 1.7}],
        "curves": {"chain": {"8": 1.5}, "best-first": {"8": 1.6, "16": 1.65, "32": 1.7}}}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": 10 + 0.1 * r} for r in (1, 9, 16)]}))
    args = ("ceiling", "--replay", replay, "--rows-probe", rows, "--rows", "9")
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert ("did not time their rows (or counts on both sides of them): best-first at 16, 32 nodes (17, 33 rows)" in out
            and "chain at" not in out.split("Left out")[1]), out
    doc = json.loads(run_cli(*args, "--format", "json")[1])
    assert [(r["policy"], r["nodes"]) for r in doc["by_nodes"]] == [("chain", 8), ("best-first", 8)]
    assert doc["by_nodes_left_out"] == [{"policy": "best-first", "nodes": 16, "rows": 17},
                                        {"policy": "best-first", "nodes": 32, "rows": 33}]
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": 10 + 0.1 * r} for r in (1, 2)]}))
    code, out, err = run_cli(*args[:-2])
    assert code == 0 and "note: no node budget's speedup is predicted: left out" in out, out


def test_rows_mismatch_advice_works_where_the_probe_lacks_the_rows(run_cli, tmp_path):
    """The warning's advice is one that runs: a probe without N + 1 rows gets the interpolated step
    for --step-ms and the probe rows command that times them, never a bare --rows N + 1 (refused),
    and the by-node table only where it is printed."""
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [
        {"policy": "chain", "tau": 1.5}, {"policy": "best-first:16", "tau": 1.7}]}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "model": "smollm2-135m", "ar_ms": 10.0,
                                "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": 10 + 0.1 * r} for r in (1, 2, 4, 8, 16, 32)]}))
    args = ("ceiling", "--replay", replay, "--rows-probe", rows, "--policy", "best-first:16")
    code, out, err = run_cli(*args, "--rows", "8")
    assert code == 0, err
    (warning,) = [line for line in out.splitlines() if line.startswith("warning:")]
    assert "17 rows: the probe timed 1,2,4,8,16,32 rows, not 17" in warning, warning
    assert "give --rows 17 --step-ms 11.7" in warning and "by-node table" not in warning, warning
    assert "specpilot probe rows --model smollm2-135m --rows 1,2,4,8,16,17,32" in warning, warning
    code, out, err = run_cli(*args, "--rows", "17", "--step-ms", "11.7", "--format", "json")
    assert code == 0 and json.loads(out)["cost_model"]["c"] == pytest.approx(1.17), err
    # beyond the probed counts nothing is interpolated: only the probe command is offered
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": 10 + 0.1 * r} for r in (1, 2, 4, 8)]}))
    warning = json.loads(run_cli(*args, "--rows", "8", "--format", "json")[1])["warnings"][0]
    assert "--step-ms" not in warning and "specpilot probe rows --rows 1,2,4,8,17 " in warning, warning
    # the by-node table is named where it is printed with the policy's row
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [
        {"policy": "chain", "tau": 1.5}, {"policy": "best-first:16", "tau": 1.7}],
        "curves": {"best-first": {"16": 1.7}}}))
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": r, "step_ms": 10 + 0.1 * r} for r in (1, 8, 17)]}))
    code, out, err = run_cli(*args, "--rows", "8")
    assert code == 0 and "Predicted speedup by node budget" in out, err
    assert "give --rows 17, or read its row of the by-node table" in out, out


def test_cli_rows_probe_ar_path_and_its_warnings(run_cli, tmp_path):
    """A probe that says which AR step T_AR is gives no warning of its own; one that does not (older
    files), or that carries the probe's warning, is flagged: c(N) is only as honest as T_AR."""
    base = {"schema": "specpilot.rows/1", "ar_ms": 4.0, "points": [{"rows": 1, "step_ms": 4.0},
                                                                   {"rows": 32, "step_ms": 4.4}]}
    for extra, expect in (({"ar_path": "fused", "warnings": []}, None),
                          ({}, "does not say which AR step"),
                          ({"ar_path": "layers", "warnings": ["T_AR is the layer modules' AR step, but ..."]},
                           "layer modules' AR step")):
        rows = tmp_path / "rows.json"
        rows.write_text(json.dumps({**base, **extra}))
        code, out, err = run_cli("ceiling", "--rows", "32", "--tau", "3", "--rows-probe", rows, "--format", "json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["cost_model"]["c"] == pytest.approx(1.1)
        if expect is None:
            assert doc["warnings"] == [] and "fused AR step" in doc["cost_model"]["sources"]["ar_ms"]
        else:
            assert len(doc["warnings"]) == 1 and expect in doc["warnings"][0]
            code, out, _ = run_cli("ceiling", "--rows", "32", "--tau", "3", "--rows-probe", rows)
            assert "warning: rows probe" in out
    rows.write_text(json.dumps({**base, "ar_path": 3}))
    code, _, err = run_cli("ceiling", "--rows", "32", "--tau", "3", "--rows-probe", rows)
    assert code == 2 and "ar_path" in err
    rows.write_text(json.dumps({**base, "points": base["points"] + [{"rows": 32, "step_ms": 99.0}]}))
    code, _, err = run_cli("ceiling", "--rows", "32", "--tau", "3", "--rows-probe", rows)
    assert code == 2 and "two points at 32 rows" in err


def test_cli_run_step_timing_is_the_outside_factor(run_cli, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"schema": "specpilot.run/1", "tau": 3.0,
                               "step_timing": {"steps": 10, "gpu_ms": 4.4, "wall_ms": 5.5, "outside_ms": 1.1}}))
    code, out, err = run_cli("ceiling", "--rows", "33", "--ar-ms", "4.0", "--run", run, "--format", "json")
    assert code == 0, err
    cm = json.loads(out)["cost_model"]
    assert cm["tau"] == 3.0 and cm["step_ms"] == 5.5 and cm["factors"]["outside"] == pytest.approx(5.5 / 4.4)
    assert cm["speedup"] == pytest.approx(3.0 / (5.5 / 4.0))
    run.write_text(json.dumps({"schema": "specpilot.run/1", "tau": 1.0, "step_timing": None}))
    code, _, err = run_cli("ceiling", "--rows", "33", "--ar-ms", "4.0", "--run", run)
    assert code == 2 and "step_timing" in err
    run.write_text(json.dumps({"schema": "specpilot.run/1", "tau": 1.3, "step_timing": None,
                               "batch": {"batch": 2, "verify_steps": 24}}))
    code, _, err = run_cli("ceiling", "--check", run)
    assert code == 2 and "batched run" in err and "without --batch" in err and len(err.strip().splitlines()) == 1


def test_sequential_drafter_passes():
    m = spec_from_config(LLAMA_8B)
    d = spec_from_config(dict(LLAMA_8B, num_hidden_layers=1))
    one = step_floor(m, GPU, rows=8, drafter=d, draft_rows=1)
    seven = step_floor(m, GPU, rows=8, drafter=d, draft_rows=1, draft_passes=7)
    assert seven.classes["drafter"].bytes == pytest.approx(7 * one.classes["drafter"].bytes)
    assert seven.classes["drafter"].floor_ms == pytest.approx(7 * one.classes["drafter"].floor_ms)
    with pytest.raises(InputError):
        step_floor(m, GPU, rows=8, drafter=d, draft_passes=0)


def test_amd_gpus_in_catalog():
    from specpilot.gpus import match_gpu_name

    assert match_gpu_name("AMD Instinct MI300X").key == "mi300x"


def test_cost_model_title_names_the_rows_a_runs_verify_steps_used(run_cli, tmp_path):
    # the title said "at 1 row" (the --rows default) for a tree run whose steps verified up to 17 rows
    runs = {}
    for mode in ("tree", "chain"):
        runs[mode] = tmp_path / f"{mode}.json"
        nodes = ("--nodes", "16") if mode == "tree" else ()
        code, _, err = run_cli("run", "--model", "tiny", "--mode", mode, *nodes, "--prompt", "abcabcabcabcabc",
                               "--max-new-tokens", "24", "--format", "json", "--out", runs[mode])
        assert code == 0, err
    for mode, nodes in (("tree", "tree at 16 nodes, "), ("chain", "chain, ")):
        by_rows = json.loads(runs[mode].read_text())["step_timing"]["by_rows"]
        lo, hi = min(r["rows"] for r in by_rows), max(r["rows"] for r in by_rows)
        assert hi > 1
        code, out, err = run_cli("ceiling", "--run", runs[mode], "--ar-ms", "1.0")
        assert code == 0, err
        title = out.splitlines()[0]
        assert title.startswith(f"Cost model of run {runs[mode]}: {nodes}verify steps of {lo}-{hi} rows, "), title
        assert "1 row" not in title
        code, out, err = run_cli("ceiling", "--run", runs[mode], "--ar-ms", "1.0", "--format", "json")
        vr = json.loads(out)["cost_model"]["run_verify_rows"]
        assert code == 0 and (vr["min"], vr["max"]) == (lo, hi) and lo < vr["mean"] < hi, out
    # a byte floor still sits at --rows, and says so; a step given on the command line keeps --rows
    code, out, _ = run_cli("ceiling", "--run", runs["tree"], "--ar-ms", "1.0", "--model", "llama-3.1-8b",
                           "--gpu", "h100")
    title = next(x for x in out.splitlines() if x.startswith("Cost model"))
    assert code == 0 and title.endswith("; byte floor at 1 row"), title
    code, out, _ = run_cli("ceiling", "--run", runs["tree"], "--ar-ms", "1.0", "--step-ms", "2", "--rows", "17")
    assert code == 0 and out.splitlines()[0] == "Cost model at 17 rows"
    code, out, _ = run_cli("ceiling", "--run", runs["tree"], "--ar-ms", "1.0", "--step-ms", "2", "--format", "json")
    assert code == 0 and "run_verify_rows" not in json.loads(out)["cost_model"]


def test_cost_model_title_of_a_tlv_cycle_without_a_run(run_cli, tmp_path):
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"schema": "specpilot.replay/1", "policies": [{"policy": "tlv:8", "tau": 3.0}]}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "fused", "warnings": [],
                                "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 9, "step_ms": 11.0}]}))
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows-probe", rows, "--policy", "tlv:8")
    assert code == 0, err
    assert "Cost model over the TLV cycle at 8 nodes\n" in out and "Cost model at 1 row" not in out


def test_cost_model_title_names_the_batch(run_cli):
    base = ("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--tau", "2", "--step-ms", "6", "--ar-ms", "4.8")
    for extra, title in (([], "Cost model at 1 row\n"), (["--batch", "16"], "Cost model at 1 row per request, batch 16\n"),
                         (["--batch", "4", "--rows", "8"], "Cost model at 8 rows per request, batch 4\n")):
        code, out, err = run_cli(*base, *extra)
        assert code == 0 and title in out, (extra, out, err)


def test_a_batched_cost_model_without_floors_says_its_batch(run_cli, tmp_path):
    """No --model: no floors carry the batch, yet c = T(4 requests x 4 rows) / T(4 requests x 1 row)
    is a batched deployment's; the title and the JSON say so."""
    rows = tmp_path / "rows4.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "batch": 4, "ar_ms": 10.0, "ar_path": "fused",
                                "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 4, "step_ms": 11.0}]}))
    code, out, err = run_cli("ceiling", "--batch", "4", "--rows", "4", "--rows-probe", rows, "--tau", "2")
    assert code == 0 and "Cost model at 4 rows per request, batch 4\n" in out, (out, err)
    code, out, err = run_cli("ceiling", "--batch", "4", "--rows", "4", "--rows-probe", rows, "--tau", "2",
                             "--format", "json")
    assert code == 0 and json.loads(out)["batch"] == 4 and json.loads(out)["shape"] is None, err
    code, out, _ = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--format", "json")
    assert code == 0 and json.loads(out)["batch"] == 1


def test_rows_probe_without_the_asked_rows_and_from_another_model(run_cli):
    from pathlib import Path

    probe = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "probe_rows_llama8b_bf16.json"
    code, _, err = run_cli("ceiling", "--rows-probe", probe, "--rows", "20", "--tau", "3")
    assert code == 2 and "has no point at 20 rows (timed at 1,2,4,8,16,32,33,64)" in err, err
    code, out, err = run_cli("ceiling", "--rows-probe", probe, "--model", "qwen3-8b", "--gpu", "h200", "--rows", "32",
                             "--tau", "3", "--format", "json")
    assert code == 0 and any("measured on llama-3.1-8b, the floors are for qwen3-8b" in w
                             for w in json.loads(out)["warnings"]), out
    code, out, _ = run_cli("ceiling", "--rows-probe", probe, "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "32",
                           "--tau", "3", "--format", "json")
    assert code == 0 and not any("different models" in w for w in json.loads(out)["warnings"])
    code, _, err = run_cli("ceiling", "--tolerance", "0.5", "--tau", "2", "--step-ms", "3", "--ar-ms", "2")
    assert code == 2 and "--tolerance go with --check" in err, err


def test_what_if_numbers_with_check_and_factors_without_gain(run_cli, tmp_path):
    code, _, err = run_cli("ceiling", "--check", tmp_path / "run.json", "--tau", "3")
    assert code == 2 and "--tau: --check judges the run against its measured files" in err, err
    code, out, err = run_cli("ceiling", "--tau", "2", "--tau-best", "2", "--step-ms", "10", "--ar-ms", "8")
    assert code == 0 and "No known factor offers a gain" in out and "Largest factor" not in out, out
    code, _, err = run_cli("ceiling", "--tau", "3", "--tau-best", "2", "--step-ms", "10", "--ar-ms", "8")
    assert code == 2 and "--tau-best 2 is below --tau 3" in err, err


def test_files_of_another_model_are_refused_beside_a_run(run_cli, tmp_path):
    """A run's speedup is not modelled from another model's step times: --run and --check refuse a
    rows probe (or an AR run) of another model."""
    run = tmp_path / "run.json"
    code, out, err = run_cli("run", "--model", "tiny", "--mode", "tree", "--nodes", "8", "--raw", "--prompt", "abc",
                             "--max-new-tokens", "8", "--format", "json", "--out", run)
    assert code == 0, err
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "model": "llama-3.1-8b", "ar_ms": 4.0,
                                "points": [{"rows": 1, "step_ms": 4.0}, {"rows": 9, "step_ms": 4.4}]}))
    for args in (("--run", run), ("--check", run)):
        code, _, err = run_cli("ceiling", *args, "--rows-probe", rows)
        assert code == 2 and "was measured on llama-3.1-8b, the run" in err and "decoded tiny" in err, err
    # a model whose name starts with the run's is another model all the same (a dense and a hybrid)
    rows.write_text(json.dumps({"schema": "specpilot.rows/1", "model": "tiny-hybrid", "ar_ms": 4.0,
                                "points": [{"rows": 1, "step_ms": 4.0}, {"rows": 9, "step_ms": 4.4}]}))
    code, _, err = run_cli("ceiling", "--check", run, "--rows-probe", rows)
    assert code == 2 and "was measured on tiny-hybrid, the run" in err, err


@pytest.mark.parametrize("a,b,same", [("tiny", "tiny-hybrid", False), ("qwen3", "qwen3.5-9b", False),
                                      ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", True),
                                      ("llama-3.1-8b", "Llama-3.1-8B-Instruct/", True),
                                      ("llama-3.1-8b", "llama-3.1-8b-w12", True), ("tiny", None, True)])
def test_model_names_compare_by_their_variant_tail(a, b, same):
    from specpilot.probes.ceiling_checks import same_model

    assert same_model(a, b) is same and same_model(b, a) is same
