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
