"""The README's figures table is generated from benchmarks/results/*.json (scripts/figures.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "figures.py"


def figures(*args: str):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_readme_table_is_current():
    r = figures("--check")
    assert r.returncode == 0, r.stderr


def test_each_page_has_at_most_one_figures_table_and_no_hand_written_as_of():
    """One current figures table per page, generated (its "as of" line too)."""
    import re

    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        assert len(re.findall(r"<!-- figures:begin", text)) <= 1, page.name
        outside = re.sub(r"<!-- figures:begin.*?<!-- figures:end[^>]*-->", "", text, flags=re.S)
        assert not re.search(r"^As of \d{4}-\d\d-\d\d", outside, flags=re.M), page.name


def test_every_results_file_is_a_subject_with_environment():
    """One JSON per subject, each naming the machine and date the table's 'as of' line needs."""
    files = sorted((REPO / "benchmarks" / "results").iterdir())
    assert files and all(p.suffix == ".json" and p.is_file() for p in files), [p.name for p in files]
    for p in files:
        doc = json.loads(p.read_text())
        assert doc.get("gpu") and doc.get("torch"), p.name


def small_setup(tmp_path: Path, measured: str, value: dict) -> tuple[Path, Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    (results / "demo.json").write_text(json.dumps({
        "benchmark": "demo", "date": "2026-12-02T01:00:00+00:00", "gpu": "NVIDIA H200", "driver": "580.1",
        "torch": "2.11.0", "triton": "3.6.0", "summary": {"speedup": 1.2345},
        "rows": [{"m": 1, "us": 10.0}, {"m": 8, "us": 12.5}, {"m": 8, "us": 14.0}]}))
    spec = tmp_path / "figures.yaml"
    spec.write_text(json.dumps({"tables": [{
        "file": "README.md", "columns": ["what", "measured", "target", "verdict", "source"],
        "rows": [{"source": "demo", "values": {"v": value},
                  "cells": ["demo kernel", measured, ">= 1.1x", "met", "{sources}"]}]}]}))
    readme = tmp_path / "README.md"
    readme.write_text("# Demo\n\n<!-- figures:begin -->\nold\n<!-- figures:end -->\n\nafter\n")
    return results, spec, readme


def run_in(tmp: Path, results: Path, spec: Path, *extra: str):
    return figures(*extra, "--root", str(tmp), "--results", str(results), "--spec", str(spec))


def test_stale_table_is_found_and_rewritten(tmp_path):
    results, spec, readme = small_setup(tmp_path, "{v:.2f}x", {"field": "summary.speedup"})
    args = ("--root", str(tmp_path), "--results", str(results), "--spec", str(spec))
    r = figures("--check", *args)
    assert r.returncode == 1 and "stale" in r.stderr
    assert "old" in readme.read_text()                       # --check writes nothing
    assert figures(*args).returncode == 0
    text = readme.read_text()
    assert "| demo kernel | 1.23x | >= 1.1x | met | [demo](benchmarks/results/demo.json) |" in text
    assert "As of 2026-12-02: NVIDIA H200 (driver 580.1), torch 2.11.0, Triton 3.6.0." in text
    assert text.endswith("<!-- figures:end -->\n\nafter\n")
    assert figures("--check", *args).returncode == 0
    # the next run of a benchmark changes the file: the README is stale again
    doc = json.loads((results / "demo.json").read_text())
    doc["summary"]["speedup"] = 1.3
    (results / "demo.json").write_text(json.dumps(doc))
    assert figures("--check", *args).returncode == 1


def test_rows_are_selected_and_aggregated(tmp_path):
    results, spec, readme = small_setup(tmp_path, "{v:.1f} us", {"row": {"m": 8}, "field": "us", "agg": "max"})
    assert run_in(tmp_path, results, spec).returncode == 0
    assert "| 14.0 us |" in readme.read_text()


def test_bad_specs_exit_2_with_one_line(tmp_path):
    cases = [
        ({"field": "summary.nope"}, "no field 'nope'"),
        ({"row": {"m": 8}, "field": "us"}, "2 rows match"),
        ({"row": {"m": 3}, "field": "us"}, "no row matches"),
        ({"source": "missing", "field": "x"}, "no results file"),
        ({"field": "summary.speedup", "agg": "median"}, "agg must be one of"),
    ]
    for value, message in cases:
        sub = tmp_path / message.replace(" ", "_").replace("'", "")
        sub.mkdir()
        results, spec, readme = small_setup(sub, "{v}", value)
        r = run_in(sub, results, spec)
        assert r.returncode == 2, (value, r.stderr)
        assert r.stderr.startswith("figures: error: ") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert "old" in readme.read_text()


def test_readme_without_markers_exits_2(tmp_path):
    results, spec, readme = small_setup(tmp_path, "{v}", {"field": "summary.speedup"})
    readme.write_text("# no table here\n")
    r = run_in(tmp_path, results, spec)
    assert r.returncode == 2 and "figures:begin" in r.stderr
    assert readme.read_text() == "# no table here\n"


def test_shipped_spec_reads_only_shipped_results(tmp_path):
    """Removing a results file the table uses is caught, not silently dropped."""
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results)
    (results / "lm_head.json").unlink()
    r = figures("--check", "--results", str(results))
    assert r.returncode == 2 and "lm_head.json" in r.stderr


