"""SIGINT, SIGTERM and SIGHUP sent to a real ``specpilot`` process: no debris, no orphan process
group, resumable state kept (``compare --resume``, ``audit collect --resume``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import stub_generate

SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def _specpilot(*args, cwd, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specpilot", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), **kw)


def _wait_for(pred, timeout=120.0, proc=None, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the command ended before {what}: exit {proc.returncode}\n{proc.stderr.read()}")
        time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _part_files(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.endswith(".part")]


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    """A folder of four .safetensors files (bf16 projections) for ``w12 pack``."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("ckpt") / "model"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16),
                   f"model.layers.{i}.mlp.down_proj.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16)},
                  str(d / f"part{i}.safetensors"))
    (d / "config.json").write_text("{}\n")
    return d


def test_sigterm_during_w12_pack_leaves_no_debris(checkpoint_folder, tmp_path):
    """SIGINT and SIGHUP take the same path (the atomic-write test below sends all three)."""
    sig = signal.SIGTERM
    before = {p.name: p.read_bytes() for p in checkpoint_folder.iterdir()}
    proc = _specpilot("w12", "pack", checkpoint_folder, "-o", "packed", "--device", "cpu", cwd=tmp_path)
    _wait_for(lambda: _part_files(tmp_path), proc=proc, what="the .part folder")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"specpilot: interrupted by {sig.name}" in err and "Traceback" not in err
    assert "" not in err.splitlines(), err   # no blank line before it (click's own for a terminal's ^C)
    assert _part_files(tmp_path) == [] and not (tmp_path / "packed").exists()
    assert {p.name: p.read_bytes() for p in checkpoint_folder.iterdir()} == before


