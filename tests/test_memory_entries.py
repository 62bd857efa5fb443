"""The mechanism memory: entries, the survival rule (memory verify), list/show, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from specpilot.bundles import memory as mem

MEMORY = mem.MEMORY_DIR


def test_packaged_memory_reproduces_its_recorded_systems(run_cli):
    code, out, err = run_cli("memory", "verify", "--format", "json")
    assert code == 0, out + err
    data = json.loads(out)
    assert data["schema"] == "specpilot.memory-verify/1" and data["ok"]
    ids = {r["id"] for r in data["entries"]}
    assert ids == {"lattice-trace", "w12", "tree", "batching", "tlv"}
    tlv = next(r for r in data["entries"] if r["id"] == "tlv")
    assert tlv["closure"] == ["w12", "tlv"]


def test_every_entry_is_complete_and_honest():
    entries = mem.load_memory()
    for e in entries.values():
        assert e.summary and e.contracts and e.limits and e.unverified, e.id
        assert any("NOT run on a GPU" in u for u in e.unverified), e.id
        for ev in e.evidence:
            assert ev.get("kind") in ("cpu-test", "paper", "gpu"), e.id
            if ev["kind"] == "paper":
                assert "not measured here" in ev["deployment"], e.id
            if ev["kind"] == "gpu":  # measured figures come from a results file, never pasted
                assert ev.get("source") and ev.get("values") and ev.get("text"), e.id
        if e.status != "library":
            assert e.sglang_checked == ["0.5.23"] and (e.hooks or e.setup), e.id
        for v in e.variants:
            assert v.problem(v.default) is None, (e.id, v.name)


def _copy(tmp_path) -> Path:
    d = tmp_path / "mem"
    shutil.copytree(MEMORY, d)
    return d


def _edit(path: Path, **changes):
    raw = yaml.safe_load(path.read_text())
    raw.update(changes)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_drift_is_detected_and_record_repairs_it(run_cli, tmp_path):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    raw["system"]["fingerprints"]["specpilot.bundles.tree"] = "sha256:" + "0" * 64
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, _ = run_cli("memory", "verify", "--memory-dir", d)
    assert code == 1 and "NOT REPRODUCED" in out and "specpilot.bundles.tree changed since it was verified" in out
    assert out.count("NOT REPRODUCED") == 1  # only tree's own record was altered
    code, out, _ = run_cli("memory", "verify", "--memory-dir", d, "--record", "tree")
    assert code == 0 and "reproduced" in out
    assert run_cli("memory", "verify", "--memory-dir", d, "tree")[0] == 0


def test_record_refuses_a_new_text_the_memory_folder_would_refuse(run_cli, tmp_path, monkeypatch):
    """--record checks each entry's new text as load_memory checks a file: a text whose id does not
    match its file name (or whose off_with names no entry) is refused, exit 2, one line, and every
    file is left as it was."""
    from conftest import refused

    d = _copy(tmp_path)
    real = mem.record_system
    snapshot = {p.name: p.read_text() for p in d.glob("*.yaml")}
    for old, new, want in (("\nid: tree\n", "\nid: tree2\n", "id 'tree2' does not match the file name"),
                           ("\noff_with:\n", "\noff_with:\n  - bundle: no-such-entry\n    why: x\n",
                            "off_with names 'no-such-entry', not a memory entry")):
        def edited(e, entries, old=old, new=new):
            text = real(e, entries)
            assert old in text
            return text.replace(old, new, 1)

        monkeypatch.setattr(mem, "record_system", edited)
        code, out, err = run_cli("memory", "verify", "--memory-dir", d, "--record", "tree")
        assert out == ""
        refused(code, err, str(d / "tree.yaml"), want)
        assert {p.name: p.read_text() for p in d.glob("*.yaml")} == snapshot


def test_recorded_hook_set_must_match(run_cli, tmp_path):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "lattice-trace.yaml").read_text())
    raw["code"]["hooks"] = raw["code"]["hooks"][:2]  # a hook removed from the code, not from the record
    (d / "lattice-trace.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, _ = run_cli("memory", "verify", "--memory-dir", d, "lattice-trace")
    assert code == 1 and "recorded hooks missing" in out


def test_a_handler_its_module_does_not_define_is_drift_even_when_recorded(run_cli, tmp_path):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    old = raw["code"]["hooks"][0]["handler"]
    new = old.split(":")[0] + ":no_such_handler"
    raw["code"]["hooks"][0]["handler"] = new
    raw["system"]["hooks"] = [h.replace(old, new) for h in raw["system"]["hooks"]]   # the record agrees
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, _ = run_cli("memory", "verify", "--memory-dir", d, "tree")
    assert code == 1 and f"handler {new}: {old.split(':')[0]} defines no no_such_handler" in " ".join(out.split()), out


def test_record_writes_nothing_when_an_entry_would_not_verify(run_cli, tmp_path):
    """--record records only entries that verify as they would be recorded: a handler its module
    does not define stays a failure (exit 1) and every file is left as it was."""
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    old = raw["code"]["hooks"][0]["handler"]
    raw["code"]["hooks"][0]["handler"] = old.split(":")[0] + ":nope_func"
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    snapshot = {p.name: p.read_text() for p in d.glob("*.yaml")}
    for args in ((), ("tree",)):
        code, out, err = run_cli("memory", "verify", *args, "--memory-dir", d, "--record", "--format", "json")
        doc = json.loads(out)
        assert code == 1 and doc["ok"] is False and doc["recorded"] is False, (out, err)
        assert any("defines no nope_func" in p for e in doc["entries"] for p in e["problems"]), out
        assert {p.name: p.read_text() for p in d.glob("*.yaml")} == snapshot
    code, out, _ = run_cli("memory", "verify", "--memory-dir", d, "--record")
    assert code == 1 and "nothing recorded: an entry fails verification" in out, out
    code, out, _ = run_cli("memory", "verify", "--help")
    assert "only when every entry verifies as it would be recorded" in " ".join(out.split())


def test_cycle_and_missing_requirement_are_errors(run_cli, tmp_path):
    d = _copy(tmp_path)
    _edit(d / "w12.yaml", requires=["tlv"])  # tlv requires w12
    code, _, err = run_cli("memory", "verify", "--memory-dir", d)
    assert code == 2 and "requirement cycle" in err and "tlv" in err and len(err.strip().splitlines()) == 1
    d2 = _copy(tmp_path / "b")
    _edit(d2 / "tree.yaml", requires=["gdn-wy"])
    code, _, err = run_cli("memory", "verify", "--memory-dir", d2)
    assert code == 2 and "unknown mechanism 'gdn-wy' (required by tree in " in err


@pytest.mark.parametrize("requires, words", [(["nonexist"], "unknown mechanism 'nonexist' (required by tree in "),
                                             (["tree"], "requirement cycle in memory: tree -> tree")])
def test_every_verb_that_reads_the_memory_refuses_what_verify_refuses(run_cli, tmp_path, requires, words):
    """A requirement that names no entry, or a cycle, is refused by list, show and the round's dry
    run as by verify (exit 2, one line), not listed as if the memory held."""
    from conftest import refused

    d = _copy(tmp_path)
    _edit(d / "tree.yaml", requires=requires)
    for args in (("memory", "list"), ("memory", "show", "w12"), ("memory", "verify"),
                 ("round", "engine:model=tiny,mode=ar", "--dry-run")):
        code, out, err = run_cli(*args, "--memory-dir", d)
        assert out == "", (args, out)
        refused(code, err, words)


def test_verify_refuses_an_entry_named_twice(run_cli, tmp_path):
    from conftest import refused

    d = _copy(tmp_path)
    snapshot = {p.name: p.read_text() for p in d.glob("*.yaml")}
    for extra in ((), ("--record",)):
        code, out, err = run_cli("memory", "verify", "tree", "w12", "tree", "--memory-dir", d, *extra)
        assert out == ""
        refused(code, err, "'tree' is named twice in 'tree w12 tree'")
    assert {p.name: p.read_text() for p in d.glob("*.yaml")} == snapshot


def test_two_replacements_of_one_target_conflict(tmp_path):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    raw["id"] = "tree2"
    raw["requires"] = ["tree"]
    raw["code"]["hooks"][0]["handler"] = "specpilot.bundles.tree:eagle_parents"
    (d / "tree2.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    entries = mem.load_memory(d)
    with pytest.raises(Exception, match="both replace"):
        mem.compose(entries, ["tree2"])


def test_list_and_show(run_cli):
    code, out, _ = run_cli("memory", "list")
    assert code == 0 and "lattice-trace" in out and "observe" in out
    code, out, _ = run_cli("memory", "show", "tree")
    assert code == 0
    assert "replace  sglang.srt.speculative.eagle_utils.organize_draft_results" in out
    assert "node_budget" in out and "unverified:" in out and "NOT run on a GPU" in out
    # what apply warns about is shown too: the drafters a variant acts on, the bundle that keeps it off
    assert "eagle, eagle3" in out and "off beside lattice-trace with dflash2: " in out
    code, out, _ = run_cli("memory", "show", "w12", "--format", "json")
    data = json.loads(out)
    assert data["schema"] == "specpilot.memory-entry/1" and data["code"]["quantization"] == ["w12"]


@pytest.mark.parametrize("mutate, msg", [
    (lambda raw: raw.update(schema="specpilot.memory-entry/9"), "unknown schema"),
    (lambda raw: raw.pop("unverified"), "missing field(s) unverified"),
    (lambda raw: raw.update(status="great"), "status must be one of"),
    (lambda raw: raw["code"]["hooks"][0].update(type="sideways"), "hook type 'sideways'"),
    (lambda raw: raw.update(id="other"), "tree.yaml: id 'other' does not match the file name (expected id: tree)"),
    (lambda raw: raw["variants"]["node_budget"].update(default="abc"),
     "variant 'node_budget': default 'abc' must be a number in [2, 256]"),
    (lambda raw: raw["variants"]["node_budget"].update(range=[256, 2]),
     "variant 'node_budget': range must be [low, high] numbers with low <= high, not [256, 2]"),
    (lambda raw: raw["variants"]["node_budget"].update(range="x"), "variant 'node_budget': range must be"),
    (lambda raw: raw["variants"]["node_budget"].update(default=1000), "default 1000 must be a number in [2, 256]"),
    (lambda raw: raw["variants"]["node_budget"].update(order="up"), "order must be descending or absent"),
    # text where YAML's true/false belongs would read as true (bool("false")), a number or list as text
    (lambda raw: raw["fits"].update(changes_output="false"), "fits.changes_output must be true or false, not 'false'"),
    (lambda raw: raw["fits"].update(changes_output="no"), "fits.changes_output must be true or false, not 'no'"),
    (lambda raw: raw["fits"].update(changes_output=0), "fits.changes_output must be true or false, not 0"),
    (lambda raw: raw.update(summary=5), "'summary' must be text"),
    (lambda raw: raw.update(summary=["a"]), "'summary' must be text"),
    (lambda raw: raw.update(limits=[1, 2]), "'limits' must be a list of text items"),
    (lambda raw: raw.update(contracts=[{"a": 1}]), "'contracts' must be a list of text items"),
    (lambda raw: raw.update(unverified="one"), "'unverified' must be a list"),
])
def test_bad_entries_exit_2(run_cli, tmp_path, mutate, msg):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    mutate(raw)
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    for verb in ("list", "verify"):
        code, out, err = run_cli("memory", verb, "--memory-dir", d)
        assert code == 2 and msg in err and out == "" and len(err.strip().splitlines()) == 1, err


def test_verify_of_an_empty_memory_is_bad_input(run_cli, tmp_path):
    code, out, err = run_cli("memory", "verify", "--memory-dir", tmp_path)
    assert code == 2 and err.strip() == f"specpilot: error: {tmp_path}: no entries (*.yaml) to verify" and out == ""
    # show says so the same way (no entry can be found there); list lists nothing and says why
    code, out, err = run_cli("memory", "show", "tree", "--memory-dir", tmp_path)
    assert code == 2 and err.strip() == f"specpilot: error: {tmp_path}: no entries (*.yaml) to show" and out == ""
    code, out, err = run_cli("memory", "list", "--memory-dir", tmp_path)
    assert code == 0 and f"no entries (*.yaml) in {tmp_path}" in out, (out, err)
    code, _, err = run_cli("memory", "verify", "--python", "")
    assert code == 2 and "--python: empty path" in err


def test_unknown_id_and_broken_yaml(run_cli, tmp_path):
    code, _, err = run_cli("memory", "show", "nope")
    assert code == 2 and "unknown mechanism 'nope'" in err
    d = tmp_path / "m"
    d.mkdir()
    (d / "x.yaml").write_text("id: [unclosed\n")
    code, _, err = run_cli("memory", "list", "--memory-dir", d)
    assert code == 2 and "not valid YAML" in err and f"{d / 'x.yaml'}:2:" in err and err.count("\n") == 1
    (d / "x.yaml").write_text("id: " + "[" * 5000 + "]" * 5000 + "\n")
    code, _, err = run_cli("memory", "list", "--memory-dir", d)
    assert code == 2 and err.strip() == f"specpilot: error: {d / 'x.yaml'}: memory entry is nested too deeply", err


def test_out_file_is_atomic_and_protects_nothing_half_written(run_cli, tmp_path):
    out = tmp_path / "verify.json"
    code, _, _ = run_cli("memory", "verify", "--format", "json", "--out", out)
    assert code == 0 and json.loads(out.read_text())["ok"]
    code, _, err = run_cli("memory", "list", "--out", tmp_path / "no" / "such" / "dir.txt")
    assert code == 2 and "does not exist" in err
    assert not list(tmp_path.glob("**/*.part"))


def test_verify_against_an_installed_sglang(run_cli, tmp_path):
    from sglang_support import SKIP_REASON, make_env, sglang_dir

    if sglang_dir() is None:
        pytest.skip(SKIP_REASON)
    py = make_env(tmp_path / "env", sglang_dir())
    code, out, err = run_cli("memory", "verify", "--python", py, "--format", "json")
    assert code == 0, out + err
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    raw["code"]["hooks"][0]["params"] = ["score_list", "token_list"]  # stock takes four: exact fails
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, _ = run_cli("memory", "verify", "--memory-dir", d, "--python", py, "tree")
    assert code == 1 and "SGLang 0.5.23: sglang.srt.speculative.eagle_utils.organize_draft_results" in out


def _results(tmp_path, speedup: float) -> Path:
    res = tmp_path / "results"
    res.mkdir(exist_ok=True)
    (res / "demo.json").write_text(json.dumps({"benchmark": "demo", "gpu": "NVIDIA H200", "torch": "2.11.0",
                                               "date": "2026-12-02T00:00:00+00:00",
                                               "rows": [{"m": 1, "speedup": speedup}]}))
    return res


def test_evidence_is_generated_from_results_and_stale_evidence_fails(run_cli, tmp_path):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    item = {"kind": "gpu", "source": "demo", "values": {"s": {"row": {"m": 1}, "field": "speedup"}},
            "text": "the demo kernel is {s:.2f}x faster at one row", "what": "pasted 0.89x"}
    raw["evidence"].insert(0, item)
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    res = _results(tmp_path, 1.25)
    code, out, _ = run_cli("memory", "verify", "tree", "--memory-dir", d, "--results", res)
    assert code == 1 and "stale" in out and "0.89x" in out and "1.25x" in out
    # --record regenerates the text (and the system) from the results files
    assert run_cli("memory", "verify", "tree", "--memory-dir", d, "--results", res, "--record")[0] == 0
    ev = yaml.safe_load((d / "tree.yaml").read_text())["evidence"][0]
    assert ev["what"] == "the demo kernel is 1.25x faster at one row"
    assert ev["hardware"] == "NVIDIA H200, torch 2.11.0; as of 2026-12-02"
    # a new results file makes the stored text stale again
    _results(tmp_path, 1.5)
    code, out, _ = run_cli("memory", "verify", "tree", "--memory-dir", d, "--results", res)
    assert code == 1 and "1.50x" in out


def test_record_rewrites_only_the_measured_items(run_cli, tmp_path):
    """--record regenerates a measured item in place; hand-written items (folded text, their
    indentation, a comment) and the rest of the file stay byte for byte."""
    d = _copy(tmp_path)
    path = d / "tree.yaml"
    text = path.read_text()
    at = text.index("\nevidence:\n") + len("\nevidence:\n")
    indent = " " * (len(text[at:]) - len(text[at:].lstrip(" ")))
    item = (f"{indent}# figures below come from benchmarks/results/demo.json\n"
            f"{indent}- kind: gpu\n{indent}  source: demo\n{indent}  values:\n"
            f"{indent}    s: {{row: {{m: 1}}, field: speedup}}\n"
            f"{indent}  text: the demo kernel is {{s:.2f}}x faster at one row\n{indent}  what: pasted 0.89x\n"
            f"{indent}# ^ regenerated by --record\n\n")
    path.write_text(text[:at] + item + text[at:])
    before = path.read_text()
    res = _results(tmp_path, 1.25)
    assert run_cli("memory", "verify", "tree", "--memory-dir", d, "--results", res, "--record")[0] == 0
    after = path.read_text()
    assert yaml.safe_load(after)["evidence"][0]["what"] == "the demo kernel is 1.25x faster at one row"
    assert after.startswith(before[:at] + f"{indent}# figures below")
    assert f"\n{indent}# ^ regenerated by --record\n\n" in after
    rest_before = before[before.index(item) + len(item):before.index("\nsystem:")]
    assert rest_before in after   # every hand-written item after it, byte for byte
    # recording again with the same results changes nothing
    assert run_cli("memory", "verify", "tree", "--memory-dir", d, "--results", res, "--record")[0] == 0
    assert path.read_text() == after


def test_record_checks_every_entry_before_writing_any(run_cli, tmp_path):
    """An entry --record cannot rewrite (a measured item in a flow-style evidence list) stops the
    record before any file changes; a flow-style list without measured items is left as written."""
    d = _copy(tmp_path)
    text = (d / "tree.yaml").read_text()
    start, end = text.index("\nevidence:"), text.index("\nlimits:")
    (d / "tree.yaml").write_text(text[:start] + '\nevidence: [{kind: paper, what: "flow style"}]' + text[end:])
    assert run_cli("memory", "verify", "--memory-dir", d, "--record")[0] == 0
    flow = (d / "tree.yaml").read_text()
    assert 'evidence: [{kind: paper, what: "flow style"}]' in flow
    item = '{kind: gpu, source: demo, values: {s: {row: {m: 1}, field: speedup}}, text: "{s:.2f}x", what: old}'
    (d / "tree.yaml").write_text(flow.replace('[{kind: paper, what: "flow style"}]', f"[{item}]"))
    raw = yaml.safe_load((d / "batching.yaml").read_text())   # an entry before it that --record would rewrite
    raw["system"]["fingerprints"][next(iter(raw["system"]["fingerprints"]))] = "sha256:" + "0" * 64
    (d / "batching.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    snapshot = {p.name: p.read_text() for p in d.glob("*.yaml")}
    code, _, err = run_cli("memory", "verify", "--memory-dir", d, "--record")
    assert code == 2 and "must each start with '- '" in err
    assert {p.name: p.read_text() for p in d.glob("*.yaml")} == snapshot


def test_measured_evidence_without_a_results_file_fails(run_cli, tmp_path):
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    raw["evidence"].append({"kind": "gpu", "what": "1.9x faster, trust me", "hardware": "H200"})
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, _ = run_cli("memory", "verify", "tree", "--memory-dir", d)
    assert code == 1 and "without a results file" in out


def test_packaged_evidence_matches_the_results_files(run_cli):
    from specpilot.bundles import evidence

    if evidence.default_results_dir() is None:
        pytest.skip("no benchmarks/results in this installation")
    code, out, err = run_cli("memory", "verify", "--format", "json")
    assert code == 0, out
    assert json.loads(out)["evidence_checked_against"]


def test_missing_evidence_is_not_a_system_that_failed_to_reproduce(run_cli, tmp_path):
    """Results files absent from --results: the hooks and module hashes still reproduce, so the
    system column says so and the evidence column says MISSING; the exit status stays 1."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = run_cli("memory", "verify", "--results", empty)
    assert code == 1, out
    assert "NOT REPRODUCED" not in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line and not line.startswith(" ")}
    assert rows["w12"][-2:] == ["reproduced", "MISSING"], out
    assert rows["tree"][-3:] == ["reproduced", "none", "measured"], out
    assert "w12: evidence 1 (gpu): no results file w12_gemm.json in" in out
    doc = json.loads(run_cli("memory", "verify", "--results", empty, "--format", "json")[1])
    w12 = next(r for r in doc["entries"] if r["id"] == "w12")
    assert not doc["ok"] and not w12["ok"] and w12["system"] == "reproduced" and w12["evidence"] == "missing"
    # stale evidence beside code that drifted: both columns say what is wrong
    d = _copy(tmp_path)
    raw = yaml.safe_load((d / "tree.yaml").read_text())
    raw["evidence"].insert(0, {"kind": "gpu", "source": "demo", "values": {"s": {"row": {"m": 1}, "field": "speedup"}},
                               "text": "{s:.2f}x", "what": "0.89x"})
    raw["system"]["fingerprints"]["specpilot.bundles.tree"] = "sha256:" + "0" * 64
    (d / "tree.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    doc = json.loads(run_cli("memory", "verify", "tree", "--memory-dir", d, "--results", _results(tmp_path, 1.25),
                             "--format", "json")[1])
    (tree,) = doc["entries"]
    assert tree["system"] == "not reproduced" and tree["evidence"] == "stale" and not tree["ok"], tree


