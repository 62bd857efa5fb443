"""Bad input gets one clear InputError (exit 2 at the CLI), never a traceback: empty, truncated,
non-SQLite, wrong-schema and gzip-corrupt files, plus property-based fuzzing of the readers."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import subprocess
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from specpilot.errors import InputError
from specpilot.probes.steps import gap_boundaries, innermost_segments, union_ns
from specpilot.probes.traces import Range, StepRequest, read_trace
from specpilot.probes.traces.jsonstream import iter_chrome_trace
from synthetic_traces import SynthSpec, write_kineto, write_nsys_sqlite

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    spec = SynthSpec(steps=3, layers=1)
    return {"sqlite": write_nsys_sqlite(d / "t.sqlite", spec), "json": write_kineto(d / "t.json", spec),
            "gz": write_kineto(d / "t.json.gz", spec)}


def _err(path, **kw) -> str:
    with pytest.raises(InputError) as e:
        read_trace(path, StepRequest(**kw))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_empty_missing_and_folder(tmp_path):
    (tmp_path / "e.sqlite").write_bytes(b"")
    assert "empty file" in _err(tmp_path / "e.sqlite")
    assert "no such file" in _err(tmp_path / "nope.sqlite")
    assert "is a folder" in _err(tmp_path)


def test_not_a_trace(tmp_path):
    p = tmp_path / "x.sqlite"
    p.write_bytes(b"hello, this is text and not a database\n")
    assert "unknown trace format" in _err(p)
    q = tmp_path / "run.qdstrm"
    q.write_bytes(b"\x00\x01qdstrm")
    assert "QdstrmImporter" in _err(q)


def test_sqlite_without_nsight_tables(tmp_path):
    p = tmp_path / "other.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE t (a INTEGER)")
    con.commit()
    con.close()
    assert "not an Nsight Systems export" in _err(p)


def test_sqlite_unsupported_schema_version(tmp_path, good):
    p = tmp_path / "v9.sqlite"
    p.write_bytes(good["sqlite"].read_bytes())
    con = sqlite3.connect(p)
    con.execute("UPDATE META_DATA_EXPORT SET value = '9.1.0' WHERE name = 'EXPORT_SCHEMA_VERSION'")
    con.commit()
    con.close()
    assert "schema 9.1.0 is not supported" in _err(p)


def test_sqlite_missing_kernel_columns(tmp_path):
    p = tmp_path / "cols.sqlite"
    con = sqlite3.connect(p)
    con.executescript("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);"
                      "INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', '3.1.0');"
                      "CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);"
                      "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER);")
    con.close()
    assert "lacks columns" in _err(p)


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_sqlite_truncated(tmp_path, good, keep):
    data = good["sqlite"].read_bytes()
    p = tmp_path / "cut.sqlite"
    p.write_bytes(data[: int(len(data) * keep)])
    assert "truncated" in _err(p) or "unreadable" in _err(p)


def test_kineto_wrong_shapes(tmp_path):
    cases = {"a.json": "{}", "b.json": '{"traceEvents": 3}', "c.json": "[1, 2",
             "d.json": '{"traceEvents": []}', "e.json": '{"traceEvents": [{"ph": "X", "cat": "kernel"}]}',
             "f.json": '{"traceEvents": [], "x": 1} trailing'}
    want = {"a.json": "no traceEvents", "b.json": "not an array", "c.json": "truncated", "d.json": "no events",
            "e.json": "malformed kernel event", "f.json": "trailing data"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert want[name] in _err(tmp_path / name), name


def test_deeply_nested_json_is_named_with_its_file(tmp_path):
    """Nesting past Python's recursion limit, in the events array and inside an event of the batched
    fast path: the file's own error, not a RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    ev = json.dumps({"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": {}})
    cases = {"top.json": '{"traceEvents": ' + deep + "}",
             "event.json": '{"traceEvents": [' + ",".join([ev] * 3000 + [ev.replace("{}", deep)]) + "]}"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert _err(tmp_path / name) == f"{tmp_path / name}: not a valid trace JSON: nested too deeply", name


def test_gzip_corrupt_and_truncated(tmp_path, good):
    data = good["gz"].read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    assert "gzip" in _err(cut) or "truncated" in _err(cut)
    bad = bytearray(data)
    for i in range(40, min(len(bad), 400)):
        bad[i] ^= 0x5A
    flipped = tmp_path / "flip.json.gz"
    flipped.write_bytes(bytes(bad))
    _err(flipped)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd command is not installed")
def test_zstd_truncated_is_named_as_such(tmp_path, good):
    whole = subprocess.run(["zstd", "-q", "-c", str(good["sqlite"])], capture_output=True, check=True).stdout
    cut = tmp_path / "cut.sqlite.zst"
    cut.write_bytes(whole[: len(whole) // 2])
    msg = _err(cut)
    assert "cut.sqlite.zst: zstd" in msg and "corrupt" in msg and "specpilot-trace-" not in msg
    from conftest import LOCAL_FIXTURES

    real = subprocess.run(["zstd", "-q", "-c", str(LOCAL_FIXTURES / "nsys_h200_decode_eager.sqlite")],
                          capture_output=True, check=True).stdout
    cut.write_bytes(real[:30000])   # its first blocks come out, the rest does not
    assert "cut.sqlite.zst: zstd stream is corrupt or truncated" in _err(cut)


@FUZZ
@given(cut=hs.floats(min_value=0.0, max_value=0.999), kind=hs.sampled_from(["json", "gz", "sqlite"]))
def test_fuzz_truncation_never_crashes(tmp_path, good, cut, kind):
    data = good[kind].read_bytes()
    p = tmp_path / f"fz.{ 'json.gz' if kind == 'gz' else kind}"
    p.write_bytes(data[: int(len(data) * cut)])
    try:
        read_trace(p, StepRequest(range_regex="decode"))
    except InputError as e:
        assert "\n" not in str(e)


def test_damaged_kernel_rows_are_left_out_or_named(tmp_path, good):
    """Rows a byte flip can produce (found by the fuzz test below): a kernel whose name id is not an
    integer (a flip made it NULL there; the schema's NOT NULL keeps an UPDATE from doing so), a kernel
    ending before it starts. The first keeps a placeholder name, the second is left out with a note;
    neither crashes the reader or makes a step's busy time negative."""
    p = tmp_path / "damaged.sqlite"
    p.write_bytes(good["sqlite"].read_bytes())
    con = sqlite3.connect(p)
    ids = [r[0] for r in con.execute("SELECT rowid FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY rowid LIMIT 2")]
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = 'x' WHERE rowid = ?", (ids[0],))
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1000000 WHERE rowid = ?", (ids[1],))
    con.commit()
    con.close()
    a = read_trace(p, StepRequest(range_regex="decode"))
    assert all(s.busy_ns >= 0 for s in a.steps)
    assert "<no name>" in {g.name for g in a.groups}
    assert any(n.startswith("1 GPU activity row(s) without a start and end") for n in a.notes)
    clean = read_trace(good["sqlite"], StepRequest(range_regex="decode"))
    assert a.total_events == clean.total_events - 1
    assert not any("damaged" in n for n in clean.notes)


@FUZZ
@given(pos=hs.integers(min_value=0, max_value=10**9), byte=hs.integers(min_value=0, max_value=255),
       kind=hs.sampled_from(["json", "gz", "sqlite"]))
def test_fuzz_byte_flips_never_crash(tmp_path, good, pos, byte, kind):
    data = bytearray(good[kind].read_bytes())
    data[pos % len(data)] = byte
    p = tmp_path / f"flip.{ 'json.gz' if kind == 'gz' else kind}"
    p.write_bytes(bytes(data))
    try:
        a = read_trace(p, StepRequest(range_regex="decode"))
        assert all(s.busy_ns >= 0 for s in a.steps)
    except InputError as e:
        assert "\n" not in str(e)


# ---- streaming JSON equals json.load ----------------------------------------------------------
json_leaf = hs.one_of(hs.none(), hs.booleans(), hs.integers(-10**12, 10**12), hs.text(max_size=20),
                      hs.floats(allow_nan=False, allow_infinity=False))
json_val = hs.recursive(json_leaf, lambda ch: hs.lists(ch, max_size=4) | hs.dictionaries(hs.text(max_size=8), ch,
                                                                                           max_size=4), max_leaves=12)
events = hs.lists(hs.dictionaries(hs.sampled_from(["ph", "cat", "name", "ts", "args", "x}, {", "[y"]),
                                  json_val | hs.sampled_from(["}, {", "a}, {\"b", "[{}, {}]"]), max_size=5),
                  max_size=30)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(evs=events, header=hs.dictionaries(hs.sampled_from(["schemaVersion", "deviceProperties", "a\"b"]), json_val,
                                          max_size=3), indent=hs.sampled_from([None, 0, 2]),
       chunk=hs.sampled_from([7, 64, 1 << 20]), gz=hs.booleans(), before=hs.booleans(),
       batch_min=hs.sampled_from([0, 50, 4096]))
def test_fuzz_stream_parser_matches_json_load(tmp_path, monkeypatch, evs, header, indent, chunk, gz, before, batch_min):
    import specpilot.probes.traces.jsonstream as js

    monkeypatch.setattr(js, "CHUNK", chunk)
    monkeypatch.setattr(js, "BATCH_MIN", batch_min)
    doc = {**(header if before else {}), "traceEvents": evs, **({} if before else header)}
    text = json.dumps(doc, indent=indent)
    p = tmp_path / ("s.json.gz" if gz else "s.json")
    p.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    got_header = {}
    got = list(iter_chrome_trace(p, lambda k, v: got_header.__setitem__(k, v)))
    assert got == [e for e in evs if isinstance(e, dict)]
    assert got_header == {k: v for k, v in header.items() if k != "traceEvents"}


def test_a_malformed_event_deep_in_a_trace_is_rejected_after_one_batch_decode(tmp_path, monkeypatch):
    """A trace malformed far into its events fails with the reader's one-line error after a
    failed batch decode and one event at a time up to the bad spot, not a batch retried after
    every event (each re-parsing the buffer: a corrupt 600 KB gzipped trace took 30 s)."""
    evs = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": i, "dur": 1} for i in range(20000)]
    text = json.dumps({"traceEvents": evs})
    at = text.index('"k15000"')
    p = tmp_path / "t.json"
    p.write_text(text[:at] + '"k15000" "x"' + text[at + len('"k15000"'):])   # a missing comma
    calls = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: calls.append(len(s)) or real(s, *a, **k))
    with pytest.raises(InputError, match="malformed JSON"):
        list(iter_chrome_trace(p, lambda k, v: None))
    assert 1 <= len(calls) <= 3


# ---- step helpers against brute force ---------------------------------------------------------
intervals = hs.lists(hs.tuples(hs.integers(0, 500), hs.integers(0, 60)), min_size=1, max_size=40)


@FUZZ
@given(iv=intervals)
def test_union_matches_brute_force(iv):
    s = np.array([a for a, _ in iv], dtype=np.int64)
    e = s + np.array([d for _, d in iv], dtype=np.int64)
    covered = set()
    for a, b in zip(s.tolist(), e.tolist()):
        covered.update(range(a, b))
    assert union_ns(s, e) == len(covered)


@FUZZ
@given(iv=intervals, gap=hs.integers(1, 50))
def test_gap_boundaries_split_only_at_idle_gaps(iv, gap):
    s = np.array([a for a, _ in iv], dtype=np.int64)
    e = s + np.array([d for _, d in iv], dtype=np.int64)
    b = gap_boundaries(s, e, gap)
    assert b[0] == s.min() and b == sorted(b)
    for x in b[1:]:
        before = e[s < x]
        assert before.size and x - before.max() > gap  # the GPU was idle more than gap before x


def test_innermost_segments_paths():
    r = [Range("draft", 0, 100), Range("lm_head", 40, 60), Range("lm_head", 150, 160)]
    assert innermost_segments(r) == [(0, 40, "draft"), (40, 60, "draft/lm_head"), (60, 100, "draft"),
                                     (150, 160, "lm_head")]


def test_zlib_error_is_input_error(tmp_path):
    raw = zlib.compress(b'{"traceEvents": []}')
    p = tmp_path / "z.json.gz"
    p.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + raw[2:-4] + b"\x00" * 3)
    _err(p)


# ---- bad values inside Kineto events ------------------------------------------------------------
def _kineto_with(tmp_path, good, cat: str, **fields):
    """The good Kineto trace with ``fields`` set on its first ``cat`` event."""
    doc = json.loads(good["json"].read_text())
    ev = next(e for e in doc["traceEvents"] if e.get("cat") == cat)
    ev.update(fields)
    p = tmp_path / f"bad_{cat}.json"
    p.write_text(json.dumps(doc))   # float('inf') is written as Infinity, as JavaScript tools write it
    return p


@pytest.mark.parametrize("name", [123, None, ["gemm"]])
def test_kineto_kernel_name_not_a_string_is_malformed(tmp_path, good, name):
    p = _kineto_with(tmp_path, good, "kernel", name=name)
    msg = _err(p)
    assert msg.startswith(f"{p}: malformed kernel event") and "not a string" in msg


@pytest.mark.parametrize("cat, field", [("kernel", "ts"), ("kernel", "dur"), ("user_annotation", "ts"),
                                        ("user_annotation", "dur"), ("cuda_runtime", "ts")])
@pytest.mark.parametrize("value", [float("inf"), 1e300])
def test_kineto_non_finite_or_huge_times_name_the_file(tmp_path, good, cat, field, value):
    p = _kineto_with(tmp_path, good, cat, **{field: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a numpy cast warning would be a leak to stderr
        msg = _err(p)
    assert msg.startswith(f"{p}: an event has a ") and ("non-finite" in msg or "out of range" in msg)


@pytest.mark.parametrize("cat, field", [("kernel", "ts"), ("kernel", "dur"), ("user_annotation", "dur"),
                                        ("cuda_runtime", "ts")])
@pytest.mark.parametrize("value", ["5", True, None])
def test_kineto_times_that_are_no_numbers_name_the_file(tmp_path, good, cat, field, value):
    """A string is not read as a number, a boolean not as 1 us, a null not as 0."""
    p = _kineto_with(tmp_path, good, cat, **{field: value})
    msg = _err(p)
    assert msg.startswith(f"{p}: malformed {cat} event") and f"{value!r} is not a number" in msg, msg


def test_a_kineto_kernel_without_its_duration_is_malformed(tmp_path, good):
    doc = json.loads(good["json"].read_text())
    next(e for e in doc["traceEvents"] if e.get("cat") == "kernel").pop("dur")
    p = tmp_path / "nodur.json"
    p.write_text(json.dumps(doc))
    assert _err(p).startswith(f"{p}: malformed kernel event (KeyError: 'dur')")


def test_kineto_event_ending_before_it_starts_is_left_out_and_counted(tmp_path, good):
    whole = read_trace(good["json"], StepRequest(range_regex="decode_step"))
    p = _kineto_with(tmp_path, good, "kernel", dur=-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = read_trace(p, StepRequest(range_regex="decode_step"))
    assert sum(s.events for s in a.steps) == sum(s.events for s in whole.steps) - 1
    assert "1 GPU event(s) ending before they start were left out (a damaged trace)" in a.notes
    assert not any("ending before" in n for n in whole.notes)