_SLOW_WRITER = textwrap.dedent("""
    import sys, time
    from specpilot import signals
    from specpilot.fileio import atomic_open
    with signals.installed():
        try:
            with atomic_open(sys.argv[1], "w") as fh:
                fh.write("half")
                print("writing", flush=True)
                time.sleep(60)
        except KeyboardInterrupt as e:
            sys.exit(e.exit_code)
        finally:
            signals.cleanup()
""")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_signal_during_an_atomic_write_removes_the_part_file(tmp_path, sig):
    target = tmp_path / "out.json"
    target.write_text("old\n")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert _part_files(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    assert _part_files(tmp_path) == [] and target.read_text() == "old\n"


@pytest.mark.parametrize("make", ["folder", "file"])
def test_a_signal_while_a_temporary_is_created_cannot_leave_it_behind(tmp_path, monkeypatch, make):
    """The signal lands right after ``mkdtemp``/``mkstemp`` returned, before the path is registered
    for removal (the window a SIGTERM hit when it came as soon as the .part folder appeared): it is
    held back until the path is registered, then ends the run, and cleanup removes the path."""
    import tempfile

    from specpilot import fileio, signals

    real = tempfile.mkdtemp if make == "folder" else tempfile.mkstemp

    def created_then_signalled(*a, **kw):
        out = real(*a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(tempfile, "mkdtemp" if make == "folder" else "mkstemp", created_then_signalled)
    with signals.installed():
        try:
            with pytest.raises(signals.Interrupted) as err:
                if make == "folder":
                    fileio.temp_dir_beside(tmp_path / "packed")
                else:
                    with fileio.atomic_open(tmp_path / "out.json") as fh:
                        fh.write("never")
            assert err.value.signum == signal.SIGTERM
            assert _part_files(tmp_path) or make == "file"   # a folder waits for cleanup; a file's writer removes it
        finally:
            signals.cleanup()
    assert _part_files(tmp_path) == [] and not (tmp_path / "out.json").exists()


def test_an_error_raised_while_a_signal_unwinds_reports_the_signal(capsys):
    """A library that catches the interrupt and raises its own error (safetensors reading a file
    when SIGTERM came: "not a readable safetensors file") must not turn a signal into exit 2."""
    from specpilot import cli, signals
    from specpilot.errors import InputError

    with signals.installed():
        assert cli._error(InputError("data.json: not valid JSON"), False) == 2
        with pytest.raises(signals.Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert cli._error(InputError("part0.safetensors: not a readable safetensors file"), False) == 128 + 15
    err = capsys.readouterr().err
    assert "specpilot: interrupted by SIGTERM" in err and "not a readable safetensors" not in err


def test_deferred_holds_a_signal_until_the_block_ends():
    from specpilot import signals

    with signals.installed():
        reached = []
        with pytest.raises(signals.Interrupted):
            with signals.deferred():
                with signals.deferred():      # nested: only the outermost block raises
                    os.kill(os.getpid(), signal.SIGINT)
                    reached.append("inner")
                reached.append("outer")
        assert reached == ["inner", "outer"] and signals.stopping()
    with signals.installed():                 # a block without a signal raises nothing
        with signals.deferred():
            pass
        assert not signals.stopping()


def test_atomic_open_commit_callback_runs_after_the_rename_with_signals_held(tmp_path):
    """A signal that lands during ``on_commit`` is raised after it: the caller's callback (w12
    pack's "the output is complete") always runs once the file is in place."""
    from specpilot import fileio, signals

    target, seen = tmp_path / "out.json", []

    def commit():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        seen.append(target.read_text())

    with signals.installed():
        try:
            with pytest.raises(signals.Interrupted):
                with fileio.atomic_open(target, on_commit=commit) as fh:
                    fh.write("done\n")
        finally:
            signals.cleanup()
    assert seen == ["done\n"] and target.read_text() == "done\n" and _part_files(tmp_path) == []


# A benchmark command that records its process group and hangs (sleeping in a child of the shell)
# on its Nth run, counted in a file beside it.
_CANDIDATE = textwrap.dedent("""
    n=$(cat runs 2>/dev/null || echo 0); n=$((n+1)); echo $n > runs
    echo $(ps -o pgid= $$) > pgid
    sleep 0.02
    if [ $n -eq "$HANG_ON" ]; then sleep 300; fi
""")


def _compare(folder: Path, *extra):
    (folder / "cand.sh").write_text(_CANDIDATE)
    return _specpilot("compare", "--base-cmd", "sleep 0.02", "--candidate-cmd", "sh cand.sh", "--runs", "8",
                      "--warmup", "0", "--format", "json", "--out", "timing.json", *extra, cwd=folder)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_during_compare_ends_the_group_and_keeps_samples(tmp_path, sig, monkeypatch):
    monkeypatch.setenv("HANG_ON", "5")  # runs 1-4 make two ABBA blocks; run 5 hangs
    proc = _compare(tmp_path)
    runs = tmp_path / "runs"
    _wait_for(lambda: runs.exists() and runs.read_text().strip() == "5" and (tmp_path / "pgid").read_text().strip()
              and (tmp_path / "timing.partial.json").exists(), proc=proc, what="the hanging run")
    time.sleep(0.2)  # the shell has started its sleep
    pgid = int((tmp_path / "pgid").read_text())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert _group_gone(pgid), "the benchmark command's process group outlived compare"
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"specpilot: interrupted by {sig.name}; 4 paired samples kept in timing.partial.json; "
                           "continue with --resume timing.partial.json"), err
    partial = json.loads((tmp_path / "timing.partial.json").read_text())
    assert partial["schema"] == "specpilot.timing-partial/1" and partial["runs"] == 4 and len(partial["aa"]) == 2
    assert _part_files(tmp_path) == [] and not (tmp_path / "timing.json").exists()
    if sig != signal.SIGTERM:
        return
    # resume: the four kept samples and four new ones; the partial file goes when it finishes
    proc = _compare(tmp_path, "--resume", "timing.partial.json")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 1), err
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["runs"] == 8 and [s["block"] for s in timing["samples"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    fields = lambda s: (s["pair"], s["block"], s["base"], s["candidate"])  # noqa: E731
    assert [fields(s) for s in timing["samples"][:4]] == [fields(s) for s in partial["samples"]]
    assert not (tmp_path / "timing.partial.json").exists() and int(runs.read_text()) == 9


def test_resume_refuses_samples_of_other_systems(tmp_path, monkeypatch):
    monkeypatch.setenv("HANG_ON", "0")
    (tmp_path / "p.json").write_text(json.dumps({
        "schema": "specpilot.timing-partial/1", "base": "sleep 1", "candidate": "sh cand.sh", "metric": "wall",
        "unit": "s", "higher_is_better": False, "schedule": "ABBA", "runs": 0, "samples": [], "aa": []}))
    proc = _compare(tmp_path, "--resume", "p.json")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--resume p.json: its samples are of base 'sleep 1'" in err, err
    assert not (tmp_path / "runs").exists()  # refused before running anything


def test_sigterm_during_audit_collect_keeps_rows_and_resumes(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "prompt_ids": [1, 10 + i]})
                               + "\n" for i in range(5)))
    log = tmp_path / "served.log"
    stub, port = stub_generate.start("stall", 2, log)
    try:
        proc = _specpilot("audit", "collect", f"http://127.0.0.1:{port}", "--prompts", prompts, "--save", "s.jsonl",
                          cwd=tmp_path)
        _wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 2, proc=proc, what="two answers")
        time.sleep(0.3)  # the third request is waiting on the stalled server
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stub.kill()
        stub.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "kept the 2 of 5 outputs collected so far in s.jsonl; continue with --resume" in err, err
    kept = [json.loads(x)["id"] for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert kept == ["p0", "p1"] and _part_files(tmp_path) == []
    log.unlink()
    stub, port = stub_generate.start("stall", 99, log)
    try:
        proc = _specpilot("audit", "collect", f"http://127.0.0.1:{port}", "--prompts", prompts, "--save", "s.jsonl",
                          "--resume", cwd=tmp_path)
        _, err = proc.communicate(timeout=120)
    finally:
        stub.kill()
        stub.wait()
    assert proc.returncode == 0, err
    # the server came back at another port: resumed, with a note that the rows name the old one
    assert "of its rows were collected from http://127.0.0.1:" in err and "resume only if that server runs the same model" in err
    assert [json.loads(x) for x in log.read_text().splitlines()] == [[1, 12], [1, 13], [1, 14]]  # only the rest ran
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(5)]
