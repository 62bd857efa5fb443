"""``specpilot round`` / ``report`` / ``check`` on the tiny built-in model (seconds), the SGLang form
on fake servers (the embedded engine's SGLang-compatible ``serve``), and the real SmolLM2 round (-m slow)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specpilot.auditors.round import RoundConfig, load_round, run_round
from specpilot.auditors.round import plan as pl
from specpilot.auditors.round.modeling import expected_c, step_time

TINY = "engine:model=tiny,mode=ar"


@pytest.fixture(scope="module")
def tiny_round(tmp_path_factory):
    """One finished round on the tiny model (with the no-op control), shared by the tests below."""
    from click.testing import CliRunner  # noqa: F401  (the real command runs through run_cli below)

    from specpilot.cli import main

    d = tmp_path_factory.mktemp("round")
    args = ["round", TINY, "--budget", "0.25", "--out-dir", str(d / "r"), "--records", str(d / "records"), "--control",
            "--n-prompts", "2", "--max-new-tokens", "16"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0
    return d


def test_round_runs_every_stage_and_writes_its_files(tiny_round):
    r = tiny_round / "r"
    state = json.loads((r / "round.json").read_text())
    assert state["schema"] == "specpilot.round/1"
    assert {s: v["status"] for s, v in state["stages"].items()} == dict.fromkeys(
        ("measure", "model", "propose", "approve", "remember"), "done")
    assert "profile: no GPU kernels to profile on the CPU" in " ".join(state["stages"]["measure"]["skipped"])
    for f in ("prompts.jsonl", "measure/rows.json", "measure/lattice.jsonl", "measure/replay.json", "model/model.json",
              "propose/candidates.json", "approve/decisions.json", "approve/stock.outputs.jsonl", "baseline.json",
              "remember/record.yaml", "remember/changes.json", "report.md", "report.html"):
        assert (r / f).is_file(), f
    assert state["spent_s"] < 0.25 * 60 + 15  # within its budget (the last stage may overrun by a run)
    res = load_round(r)
    assert res.model.largest == "tree" and res.model.factors["tree"] >= 1.0
    assert res.model.factors["kernel"] is None and res.model.factors["outside"] is None
    cands = {c.id: c for c in res.proposal.candidates}
    assert {"tree", "chain", "no-op"} <= set(cands) and cands["no-op"].control
    assert cands["tree"].retuned.startswith("N = ") and "nodes=" in cands["tree"].system
    reasons = {x["id"]: x["reason"] for x in res.proposal.not_proposed}
    assert "needs a CUDA GPU" in reasons["w12"] and "one-request" in reasons["batching"]
    # TLV on the CPU: its cycles recorded at one budget, predicted from tlv:N and the passes' ms
    tlv = res.measurement.tlv
    assert tlv["nodes"] == 16 and tlv["tau"] >= 1 and tlv["time_ms"]["qpass"] > 0 and tlv["time_ms"]["exact"] > 0
    assert (r / "measure" / "tlv.lattice.jsonl").is_file()
    row = next(x for x in res.model.by_nodes if x["family"] == "tlv")
    assert row["speedup"] == pytest.approx(tlv["tau"] * row["c"] ** -1)
    assert cands["tlv"].retuned.startswith("N = 16 nodes as recorded") and "mode=tlv" in cands["tlv"].system
    assert cands["tlv"].predicted_speedup == pytest.approx(row["speedup"])
    base = json.loads((r / "baseline.json").read_text())
    assert set(base["outputs"]) == {"stock", "ar", "system"}   # the AR stock's outputs are AR's
    if res.state["final"] != TINY:   # the final system's own outputs, kept past later refusals
        final = next(d for d in res.decisions if d.system == res.state["final"] and d.verdict == "approved")
        saved = [json.loads(x)["output_ids"] for x in (r / final.files["outputs"]).read_text().splitlines()]
        assert [o["output_ids"] for o in base["outputs"]["system"]] == saved


def test_the_no_op_control_is_refused_and_every_judged_candidate_is_audited(tiny_round):
    res = load_round(tiny_round / "r")
    by_id = {d.id: d for d in res.decisions}
    noop = by_id["no-op"]
    assert noop.verdict in ("refused", "skipped")
    for d in res.decisions:
        if d.verdict == "skipped":
            assert d.reason.startswith("budget")
            continue
        assert d.timing["schema"] == "specpilot.timing/1" and len(d.timing["samples"]) >= pl.PAIRS_MIN
        assert d.audit["verdict"] == "pass"  # every candidate is lossless: the engine's trees are exact
        assert d.audit["systems"][0]["role"] == "stock"
    assert res.final == res.state["current"]


def test_the_record_makes_the_next_round_start_from_the_final_system(tiny_round, run_cli):
    rec = yaml.safe_load((tiny_round / "r" / "remember" / "record.yaml").read_text())
    assert rec["schema"] == "specpilot.deployment-record/1" and len(rec["rounds"]) == 1
    assert rec["current"] == rec["rounds"][0]["final"]
    # a changed record: the next round (dry run) starts from the record's system
    path = next((tiny_round / "records").glob("*.yaml"))
    rec["current"] = "engine:model=tiny,mode=chain,depth=4"
    path.write_text(yaml.safe_dump(rec))
    code, out, err = run_cli("round", TINY, "--dry-run", "--records", tiny_round / "records", "--format", "json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["start"] == "engine:model=tiny,mode=chain,depth=4" and plan["record"]
    code, out, _ = run_cli("round", TINY, "--dry-run", "--records", tiny_round / "records", "--fresh", "--format", "json")
    assert json.loads(out)["start"] == TINY


def test_report_is_self_contained_and_rerenders(tiny_round, run_cli):
    r = tiny_round / "r"
    html = (r / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4
    assert "src='http" not in html and "<script" not in html and "<link" not in html
    md = (r / "report.md").read_text()
    assert "## 4. Approve" in md and "no-op" in md and "(report/tau_c.png)" in md
    assert (r / "report" / "tau_c.png").is_file()
    (r / "report.html").unlink()
    code, out, err = run_cli("report", r)
    assert code == 0 and (r / "report.html").is_file(), err
    assert run_cli("report", tiny_round)[0] == 2  # not a round folder


@pytest.mark.parametrize("name", ["smollm2-cpu", "llama8b-h200"])
def test_committed_example_rounds_rerender_to_their_reports(name, run_cli, tmp_path):
    """The rounds under examples/ were made by the current code: re-rendering gives the same report."""
    src = Path(__file__).resolve().parents[1] / "examples" / "rounds" / name
    shutil.copytree(src, tmp_path / name)
    code, _, err = run_cli("report", tmp_path / name)
    assert code == 0, err
    assert (tmp_path / name / "report.md").read_text() == (src / "report.md").read_text()


@pytest.mark.parametrize("name", ["smollm2-cpu", "llama8b-h200"])
def test_committed_example_timings_quote_the_verdict_compare_from_gives(name):
    """The stored verdict and reason of each example timing (and its copy in decisions.json) are
    what 'specpilot compare --from' judges from its samples now (the lower of both bounds)."""
    from specpilot.auditors.timing import rejudge

    d = Path(__file__).resolve().parents[1] / "examples" / "rounds" / name / "approve"
    copies = {x["id"]: x["timing"] for x in json.loads((d / "decisions.json").read_text())["decisions"] if x["timing"]}
    for f in sorted(d.glob("*.timing.json")):
        now = rejudge(f).to_json()
        for stored in (json.loads(f.read_text()), copies[f.name.split(".")[0]]):
            assert {k: stored[k] for k in ("approved", "verdict", "reason")} == \
                {k: now[k] for k in ("approved", "verdict", "reason")}, f


@pytest.mark.parametrize("stage, what", [("measure/measure.json", "round-measure (no field 'system')"),
                                         ("model/model.json", "round-model (no field 'current')"),
                                         ("propose/candidates.json", "round-candidates (no field 'candidates')"),
                                         ("approve/decisions.json", "round-decisions (no field 'decisions')")])
def test_report_on_a_stage_file_without_its_fields_is_bad_input(stage, what, run_cli, tmp_path):
    src = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"
    shutil.copytree(src, tmp_path / "r")
    f = tmp_path / "r" / stage
    f.write_text(json.dumps({"schema": json.loads(f.read_text())["schema"]}))
    code, _, err = run_cli("report", tmp_path / "r")
    assert code == 2 and f"{stage}: malformed {what}" in err and "Traceback" not in err, err
    assert (tmp_path / "r" / "report.md").read_text() == (src / "report.md").read_text()


@pytest.mark.parametrize("stage, path, words", [
    ("measure/measure.json", (), "round-measure (unknown field 't_ar_ms' (did you mean 'ar_ms'?))"),
    ("model/model.json", (), "round-model (unknown field 't_ar_ms')"),
    ("propose/candidates.json", (), "round-candidates (unknown field 't_ar_ms')"),
    ("propose/candidates.json", ("candidates", 0), "round-candidates (candidates[0] (chain): unknown field 't_ar_ms')"),
])
def test_report_on_a_stage_file_with_an_unknown_field_names_it(stage, path, words, run_cli, tmp_path):
    """Every stage file that builds a dataclass says which field it does not know, as
    decisions.json's reader does, not the constructor's words."""
    src = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"
    shutil.copytree(src, tmp_path / "r")
    f = tmp_path / "r" / stage
    doc = json.loads(f.read_text())
    obj = doc
    for key in path:
        obj = obj[key]
    obj["t_ar_ms"] = -1
    f.write_text(json.dumps(doc))
    code, _, err = run_cli("report", tmp_path / "r")
    assert code == 2 and err.count("\n") == 1 and f"{stage}: malformed {words}" in err and "__init__" not in err, err


@pytest.mark.parametrize("entry, words", [
    ("oops", "decisions[1] is a str, not an object"),
    ({"verdict": "maybe"}, "decisions[1] (tree): verdict must be approved, refused or skipped"),
    ({"gain": 1.2}, "decisions[1] (tree): unknown field 'gain'"),
    ({"id": None}, "decisions[1]: id must be a candidate name"),
])
def test_a_malformed_decision_is_named_by_report_and_resume(run_cli, tmp_path, entry, words):
    src = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"
    shutil.copytree(src, tmp_path / "r")
    f = tmp_path / "r" / "approve" / "decisions.json"
    doc = json.loads(f.read_text())
    doc["decisions"][1] = dict(doc["decisions"][1], **entry) if isinstance(entry, dict) else entry
    f.write_text(json.dumps(doc))
    for args in (("report", tmp_path / "r"), ("round", "--resume", tmp_path / "r", "--budget", "0.05")):
        code, _, err = run_cli(*args)
        assert code == 2 and err.count("\n") == 1 and "approve/decisions.json: malformed round-decisions" in err \
            and words in err and "argument after **" not in err, (args, err)


def test_check_refuses_prompt_ids_outside_the_stock_vocabulary_before_any_run(tiny_round, run_cli, tmp_path):
    doc = json.loads((tiny_round / "r" / "baseline.json").read_text())
    first = next(iter(doc["outputs"].values()))[0]["id"]
    for rows in doc["outputs"].values():   # every role ran the prompt on these ids
        next(r for r in rows if r["id"] == first)["prompt_ids"] = [99999]
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    code, _, err = run_cli("check", "--baseline", tmp_path, "--runs", "2")
    assert code == 2 and "outside the vocabulary" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("change, words", [
    (("round.json", "stages", "oops"), "stages must be a map"), (("round.json", "facts", [1, 2]), "facts must be a map"),
    (("round.json", "budget_s", "x"), "budget_s must be a number"), (("round.json", "spent_s", None), "spent_s"),
    (("round.json", "current", 5), "current must be a system"),
])
def test_a_damaged_round_file_is_bad_input_for_report_and_resume(run_cli, tmp_path, change, words):
    src = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"
    shutil.copytree(src, tmp_path / "r")
    f, key, value = change
    doc = json.loads((tmp_path / "r" / f).read_text())
    doc[key] = value
    (tmp_path / "r" / f).write_text(json.dumps(doc))
    for args in (("report", tmp_path / "r"), ("round", "--resume", tmp_path / "r", "--budget", "0.05")):
        code, _, err = run_cli(*args)
        assert code == 2 and words in err and "internal error" not in err, (args, err)


def test_a_wrong_value_deep_in_a_stage_file_is_bad_input_and_a_deleted_one_is_not_redone(run_cli, tmp_path):
    src = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "smollm2-cpu"
    shutil.copytree(src, tmp_path / "r")
    f = tmp_path / "r" / "approve" / "decisions.json"
    doc = json.loads(f.read_text())
    doc["decisions"][0]["timing"]["gain"] = "fast"
    f.write_text(json.dumps(doc))
    code, _, err = run_cli("report", tmp_path / "r")
    assert code == 2 and "decisions.json: malformed round-decisions (decisions[0] (chain): timing.gain must be a " \
        "number > 0, not 'fast')" in err and "internal error" not in err, err
    shutil.rmtree(tmp_path / "r")
    shutil.copytree(src, tmp_path / "r")
    (tmp_path / "r" / "measure" / "measure.json").unlink()
    code, _, err = run_cli("round", "--resume", tmp_path / "r", "--budget", "0.05")
    assert code == 2 and "missing, though round.json says the measure stage is done" in err, err


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
def test_report_renders_in_a_headless_browser(tiny_round, tmp_path):
    import numpy as np
    from PIL import Image

    shot = tmp_path / "report.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}",
                    f"--screenshot={shot}", "--window-size=1280,4000",
                    (tiny_round / "r" / "report.html").resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    img = np.asarray(Image.open(shot).convert("L"))
    assert img.shape == (4000, 1280)
    # text and plots: many distinct grey levels, a good share of the page not white
    assert len(np.unique(img)) > 50 and (img < 200).mean() > 0.02


def _set(doc: dict, path: str, value):
    *head, last = path.split(".")
    for k in head:
        doc = doc[int(k)] if isinstance(doc, list) else doc[k]
    if isinstance(doc, list):
        doc[int(last)] = value
    else:
        doc[last] = value


@pytest.mark.parametrize("field, value, words", [
    ("system", 5, "'system' must be a non-empty string"),
    ("noise", "x", "'noise' must be a fraction in [0, 1)"),
    ("samples", ["a", "b"], "'samples' must be a list of at most 100000 throughputs in [1e-09, 1e+09] tokens/s"),
    ("samples", "x", "'samples' must be a list of at most 100000 throughputs in [1e-09, 1e+09] tokens/s"),
    ("max_new_tokens", 0, "'max_new_tokens' must be a whole number >= 1"),
    ("outputs.stock.0.prompt_ids", [99999], "has other prompt_ids than in"),
    ("outputs.stock.0.prompt_ids", "abc", "'outputs.stock[0]' must be a row"),
    ("outputs.system.0.output_ids", None, "'outputs.system[0]' must be a row"),
    ("outputs.stock", [], "baseline field 'outputs.stock' is empty, though every role holds the same prompts"),
    ("outputs.stock", None, "no stock outputs to audit against"),
    ("outputs", [], "'outputs' must be an object"),
    ("outputs.stock.0.output_ids", [10 ** 9], "outside the stock model's vocabulary"),
])
def test_check_refuses_a_damaged_baseline_before_any_run(tiny_round, run_cli, tmp_path, field, value, words):
    """A field of the wrong type is bad input, said before the timed runs: not a crash (exit 4),
    and not a gate that passes having checked nothing."""
    doc = json.loads((tiny_round / "r" / "baseline.json").read_text())
    _set(doc, field, value)
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    code, out, err = run_cli("check", "--baseline", tmp_path, "--runs", "2")
    assert code == 2 and words in err and "internal error" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("samples, noise, words", [
    ([10.0, 11.0], None, "'noise' must be the samples' A/A noise, a fraction in [0, 1), beside the samples"),
    ([10.0] * 100_001, 0.01, "'samples' must be a list of at most 100000 throughputs in [1e-09, 1e+09] tokens/s"),
])
def test_check_refuses_samples_without_their_noise_or_past_the_run_limit(tiny_round, run_cli, tmp_path, samples,
                                                                         noise, words):
    """Samples without their noise judged by the fresh runs' own alone (a looser rule, said nowhere);
    a baseline of 200000 samples made check's default 200000 runs, past --runs' limit."""
    doc = json.loads((tiny_round / "r" / "baseline.json").read_text())
    doc.update(samples=samples, noise=noise)
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    code, _, err = run_cli("check", "--baseline", tmp_path, "--no-audit")
    assert code == 2 and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(system="engine:model=tiny,bogus=1"), "baseline.json: baseline field 'system': engine spec"),
    (lambda d: d.update(stock="engine:model=tiny,mode=warp"), "baseline.json: baseline field 'stock': unknown mode"),
    (lambda d: d["outputs"]["stock"].pop(0), "baseline.json: baseline field 'outputs.stock' lacks prompt id"),
    (lambda d: d["outputs"]["system"].append(d["outputs"]["system"][0]),
     "baseline.json: baseline field 'outputs.system' holds prompt id"),
    (lambda d: d["outputs"]["ar"][0].update(prompt_ids=d["outputs"]["ar"][0]["prompt_ids"] + [5]),
     "baseline.json: baseline field 'outputs.ar': prompt"),
])
def test_check_names_the_baseline_for_a_bad_spec_or_prompts_that_do_not_pair(tiny_round, run_cli, tmp_path, change,
                                                                                words):
    """Said as the baseline is read, naming its file and field: not after the timed runs."""
    doc = json.loads((tiny_round / "r" / "baseline.json").read_text())
    change(doc)
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    for extra in ((), ("--no-audit",)):
        code, _, err = run_cli("check", "--baseline", tmp_path, "--runs", "2", *extra)
        assert code == 2 and words in err and err.count("\n") == 1, err


def test_check_refuses_out_on_its_baseline_before_running(tiny_round, run_cli, tmp_path):
    import shutil

    shutil.copy(tiny_round / "r" / "baseline.json", tmp_path / "b.json")
    before = (tmp_path / "b.json").read_text()
    code, _, err = run_cli("check", "--baseline", tmp_path / "b.json", "--out", tmp_path / "b.json")
    assert code == 2 and "refusing to overwrite" in err and "runs in" not in err, err
    assert (tmp_path / "b.json").read_text() == before


def test_check_without_timing_samples_needs_no_timing(tiny_round, run_cli, tmp_path):
    """A baseline whose round timed no candidate: the gate passing on the audit alone is asked for
    (--no-timing), not given silently; with --no-audit too there is nothing to check."""
    doc = json.loads((tiny_round / "r" / "baseline.json").read_text())
    doc["samples"] = []
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    code, _, err = run_cli("check", "--baseline", tmp_path, "--runs", "2")
    assert code == 2 and "holds no timing samples" in err and "--no-timing" in err, err
    code, _, err = run_cli("check", "--baseline", tmp_path, "--no-timing", "--no-audit")
    assert code == 2 and "leave nothing to check" in err, err
    doc["samples"] = [123.4]   # one sample: said as one, not as none
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    code, _, err = run_cli("check", "--baseline", tmp_path, "--runs", "2")
    assert code == 2 and "holds 1 timing sample" in err and "at least 2" in err and err.count("\n") == 1, err
    code, out, err = run_cli("check", "--baseline", tmp_path, "--no-timing", "--format", "json")
    assert code == 0 and json.loads(out)["timing"] == "not judged" and json.loads(out)["fresh"] == [], err


def test_check_passes_on_the_same_system_and_fails_on_a_regression_or_a_failed_audit(tiny_round, run_cli, tmp_path):
    r = tiny_round / "r"
    # this shared CPU drifts between sessions: the same system passes with a tolerance
    code, out, err = run_cli("check", "--baseline", r, "--runs", "4", "--tolerance", "0.6", "--format", "json")
    assert code == 0, out + err
    res = json.loads(out)
    assert res["passed"] and res["audit_verdict"] == "pass" and res["outputs_identical"] is True, res
    base = json.loads((r / "baseline.json").read_text())
    # a baseline a thousand times faster than anything this machine does: a regression beyond the
    # noise, even the noise of runs that share two cores with other tests (a run twice as slow as
    # its pair makes 10x undetectable: the threshold is 1% + 2 x noise)
    fast = dict(base, samples=[s * 1000 for s in base["samples"]], noise=0.01)
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    code, out, _ = run_cli("check", "--baseline", tmp_path / "fast.json", "--runs", "6", "--no-audit",
                           "--format", "json")
    res = json.loads(out)
    assert code == 1 and res["timing"] == "regression" and not res["passed"], res
    # other weights decode other tokens: the audit against stock rejects them
    code, out, _ = run_cli("check", "--baseline", r, "--system", "engine:model=tiny,mode=ar,seed=7", "--runs", "2",
                           "--format", "json")
    res = json.loads(out)
    assert code == 1 and res["audit_verdict"] == "reject" and any("audit" in x for x in res["reasons"])


def test_check_reads_system_as_typed(tiny_round, run_cli):
    """--system is typed: a batching rule where it changes nothing is refused, as run refuses it."""
    code, _, err = run_cli("check", "--baseline", tiny_round / "r", "--system", "engine:model=tiny,mode=ar,budget=equal",
                           "--runs", "2", "--no-audit")
    assert code == 2 and "engine option budget applies to batched decoding" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("args, msg", [
    (["round", TINY, "--candidates", "bogus"], "unknown candidate 'bogus'"),
    (["round", "engine:model=tiny,mode=warp"], "unknown mode"),
    (["round", "engine:model=tiny,mode=tlv,dtype=float16"], "not float16"),
    (["round", "nope.yaml"], "nope.yaml: no such file (a DEPLOYMENT file is an SGLang deployment"),
    (["round", "deploy/nope"], "deploy/nope: no such file"),
    (["round", "nope"], "a DEPLOYMENT is an engine spec"),
    (["round", TINY, "--budget", "0"], "--budget 0.0"),
    (["round", "--resume", "nowhere"], "nothing to resume"),
    (["check", "--baseline", "nowhere.json"], "no such file"),
])
def test_bad_input_is_one_line_exit_2(run_cli, tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(*args, "--out-dir", tmp_path / "o") if args[0] == "round" and "--resume" not in args \
        else run_cli(*args)
    assert code == 2 and msg in err and err.count("\n") == 1, err


@pytest.mark.parametrize("rules,policy", [("", "adaptive:8"), (",block=fixed", "shared:8"),
                                          (",budget=equal,block=fixed", "best-first:8"), ("batch=1", "best-first:8")])
def test_a_batched_tree_is_placed_by_its_batching_rules(rules, policy):
    """The current system's tau is replayed under the policy its batch decoder builds trees by."""
    from specpilot.auditors.round import measure as ms
    from specpilot.engine.spec import EngineSpec

    text = "engine:model=tiny,mode=tree,nodes=8" + (",batch=1" if rules == "batch=1" else ",batch=4" + rules)
    assert ms.system_rows(EngineSpec.parse(text)) == (9, policy)


