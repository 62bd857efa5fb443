"""The cost model closed: CPU step timing, TLV's cycle in ``ceiling`` and ``ceiling --check``."""

import json

import pytest


def _run_doc(mode="tree", nodes=16, tau=3.0, steps=50, verify=12.0, draft=1.0, rest=1.0, qpass=0.0, rows=17,
             pass_ms=None, tlv=None):
    """A run JSON as ``specpilot run --format json`` writes it: one request, ``steps`` passes of
    ``verify + draft + qpass + rest`` ms each, ``pass_ms`` per pass end to end (default: the step
    plus 0.2 ms between steps)."""
    wall = verify + draft + qpass + rest
    pass_ms = wall + 0.2 if pass_ms is None else pass_ms
    tokens = int(round(tau * steps)) + 1
    timing = {"steps": steps, "wall_ms": wall, "draft_ms": draft, "verify_ms": verify, "rest_ms": rest,
              "by_rows": [{"rows": rows, "steps": steps, "verify_ms": verify}]}
    if qpass:
        timing["qpass_ms"] = qpass
    doc = {"schema": "specpilot.run/1", "mode": mode, "nodes": nodes if mode in ("tree", "tlv") else None,
           "tau": (tokens - 1) / steps, "steps": steps, "tokens": tokens, "step_timing": timing,
           "results": [{"id": 0, "tokens": tokens, "steps": steps, "seconds": 0.5 + steps * pass_ms / 1e3,
                        "prefill_seconds": 0.5}]}
    if tlv:
        doc["tlv"] = {"nodes": nodes, "time_ms": tlv, "cycle_ms": sum(tlv.values())}
    return doc


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture
def files(tmp_path):
    ar = _write(tmp_path, "ar.json", _run_doc("ar", tau=1.0, steps=100, verify=10.0, draft=0.0, rest=0.5, rows=1,
                                              pass_ms=10.6))
    tree = _write(tmp_path, "tree.json", _run_doc())
    replay = _write(tmp_path, "replay.json", {"schema": "specpilot.replay/1",
                                              "policies": [{"policy": "best-first:16", "tau": 3.0}]})
    rows = _write(tmp_path, "rows.json", {"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "layers",
                                          "device": "cpu", "points": [{"rows": 1, "step_ms": 10.0},
                                                                      {"rows": 16, "step_ms": 11.5},
                                                                      {"rows": 32, "step_ms": 13.0}]})
    return {"ar": ar, "tree": tree, "replay": replay, "rows": rows, "dir": tmp_path}


def test_a_run_is_not_modelled_with_a_batched_rows_probe_or_batch(run_cli, files):
    """A run is of one request per step: a probe of 4 requests per step beside it (c = a 4-request
    step over a 4-request AR step, T_AR per step of four) is another deployment, and the error
    says to probe one request, not to give --batch 4; --batch 4 itself is refused beside a run."""
    doc = json.loads(files["rows"].read_text())
    rows4 = _write(files["dir"], "rows4.json", {**doc, "batch": 4})
    for verb in ("--check", "--run"):
        code, _, err = run_cli("ceiling", verb, files["tree"], "--rows-probe", rows4, "--replay", files["replay"])
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert (f"rows4.json: the rows probe timed 4 requests per step, but {verb} {files['tree']} is a run of one "
                "request per step; give a rows probe of one request (probe rows without --batch)") in err, err
        code, _, err = run_cli("ceiling", verb, files["tree"], "--rows-probe", rows4, "--replay", files["replay"],
                               "--batch", "4")
        assert code == 2 and f"--batch 4: {verb} {files['tree']} is a run of one request per step" in err, err
    code, _, err = run_cli("ceiling", "--run", files["tree"], "--rows-probe", files["rows"], "--replay",
                           files["replay"], "--batch", "1")
    assert code == 0, err
    # a batched run beside --batch: what it is, not "a run of one request per step"
    batched = _write(files["dir"], "batched.json", {k: v for k, v in json.loads(files["tree"].read_text()).items()
                                                   if k != "step_timing"} | {"batch": {"batch": 6}})
    for verb, floors in (("--check", ()), ("--run", ("--model", "llama-3.1-8b", "--gpu", "h200"))):
        code, _, err = run_cli("ceiling", verb, batched, "--batch", "6", "--replay", files["replay"], *floors)
        assert code == 2 and "a batched run (--batch) has no per-step timing of one request" in err, err


