"""``specpilot profile`` as users run it: real trace files through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from synthetic_traces import SynthSpec, truth, write_kineto, write_nsys_sqlite

LOCAL = Path(__file__).parent / "fixtures"
H200_EAGER = LOCAL / "nsys_h200_decode_eager.sqlite"
H200_KINETO = LOCAL / "kineto_h200_decode_eager.json.gz"
CONFIG = LOCAL / "decode_target_config.json"
PROFILE_KEYS = {"schema", "gpu", "model", "shape", "steps", "step_wall_ms", "kernel_busy_ms", "outside_ms",
                "kernel_factor", "outside_factor", "total_floor_ms", "classes"}
CLASS_KEYS = {"ms", "share", "bytes", "flops", "floor_ms", "efficiency"}


def test_profile_h200_capture_with_floors(run_cli, tmp_path):
    out = tmp_path / "p.json"
    code, stdout, err = run_cli("profile", H200_EAGER, "--step-range", r"^decode_step_\d+$", "--model", CONFIG,
                                "--drafter", LOCAL / "decode_drafter_config.json", "--context", 512, "--format", "json", "--out", out)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert PROFILE_KEYS <= set(d) and d["schema"] == "specpilot.profile/1"
    assert d["gpu"]["name"] == "NVIDIA H200" and d["gpu"]["key"] == "h200" and d["steps"] == 12
    for c in d["classes"].values():
        assert CLASS_KEYS <= set(c)
    assert {"linear", "lm_head", "attention", "drafter", "elementwise"} <= set(d["classes"])
    assert d["classes"]["lm_head"]["floor_ms"] > 0 and d["classes"]["drafter"]["floor_ms"] > 0
    assert sum(c["share"] for c in d["classes"].values()) == pytest.approx(1.0)
    assert d["outside_ms"] == pytest.approx(d["step_wall_ms"] - d["kernel_busy_ms"])
    assert d["kernel_factor"] == pytest.approx(d["kernel_busy_ms"] / d["total_floor_ms"])
    assert d["outside_factor"] == pytest.approx(d["step_wall_ms"] / d["kernel_busy_ms"])
    for c in d["classes"].values():
        if c["floor_ms"] and c["ms"]:
            assert c["efficiency"] == pytest.approx(c["floor_ms"] / c["ms"])
    # the ceiling verb reads it
    from specpilot.readers import read_profile

    p = read_profile(str(out))
    assert p.kernel_busy_ms == d["kernel_busy_ms"] and p.step_wall_ms == d["step_wall_ms"]
    assert p.unfloored_drafter is None and not any("drafter kernels ran" in w for w in d["warnings"])


def test_drafter_kernels_without_a_drafter_floor_are_warned_of_in_profile_and_ceiling(run_cli, tmp_path):
    """Without --drafter the floor leaves the drafter out while the busy time counts its kernels (half
    of this trace's): the kernel factor reads high, which both verbs say, with its size."""
    out = tmp_path / "p.json"
    code, _, err = run_cli("profile", H200_EAGER, "--model", CONFIG, "--context", 512, "--format", "json", "--out", out)
    d = json.loads(out.read_text())
    drafter = d["classes"]["drafter"]
    assert code == 0 and drafter["floor_ms"] is None and drafter["share"] > 0.4
    said = f"drafter kernels ran ({drafter['ms']:.4g} ms a step, {drafter['share']:.0%} of the kernel time) but " \
           f"have no floor without --drafter MODEL: the kernel factor ({d['kernel_factor']:.4g}) sets them against"
    assert [w for w in d["warnings"] if w.startswith(said)], d["warnings"]
    code, text, err = run_cli("ceiling", "--profile", out, "--tau", 3, "--ar-ms", 4)
    assert code == 0 and f"warning: --profile {out}: {said}" in text and "and the ceiling with it" in text, text


def test_table_explain_and_plot(run_cli, tmp_path):
    png = tmp_path / "p.png"
    code, out, err = run_cli("profile", H200_KINETO, "--step-range", "^decode_step", "--explain", "--plot", png)
    assert code == 0, err
    assert "Kernel time per class" in out and "Classification (--explain)" in out
    assert "default#2: range~" in out  # the drafter range rule shows in the explanation
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the suffix picks the format; one no format has is refused before the trace is read
    svg = tmp_path / "p.svg"
    assert run_cli("profile", H200_KINETO, "--step-range", "^decode_step", "--plot", svg)[0] == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    code, _, err = run_cli("profile", H200_KINETO, "--plot", tmp_path / "p.txt")
    assert code == 2 and "name a .png, .svg, .pdf file" in err and not (tmp_path / "p.txt").exists()


def test_synthetic_numbers_exact(run_cli, tmp_path):
    spec = SynthSpec(steps=6, layers=3)
    p = write_nsys_sqlite(tmp_path / "s.sqlite", spec)
    code, out, err = run_cli("profile", p, "--step-range", "decode_step", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    t = truth(spec)[0]
    assert d["kernel_busy_ms"] == pytest.approx(t["busy_ns"] / 1e6)
    assert d["step_wall_ms"] == pytest.approx((t["cpu"][1] - t["cpu"][0]) / 1e6)
    ms = lambda prefix: sum(v[1] for k, v in t["names"].items() if k.startswith(prefix)) / 1e6  # noqa: E731
    assert d["classes"]["attention"]["ms"] == pytest.approx(ms("flash"))
    assert d["classes"]["norm"]["ms"] == pytest.approx(ms("rms_norm") + ms("act_and_mul"))
    assert d["classes"]["lm_head"]["ms"] == pytest.approx(ms("nvjet_sm90_tst_256x8"))  # once per step
    assert d["classes"]["memcpy"]["calls"] == 1


@pytest.mark.parametrize("overlap_ns, noted", [(0, False), (8000, True)])
def test_overlapping_kernels_are_noted(run_cli, tmp_path, overlap_ns, noted):
    """Kernel durations that overlap (here attention on a second stream inside the GEMM before it)
    add up to more than the busy time: the profile says so instead of printing shares silently."""
    spec = SynthSpec(steps=4, layers=2, second_stream=bool(overlap_ns), overlap_ns=overlap_ns)
    p = write_kineto(tmp_path / "s.json", spec)
    code, out, err = run_cli("profile", p, "--step-range", "decode_step", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    summed = sum(c["ms"] for c in d["classes"].values())
    assert (summed > 1.05 * d["kernel_busy_ms"]) == noted
    assert any("kernels overlap" in n for n in d["notes"]) == noted


def test_ceiling_json_supplies_floors(run_cli, tmp_path):
    ceil = tmp_path / "c.json"
    ceil.write_text(json.dumps({"schema": "specpilot.ceiling/1", "classes": {
        "linear": {"bytes": 1e8, "flops": 2e8, "floor_ms": 0.02}, "attention": {"bytes": 1e6, "flops": 0, "floor_ms": 0.001}},
        "total_floor_ms": 0.021, "by_rows": {"1": {"rows": 1, "batch": 1, "context": 512, "total_floor_ms": 0.021,
                                               "classes": {"linear": {"bytes": 1e8, "flops": 2e8, "floor_ms": 0.02},
                                                           "attention": {"bytes": 1e6, "flops": 0, "floor_ms": 0.001}}}}}))
    code, out, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--ceiling", ceil, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["total_floor_ms"] == 0.021 and d["classes"]["linear"]["floor_ms"] == 0.02
    assert d["shape"] == {"rows": 1, "batch": 1, "context": 512}
    code, _, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--ceiling", ceil, "--rows", 8)
    assert code == 2 and "no floors for --rows 8" in err
    # the ceiling's floors are its GPU's: another --gpu (or peak figures) would be ignored
    code, _, err = run_cli("profile", H200_EAGER, "--ceiling", ceil, "--gpu", "h100")
    assert code == 2 and "--gpu: --ceiling brings the floors of the GPU it was made for" in err, err
    # a ceiling of several row counts: --rows picks one, and without it the trace's rows are not guessed
    doc = json.loads(ceil.read_text())
    doc["by_rows"]["8"] = {**doc["by_rows"]["1"], "rows": 8, "total_floor_ms": 0.03}
    ceil.write_text(json.dumps(doc))
    code, _, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--ceiling", ceil)
    assert code == 2 and "ceiling has floors for several rows (1, 8); choose one with --rows" in err, err
    code, out, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--ceiling", ceil, "--rows", 8,
                             "--format", "json")
    assert code == 0 and json.loads(out)["total_floor_ms"] == 0.03, err


def test_a_profile_made_with_a_ceilings_floors_reads_back_with_model(run_cli, tmp_path):
    """The ceiling JSON records its LM head and KV dtypes (and drafter); a profile made against it keeps them,
    so ceiling --profile --model computes the same floors instead of refusing them as another shape."""
    ceil, prof = tmp_path / "c.json", tmp_path / "p.json"
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--context", 4096, "--kv-dtype", "fp8",
                           "--lm-head-dtype", "fp8", "--weight-dtype", "w12", "--format", "json", "--out", ceil)
    assert code == 0, err
    shape = json.loads(ceil.read_text())["shape"]
    assert (shape["weight_dtype"], shape["lm_head_dtype"], shape["kv_dtype"]) == ("w12", "fp8", "fp8")
    code, _, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--ceiling", ceil, "--format", "json",
                           "--out", prof)
    assert code == 0, err
    assert json.loads(prof.read_text())["shape"]["lm_head_dtype"] == "fp8"
    code, out, err = run_cli("ceiling", "--profile", prof, "--model", "llama-3.1-8b", "--tau", 2, "--ar-ms", 4,
                             "--format", "json")
    assert code == 0, err
    assert json.loads(out)["shape"]["kv_dtype"] == "fp8"
    doc = json.loads(ceil.read_text())
    doc["shape"]["kv_dtype"] = 8
    ceil.write_text(json.dumps(doc))
    code, _, err = run_cli("profile", H200_EAGER, "--ceiling", ceil)
    assert code == 2 and "ceiling's shape 'kv_dtype' must be a name" in err, err