def test_a_tlv_system_is_placed_by_its_recorded_cycles():
    """A round may start from a TLV system: its rows and policy, tau per exact pass from its own
    recording and c from the cycle's two passes (drafts left out, as for trees)."""
    from specpilot.auditors.round import measure as ms
    from specpilot.auditors.round.modeling import build_model
    from specpilot.engine.spec import EngineSpec

    spec = EngineSpec.parse("engine:model=tiny,mode=tlv,nodes=6")
    assert ms.system_rows(spec) == (8, "tlv:6") and ms.tlv_spec(spec) is spec
    other = ms.tlv_spec(EngineSpec.parse("engine:model=tiny,mode=tree,nodes=4"))
    assert other.mode == "tlv" and other.nodes == ms.TLV_NODES
    assert ms.tlv_unavailable(spec) is None
    assert "decode=fused" in ms.tlv_unavailable(spec.with_(device="cuda", decode="layers"))
    tlv = {"spec": str(spec), "nodes": 6, "tau": 3.0, "cycles": 10,
           "time_ms": {"draft1": 0.1, "qpass": 0.6, "draft2": 0.1, "exact": 1.2, "append": 0.1}}
    meas = ms.Measurement(system=str(spec), tokens_per_s=100.0, calibration={}, context=64, ar_ms=1.0,
                          step_ms={1: 1.0, 8: 1.2}, current_rows=8, current_policy="tlv:6", tlv=tlv,
                          replay={"policies": [{"policy": "chain", "nodes": 8, "tau": 1.5},
                                               {"policy": "best-first:8", "nodes": 8, "tau": 2.0}],
                                  "steps": 10, "positions": 8, "candidates": 3})
    assert meas.taus["tlv:6"] == 3.0
    res = build_model(meas)
    assert res.current["tau"] == 3.0 and res.current["c"] == pytest.approx(1.8)
    assert res.current["speedup"] == pytest.approx(3.0 / 1.8)
    row = next(r for r in res.by_nodes if r["family"] == "tlv")
    assert row["nodes"] == 6 and row["speedup"] == pytest.approx(3.0 / 1.8)
    assert ms.Measurement.from_json(json.loads(json.dumps(meas.to_json()))).tlv == tlv


