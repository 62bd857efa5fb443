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


def test_batched_probe_c_is_sane_without_warmup():
    """In a fresh process (where the first step pays for allocation) c(N) of a batched probe with
    --warmup 0 is not an artefact of an untimed first step: T_AR is not many times T(2)."""
    proc = subprocess.run([sys.executable, "-m", "specpilot", *TINY, "--batch", "2", "--rows", "1,2,4", "--reps", "2",
                           "--warmup", "0", "--format", "json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    c = {p["rows"]: p["c"] for p in json.loads(proc.stdout)["points"]}
    assert c[2] > 0.3 and c[4] > 0.3, c