def test_check_passes_within_tolerance(run_cli, files):
    code, out, err = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe",
                             files["rows"], "--ar-run", files["ar"], "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    # predicted 3 x 10 / (T(17) + 1 + 1), T(17) between the probed 16 and 32 rows
    assert d["predicted_speedup"] == pytest.approx(30 / (11.5 + 1.5 / 16 + 2))
    assert d["measured_speedup"] == pytest.approx(10.6 / (50 * 14.2 / 150))
    assert d["passed"] and d["term_off"] is None and abs(d["error"]) < 0.10
    assert [t["term"] for t in d["terms"]] == ["tau", "c(N)", "drafting", "outside/host", "T_AR"]
    code, out, _ = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe",
                           files["rows"], "--ar-run", files["ar"])
    assert code == 0 and "PASS: predicted 2.207x vs measured 2.239x" in out


@pytest.mark.parametrize("case, term, numbers", [
    ("tau", "tau", ("predicted 4 ", "measured 3 ")),
    ("c(N)", "c(N)", ("predicted 5.062", "measured 12 ")),
    ("outside", "outside/host", ("predicted 1 ", "measured 12 ")),
    ("drafting", "drafting", ("predicted 0.5 ", "measured 8 ")),
])
def test_check_fails_naming_the_term(run_cli, files, case, term, numbers):
    tmp = files["dir"]
    run, replay, rows, extra = files["tree"], files["replay"], files["rows"], []
    if case == "tau":
        replay = _write(tmp, "r2.json", {"schema": "specpilot.replay/1", "policies": [{"policy": "best-first:16",
                                                                                      "tau": 4.0}]})
    elif case == "c(N)":
        rows = _write(tmp, "rows2.json", {"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "layers",
                                          "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 16, "step_ms": 5.0},
                                                     {"rows": 32, "step_ms": 6.0}]})
    elif case == "outside":
        run = _write(tmp, "t2.json", _run_doc(pass_ms=25.0))
    else:
        run = _write(tmp, "t2.json", _run_doc(draft=8.0))
        extra = ["--draft-ms", "0.5"]
    code, out, err = run_cli("ceiling", "--check", run, "--replay", replay, "--rows-probe", rows, "--ar-run",
                             files["ar"], *extra)
    assert code == 1, err
    verdict = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert f"term off: {term} (" in verdict
    for n in numbers:
        assert n in verdict
    code, out, _ = run_cli("ceiling", "--check", run, "--replay", replay, "--rows-probe", rows, "--ar-run",
                           files["ar"], *extra, "--format", "json")
    assert code == 1 and json.loads(out)["term_off"] == term


def test_check_refuses_a_rows_probe_or_ar_run_of_another_device(run_cli, files):
    """As --run does: a GPU's rows probe or a CUDA AR run beside a CPU run is another deployment
    (--check passed with both, from the H100's c(N))."""
    tmp = files["dir"]
    cpu_run = _write(tmp, "tree_cpu.json", {**_run_doc(), "device": "cpu"})
    gpu_rows = _write(tmp, "rows_gpu.json", {**json.loads(files["rows"].read_text()), "device": "cuda",
                                             "gpu": "NVIDIA H100 80GB HBM3"})
    cuda_ar = _write(tmp, "ar_cuda.json", {**json.loads(files["ar"].read_text()), "device": "cuda"})
    for verb in ("--check", "--run"):
        code, _, err = run_cli("ceiling", verb, cpu_run, "--rows-probe", gpu_rows, "--replay", files["replay"])
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert (f"--rows-probe {gpu_rows} and --run {cpu_run} disagree on the device (NVIDIA H100 80GB HBM3 against "
                "the CPU)") in err, err
    code, _, err = run_cli("ceiling", "--check", cpu_run, "--rows-probe", files["rows"], "--ar-run", cuda_ar)
    assert code == 2 and (f"--ar-run {cuda_ar} and --run {cpu_run} disagree on the device (cuda against the CPU): "
                          "they are not one deployment's; give an AR run of the run's device") in err, err
    code, _, err = run_cli("ceiling", "--check", cpu_run, "--rows-probe", files["rows"], "--ar-run", files["ar"])
    assert code in (0, 1), err   # a run without a device is taken as it is