def test_for_rows_and_docs_tables(tmp_path):
    """A `for` row expands per value; a table in docs/ cites its files once, linked from docs/."""
    results, spec, readme = small_setup(tmp_path, "{v}", {"field": "summary.speedup"})
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "demo.md"
    doc.write_text("x\n<!-- figures:begin demo -->\n<!-- figures:end demo -->\n")
    table = {"file": "docs/demo.md", "block": "demo", "columns": ["rows", "us"],
             "rows": [{"source": "demo", "for": {"m": [1, 8]},
                       "values": {"us": {"row": {"m": "$m"}, "field": "us", "agg": "first"}},
                       "cells": ["$m", "{us:.1f}"]}]}
    s = json.loads(spec.read_text())
    s["tables"].append(table)
    spec.write_text(json.dumps(s))
    assert run_in(tmp_path, results, spec).returncode == 0
    text = doc.read_text()
    assert "Source: [demo](../benchmarks/results/demo.json)." in text
    assert "| 1 | 10.0 |\n| 8 | 12.5 |" in text


def test_targets_give_the_status(tmp_path):
    """A row's ``targets`` say ``met`` or name the value that misses; a malformed target exits 2."""
    for targets, want in [([{"value": "v", "min": 1.1}], "| met |"),
                          ([{"value": "v", "min": 1.3, "label": "speedup"}], "| not met (speedup 1.23 < 1.3) |"),
                          ([{"value": "v", "max": 1.0}], "| not met (v 1.23 > 1.0) |"),
                          ([{"value": "v", "within": 1.3}], "| met |"),
                          ([{"value": "v", "within": 0.5, "label": "err"}], "| not met (err +1.23 outside +-0.5) |")]:
        sub = tmp_path / str(len(list(tmp_path.iterdir())))
        sub.mkdir()
        results, spec, readme = small_setup(sub, "{v:.2f}x", {"field": "summary.speedup"})
        s = json.loads(spec.read_text())
        s["tables"][0]["rows"][0]["targets"] = targets
        s["tables"][0]["rows"][0]["cells"][3] = "{status}"
        spec.write_text(json.dumps(s))
        assert run_in(sub, results, spec).returncode == 0
        assert want in readme.read_text(), readme.read_text()
    s["tables"][0]["rows"][0]["targets"] = [{"value": "v"}]
    spec.write_text(json.dumps(s))
    r = run_in(sub, results, spec)
    assert r.returncode == 2 and "one of 'min', 'max', 'within'" in r.stderr and r.stderr.count("\n") == 1