def test_an_existing_round_folder_is_never_overwritten(run_cli, tiny_round):
    code, _, err = run_cli("round", TINY, "--out-dir", tiny_round / "r")
    assert code == 2 and "--resume" in err


def test_a_stopped_round_resumes_where_it_stopped(tmp_path):
    class Stop(Exception):
        pass

    def stop_at_approve(stage, msg):
        if stage == "approve":
            raise Stop

    cfg = RoundConfig(deployment=TINY, out_dir=str(tmp_path / "r"), budget_min=0.15, records_dir=str(tmp_path / "rec"),
                      candidates=["chain"], n_prompts=2, max_new_tokens=8)
    with pytest.raises(Stop):
        run_round(cfg, notify=stop_at_approve)
    state = json.loads((tmp_path / "r" / "round.json").read_text())
    assert state["stages"]["measure"]["status"] == "done" and state["stages"]["approve"]["status"] == "failed"
    measured = (tmp_path / "r" / "measure" / "measure.json").read_text()
    res = run_round(RoundConfig(out_dir=str(tmp_path / "r")), resume=True)
    assert res.state["stages"]["approve"]["status"] == "done" and [d.id for d in res.decisions] == ["chain"]
    assert (tmp_path / "r" / "measure" / "measure.json").read_text() == measured  # not measured again