def test_check_repeats_the_rows_probes_own_warnings(run_cli, files):
    """A probe that flagged its c(N) as noise: plain ceiling repeats it, the check dropped it while
    blaming c(N)."""
    doc = json.loads(files["rows"].read_text())
    noisy = _write(files["dir"], "noisy.json", {**doc, "warnings": ["c(N) below 0.95 at 2 rows (0.774): noise"]})
    code, out, err = run_cli("ceiling", "--check", files["tree"], "--rows-probe", noisy, "--ar-run", files["ar"])
    assert code in (0, 1), err
    assert f"warning: rows probe {noisy}: c(N) below 0.95 at 2 rows (0.774): noise" in out, out
    code, out, err = run_cli("ceiling", "--check", files["tree"], "--rows-probe", noisy, "--ar-run", files["ar"],
                             "--format", "json")
    assert json.loads(out)["warnings"] == [f"rows probe {noisy}: c(N) below 0.95 at 2 rows (0.774): noise"]


def test_check_with_the_rows_probe_alone_as_ar_reference(run_cli, files):
    code, out, err = run_cli("ceiling", "--check", files["tree"], "--rows-probe", files["rows"], "--format", "json")
    assert code in (0, 1), err
    d = json.loads(out)
    assert d["measured_speedup"] == pytest.approx(10.0 / (50 * 14.2 / 150))
    assert d["terms"][0]["predicted_from"].endswith("(its own)") and d["notes"]