def test_test_counts_named_in_evidence_are_what_pytest_collects():
    """An evidence item (or docs/bundles.md) that says "tests/X.py (N tests)" names the count
    pytest collects from that file now (every test, the default -m filter aside)."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"(tests/[\w/]+\.py)`?(?:,| \()\s*(\d+) tests\b")
    named = []
    for e in mem.load_memory().values():
        for i, item in enumerate(e.evidence):
            named += [(f"{e.id} evidence {i + 1}", f, int(n))
                      for f, n in pattern.findall(" ".join(str(item.get("what", "")).split()))]
    named += [("docs/bundles.md", f, int(n)) for f, n in pattern.findall((root / "docs" / "bundles.md").read_text())]
    assert any(where.startswith("tree ") for where, _, _ in named), named   # the pattern still finds the tree's
    paths = sorted({path for _, path, _ in named})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *paths], cwd=root, capture_output=True, text=True, timeout=300)
    found = re.search(r"(\d+) tests? collected", proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = [line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) == int(found.group(1)), proc.stdout[-2000:]   # one line per collected test
    for where, path, n in named:
        assert ids.count(path) == n, f"{where} says {path} has {n} tests; pytest collects {ids.count(path)}"


def test_a_stale_long_text_is_quoted_where_it_differs():
    """Both quotes were cut to the same 90-character start: the changed figure at the end was in
    neither."""
    from specpilot.bundles.evidence import _where_they_differ

    head = "a kernel that only reads the W12 bytes (the read floor) is 1.470x of cuBLAS at 1 row and"
    says, gives = _where_they_differ(head + " reaches 87.8% of the floor", head + " reaches 50.0% of the floor")
    assert "87.8%" in says and "50.0%" in gives and says.startswith("...") and says != gives
    assert _where_they_differ("short 1", "short 2") == ("short 1", "short 2")