def test_resume_adds_its_minutes_and_judges_what_was_skipped_for_time(tmp_path):
    """A round resumed with --budget M: spent and budget add up over the sessions (M more minutes),
    a candidate an earlier session skipped for want of time is judged now, and the deployment
    record's entry for the round is replaced, not added twice."""
    from specpilot.cli import main

    cfg = RoundConfig(deployment=TINY, out_dir=str(tmp_path / "r"), budget_min=1.0, records_dir=str(tmp_path / "rec"),
                      candidates=["chain"], n_prompts=2, max_new_tokens=8)
    run_round(cfg)
    r = tmp_path / "r"
    state = json.loads((r / "round.json").read_text())
    # as a session that ran out of time leaves it: the candidate skipped, 59 of 60 s spent
    state["spent_s"] = 59.0
    (r / "round.json").write_text(json.dumps(state))
    reason = "budget: 0 s left, not enough for 4 paired runs of 2 prompts x 8 tokens"
    (r / "approve" / "decisions.json").write_text(json.dumps({"schema": "specpilot.round-decisions/1", "decisions": [
        {"id": "chain", "memory": None, "system": "x", "base": "y", "verdict": "skipped", "reason": reason}]}))
    record = next((tmp_path / "rec").glob("*.yaml"))
    with pytest.raises(SystemExit) as e:
        main(["round", "--resume", str(r), "--budget", "1"])
    assert e.value.code == 0
    state = json.loads((r / "round.json").read_text())
    assert state["budget_s"] == pytest.approx(59.0 + 60.0) and state["spent_s"] > 59.0
    dec = json.loads((r / "approve" / "decisions.json").read_text())["decisions"]
    assert [d["id"] for d in dec] == ["chain"] and not dec[0]["reason"].startswith("budget:"), dec
    import yaml

    assert len(yaml.safe_load(record.read_text())["rounds"]) == 1
    # a resume without --budget keeps the budget; new settings are refused, not ignored
    with pytest.raises(SystemExit) as e:
        main(["round", "--resume", str(r)])
    assert e.value.code == 0 and json.loads((r / "round.json").read_text())["budget_s"] == pytest.approx(119.0)


@pytest.mark.parametrize("extra", [["--candidates", "tree"], ["--control"], ["--n-prompts", "3"], ["--fresh"],
                                   ["--seed", "3"], ["--out-dir", "elsewhere"]])
def test_resume_refuses_settings_of_a_new_round(run_cli, tiny_round, extra):
    code, _, err = run_cli("round", "--resume", tiny_round / "r", *extra)
    assert code == 2 and "as it was set up; leave out " + extra[0] in err, err


def test_a_budget_too_small_skips_cleanly(tmp_path):
    res = run_round(RoundConfig(deployment=TINY, out_dir=str(tmp_path / "r"), budget_min=0.01,
                                records_dir=str(tmp_path / "rec")))
    skipped = [d for d in res.decisions if d.verdict == "skipped"]
    lattice_skipped = any("lattice" in s for s in res.state["stages"]["measure"]["skipped"])
    assert skipped or lattice_skipped or res.state.get("stopped")
    assert all(d.reason.startswith("budget") for d in skipped)


def test_plan_and_model_arithmetic():
    s = pl.Shape(4, 48)
    assert s.run_s(10.0, 0.5) == pytest.approx(4 * (0.5 + 4.8))
    shape, pairs = pl.choose_shape("cpu", 600.0, [10.0, 10.0], 10.0, 0.2, 10.0, 5.0)
    total = shape.run_s(10, 0.2) + 2 * pl.candidate_cost(shape, pairs, 10, 10, 0.2, 10, 5)
    assert total <= 600 and pairs >= pl.PAIRS_MIN
    assert pl.pairs_for(pl.Shape(2, 16), 1.0, 1, 10, 10, 0.2, 10, 5) is None
    n = pl.pairs_for(pl.Shape(2, 16), 1000.0, 1, 10, 10, 0.2, 10, 5)
    assert n == pl.PAIRS_MAX and n % 2 == 0
    ms = {1: 10.0, 3: 14.0, 9: 20.0}
    assert step_time(2, ms) == pytest.approx(12.0) and step_time(17, ms) == pytest.approx(28.0)
    c, rows = expected_c("chain", 8, ms, 10.0, {"chain": {"8": {"1": 3, "9": 1}}})
    assert rows == pytest.approx(3.0) and c == pytest.approx((3 * 10 + 20) / 4 / 10)
    assert expected_c("chain", 2, ms, 10.0, {})[0] == pytest.approx(1.4)