def test_check_bad_input_is_one_line(run_cli, files):
    tmp = files["dir"]
    no_split = _run_doc()
    for k in ("draft_ms", "verify_ms", "rest_ms"):
        del no_split["step_timing"][k]
    cases = [
        (["--check", files["tree"], "--replay", files["replay"]], "AR reference"),
        (["--check", _write(tmp, "ns.json", no_split), "--rows-probe", files["rows"]], "split"),
        (["--check", files["tree"], "--rows-probe", files["rows"], "--replay", files["replay"], "--policy", "tlv:16"],
         "no policy"),
        (["--check", files["tree"], "--ar-run", files["tree"]], "AR run"),
        # nothing but the AR reference: every term would be the run's own (a PASS at +0.0%)
        (["--check", files["tree"], "--ar-run", files["ar"]], "with --ar-run alone predicts the run from itself"),
        (["--check", files["tree"], "--run", files["tree"], "--rows-probe", files["rows"]], "--check RUN.json"),
        (["--rows", "1", "--tau", "2", "--step-ms", "3", "--ar-ms", "2", "--ar-run", files["ar"]], "--check"),
        (["--check", tmp / "missing.json", "--rows-probe", files["rows"]], "missing.json"),
        (["--check", files["tree"], "--rows-probe", files["rows"], "--tolerance", "0"], "tolerance"),
        # the run verified 17 rows; a probe of 1 and 2 rows would only extrapolate a line to them
        (["--check", files["tree"], "--rows-probe", _write(tmp, "short.json", {
            "schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "layers", "device": "cpu",
            "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 2, "step_ms": 10.1}]})],
         "timed 1..2 rows; the run verified 17 rows too: probe them (probe rows --rows 1,2,17)"),
    ]
    for args, words in cases:
        code, out, err = run_cli("ceiling", *args)
        assert code == 2, (args, out, err)
        assert err.startswith("specpilot: error:") or err.startswith("Usage"), err
        if err.startswith("specpilot: error:"):
            assert err.strip().count("\n") == 0, err
        assert words in err, (words, err)


TLV_SPLIT = {"draft1": 0.5, "qpass": 9.0, "draft2": 0.5, "exact": 12.0, "append": 1.0}


def test_ceiling_tlv_cycle_from_a_run(run_cli, tmp_path):
    run = _write(tmp_path, "tlv.json", _run_doc("tlv", tau=6.0, verify=12.0, draft=1.0, qpass=9.0, rest=1.0,
                                                tlv=TLV_SPLIT))
    code, out, err = run_cli("ceiling", "--run", run, "--ar-ms", "10", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    cy = d["tlv_cycle"]
    assert cy["terms_ms"] == TLV_SPLIT and cy["cycle_ms"] == pytest.approx(23.0) and cy["nodes"] == 16
    assert d["cost_model"]["step_ms"] == pytest.approx(23.0) and d["cost_model"]["tau"] == pytest.approx(6.0)
    assert cy["speedup"] == pytest.approx(6.0 / (23.0 / 10))
    assert "TLV cycle" in d["cost_model"]["sources"]["step_ms"] or "cycle" in d["cost_model"]["sources"]["step_ms"]
    code, out, _ = run_cli("ceiling", "--run", run, "--ar-ms", "10")
    assert code == 0 and "TLV cycle at 16 nodes" in out
    for name in ("draft 1", "Q pass", "draft 2", "exact pass", "append"):
        assert name in out


def test_ceiling_tlv_cycle_from_replay_and_probe(run_cli, tmp_path):
    replay = _write(tmp_path, "r.json", {"schema": "specpilot.replay/1",
                                         "policies": [{"policy": "best-first:16", "tau": 3.0},
                                                      {"policy": "tlv:16", "tau": 5.0}]})
    rows = _write(tmp_path, "rows.json", {"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "layers",
                                          "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 17, "step_ms": 12.0}]})
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows-probe", rows, "--policy", "tlv:16",
                             "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    cy = d["tlv_cycle"]
    assert cy["terms_ms"]["qpass"] == 12.0 and cy["terms_ms"]["exact"] == 12.0 and cy["terms_ms"]["draft1"] is None
    assert cy["unknown"] == ["draft1", "draft2", "append"] and d["cost_model"]["tau"] == 5.0
    assert d["cost_model"]["speedup"] == pytest.approx(5.0 / 2.4)


def test_ceiling_tlv_cycle_takes_the_probes_own_q_pass(run_cli, tmp_path):
    """A rows probe that timed the Q pass (probe rows --qview) gives the cycle its Q pass term; a
    qpass_ms at one row or out of range is refused."""
    replay = _write(tmp_path, "r.json", {"schema": "specpilot.replay/1", "policies": [{"policy": "tlv:16", "tau": 5.0}]})
    pts = [{"rows": 1, "step_ms": 10.0}, {"rows": 9, "step_ms": 11.0, "qpass_ms": 7.0},
           {"rows": 33, "step_ms": 13.0, "qpass_ms": 9.0}]
    rows = _write(tmp_path, "rows.json", {"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "layers",
                                          "qview": "fp8", "points": pts})
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows-probe", rows, "--policy", "tlv:16",
                             "--format", "json")
    assert code == 0, err
    cy = json.loads(out)["tlv_cycle"]
    assert cy["terms_ms"]["qpass"] == pytest.approx(7.0 + 2.0 * 8 / 24) and cy["terms_ms"]["exact"] == pytest.approx(11.0 + 2.0 * 8 / 24)
    assert cy["probe_ms"]["qpass_timed"] is True
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows-probe", rows, "--policy", "tlv:16")
    assert code == 0 and "stands in for the Q pass" not in out and "probe ms (17 rows, Q pass fp8)" in out
    # passes at rows the probe did not time are said to be interpolated (they read as measured)
    assert cy["probe_ms"]["interpolated"] == [9, 33]
    assert "at 17 rows (linear from its 9- and 33-row steps: it timed no 17-row step)" in out
    assert ("the TLV cycle's probe passes at 17 rows are linear from --rows-probe "
            f"{rows}'s 9- and 33-row steps") in out + err
    # beyond the probe's last count too (17 rows from a probe that stops at 16)
    short = _write(tmp_path, "short.json", {"schema": "specpilot.rows/1", "ar_ms": 10.0, "ar_path": "layers",
                                            "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 8, "step_ms": 11.0},
                                                       {"rows": 16, "step_ms": 12.0}]})
    code, out, err = run_cli("ceiling", "--replay", replay, "--rows-probe", short, "--policy", "tlv:16",
                             "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["tlv_cycle"]["probe_ms"]["interpolated"] == [8, 16]
    assert any("linear from --rows-probe" in w and "it timed no 17-row step" in w for w in doc["warnings"])
    # a Q pass is not extrapolated, nor taken from one timed count elsewhere: the exact step stands in, and says why
    for policy, pts_used, why in (("tlv:40", pts, "timed its Q pass at 9-33 rows, not around 41"),
                                  ("tlv:16", pts[:2], "timed its Q pass at 9 rows, not around 17")):
        r2 = _write(tmp_path, "r2.json", {"schema": "specpilot.rows/1", "ar_ms": 10.0, "points": pts_used})
        rp = _write(tmp_path, "rp.json", {"schema": "specpilot.replay/1", "policies": [{"policy": policy, "tau": 5.0}]})
        code, out, err = run_cli("ceiling", "--replay", rp, "--rows-probe", r2, "--policy", policy)
        assert code == 0 and "exact step stands in for the Q pass" in out and why in out, out + err
    for policy in ("tlv:0", "tlv:-1", "tlv:x"):
        rp = _write(tmp_path, "rp.json", {"schema": "specpilot.replay/1", "policies": [{"policy": policy, "tau": 5.0}]})
        code, _, err = run_cli("ceiling", "--replay", rp, "--rows-probe", rows, "--policy", policy)
        assert code == 2 and "tlv:N takes a node budget N of 1 or more" in err, err
    for bad in ({"rows": 1, "step_ms": 10.0, "qpass_ms": 5.0}, {"rows": 9, "step_ms": 11.0, "qpass_ms": -1}):
        doc = {"schema": "specpilot.rows/1", "ar_ms": 10.0, "points": [pts[0] if bad["rows"] != 1 else bad, bad
                                                                        if bad["rows"] != 1 else pts[1]]}
        path = _write(tmp_path, "bad.json", doc)
        code, _, err = run_cli("ceiling", "--replay", replay, "--rows-probe", path, "--policy", "tlv:16")
        assert code == 2 and "'qpass_ms' must be a number" in err, err


def test_check_tlv_run(run_cli, tmp_path, files):
    run = _write(tmp_path, "tlv.json", _run_doc("tlv", tau=6.0, verify=12.0, draft=1.0, qpass=9.0, rest=1.0,
                                                tlv=TLV_SPLIT))
    replay = _write(tmp_path, "r.json", {"schema": "specpilot.replay/1", "policies": [{"policy": "tlv:16", "tau": 6.0}]})
    code, out, err = run_cli("ceiling", "--check", run, "--replay", replay, "--ar-run", files["ar"],
                             "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["policy"] == "tlv:16" and d["tlv_cycle_ms"]["cycle"] == pytest.approx(23.0)
    assert any(n.startswith("no --rows-probe: c(N) is the run's own") for n in d["notes"]), d["notes"]
    terms = {t["term"]: t for t in d["terms"]}
    assert terms["drafting"]["measured"] == pytest.approx(1.0) and terms["Q pass"]["measured"] == pytest.approx(9.0)
    assert d["predicted_speedup"] == pytest.approx(6.0 * 10.5 / 23.0)
    assert terms["outside/host"]["measured_from"] == f"run {run} (decode ms per pass - verify - drafting - Q pass)"


def test_check_tlv_run_takes_the_probes_q_pass_of_its_own_view_only(run_cli, tmp_path, files):
    """The probe's Q pass predicts the run's where both read the same view; a probe of the other
    view cannot (it would fail the check on a comparison it knows is not like for like): the run's
    own Q pass stands in, with a note naming both views."""
    doc = _run_doc("tlv", tau=6.0, verify=12.0, draft=1.0, qpass=9.0, rest=1.0, tlv=TLV_SPLIT)
    doc["tlv"]["qview"] = "fp8"
    run = _write(tmp_path, "tlv.json", doc)
    replay = _write(tmp_path, "r.json", {"schema": "specpilot.replay/1", "policies": [{"policy": "tlv:16", "tau": 6.0}]})
    probe = {"schema": "specpilot.rows/1", "ar_ms": 10.0, "qview": "fp8",
             "points": [{"rows": 1, "step_ms": 10.0}, {"rows": 9, "step_ms": 11.0, "qpass_ms": 6.0},
                        {"rows": 33, "step_ms": 13.0, "qpass_ms": 8.0}]}
    rows = _write(tmp_path, "rows.json", probe)
    code, out, err = run_cli("ceiling", "--check", run, "--replay", replay, "--rows-probe", rows, "--format", "json")
    assert code in (0, 1), err
    q = {t["term"]: t for t in json.loads(out)["terms"]}["Q pass"]
    assert q["predicted"] == pytest.approx(6.0 + 2.0 * 8 / 24) and q["measured"] == pytest.approx(9.0)
    assert q["predicted_from"] == f"rows probe {rows} at 17 rows (its Q pass)"
    assert not any("view" in n for n in json.loads(out)["notes"])
    probe["qview"] = "w12"
    rows = _write(tmp_path, "rows_w12.json", probe)
    code, out, err = run_cli("ceiling", "--check", run, "--replay", replay, "--rows-probe", rows, "--format", "json")
    assert code in (0, 1), err
    q = {t["term"]: t for t in json.loads(out)["terms"]}["Q pass"]
    assert q["predicted"] == pytest.approx(9.0) and q["predicted_from"] == f"run {run} (its own)"
    assert any("the probe's Q pass read the w12 view, the run's the fp8 view: the prediction takes the run's own"
               in n for n in json.loads(out)["notes"])
    code, out, err = run_cli("ceiling", "--run", run, "--replay", replay, "--rows-probe", rows)
    assert code == 0 and "the probe's Q pass read the w12 view, the run's the fp8 view" in out, out + err


@pytest.mark.parametrize("mode", ["tree", "tlv"])
def test_cpu_step_timing_present_and_consistent(run_cli, mode):
    code, out, err = run_cli("run", "--model", "tiny", "--mode", mode, "--nodes", "8", "--prompt-ids",
                             "1,2,3,1,2,3,1,2", "--max-new-tokens", "12", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    t = d["step_timing"]
    assert "gpu_ms" not in t and t["steps"] == d["steps"]
    parts = t["draft_ms"] + t["verify_ms"] + t.get("qpass_ms", 0.0)
    assert min(t["draft_ms"], t["verify_ms"]) >= 0 and t["verify_ms"] > 0
    assert parts <= t["wall_ms"] + 1e-9 and t["rest_ms"] == pytest.approx(t["wall_ms"] - parts)
    assert sum(r["steps"] for r in t["by_rows"]) == t["steps"] and all(r["verify_ms"] > 0 for r in t["by_rows"])
    assert (t.get("qpass_ms", 0) > 0) == (mode == "tlv")
    assert d["results"][0]["step_timing"]["steps"] == t["steps"]
    assert d["gpu_clocks"] is None and "GPU clock" not in out   # the CPU: no NVML figures


CLOCKS = {"samples": 40, "period_s": 0.02, "sm_mhz": {"min": 1560, "median": 1600, "max": 1980},
          "gpu_max_sm_mhz": 1980, "power_w": {"median": 698.0, "max": 702.5}, "power_limit_w": 700.0,
          "slowed": 0.35, "reasons": ["sw_power_cap"]}


def test_check_notes_a_run_whose_gpu_slowed(run_cli, files):
    tmp = files["dir"]
    ar = json.loads(files["ar"].read_text())
    ar["gpu_clocks"] = CLOCKS
    tree = json.loads(files["tree"].read_text())
    tree["gpu_clocks"] = dict(CLOCKS, slowed=0.0, reasons=[])   # at full clock: no note
    code, out, err = run_cli("ceiling", "--check", _write(tmp, "t.json", tree), "--replay", files["replay"],
                             "--rows-probe", files["rows"], "--ar-run", _write(tmp, "a.json", ar), "--format", "json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert len(notes) == 1 and "a.json (sw_power_cap in 35% of the samples, SM 1560-1980 MHz)" in notes[0]
    code, out, _ = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe",
                           files["rows"], "--ar-run", _write(tmp, "a.json", ar))
    assert "note: the GPU lowered its clock during" in out


@pytest.mark.parametrize("bad", [{"sm_mhz": {"min": 1560}}, dict(CLOCKS, slowed=1.5), dict(CLOCKS, reasons="cap"), [1]])
def test_check_refuses_malformed_gpu_clocks(run_cli, files, bad):
    doc = json.loads(files["tree"].read_text())
    doc["gpu_clocks"] = bad
    code, out, err = run_cli("ceiling", "--check", _write(files["dir"], "bad.json", doc), "--rows-probe", files["rows"])
    assert code == 2 and err.startswith("specpilot: error:") and "'gpu_clocks'" in err and err.count("\n") == 1, err


def _passing_check_notes(run_cli, files, name, ar_ms, steps_ms):
    """The notes of a passing check against a rows probe of T_AR ``ar_ms`` and steps of 1 / 16 / 32
    rows ``steps_ms``."""
    rows = _write(files["dir"], name, {"schema": "specpilot.rows/1", "ar_ms": ar_ms, "ar_path": "layers",
                                       "points": [{"rows": n, "step_ms": ms} for n, ms in zip((1, 16, 32), steps_ms)]})
    code, out, err = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe", rows,
                             "--ar-run", files["ar"], "--format", "json")
    assert code == 0 and json.loads(out)["passed"], out + err
    return json.loads(out)["notes"]


def test_check_names_terms_that_cancel_in_a_pass(run_cli, files):
    # a probe taken on a machine twice as slow: its T_AR and its verify steps both 2x the runs'
    note = next(n for n in _passing_check_notes(run_cli, files, "slow.json", 20.0, (20.0, 23.0, 26.0)) if "cancel" in n)
    assert "c(N) (23.19 predicted vs 12 measured verify ms/pass" in note and "T_AR (20 predicted vs 10.6" in note
    assert "tau" not in note and "drafting" not in note
    code, out, _ = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe",
                           files["rows"], "--ar-run", files["ar"], "--format", "json")
    assert not any("cancel" in n for n in json.loads(out)["notes"])


def test_check_names_what_offsets_a_single_term_off_in_a_pass(run_cli, files):
    """One term alone past the tolerance cannot cancel itself: the note names the terms that offset it."""
    notes = _passing_check_notes(run_cli, files, "one.json", 11.5, (11.5, 13.5, 15.1))
    note = next(n for n in notes if "speedups agree" in n)
    assert "this term alone moves the prediction past the tolerance: c(N) (13.6 predicted vs 12 measured" in note
    assert "cancel" not in note
    offset = note[note.index("; offset by "):]
    assert "T_AR (11.5 predicted vs 10.6" in offset and "outside/host" in offset and "tau" not in offset


def _chain_replay(tmp_path, name, policies, positions=8, steps=50):
    return _write(tmp_path, name, {"schema": "specpilot.replay/1", "positions": positions, "steps": steps,
                                   "policies": [{"policy": p, "tau": t, "nodes": n} for p, t, n in policies]})


def test_a_bare_chain_is_not_taken_from_a_shorter_chain(run_cli, files):
    """chain is every draft position: a replay holding only chain:2 of an 8-position lattice was read
    as chain (its tau under chain's name, and a chain run checked against it); chain:8 is chain."""
    tmp = files["dir"]
    run = _write(tmp, "chain.json", _run_doc("chain", tau=3.0, rows=9))
    short = _chain_replay(tmp, "short.json", [("chain:2", 1.5, 2)])
    for argv in (("--replay", short, "--ar-ms", "10", "--step-ms", "12"),
                 ("--check", run, "--replay", short, "--ar-run", files["ar"])):
        code, _, err = run_cli("ceiling", *argv)
        assert code == 2 and "no policy 'chain' in the replay (has chain:2)" in err and err.count("\n") == 1, err
    full = _chain_replay(tmp, "full.json", [("chain:8", 3.0, 8)])
    code, out, err = run_cli("ceiling", "--check", run, "--replay", full, "--ar-run", files["ar"], "--format", "json")
    assert code == 0, err
    assert json.loads(out)["terms"][0]["predicted_from"] == f"replay {full} (chain:8)"


def test_check_notes_a_replay_of_another_run_s_lattice(run_cli, files):
    tmp = files["dir"]
    other = _write(tmp, "other.json", {"schema": "specpilot.replay/1", "steps": 49,
                                       "policies": [{"policy": "best-first:16", "tau": 3.0}]})
    code, out, err = run_cli("ceiling", "--check", files["tree"], "--replay", other, "--rows-probe", files["rows"],
                             "--ar-run", files["ar"], "--format", "json")
    assert code == 0, err
    assert ("the replay's lattice has 49 steps, the run 50 passes: it is not this run's lattice, so its tau is "
            "another run's, not this run's exactly") in json.loads(out)["notes"]
    code, out, _ = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe",
                           files["rows"], "--ar-run", files["ar"], "--format", "json")
    assert not any("lattice has" in n for n in json.loads(out)["notes"])


def test_check_takes_the_tolerance_its_help_allows(run_cli, files):
    code, _, err = run_cli("ceiling", "--check", files["tree"], "--replay", files["replay"], "--rows-probe",
                           files["rows"], "--ar-run", files["ar"], "--tolerance", "10")
    assert code == 0, err