def test_the_floors_line_names_replaced_peaks(run_cli):
    code, out, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--model", "llama-3.1-8b")
    assert code == 0 and "floors: step_floor(llama-3.1-8b, h200)\n" in out, out
    code, out, err = run_cli("profile", H200_EAGER, "--step-range", "^decode_step", "--model", "llama-3.1-8b",
                             "--bandwidth", "3")
    assert code == 0 and "floors: step_floor(llama-3.1-8b, h200, 3 TB/s" in out, out


def test_gpu_from_flag_and_unknown_gpu(run_cli, fixtures_dir):
    mi = fixtures_dir / "kineto_sglang_qwen3-8b_decode_mi300x.json.gz"
    # the trace names its GPU (MI300X, in the catalog): floors need no flags
    code, out, err = run_cli("profile", mi, "--step-range", r"^step\[", "--model", "qwen3-8b", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["total_floor_ms"] > 0
    code, _, err = run_cli("profile", mi, "--step-range", r"^step\[", "--model", "qwen3-8b", "--gpu", "tpu-v9")
    assert code == 2 and "unknown GPU" in err
    code, out, err = run_cli("profile", mi, "--step-range", r"^step\[", "--model", "qwen3-8b", "--batch", 32,
                             "--bandwidth", 5.3, "--flops", 1307, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["gpu"]["name"] == "AMD Instinct MI300X" and d["gpu"]["bandwidth_tbs"] == 5.3
    assert d["classes"]["lm_head"]["ms"] > 0  # the once-per-step GEMM is the LM head
    assert d["classes"]["linear"]["calls"] == 36 * 4


@pytest.mark.parametrize("fmt", ["yaml", "markdown"])
def test_other_formats(run_cli, tmp_path, fmt):
    p = write_kineto(tmp_path / "s.json.gz", SynthSpec(steps=3, layers=1))
    code, out, err = run_cli("profile", p, "--format", fmt)
    assert code == 0, err
    assert ("schema: specpilot.profile/1" in out) if fmt == "yaml" else ("## Kernel time per class" in out)


def _bad(run_cli, *args, out=None):
    extra = ("--out", out) if out else ()
    code, stdout, err = run_cli("profile", *args, *extra)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specpilot: error:"), err
    if out:
        assert not Path(out).exists() and not list(Path(out).parent.glob(f".{Path(out).name}.*"))
    return lines[0]


def test_bad_inputs_exit_2_without_output(run_cli, tmp_path):
    out = tmp_path / "o.json"
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "junk.sqlite").write_bytes(b"junk" * 100)
    good = write_nsys_sqlite(tmp_path / "g.sqlite", SynthSpec(steps=2, layers=1))
    assert "empty" in _bad(run_cli, tmp_path / "empty.json", out=out)
    assert "unknown trace format" in _bad(run_cli, tmp_path / "junk.sqlite", out=out)
    assert "no such file" in _bad(run_cli, tmp_path / "missing.json", out=out)
    assert "no NVTX" in _bad(run_cli, good, "--step-range", "^nothing", out=out)
    assert "unknown model" in _bad(run_cli, good, "--model", "no-such-model", out=out)
    assert "not both" in _bad(run_cli, good, "--model", CONFIG, "--ceiling", CONFIG)
    assert "no steps left" in _bad(run_cli, good, "--skip-steps", 5, out=out)
    rules = tmp_path / "r.yaml"
    rules.write_text("schema: nope\nrules: []\n")
    assert "unknown schema" in _bad(run_cli, good, "--rules", rules, out=out)
    assert "refusing to overwrite" in _bad(run_cli, good, "--out", good)
    # the model's and the drafter's config files are inputs too: refused before the trace is read
    for opt in ("--model", "--drafter"):
        cfg = tmp_path / f"cfg{opt}.json"
        cfg.write_text(Path(CONFIG).read_text())
        model = ("--model", CONFIG) if opt == "--drafter" else ()
        assert "refusing to overwrite input file" in _bad(run_cli, good, *model, opt, cfg, "--out", cfg)
        assert cfg.read_text() == Path(CONFIG).read_text()


@pytest.mark.parametrize("name, text, expect", [
    ("r1.yaml", "schema: specpilot.kernel_classes/1\nrules:\n  - {class: a, match: '('}\n",
     "bad/r1.yaml: rule 0: match '(' is not a valid regex"),
    ("empty.jsonl", "", "bad/empty.jsonl: expected a YAML mapping"),
    ("r3.yaml", "schema: specpilot.kernel_classes/1\nrules:\n  - {class: a,\n    match: x\n  - oops\n",
     "bad/r3.yaml:6: not valid YAML (expected ',' or '}'"),
])
def test_rules_file_errors_name_the_path_as_given_and_the_line(run_cli, tmp_path, monkeypatch, name, text, expect):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    assert _bad(run_cli, H200_EAGER, "--rules", f"bad/{name}").startswith(f"specpilot: error: {expect}")


def test_nsys_rep_without_nsys_exits_3(run_cli, monkeypatch, tmp_path):
    import shutil

    import specpilot.probes.traces.nsys_rep as rep

    monkeypatch.setattr(rep, "find_nsys", lambda: None)
    alone = tmp_path / "nsys_h200_decode_eager.nsys-rep"   # without the export beside it, which needs no nsys
    shutil.copy(LOCAL / "nsys_h200_decode_eager.nsys-rep", alone)
    code, _, err = run_cli("profile", alone)
    assert code == 3 and "nsys" in err and len(err.strip().splitlines()) == 1


def test_skip_steps_and_gap_mode(run_cli, tmp_path):
    p = write_kineto(tmp_path / "s.json", SynthSpec(steps=5, layers=1))
    code, out, err = run_cli("profile", p, "--step-mode", "gap", "--skip-steps", 2, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["steps"] == 3 and d["trace"]["steps_found"] == 5 and d["step_mode"] == "gap"
    assert [s["index"] for s in d["per_step"]] == [2, 3, 4]


def test_empty_step_range_is_refused(run_cli):
    from conftest import one_error

    code, out, err = run_cli("profile", H200_KINETO, "--step-range", "")
    assert code == 2 and not out and "--step-range is empty" in one_error(err)


def test_implausible_steps_from_annotations_do_not_suggest_them_again(run_cli, fixtures_dir):
    code, out, err = run_cli("profile", fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert "20 NVTX step ranges" in d["step_detail"]
    (warn,) = [w for w in d["warnings"] if "implausible" in w]
    assert "the steps are the trace's 'step_N' ranges" in warn and "--step-mode graph or gap" in warn
    assert "--step-range" not in warn
    # found by gap mode instead, the annotations are worth naming
    code, out, err = run_cli("profile", fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite", "--step-mode",
                             "gap", "--format", "json")
    assert code == 0, err
    assert any("--step-range REGEX (the trace has 'step_N' x20)" in w for w in json.loads(out)["warnings"])


def test_implausible_range_steps_list_the_other_annotation_families():
    from specpilot.probes.steps import plausibility

    (warn,) = plausibility([2, 2, 2], [1000] * 3, {"step_N": 3, "layer_N": 90}, ["step_0", "step_1", "step_2"])
    assert "the steps are the trace's 'step_N' ranges" in warn
    assert "other annotations with --step-range REGEX (the trace also has 'layer_N' x90)" in warn


def test_gpu_from_kernel_names_needs_gpu_for_floors(run_cli, fixtures_dir, tmp_path):
    """Without deviceProperties a ROCm trace names only the gfx ISA, which several catalog GPUs share."""
    import gzip

    from conftest import one_error

    doc = json.loads(gzip.decompress((fixtures_dir / "kineto_sglang_qwen3-8b_decode_mi300x.json.gz").read_bytes()))
    del doc["deviceProperties"]
    p = tmp_path / "mi300x_no_props.json.gz"
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    code, _, err = run_cli("profile", p, "--model", "qwen3-8b")
    assert code == 2 and "'AMD gfx942 GPU (MI300 series, from kernel names)' is not in the GPU catalog" in one_error(err)
    code, out, err = run_cli("profile", p, "--model", "qwen3-8b", "--gpu", "mi300x", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["gpu"]["key"] == "mi300x"


def test_a_diff_keeps_flags_and_warnings_and_says_when_the_gpus_differ(run_cli, fixtures_dir):
    mi = fixtures_dir / "kineto_sglang_qwen3-8b_decode_mi300x.json.gz"
    code, out, err = run_cli("profile", H200_EAGER, mi, "--diff", "--model", "llama-3.1-8b")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("linear "))
    assert "(!) ->" in line, line
    assert "warning: base: linear: model/config mismatch" in out
    assert "warning: the traces come from different GPUs (NVIDIA H200 -> AMD Instinct MI300X)" in out


def test_floor_shape_options_without_floors_are_refused(run_cli, tmp_path):
    """--rows/--batch/--context (and the other options of the floors) where no floors read them: refused
    before the trace is read, naming what they need."""
    out = tmp_path / "o.json"
    good = write_kineto(tmp_path / "s.json.gz", SynthSpec(steps=2, layers=1))
    err = _bad(run_cli, good, "--rows", 8, "--batch", 4, "--context", 100, out=out)
    assert "--rows, --batch, --context: they shape the byte floors, which need --model or --ceiling" in err
    assert "--kv-dtype: it shapes the byte floors" in _bad(run_cli, good, "--kv-dtype", "fp8", out=out)
    # a ceiling takes --rows (one of its row counts); its floors have their own batch and context
    ceil = tmp_path / "c.json"
    err = _bad(run_cli, good, "--ceiling", ceil, "--rows", 8, "--batch", 4, out=out)
    assert "--batch: --ceiling brings floors of the shape it was made for" in err
    rank1 = tmp_path / "s1.json.gz"
    rank1.write_bytes(good.read_bytes())
    assert "sets no byte floors" in _bad(run_cli, good, rank1, "--context", 100, out=out)
    code, _, err = run_cli("profile", good, "--model", CONFIG, "--rows", 8, "--batch", 4, "--gpu", "h200")
    assert code == 0, err


def test_a_rules_path_that_is_no_file_says_what_it_is(run_cli, tmp_path):
    assert _bad(run_cli, H200_EAGER, "--rules", "/dev/null").startswith(
        "specpilot: error: /dev/null: not a rules file (a folder or device)")
    assert _bad(run_cli, H200_EAGER, "--rules", tmp_path / "none.yaml").startswith(
        f"specpilot: error: {tmp_path / 'none.yaml'}: no such rules file")


@pytest.mark.parametrize("fmt", ["nsys", "kineto"])
def test_graph_steps_leave_the_last_steps_open_wall_out(run_cli, tmp_path, fmt):
    """Graph-launch steps end where the next starts; the last has no next step: its GPU span alone
    is no wall, so the wall figures are the other steps' (its per-step wall is null) and a note says it."""
    spec = SynthSpec(steps=4, layers=1, graphs=True, step_gap_ns=2_000_000)
    p = write_nsys_sqlite(tmp_path / "g.sqlite", spec) if fmt == "nsys" else write_kineto(tmp_path / "g.json", spec)
    code, out, err = run_cli("profile", p, "--step-mode", "graph", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    walls = [s["wall_ms"] for s in d["per_step"]]
    assert walls[-1] is None and all(w is not None and w > 2.0 for w in walls[:-1])
    assert d["step_wall_ms"] == pytest.approx(sorted(walls[:-1])[1])
    assert any("the last step's wall is left out" in n for n in d["notes"])


@pytest.mark.parametrize("fmt", ["nsys", "kineto"])
def test_skipping_to_the_open_last_step_alone_is_refused_and_one_step_says_its_wall_is_its_span(run_cli, tmp_path,
                                                                                            fmt):
    """The last graph-launch step's GPU span is no wall: skipping every other step would make the span the
    step wall (outside factor 1), so it is refused; a trace of one such step keeps its span with a note."""
    spec = SynthSpec(steps=4, layers=1, graphs=True, step_gap_ns=2_000_000)
    p = write_nsys_sqlite(tmp_path / "g.sqlite", spec) if fmt == "nsys" else write_kineto(tmp_path / "g.json", spec)
    code, out, err = run_cli("profile", p, "--step-mode", "graph", "--skip-steps", "3", "--format", "json")
    assert code == 2 and out == ""
    assert "the only step left after --skip-steps 3 is the trace's last" in err and "skip at most 2" in err
    code, out, err = run_cli("profile", p, "--step-mode", "graph", "--skip-steps", "2", "--format", "json")
    assert code == 0, err
    assert [s["wall_ms"] is None for s in json.loads(out)["per_step"]] == [False, True]
    one = SynthSpec(steps=1, layers=1, graphs=True)
    p1 = write_nsys_sqlite(tmp_path / "one.sqlite", one) if fmt == "nsys" else write_kineto(tmp_path / "one.json", one)
    code, out, err = run_cli("profile", p1, "--step-mode", "graph", "--format", "json")
    assert code == 0, err
    assert any("the trace holds one step" in n and "not measured" in n for n in json.loads(out)["notes"])


def _rank_trace(path, busy_us):
    """A Kineto trace of one rank: a decode_step_i range per step holding one kernel of busy_us[i]."""
    events = []
    for i, us in enumerate(busy_us):
        s = 10_000 + i * 5000
        events += [{"ph": "X", "cat": "user_annotation", "name": f"decode_step_{i}", "ts": s, "dur": 4000,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": s + 10, "dur": 5,
                    "pid": 1, "tid": 1, "args": {"correlation": i + 1}},
                   {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "ts": s + 20, "dur": us, "pid": 0, "tid": 7,
                    "args": {"device": 0, "stream": 7, "correlation": i + 1}}]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_ranks_of_different_step_counts_are_compared_over_common_steps_throughout(run_cli, tmp_path):
    a = _rank_trace(tmp_path / "rank0.json", [400, 900, 1400])
    b = _rank_trace(tmp_path / "rank1.json", [600, 1900])
    code, out, err = run_cli("profile", a, b, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert [r["kernel_busy_ms"] for r in d["ranks"]] == pytest.approx([0.65, 1.25])
    assert d["group_busy_ms"] == pytest.approx(1.25) and d["steps"] == 2
    assert any("different step counts (3, 2); every figure is over the first 2 of each" in n for n in d["notes"])


def test_a_compressed_trace_is_named_in_errors_and_read_by_ranks(run_cli, tmp_path):
    import lzma
    import sqlite3

    db = tmp_path / "unrel.sqlite"
    con = sqlite3.connect(db)
    con.execute("create table a(x)")
    con.commit()
    con.close()
    packed = tmp_path / "unrel.sqlite.xz"
    packed.write_bytes(lzma.compress(db.read_bytes()))
    code, _, err = run_cli("profile", packed)
    assert code == 2 and f"{packed}:" in err and "specpilot-trace-" not in err, err
    events = []
    for dev in (0, 1):
        for i in range(3):
            s = 10_000 + i * 5000
            events += [{"ph": "X", "cat": "kernel", "name": "gemm_kernel", "ts": s, "dur": 100 + 50 * dev,
                        "args": {"device": dev, "stream": 7, "correlation": dev * 10 + i}}]
    plain = json.dumps({"traceEvents": events}).encode()
    (tmp_path / "mg.json.xz").write_bytes(lzma.compress(plain))
    (tmp_path / "mg.json").write_bytes(plain)
    outs = []
    for name in ("mg.json", "mg.json.xz"):
        code, out, err = run_cli("profile", tmp_path / name, "--ranks", "--step-mode", "whole", "--format", "json")
        assert code == 0, err
        d = json.loads(out)
        outs.append([r["kernel_busy_ms"] for r in d["ranks"]])
    assert outs[0] == outs[1] and len(outs[0]) == 2


@pytest.mark.parametrize("nelems", [-100, 1e30])
def test_a_collective_s_message_size_out_of_range_is_refused_naming_it(run_cli, tmp_path, nelems):
    events = [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 10, "dur": 50, "pid": 1, "tid": 1,
               "args": {"External id": 5, "Collective name": "allreduce", "In msg nelems": nelems,
                        "Out msg nelems": 100, "dtype": "BFloat16", "Group size": 2}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 5, "pid": 1, "tid": 1,
               "args": {"correlation": 1, "External id": 5}},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 30, "dur": 40,
               "pid": 0, "tid": 7, "args": {"device": 0, "stream": 7, "correlation": 1, "External id": 5}}]
    p = tmp_path / "comm.json"
    p.write_text(json.dumps({"traceEvents": events}))
    code, _, err = run_cli("profile", p, "--link-bandwidth", "450")
    assert code == 2 and f"{p}: collective" in err and "'In msg nelems' must be a count of elements" in err, err


def test_an_nvtx_range_past_any_clock_is_a_damaged_export(run_cli, tmp_path):
    import shutil
    import sqlite3

    p = tmp_path / "nvtx_end.sqlite"
    shutil.copy(Path(__file__).parent / "fixtures" / "nsys_h200_decode_eager.sqlite", p)
    con = sqlite3.connect(p)
    con.execute("UPDATE NVTX_EVENTS SET end = 9223372036854775807 WHERE text = 'decode_step_1'")
    con.commit()
    con.close()
    code, _, err = run_cli("profile", p)
    assert code == 2 and f"{p}: NVTX range 'decode_step_1' spans" in err and "a damaged export" in err, err


def test_zero_length_kernels_are_kernels_of_their_class(run_cli, tmp_path):
    """Zero-duration GEMMs in every step: their class has kernels (no 'no kernels classified' note),
    and the top kernels' 0 ms says why (not 'fewer than half of the steps')."""
    events = []
    for step in range(3):
        s = 10_000 + step * 5000
        events.append({"ph": "X", "cat": "user_annotation", "name": f"decode_step_{step}", "ts": s, "dur": 4000,
                       "pid": 1, "tid": 1})
        for i in range(6):
            corr = step * 10 + i
            events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": s + 10 + i * 100,
                        "dur": 5, "pid": 1, "tid": 1, "args": {"correlation": corr}},
                       {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT",
                        "ts": s + 20 + i * 100, "dur": 0, "pid": 0, "tid": 7,
                        "args": {"device": 0, "stream": 7, "correlation": corr}}]
    p = tmp_path / "zero.json"
    p.write_text(json.dumps({"traceEvents": events}))
    code, out, err = run_cli("profile", p, "--model", "llama-3.1-8b", "--gpu", "h200", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert not any("no kernels were classified as 'linear'" in n or "classified as linear" in n for n in d["notes"])
    code, out, err = run_cli("profile", p, "--model", "llama-3.1-8b", "--gpu", "h200")
    assert "0 ms: its records last no time (zero-length in the trace)" in out, out
    assert "fewer than half of the steps" not in out


def test_plot_or_explain_with_several_traces_names_only_what_was_given(run_cli, tmp_path):
    """--diff --plot was refused naming --explain too, which was not given."""
    from pathlib import Path

    t = Path(__file__).parent / "fixtures" / "nsys_h200_decode_eager.sqlite"
    code, _, err = run_cli("profile", t, t, "--diff", "--plot", tmp_path / "d.png")
    assert code == 2 and "--plot profiles one trace; leave it out with --diff" in err and "--explain" not in err, err
    code, _, err = run_cli("profile", t, t, "--diff", "--plot", tmp_path / "d.png", "--explain")
    assert code == 2 and "--plot and --explain profile one trace; leave them out" in err, err