# ------------------------------------------------------------------------------------ SGLang form
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_hf(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(folder))
    return folder


def _sglang_deployment(tmp_path) -> tuple[dict, int, int]:
    """A deployment of the tiny model behind two fake SGLang servers (``specpilot serve``): the
    file's fields, the stock port and the candidate's."""
    from specpilot.auditors.replay import synthetic_rows

    lat = tmp_path / "lattice.jsonl"
    lat.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(requests=3, steps=6, m=4, k=4,
                                                                        transitions=True)))
    (tmp_path / "rows.json").write_text(json.dumps({"schema": "specpilot.rows/1", "ar_ms": 10.0, "context": 84,
                                                    "points": [{"rows": r, "step_ms": 10.0 + r * 0.1}
                                                               for r in (1, 2, 3, 5, 9, 17, 33)]}))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}",
                                                                "prompt_ids": [40 + i, 41, 42, 43, 44] * 3}) + "\n"
                                                    for i in range(3)))
    stock_port, cand_port = _free_port(), _free_port()
    serve = f"{sys.executable} -m specpilot serve --engine {{engine}} --port {{port}}"
    model = _tiny_hf(tmp_path / "scorer")   # the servers' model is the scorer: stock is its greedy output
    dep = {"schema": "specpilot.deployment/1", "name": "tiny behind fake SGLang servers", "dtype": "bf16",
           "drafter": "eagle", "batch": 1, "rows": 9, "policy": "chain:4", "sglang": {"version": "0.5.23"},
           "prompts": "prompts.jsonl", "max_new_tokens": 8, "scorer": str(model),
           "measurements": {"rows_probe": "rows.json", "lattices": ["lattice.jsonl"]},
           "servers": {"stock": {"url": f"http://127.0.0.1:{stock_port}", "ready_timeout": 120,
                                 "start": serve.replace("{engine}", f"engine:model={model},mode=ar,threads=1")
                                 .replace("{port}", str(stock_port))},
                       "candidate": {"port": cand_port, "ready_timeout": 120, "expected_start_s": 5},
                       "candidates": {"tree": {"start": serve.replace(
                           "{engine}", f"engine:model={model},mode=tree,nodes=8,threads=1")}}}}
    return dep, stock_port, cand_port


def test_sglang_deployment_runs_candidates_as_servers(tmp_path, run_cli):
    dep, stock_port, cand_port = _sglang_deployment(tmp_path)
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(dep))
    code, out, err = run_cli("round", tmp_path / "deployment.yaml", "--budget", "0.3", "--out-dir", tmp_path / "r",
                             "--records", tmp_path / "rec", "--candidates", "tree,tlv,batching,w12,lattice-trace",
                             "--format", "json")
    assert code == 0, err
    res = load_round(tmp_path / "r")
    assert res.measurement.ar_ms == 10.0 and res.measurement.replay["steps"] == 18
    reasons = {x["id"]: x["reason"] for x in res.proposal.not_proposed}
    assert "needs a plain DFlash drafter" in reasons["tlv"] and "experimental" in reasons["tlv"]
    assert "needs a DSpark drafter" in reasons["batching"] and "for batched serving" in reasons["batching"]
    assert "experimental" in reasons["w12"] and "observer" in reasons["lattice-trace"]
    (tree,) = res.proposal.candidates
    assert tree.change["node_budget"] >= 2 and "node_budget" in tree.retuned
    (dec,) = res.decisions
    assert dec.id == "tree" and dec.timing["samples"] and dec.audit["verdict"] == "pass", dec.reason
    assert (tmp_path / "r" / "approve" / "tree.server.log").is_file()
    for port in (stock_port, cand_port):  # every server the round started is stopped
        assert not _started_with_port(port)
    # no calibration run: the report said "0 tokens/s in a calibration run (None tokens)"
    report = (tmp_path / "r" / "report.md").read_text()
    assert "no calibration run (its decode speed is measured by the stock server" in report
    assert "None tokens" not in report
    # the probe's own context (the deployment's 1024 was shown), and what is known of a lattice file
    # ("Lattice recorded on None prompts x None new tokens")
    assert res.measurement.context == 84 and "T_step(N) at context 84 (rows probe rows.json)" in report, report
    assert "Lattice from lattice.jsonl: 18 verify steps" in report and "None" not in report, report


@pytest.mark.parametrize("context, words", [
    (None, None),
    ("84", "rows.json: rows probe 'context' must be a whole number >= 1, got '84'"),
    (0, "rows.json: rows probe 'context' must be a whole number >= 1, got 0"),
])
def test_an_sglang_rows_probe_is_placed_at_its_own_context(tmp_path, context, words):
    """A deployment's rows probe gives T_step(N) at the context it was probed at, not the deployment's;
    one that does not say is not given the deployment's, and the report says so."""
    from specpilot.auditors.round.deployment_file import read_deployment
    from specpilot.auditors.round.measure import Measurement
    from specpilot.auditors.round.sglang import measure_sglang
    from specpilot.errors import InputError

    rows = {"schema": "specpilot.rows/1", "ar_ms": 10.0, "points": [{"rows": r, "step_ms": 10.0 + r} for r in (1, 2)]}
    if context is not None:
        rows["context"] = context
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "p0",
                                                        "prompt_ids": [1, 2]}) + "\n")
    (tmp_path / "d.yaml").write_text(yaml.safe_dump({
        "schema": "specpilot.deployment/1", "drafter": "eagle", "context": 1024, "prompts": "prompts.jsonl",
        "measurements": {"rows_probe": "rows.json"}, "servers": {"stock": {"url": "http://127.0.0.1:1"}}}))
    (tmp_path / "out").mkdir()
    dep = read_deployment(tmp_path / "d.yaml")
    if words:
        with pytest.raises(InputError, match=re.escape(words)):
            measure_sglang(dep, tmp_path / "out", lambda *a: None)
        return
    meas = measure_sglang(dep, tmp_path / "out", lambda *a: None)
    assert meas.context is None and Measurement.from_json(meas.to_json()).context is None


def test_a_candidate_whose_server_cannot_be_its_own_is_refused_and_the_round_reports(tmp_path, run_cli):
    """The candidate's port is stock's: what answers there is stock, which must not be timed as
    the candidate. It is refused with the reason, the round ends (exit 0) and renders."""
    dep, stock_port, _ = _sglang_deployment(tmp_path)
    dep["servers"]["candidate"]["port"] = stock_port
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(dep))
    code, out, err = run_cli("round", tmp_path / "deployment.yaml", "--budget", "0.3", "--out-dir", tmp_path / "r",
                             "--records", tmp_path / "rec", "--candidates", "tree")
    assert code == 0, err
    (dec,) = load_round(tmp_path / "r").decisions
    assert dec.verdict == "refused" and "already answers before its server is started" in dec.reason, dec.reason
    assert not dec.timing and run_cli("report", tmp_path / "r")[0] == 0
    assert not _started_with_port(stock_port)
    # it writes no baseline: check says why, not 'no such file' as of a damaged round
    code, _, err = run_cli("check", "--baseline", tmp_path / "r", "--no-timing")
    assert code == 2 and "a round of an SGLang deployment writes no baseline.json" in err, err


def test_a_stopped_server_is_gone_when_stop_returns():
    """The round starts servers through a shell; a server that drains after SIGTERM outlives the
    shell, and stop() waits for it (the whole process group), not only for the shell."""
    from specpilot.auditors.round.servers import Server, group_alive

    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0))); "
            "print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen(f"{sys.executable} -c \"{code}\"; true", shell=True, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    assert group_alive(proc.pid)
    Server("http://127.0.0.1:1", proc, None).stop()
    assert not group_alive(proc.pid)


