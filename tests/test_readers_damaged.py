"""Files one verb writes and another reads: a present field of the wrong type or an impossible
value is a damaged file (exit 2 naming the field), never taken as absent (which skipped the checks
that compare deployments) nor carried into a figure (a negative time, a math domain error)."""

import json
from pathlib import Path

import pytest

from conftest import refused

REPO = Path(__file__).resolve().parents[1]
MEASURE = REPO / "examples" / "rounds" / "llama8b-h200" / "measure"


def _made(*args) -> None:
    """``specpilot ARGS`` in-process for a module's files (stdout and stderr left alone)."""
    from specpilot.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        assert e.code in (0, None), args


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A chain run, an AR run and a replay of the chain's lattice (tiny engine), a rows probe."""
    d = tmp_path_factory.mktemp("runs")
    for args in (["run", "--model", "tiny", "--mode", "chain", "--prompt", "abcabcabcabc", "--max-new-tokens", "24",
                  "--lattice-out", d / "c.lat.jsonl", "--format", "json", "--out", d / "chain.json"],
                 ["run", "--model", "tiny", "--mode", "ar", "--prompt", "abcabcabcabc", "--max-new-tokens", "24",
                  "--format", "json", "--out", d / "ar.json"],
                 ["replay", d / "c.lat.jsonl", "--format", "json", "--out", d / "rep.json"],
                 ["probe", "rows", "--model", "tiny", "--device", "cpu", "--rows", "1,2,4", "--context", "16",
                  "--reps", "2", "--warmup", "1", "--format", "json", "--out", d / "rows.json"]):
        _made(*args)
    return d


def _edited(src: Path, dst: Path, edit) -> Path:
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    return dst


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


@pytest.mark.parametrize("edit, words", [
    (_set("steps", -5), "the run's 'steps' must be a whole number >= 0"),
    (lambda d: [r.__setitem__("tokens", 0) for r in d["results"]], "'tokens' (a whole number >= 1)"),
    (lambda d: d["step_timing"].__setitem__("verify_ms", -2.5),
     "step_timing 'verify_ms' must be a finite number of ms >= 0"),
    (lambda d: d["step_timing"].__setitem__("draft_ms", -0.5),
     "step_timing 'draft_ms' must be a finite number of ms >= 0"),
    (_set("model", ["tiny"]), "run's 'model' must be a name"),
    (_set("device", 1), "run's 'device' must be a name"),
])
def test_a_damaged_run_is_refused(run_cli, files, tmp_path, edit, words):
    bad = _edited(files / "chain.json", tmp_path / "bad.json", edit)
    code, _, err = run_cli("ceiling", "--check", bad, "--replay", files / "rep.json", "--ar-run", files / "ar.json")
    refused(code, err, words)


@pytest.mark.parametrize("edit, words", [
    (_set("model", ["llama-3.1-8b"]), "rows probe 'model' must be a name"),
    (_set("gpu", 1), "rows probe 'gpu' must be a name"),
    (_set("device", 1), "rows probe 'device' must be a name"),
])
def test_a_rows_probe_of_wrong_types_is_refused_not_taken_as_unknown(run_cli, files, tmp_path, edit, words):
    bad = _edited(files / "rows.json", tmp_path / "bad.json", edit)
    code, _, err = run_cli("ceiling", "--run", files / "chain.json", "--rows-probe", bad)
    refused(code, err, words)


def test_a_profile_of_wrong_types_is_refused(run_cli, tmp_path):
    for edit, words in ((_set("model", ["llama-3.1-8b"]), "profile's 'model' must be a name"),
                        (_set("gpu", 7), "profile's 'gpu' must be an object")):
        bad = _edited(MEASURE / "profile.json", tmp_path / "bad.json", edit)
        code, _, err = run_cli("ceiling", "--profile", bad, "--model", "qwen3-8b", "--gpu", "h100", "--tau", "2",
                               "--ar-ms", "4")
        refused(code, err, words)


def test_replay_curves_take_numbers_only(run_cli, files, tmp_path):
    bad = _edited(files / "rep.json", tmp_path / "bad.json", _set("curves", {"best-first": {"8": True, "4": "2.5"}}))
    code, _, err = run_cli("ceiling", "--replay", bad, "--tau", "2", "--step-ms", "6", "--ar-ms", "5")
    refused(code, err, "curve 'best-first' must map node counts to tau (numbers)")


@pytest.fixture(scope="module")
def w12_ceiling(tmp_path_factory):
    out = tmp_path_factory.mktemp("ceil") / "cw12.json"
    _made("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--weight-dtype", "w12", "--format", "json",
          "--out", out)
    return out


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["classes"]["linear"].__setitem__("bytes", "lots"), "class 'linear': 'bytes' must be a finite number"),
    (_set("total_floor_ms", True), "'total_floor_ms' must be a finite number >= 0"),
    (lambda d: d["classes"]["linear"].__setitem__("floor_ms", -2.0), "class 'linear' needs a 'floor_ms' of a finite"),
])
def test_profile_ceiling_refuses_a_damaged_ceiling(run_cli, w12_ceiling, tmp_path, edit, words):
    bad = _edited(w12_ceiling, tmp_path / "bad.json", edit)
    code, _, err = run_cli("profile", MEASURE / "trace.json.gz", "--ceiling", bad)
    refused(code, err, words)


def test_profile_ceiling_keeps_the_weight_dtype_of_its_floors(run_cli, w12_ceiling, tmp_path):
    """A profile floored by a W12 ceiling says so, so ceiling --profile refuses bf16 floors beside it."""
    prof = tmp_path / "pf.json"
    code, _, err = run_cli("profile", MEASURE / "trace.json.gz", "--ceiling", w12_ceiling, "--format", "json",
                           "--out", prof)
    assert code == 0, err
    assert json.loads(prof.read_text())["shape"]["weight_dtype"] == "w12"
    code, _, err = run_cli("ceiling", "--profile", prof, "--model", "llama-3.1-8b", "--weight-dtype", "bf16",
                           "--tau", "2", "--ar-ms", "4")
    refused(code, err, "weight dtype")
