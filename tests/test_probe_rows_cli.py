"""``specpilot probe`` through the CLI: warm-up of the batched probe, the --rows series, the bare group."""

import json
import subprocess
import sys

import pytest

TINY = ("probe", "rows", "--model", "tiny", "--context", "64", "--threads", "1", "--device", "cpu")


def test_batched_probe_warms_the_first_row_count(run_cli, monkeypatch):
    """--warmup 0: the first N still gets one untimed step (the help's promise), as the one-request
    probe does; the later N get none."""
    import specpilot.engine.graphs as graphs

    seen = []
    real = graphs.time_calls

    def spy(fn, reps, warmup, cuda):
        seen.append(warmup)
        return real(fn, reps, warmup, cuda)

    monkeypatch.setattr(graphs, "time_calls", spy)
    code, out, err = run_cli(*TINY, "--batch", "2", "--rows", "1,2,4", "--reps", "1", "--warmup", "0",
                             "--format", "json")
    assert code == 0, err
    assert seen == [1, 0, 0]
    assert json.loads(out)["warmup"] == 0


@pytest.mark.parametrize("batch", ["1", "2"])
def test_every_point_names_the_path_its_step_ran(run_cli, batch):
    """One request's probe and the batched probe alike: each point has ``path`` (the text's column
    read it from the point, falling back to ``ar_path``, so only the JSON lacked it)."""
    code, out, err = run_cli(*TINY, "--batch", batch, "--rows", "1,2,4", "--reps", "1", "--warmup", "0",
                             "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert [p["path"] for p in data["points"]] == ["layers"] * 3 and data["ar_path"] == "layers"


@pytest.mark.parametrize("batch", ["1", "2"])
def test_the_memory_check_counts_the_probes_peak(run_cli, tmp_path, monkeypatch, batch):
    """Free memory that holds the KV caches but not the RoPE tables and the largest transient
    beside them (the cache fill's random values, a step's scores): refused up front, exit 3, one
    line, nothing written. Here a tiny fp32 cache takes 1024 bytes a position and slot, the whole
    peak about 1.4 KB a position (plus the fill of the batch's slots)."""
    import specpilot.machine

    from specpilot.engine.api import resolve_model
    from specpilot.engine.rows import peak_bytes

    import torch

    spec, S = resolve_model("tiny", False)[0], 100_000 + 2 + 64
    need = peak_bytes(spec, S, torch.float32, "cpu", 2, int(batch))
    assert need["kv"] == 1024 * S * (1 if batch == "1" else 3) and need["device"] > need["kv"] + need["rope"]
    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: need["kv"] + need["rope"])
    out = tmp_path / "rows.json"
    code, stdout, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--context", "100000",
                                "--rows", "1,2", "--batch", batch, "--out", out)
    assert code == 3 and not out.exists() and stdout == "", err
    assert err.startswith("specpilot: error: probe rows needs about") and err.count("\n") == 1, err
    monkeypatch.setattr(specpilot.machine, "free_memory", lambda device: need["device"])   # the peak fits
    code, _, err = run_cli("probe", "rows", "--model", "tiny", "--device", "cpu", "--context", "100000",
                           "--rows", "1,2", "--batch", batch, "--reps", "1", "--warmup", "0", "--out", out)
    assert code == 0 and out.exists(), err


@pytest.mark.parametrize("batch", ["1", "2"])
def test_probe_says_it_loads_the_model_and_reports_the_cache_fill(run_cli, monkeypatch, batch):
    """stderr not a terminal: the loading line before the CPU engine's, and progress lines for the
    cache fill (long at long contexts) as for the row counts."""
    from specpilot import machine

    monkeypatch.setattr(machine, "_announced", set())
    monkeypatch.setenv("SPECPILOT_PROGRESS_SECONDS", "0")
    code, _, err = run_cli(*TINY, "--batch", batch, "--rows", "1,2", "--reps", "1", "--warmup", "0")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[:2] == ["specpilot: loading model tiny (probe rows, cpu) ...",
                         "specpilot: CPU engine: 1 torch thread (--threads)"], err
    assert any(ln.startswith("filling the KV cache: 8/8 tensor") for ln in lines), err
    assert any(ln.startswith("rows: 2/2 N") for ln in lines) and "\r" not in err, err


