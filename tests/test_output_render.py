"""The text renderers every verb's report goes through."""

from specpilot.output import Report, Section, count, render


def test_markdown_puts_each_note_and_line_in_its_own_paragraph():
    report = Report(data={}, sections=[Section("t", ["a"], [[1]], note="first\nsecond")],
                    lines=["warning: one", "verdict: pass"])
    md = render(report, "markdown")
    assert "first\n\nsecond" in md and "warning: one\n\nverdict: pass" in md
    text = render(report, "text")   # a terminal keeps one line each
    assert "first\nsecond" in text and "warning: one\nverdict: pass" in text


def test_count_takes_the_singular_for_one():
    assert [count(1, "step"), count(2, "step"), count(0, "pass", "passes"), count(1, "pass", "passes")] == \
        ["1 step", "2 steps", "0 passes", "1 pass"]


def test_plain_text_wraps_prose_columns_and_lines_where_asked_and_markdown_does_not():
    prose = " ".join(f"word{i}" for i in range(60))
    report = Report(data={}, sections=[Section("evidence", ["kind", "what"], [["cpu-test", prose]], wrap=[None, 40])],
                    lines=["  - " + prose], title="entry: " + prose, wrap=50)
    text = render(report, "text")
    assert max(map(len, text.splitlines())) <= 50 and text.count("word59") == 3
    item = [ln for ln in text.splitlines() if ln.startswith("  - ")]
    assert len(item) == 1 and text.split(item[0], 1)[1].splitlines()[1].startswith("    word")   # hangs under it
    md = render(report, "markdown")
    assert "| cpu-test | " + prose in md and "# entry: " + prose in md and "  - " + prose in md


def test_memory_show_fits_a_wide_terminal(run_cli):
    code, out, _ = run_cli("memory", "show", "tree")
    wide = [ln for ln in out.splitlines() if len(ln) > 180]
    assert code == 0 and not wide, wide[:1]


def test_numbers_that_are_not_finite_are_written_as_null_never_as_nan():
    """Python's json writes NaN/Infinity, which strict readers refuse; a report writes null."""
    import json as std

    import numpy as np
    import yaml

    report = Report(data={"a": float("inf"), "b": [1.0, float("nan")], "c": {"d": np.float64("-inf")}, "e": 2.5})
    text = render(report, "json")
    assert "Infinity" not in text and "NaN" not in text
    assert std.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2.5}
    assert yaml.safe_load(render(report, "yaml")) == std.loads(text)


def test_out_named_gz_is_gzip_and_read_back_by_the_readers(run_cli, tmp_path):
    """--out rp.json.gz wrote plain JSON that a reader, taking .gz as compressed, refused."""
    import gzip

    out = tmp_path / "rows.json.gz"
    code, _, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "1,8", "--format", "json",
                           "--out", out)
    assert code == 0 and gzip.decompress(out.read_bytes()).startswith(b"{"), err
    from specpilot.fileio import read_json   # what the verbs read JSON files with

    assert read_json(out, kind="ceiling")["schema"] == "specpilot.ceiling/1"


def test_a_value_with_a_bar_or_a_newline_stays_in_its_cell():
    """An id "a|b" made two Markdown cells, "line1\\nline2" a row of its own in both renderings."""
    report = Report(data={}, sections=[Section(None, ["id", "tokens"], [["a|b", 4], ["line1\nline2", 5],
                                                                         ["back\\slash", 6]])])
    import re

    md = render(report, "markdown").splitlines()
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in md]
    assert cells[2:] == [["a\\|b", "4"], ["line1<br>line2", "5"], ["back\\\\slash", "6"]] and len(md) == 5
    text = render(report, "text").splitlines()
    assert len(text) == 5 and text[3].startswith("line1\\nline2")


def test_a_name_too_long_once_written_as_its_temporary_is_refused_before_the_work(run_cli, tmp_path, monkeypatch):
    """A name the file system takes, but not as the .NAME.XXXXXXXX.part it is written as first: refused
    up front (it failed after the work: a measurement lost)."""
    monkeypatch.chdir(tmp_path)
    name = "q" * 246   # 246 fits in 255 bytes; ".{name}.XXXXXXXX.part" does not
    (tmp_path / name).write_text("")   # the plain name is a valid file name here
    (tmp_path / name).unlink()
    code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "1", "--out", name)
    assert code == 2 and out == "" and "the name is too long for the file system" in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_output_name_ending_in_a_slash_is_refused(run_cli, tmp_path, monkeypatch):
    """'--out f/' named the file f (Path drops the slash) and wrote over it; 'new/' made a file 'new'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("kept\n")
    for name in ("f/", "new/"):
        code, out, err = run_cli("ceiling", "--model", "llama-3.1-8b", "--gpu", "h200", "--rows", "1", "--out", name)
        assert code == 2 and out == "" and f"--out {name}: ends in '/', a folder; give a file name" in err, err
    assert (tmp_path / "f").read_text() == "kept\n" and not (tmp_path / "new").exists()


def test_an_output_the_disk_refuses_names_the_file_and_is_the_machine_s_error(tmp_path):
    """A file size limit (a full disk alike) while writing --out: exit 3 naming the output, no temporary left."""
    import subprocess
    import sys

    out = tmp_path / "big.json"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
            "from specpilot.entry import main; sys.argv = ['specpilot'] + sys.argv[1:]; main()")
    res = subprocess.run([sys.executable, "-c", code, "ceiling", "--model", "llama-3.1-8b", "--gpu", "h200",
                          "--rows", ",".join(str(r) for r in range(1, 257)), "--format", "json", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stderr
    assert res.stderr.strip() == f"specpilot: error: {out}: File too large", res.stderr
    assert list(tmp_path.iterdir()) == []