def _started_with_port(port: int) -> list[str]:
    """Live processes started with ``--port PORT`` (the round's servers; other tests' servers take
    ``--port 0``, so a port the OS hands out again to one of them does not count)."""
    found = []
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = f.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a == b"--port" and b == str(port).encode() for a, b in zip(args, args[1:])):
            found.append(f.parent.name)
    return found


def test_sglang_deployment_file_errors(tmp_path, run_cli):
    (tmp_path / "d.yaml").write_text(yaml.safe_dump({"schema": "specpilot.deployment/1", "drafter": "medusa"}))
    code, _, err = run_cli("round", tmp_path / "d.yaml", "--out-dir", tmp_path / "r")
    assert code == 2 and "drafter must be one of" in err
    (tmp_path / "e.yaml").write_text(yaml.safe_dump({"schema": "specpilot.other/1"}))
    code, _, err = run_cli("round", tmp_path / "e.yaml", "--out-dir", tmp_path / "r2")
    assert code == 2 and "unknown schema" in err


_GOOD = {"schema": "specpilot.deployment/1", "drafter": "eagle", "prompts": "p.jsonl",
         "servers": {"stock": {"url": "http://127.0.0.1:1", "start": "true"}}}


@pytest.mark.parametrize("change, words", [
    ({"servers": "abc"}, "servers must be a map"),
    ({"servers": {"stock": "http://127.0.0.1:1"}}, "servers.stock must be a map"),
    ({"servers": {"stock": {"url": "not a url"}}}, "servers.stock.url must be an http:// URL"),
    ({"servers": {"stock": {"url": "http://127.0.0.1:1"}, "candidates": ["tree"]}}, "servers.candidates must be a map"),
    ({"servers": {"stock": {"url": "http://127.0.0.1:1"}, "candidate": {"port": "abc"}}}, "servers.candidate.port"),
    ({"servers": {"stock": {"url": "http://127.0.0.1:1", "ready_timeout": "soon"}}}, "servers.stock.ready_timeout"),
    ({"measurements": "rows.json"}, "measurements must be a map"),
    ({"measurements": {"ar_ms": "x", "step_ms": 3}}, "measurements.ar_ms must be a number of milliseconds in (0, "),
    ({"measurements": {"ar_ms": 1e308, "step_ms": 3}}, "measurements.ar_ms must be a number of milliseconds in (0, "),
    # a typo'd field in a map was dropped silently (the top level's were refused)
    ({"measurements": {"ar_ms": 5, "step_ms": 6, "rows_prob": "rows.json"}},
     "unknown field measurements.'rows_prob' (did you mean 'rows_probe'?); the fields of measurements: "),
    ({"sglang": {"version": "0.5.23", "pyhton": "/opt/x"}}, "unknown field sglang.'pyhton' (did you mean 'python'?)"),
    ({"servers": {"stock": {"url": "http://127.0.0.1:1", "typo": 1}}}, "unknown field servers.stock.'typo'"),
    ({"servers": {"stock": {"url": "http://127.0.0.1:1"}, "candidat": {}}}, "unknown field servers.'candidat'"),
    # a misspelt candidate id ran the round and recorded its candidate as refused ('no start command')
    ({"servers": {"stock": {"url": "http://127.0.0.1:1"}, "candidates": {"tre": {"start": "true"}}}},
     "d.yaml: servers.candidates: unknown candidate 'tre' (did you mean 'tree'?); the candidates: "),
    ({"measurements": {"outputs": {"stokc": "s.jsonl"}}}, "unknown field measurements.outputs.'stokc'"),
    ({"sglang": {"version": float("nan")}}, "sglang.version must be a version"),
    ({"sglang": {"version": True}}, "sglang.version must be a version"),
    ({"sglang": {"python": ""}}, "sglang.python must be a path"),
    ({"servers": {"stock": {"url": "http://127.0.0.1:1", "ready_timeout": 1e308}}},
     "servers.stock.ready_timeout must be a number of seconds in (0, 604800]"),
    ({"batch": 10 ** 30}, "batch must be a whole number in [1, 65536]"),
    ({"context": 10 ** 30}, "context must be a whole number in [1, 16777216]"),
    ({"measurements": {"rows_probe": "missing.json"}}, "measurements: missing.json is not a file"),
    ({"sglang": "0.5.23"}, "sglang must be a map"),
    ({"drafter": ["eagle"]}, "drafter must be one of"),
    ({"batch": 0}, "batch must be a whole number in [1, "), ({"rows": -3}, "rows must be a whole number in [1, "),
    ({"max_new_tokens": 0}, "max_new_tokens must be a whole number in [1, "),
    ({"experimental": "no"}, "experimental must be true or false"),
    ({"scorer": "tiny"}, "scorer: tiny: not a model folder, a .gguf file, or 'smollm2'"),
    ({"prompts": None}, "give prompts:"), ({"prompts": "none.jsonl"}, "prompts: none.jsonl is not a file"),
    ({"servers": {}}, "give servers.stock.url"),
    ({"max_new_token": 512}, "unknown field 'max_new_token' (did you mean 'max_new_tokens'?)"),
    ({"experimantal": True}, "unknown field 'experimantal' (did you mean 'experimental'?)"),
    ({"policy": "zzz"}, "d.yaml: policy: unknown policy 'zzz'"),
    ({"policy": "best-first"}, "d.yaml: policy: policy 'best-first' needs a parameter"),
    ({"dtype": "int3"}, "d.yaml: dtype must be the weights' dtype, one of bf16, fp16"),
    ({"gpu": "h999"}, "d.yaml: gpu: unknown GPU 'h999'; known: "),
    ({"model": "nosuch"}, "d.yaml: model: unknown model 'nosuch'"),
    ({"prompts": "text.jsonl"}, "d.yaml: prompts: text.jsonl holds text prompts, which need a tokenizer: give scorer:"),
])
def test_a_deployment_file_is_checked_when_read(tmp_path, run_cli, change, words):
    """Wrong types and impossible values are named at once (exit 2), the dry run included: not a
    crash (exit 4), nor a failure after stages have run."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "prompt_ids": [1]}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a", "text": "Why?"}) + "\n")
    doc = {k: v for k, v in {**_GOOD, **change}.items() if v is not None}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(doc))
    for extra in (["--dry-run"], ["--out-dir", tmp_path / "r"]):
        code, _, err = run_cli("round", tmp_path / "d.yaml", *extra)
        assert code == 2 and words in err and "internal error" not in err, (extra, err)
    assert not (tmp_path / "r").exists()


def test_a_key_given_twice_in_a_deployment_file_is_refused(tmp_path, run_cli):
    """The second value won silently (drafter: eagle, then drafter: dflash: a dflash round)."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"schema": "specpilot.prompts/1", "id": "a",
                                                  "prompt_ids": [1]}) + "\n")
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(_GOOD) + "drafter: dflash\n")
    code, _, err = run_cli("round", tmp_path / "d.yaml", "--dry-run")
    assert code == 2 and "key 'drafter' given twice (lines " in err, err


def test_a_key_a_yaml_merge_brought_in_may_be_given_again():
    """YAML 1.1 overrides a merged key with an explicit one (tlv: <<: *t, start: ...): refused as
    'given twice'."""
    from specpilot.fileio import load_yaml

    doc = load_yaml("tree: &t {start: echo a, ready_timeout: 100}\ntlv:\n  <<: *t\n  start: echo b\n")
    assert doc["tlv"] == {"start": "echo b", "ready_timeout": 100}
    with pytest.raises(yaml.YAMLError, match="key 'start' given twice"):
        load_yaml("tlv:\n  <<: {a: 1}\n  start: x\n  start: y\n")