def test_batched_probe_c_is_sane_without_warmup():
    """In a fresh process (where the first step pays for allocation) c(N) of a batched probe with
    --warmup 0 is not an artefact of an untimed first step: T_AR is not many times T(2)."""
    proc = subprocess.run([sys.executable, "-m", "specpilot", *TINY, "--batch", "2", "--rows", "1,2,4", "--reps", "2",
                           "--warmup", "0", "--format", "json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    c = {p["rows"]: p["c"] for p in json.loads(proc.stdout)["points"]}
    assert c[2] > 0.3 and c[4] > 0.3, c


@pytest.mark.parametrize("text, rows", [
    ("1,2,4,...,256", [1, 2, 4, 8, 16, 32, 64, 128, 256]),
    ("1,2,...,6", [1, 2, 3, 4, 5, 6]),                 # only stepping by one reaches 6
    ("8,16,24,...,64", [8, 16, 24, 32, 40, 48, 56, 64]),
    ("2,5,...,14", [2, 5, 8, 11, 14]),
    ("1,2,4,...,16,24,...,40", [1, 2, 4, 8, 16, 24, 32, 40]),
])
def test_rows_series_accepted(text, rows):
    from specpilot.options import parse_int_list

    assert parse_int_list(text) == rows


@pytest.mark.parametrize("text, words", [
    ("1,2,4,...,100", "100 is not on the series 1,2,4,... (times 2: ...,64,128)"),   # was 51 counts by 2
    ("1,3,...,20", "20 is not on the series 1,3,... (times 3: ...,9,27; steps of 2: ...,19,21)"),   # was 1,3,9,20
    ("1,2,...,16", "give a third value (1,2,4,...,16 or 1,2,3,...,16)"),
    ("1,2,4,...,4", "must end above 4, got 4"),
])
def test_rows_series_refused_before_loading(run_cli, monkeypatch, text, words):
    import specpilot.engine.rows as rows

    monkeypatch.setattr(rows, "probe_rows", lambda *a, **k: pytest.fail("loaded a model for a bad --rows"))
    code, out, err = run_cli(*TINY, "--rows", text)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("specpilot: error: --rows: ") and words in err, err


@pytest.mark.parametrize("text", ["1,2,...,16", "1,3,...,9", "2,4,...,8", "3,6,...,12", "8,16,...,64"])
def test_the_series_an_ambiguous_one_suggests_are_taken(text):
    import re

    from specpilot.errors import InputError
    from specpilot.options import parse_int_list

    with pytest.raises(InputError) as e:
        parse_int_list(text)
    first, second = re.search(r"give a third value \((.+) or (.+)\)$", str(e.value)).groups()
    end = int(text.rsplit(",", 1)[1])
    for suggested in (first, second):
        got = parse_int_list(suggested)
        assert got[:2] == [int(x) for x in text.split(",")[:2]] and got[-1] == end, (suggested, got)
    assert parse_int_list(first) != parse_int_list(second)


@pytest.mark.parametrize("group", [(), ("probe",), ("memory",), ("w12",), ("audit",)])
def test_a_group_without_a_subcommand_prints_its_help(run_cli, group):
    """As --help and as audit always did: the help on stdout, exit 0, not one squeezed error line."""
    code, out, err = run_cli(*group)
    assert code == 0 and err == "", err
    assert out.startswith(f"Usage: {' '.join(('specpilot',) + group)} [OPTIONS] COMMAND") and "\nCommands:\n" in out


def test_a_bad_model_is_refused_before_the_engine_banner(tmp_path):
    """The model argument is checked before the CPU engine's thread banner: a bad one is one line
    alone (a fresh process each: the banner is printed once per process)."""
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "prompts.txt").write_text("hello\n")
    for model, words in (("nosuch", "unknown model 'nosuch'"),
                         ("llama-3.1-8b", "is a catalog config with no weights; add --random-weights"),
                         (tmp_path / "noconfig", "folder has no config.json"),
                         (tmp_path / "empty.json", "not valid JSON"),
                         # not a config at all: what a model is given as (the engine also reads a GGUF)
                         (tmp_path / "prompts.txt", "a model is its config.json, a folder holding one, a .gguf "
                                                    "file or a known name")):
        proc = subprocess.run([sys.executable, "-m", "specpilot", "probe", "rows", "--model", str(model), "--device",
                               "cpu", "--rows", "1,2"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.startswith("specpilot: error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert words in proc.stderr, proc.stderr


def test_a_bad_model_is_refused_before_torch_is_imported(tmp_path):
    """Such a refusal takes a fraction of a second: torch (seconds to import) only after the checks."""
    from conftest import cli_imports, refused

    for device in (["--device", "cpu"], []):   # without --device: before torch is asked for a GPU
        code, out, err, imported = cli_imports("probe", "rows", "--model", "nosuch", *device, "--rows", "1,2",
                                               "--batch", "2", cwd=tmp_path)
        refused(code, err, "unknown model 'nosuch'")
        assert out == "" and imported == [], imported


@pytest.mark.parametrize("batch", ["1", "2"])
def test_a_step_of_more_rows_timed_faster_than_one_row_is_warned(run_cli, monkeypatch, batch):
    """c(N) below ceiling's 0.95 is noise: said on stderr and in the JSON's warnings."""
    import specpilot.engine.graphs as graphs
    import specpilot.engine.rows as rows_mod

    calls = []
    if batch == "1":
        monkeypatch.setattr(rows_mod, "_time_step", lambda model, inp, T, *a: {1: 10.0, 2: 6.0, 4: 12.0}[T])
    else:
        monkeypatch.setattr(graphs, "time_calls", lambda fn, reps, warmup, cuda: calls.append(1) or
                            [{1: 10.0, 2: 6.0, 3: 12.0}[len(calls)]])
    code, out, err = run_cli(*TINY, "--batch", batch, "--rows", "1,2,4", "--reps", "1", "--format", "json")
    assert code == 0, err
    w = [x for x in json.loads(out)["warnings"] if x.startswith("c(N) below 0.95")]
    assert w == ["c(N) below 0.95 at 2 rows (0.6): a step of more rows timed faster than the one-row step, which is "
                 "noise (a busy machine, too few --reps); probe again before a cost model uses it"], out
    assert "c(N) below 0.95 at 2 rows" in err


def test_a_low_c_past_the_certified_head_is_not_called_noise(run_cli):
    """Past 64 rows the step runs the linear head (on the CPU far faster than the certified one in
    Triton's interpreter): a real difference, said by its own warning, not 'noise, probe again'."""
    code, out, err = run_cli("probe", "rows", "--model", "tiny", "--head", "certified", "--rows", "1,65",
                             "--context", "8", "--reps", "2", "--warmup", "1", "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["points"][1]["c"] < 0.95
    assert not any("noise" in w for w in d["warnings"]), d["warnings"]
    assert any("the certified head takes up to 64 rows" in w for w in d["warnings"])