# ------------------------------------------------------------------------------------ real SmolLM2
@pytest.mark.slow
@pytest.mark.timeout(20 * 60)
def test_smollm2_round_on_the_cpu(tmp_path, run_cli):
    repo = Path(__file__).resolve().parents[1]
    code, out, err = run_cli("round", "engine:model=smollm2,mode=ar,threads=1", "--prompts",
                             repo / "examples" / "prompts_grounded.jsonl", "--budget", "10", "--out-dir", tmp_path / "r",
                             "--records", tmp_path / "rec", "--format", "json")
    assert code == 0, err
    res = load_round(tmp_path / "r")
    assert res.state["spent_s"] < 10 * 60 + 120
    judged = [d for d in res.decisions if d.verdict != "skipped"]
    assert {d.id for d in judged} >= {"chain", "tree"} or res.state["stages"]["approve"]["skipped"]
    for d in judged:
        assert d.audit["verdict"] == "pass", d.reason   # the engine's chain and trees are lossless
    assert (tmp_path / "r" / "report.html").is_file()


def test_the_pipelined_ar_loops_steps_are_its_graph_launches():
    """On CUDA the AR loop replays one CUDA graph per token without a call per step, so the
    capture annotates no step: the round's profile takes the graph launches as the steps (it
    looked for decode_step_ annotations, found none and went on without a profile)."""
    from specpilot.auditors.round.measure import profile_trace
    from specpilot.errors import InputError
    from specpilot.models import load_model_spec

    trace = Path(__file__).parent / "fixtures" / "kineto_specpilot_h100_ar_pipelined.json.gz"
    spec = load_model_spec("smollm2-135m")
    prof = profile_trace(trace, spec, "h100", 1, 600, False, annotated=False)
    assert prof["steps"] == 29 and prof["step_wall_ms"] > prof["kernel_busy_ms"] > 0
    assert prof["total_floor_ms"] > 0
    with pytest.raises(InputError, match="decode_step_"):
        profile_trace(trace, spec, "h100", 1, 600, False)


@pytest.mark.gpu
@pytest.mark.timeout(10 * 60)
def test_round_on_a_gpu_profiles_the_steps_and_judges_w12(tmp_path, run_cli):
    """SmolLM2 shapes with random weights on CUDA: the profile gives the kernel and outside factors,
    W12 (with the certified head) and the no-op control are judged with paired runs and audits."""
    code, out, err = run_cli("round", "engine:model=smollm2,random=1,device=cuda,mode=ar,ctx=1024", "--candidates", "w12",
                             "--control", "--budget", "2", "--out-dir", tmp_path / "r", "--records", tmp_path / "rec")
    assert code == 0, err
    res = load_round(tmp_path / "r")
    assert res.measurement.profile and res.model.factors["kernel"] and res.model.factors["outside"]
    by_id = {d.id: d for d in res.decisions}
    assert by_id["no-op"].verdict != "approved"
    assert by_id["w12"].timing is not None and by_id["w12"].audit["verdict"] == "pass"


def test_the_model_takes_the_profile_of_the_decode_steps():
    """With a profile (a GPU round), the kernel and outside factors join the tree factor."""
    from specpilot.auditors.round.measure import Measurement
    from specpilot.auditors.round.modeling import build_model

    replay = {"policies": [{"policy": "chain", "tau": 1.5}, {"policy": "oracle:8", "tau": 2.0}],
              "curves": {"chain": {"4": 1.4}, "best-first": {"4": 1.6}}}
    meas = Measurement(system="engine:model=x,mode=ar", tokens_per_s=200.0, calibration={}, context=96, ar_ms=4.0,
                       step_ms={1: 4.0, 5: 4.4}, current_rows=1, current_policy="ar", replay=replay,
                       profile={"kernel_busy_ms": 4.5, "step_wall_ms": 5.0, "total_floor_ms": 3.0})
    m = build_model(meas)
    assert m.factors["tree"] == pytest.approx(2.0)
    assert m.factors["kernel"] == pytest.approx(1.5) and m.factors["outside"] == pytest.approx(5.0 / 4.5)
    assert m.largest == "tree" and m.cost_model["ceiling"] == pytest.approx(2.0 * 1.5 * 5.0 / 4.5)
    assert {(r["family"], r["nodes"]) for r in m.by_nodes} == {("chain", 4), ("best-first", 4)}
    assert next(r for r in m.by_nodes if r["family"] == "best-first")["speedup"] == pytest.approx(1.6 / 1.1)


def test_a_model_without_a_replayed_tau_or_rows_probe_reads_back():
    """A round whose lattice recording or rows probe was skipped for time writes the current
    system's tau, c and speedup as null; its model file reads back (report and resume took it for
    damaged)."""
    from specpilot.auditors.round.measure import Measurement
    from specpilot.auditors.round.modeling import ModelResult, build_model

    meas = Measurement(system="engine:model=x,mode=chain", tokens_per_s=100.0, calibration={}, context=96,
                       current_rows=5, current_policy="chain:4")
    doc = json.loads(json.dumps(build_model(meas).to_json()))
    assert doc["current"]["tau"] is None and doc["current"]["speedup"] is None
    assert ModelResult.from_json(doc).current == doc["current"]


def test_the_model_notes_a_profile_below_its_floor():
    """A profile whose GPU time is below the byte floor does not lower the round's ceiling, and the
    cost model's warning about it reaches the round's notes."""
    from specpilot.auditors.round.measure import Measurement
    from specpilot.auditors.round.modeling import build_model

    replay = {"policies": [{"policy": "chain", "tau": 1.5}, {"policy": "oracle:8", "tau": 2.0}], "curves": {}}
    meas = Measurement(system="engine:model=x,mode=ar", tokens_per_s=200.0, calibration={}, context=96, ar_ms=4.0,
                       step_ms={1: 4.0, 5: 4.4}, current_rows=1, current_policy="ar", replay=replay,
                       profile={"kernel_busy_ms": 2.0, "step_wall_ms": 5.0, "total_floor_ms": 3.0})
    m = build_model(meas)
    assert m.cost_model["ceiling"] >= m.current["speedup"]
    assert any("floor" in n for n in m.notes), m.notes


def test_a_tlv_current_system_beyond_the_trees_is_the_best_tau_it_names():
    """A TLV current system's tau per exact pass above every replayed tree's: tau_best is the
    current system's, and its source says so; below the trees' best, the trees' best is named."""
    from specpilot.auditors.round.measure import Measurement
    from specpilot.auditors.round.modeling import build_model

    replay = {"policies": [{"policy": "chain", "tau": 1.2}, {"policy": "oracle:8", "tau": 1.37}], "curves": {}}
    tlv = {"nodes": 16, "tau": 2.38, "time_ms": {"draft1": 0.2, "qpass": 3.0, "draft2": 0.2, "exact": 5.0,
                                                  "append": 0.1}}
    meas = Measurement(system="engine:model=x,mode=tlv,nodes=16", tokens_per_s=100.0, calibration={}, context=96,
                       ar_ms=4.0, step_ms={1: 4.0, 17: 5.0}, current_rows=17, current_policy="tlv:16",
                       replay=replay, tlv=tlv)
    m = build_model(meas)
    assert m.cost_model["inputs"]["tau_best"] == pytest.approx(2.38)
    assert m.sources["tau_best"] == "replay measure/tlv.lattice.jsonl (tlv:16, the current system)"
    meas.tlv = dict(tlv, tau=1.3)   # below oracle:8: the trees' best, named
    m = build_model(meas)
    assert m.cost_model["inputs"]["tau_best"] == pytest.approx(1.37)
    assert m.sources["tau_best"] == "replay measure/replay.json (oracle:8)"


def test_a_batched_engine_deployment_is_its_own_and_records_tlv_per_batched_step(tmp_path):
    """The deployment's facts carry the engine's batch (its record file is not the one-request
    deployment's), and the TLV recording of a batched engine takes the batch decoder's totals (its
    requests' own rows have no time split)."""
    from specpilot.auditors.outputs import Prompt
    from specpilot.auditors.round.deployment import parse_deployment
    from specpilot.auditors.round.measure import record_tlv
    from specpilot.engine.api import load_engine

    one, two = (parse_deployment(f"engine:model=tiny,mode=tree,threads=1{b}").facts for b in ("", ",batch=2"))
    assert (one.batch, two.batch) == (1, 2) and one.identity().endswith("-b1") and two.identity().endswith("-b2")
    eng = load_engine("engine:model=tiny,mode=tlv,nodes=6,depth=3,topk=2,threads=1,batch=2")
    got = record_tlv(eng, [Prompt(i, [1, 2 + i, 3]) for i in range(3)], 6, tmp_path / "tlv.jsonl")
    assert got["cycles"] > 0 and got["cycle_ms"] > 0 and set(got["time_ms"]) == {"draft1", "qpass", "draft2", "exact",
                                                                                  "append"}


def test_report_commands_wrap_between_words_only():
    from specpilot.reports.round_report import CSS, _inline

    out = _inline("Made by `specpilot round --records r.jsonl` <now>")
    assert "<code><span>specpilot</span> <span>round</span> <span>--records</span> <span>r.jsonl</span></code>" in out
    assert "&lt;now&gt;" in out and "code span{white-space:nowrap}" in CSS


def test_a_dry_run_over_its_budget_says_so(run_cli, tmp_path):
    """It walks stage 4 as the round does: a candidate for which not even the fewest paired runs fit
    the time left is skipped, named with the reason, and its time is not in the estimate (the
    estimate counted every candidate, and no candidate was said to be skipped)."""
    records = ("--records", tmp_path / "records")
    code, out, err = run_cli("round", TINY, "--dry-run", "--budget", "0.05", *records)
    assert code == 0, err
    assert "warning: the smallest plan takes" in out and "more than the 0.1 min budget" in out
    for c in ("chain", "tree", "tlv"):
        assert f"skipped for the budget: {c}: about 0 s left, not enough for 4 paired runs" in out, out
    assert "no candidate: the reference outputs only; skipped for the budget: chain, tree, tlv" in out, out
    code, out, _ = run_cli("round", TINY, "--dry-run", "--budget", "0.05", *records, "--format", "json")
    plan = json.loads(out)
    assert [x["id"] for x in plan["over_budget"]] == ["chain", "tree", "tlv"]
    assert plan["every_candidate_s"] > plan["budget_s"]
    code, out, _ = run_cli("round", TINY, "--dry-run", "--budget", "60", *records, "--format", "json")
    plan = json.loads(out)
    assert code == 0 and plan["over_budget"] == [] and "3 candidate(s) (chain 16, tree 16, tlv 16 paired runs)" in \
        plan["stages"][3]["work"], plan["stages"][3]
    code, out, _ = run_cli("round", TINY, "--dry-run", "--budget", "60", *records)
    assert code == 0 and "smallest plan" not in out and "skipped for the budget" not in out


def test_report_names_no_factor_where_none_offers_a_gain(tiny_round, run_cli, tmp_path):
    """Every factor at 1: the report says what specpilot ceiling says (no known factor offers a
    gain), not that one of them is the largest."""
    shutil.copytree(tiny_round / "r", tmp_path / "r")
    path = tmp_path / "r" / "model" / "model.json"
    doc = json.loads(path.read_text())
    doc["factors"] = {"tree": 1.0, "kernel": None, "outside": None}
    doc["largest"] = doc["cost_model"]["largest_factor"] = "tree"
    doc["cost_model"]["factors"] = dict(doc["factors"])
    doc["cost_model"]["ceiling"] = doc["cost_model"]["speedup"]
    path.write_text(json.dumps(doc))
    code, _, err = run_cli("report", tmp_path / "r")
    assert code == 0, err
    md = (tmp_path / "r" / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("Current system: tau"))
    assert line.endswith("No known factor offers a gain (each is 1 or below).") and "Largest" not in line, line
    # a factor above 1 is named with the ceiling's advice
    doc["factors"]["tree"] = doc["cost_model"]["factors"]["tree"] = 1.5
    path.write_text(json.dumps(doc))
    assert run_cli("report", tmp_path / "r")[0] == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Largest factor: **tree** (1.5x): build a better draft tree (replay policies: specpilot replay)." in md


def test_tau_c_plot_shows_a_chain_that_equals_the_tree():
    """Chain and best-first rows with the same values: the chain's series still shows (its colour
    covers a good part of the plot area, not only the legend)."""
    import io

    import numpy as np
    from PIL import Image

    from specpilot.reports import round_plots

    rows = [{"family": fam, "nodes": n, "rows": n + 1, "tau": 1.0 + 0.1 * i, "c": 1.0 + 0.02 * i,
             "speedup": (1.0 + 0.1 * i) / (1.0 + 0.02 * i)}
            for fam in ("chain", "best-first") for i, n in enumerate((1, 2, 4, 8))]
    img = np.asarray(Image.open(io.BytesIO(round_plots.tau_c({"by_nodes": rows}, None))).convert("RGB")).astype(int)
    plot = img[: int(img.shape[0] * 0.7)]   # above the legend
    chain = (np.abs(plot - np.array([0xDD, 0x84, 0x52])).sum(axis=2) < 90)
    assert chain.sum() > 1500, chain.sum()


def test_committed_gpu_round_profile_is_what_its_trace_gives_now():
    """The H200 example's measure stage files hold the profile the current profile library reads
    from the committed trace (classes counted from where the previous kernel ended under PDL), and
    its report says how they were counted."""
    from specpilot.auditors.round.measure import profile_trace
    from specpilot.engine.api import resolve_model

    ex = Path(__file__).resolve().parents[1] / "examples" / "rounds" / "llama8b-h200"
    got = profile_trace(ex / "measure" / "trace.json.gz", resolve_model("llama-3.1-8b", True)[0], "h200", 1, 96,
                        False)
    for name in ("profile.json", "measure.json"):
        doc = json.loads((ex / "measure" / name).read_text())
        want = doc if name == "profile.json" else doc["profile"]
        assert {k: v for k, v in got.items() if k != "trace"} == {k: v for k, v in want.items() if k != "trace"}
    busy = sum(c["ms"] for c in got["classes"].values())
    assert abs(busy - got["kernel_busy_ms"]) < 0.01   # the classes add up to the GPU's busy time per step
    assert "Note: kernels overlap the one before them" in (ex / "report.md").read_text()


def test_the_dry_run_of_an_sglang_deployment_reads_its_record(tmp_path, run_cli):
    """It printed 'starts from: stock' whatever the record said (a damaged record too, which the
    round then refused), a decode speed of 0 tokens/s and an approve stage of the budget less 10 s."""
    from specpilot.auditors.round import remember as rm
    from specpilot.auditors.round.deployment import parse_deployment

    dep, _, _ = _sglang_deployment(tmp_path)
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(dep))
    rec = rm.record_path(tmp_path / "rec", parse_deployment(str(path)).facts.identity())
    rec.parent.mkdir()
    rec.write_text(yaml.safe_dump({"schema": rm.SCHEMA, "current": "stock + tree", "bundles": ["tree"],
                                   "rounds": []}))
    code, out, err = run_cli("round", path, "--dry-run", "--records", tmp_path / "rec")
    assert code == 0, err
    assert f"starts from: stock + tree (record {rec})" in out, out
    assert "decode speed: measured by the stock server at the start of stage 4" in out and "0 tokens/s" not in out
    assert "estimated time: the 20.0 min budget (the approve stage takes what the others leave)" in out, out
    rec.write_text("::: [")
    code, _, err = run_cli("round", path, "--dry-run", "--records", tmp_path / "rec")
    assert code == 2 and "not valid YAML" in err, err
