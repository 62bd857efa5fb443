"""apply / status / revert / memory verify: what they refuse to write over in the target environment
(SGLang's package and metadata, wherever a .pth leads), the commands they suggest when the target's
SpecPilot differs, an activation file that cannot be replaced, and the probe of a --python that hangs."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.bundles import activation as act
from specpilot.bundles import sglang_env
from conftest import refused
from sglang_support import SKIP_REASON, make_env, purelib, sglang_dir
from sglang_support import env_fixture  # noqa: F401  (the env fixture: a target environment per module)

SGL = sglang_dir()


def _fake_sglang(root: Path) -> Path:
    """A stand-in SGLang under ``root`` (its package and .dist-info): what the probe finds, never the real
    wheel's files, so a test that fails writes over nothing shared."""
    (root / "sglang" / "srt" / "speculative").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "srt" / "speculative" / "eagle_utils.py").write_text("# stand-in\n")
    meta = root / "sglang-0.5.23.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    return root


@pytest.fixture(scope="module", params=["pth", "site-packages"])
def fake_env(request, tmp_path_factory) -> tuple[Path, Path]:
    """(python, SGLang's root): SGLang reached through a .pth (the docs' layout) or installed in site-packages."""
    where = tmp_path_factory.mktemp("fake")
    if request.param == "pth":
        root = _fake_sglang(where / "sgl")
        return make_env(where / "env", root), root
    py = make_env(where / "env", None)
    return py, _fake_sglang(purelib(py))


def _targets(py: Path, root: Path) -> list[Path]:
    return [root / "sglang" / "srt" / "speculative" / "eagle_utils.py", root / "sglang-0.5.23.dist-info" / "METADATA",
            purelib(py) / "_specpilot_under_test.pth"]


@pytest.mark.parametrize("verb", [["memory", "verify"], ["status"], ["revert"], ["apply", "tree", "--dry-run"]])
def test_out_never_writes_over_sglang_or_site_packages(run_cli, fake_env, verb):
    py, root = fake_env
    for target in _targets(py, root):
        before = target.read_bytes()
        code, out, err = run_cli(*verb, "--python", py, "--out", target)
        refused(code, err, f"--out {target}")
        assert target.read_bytes() == before and out == ""
    assert not (purelib(py) / act.ACTIVATION_NAME).exists()


def test_memory_verify_out_is_not_the_activation_file(run_cli, fake_env):
    py, _ = fake_env
    path = purelib(py) / act.ACTIVATION_NAME
    code, _, err = run_cli("memory", "verify", "--python", py, "--out", path)
    refused(code, err, "that is the activation file")
    assert not path.exists()


def _other_specpilot(monkeypatch):
    """The probe as it reads an environment whose SpecPilot's bundle modules differ from this one's."""
    real = act.probe

    def probe(python=None, timeout=None, modules=()):
        e = real(python, timeout, modules)
        e.fingerprints = {m: "sha256:" + "2" * 64 for m in e.fingerprints}
        return e

    monkeypatch.setattr(act, "probe", probe)


@pytest.mark.skipif(SGL is None, reason=SKIP_REASON)
def test_the_refusal_of_another_specpilot_carries_every_option(run_cli, env, monkeypatch, tmp_path):
    _other_specpilot(monkeypatch)
    out = tmp_path / "my report.json"
    code, _, err = run_cli("apply", "tree", "--python", env, "--drafter", "eagle", "--set", "node_budget=24",
                           "--model", "/models/My Model", "--experimental", "--dry-run", "--format", "json",
                           "--out", out)
    assert code == 3 and "differs from this one" in err, err
    hint = err.split("run that environment's own: ", 1)[1].strip()
    assert shlex.split(hint) == [str(env), "-m", "specpilot", "apply", "tree", "--drafter", "eagle",
                                 "--set", "node_budget=24", "--model", "/models/My Model", "--experimental",
                                 "--dry-run", "--format", "json", "--out", str(out)]
    assert not (purelib(env) / act.ACTIVATION_NAME).exists() and not out.exists()


@pytest.mark.skipif(SGL is None, reason=SKIP_REASON)
def test_status_suggests_the_targets_own_apply_when_its_specpilot_differs(run_cli, env, monkeypatch):
    path = purelib(env) / act.ACTIVATION_NAME
    code, _, err = run_cli("apply", "tree", "--python", env, "--drafter", "eagle", "--set", "node_budget=24")
    assert code == 0, err
    try:
        _other_specpilot(monkeypatch)
        code, out, err = run_cli("status", "--python", env)
        assert code == 1, err
        cmd = next(ln.strip() for ln in out.splitlines() if " -m specpilot apply " in ln)
        assert shlex.split(cmd) == [str(env), "-m", "specpilot", "apply", "tree", "--drafter", "eagle",
                                    "--set", "node_budget=24"]
        # apply run here refuses it, as the suggestion says
        code, _, err = run_cli(*shlex.split(cmd)[3:], "--python", env)
        assert code == 3 and "differs from this one" in err
        monkeypatch.undo()
        code, out, _ = run_cli("status", "--python", env)
        assert code == 0 and " -m specpilot apply" not in out
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.skipif(SGL is None, reason=SKIP_REASON)
def test_an_activation_file_that_cannot_be_replaced_is_named(run_cli, env, monkeypatch):
    path = purelib(env) / act.ACTIVATION_NAME
    assert run_cli("apply", "tree", "--python", env, "--drafter", "eagle")[0] == 0
    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src, dst):   # as an immutable file (chattr +i) refuses it, its folder writable
        if Path(dst) == path:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(dst))
        return real_replace(src, dst)

    def unlink(self, missing_ok=False):
        if self == path:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        return real_unlink(self, missing_ok)

    try:
        before = path.read_bytes()
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(Path, "unlink", unlink)
        for args, verb in ((["apply", "tree", "--drafter", "eagle", "--set", "node_budget=24"], "replaced"),
                           (["revert"], "removed")):
            code, _, err = run_cli(*args, "--python", env)
            assert code == 3 and f"{path} cannot be {verb} (Operation not permitted)" in err, err
            assert "is not writable" not in err and path.read_bytes() == before
        assert not list(purelib(env).glob(f".{act.ACTIVATION_NAME}.*.part"))
    finally:
        monkeypatch.undo()
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _hanging_python(tmp_path) -> tuple[Path, Path]:
    """(a --python wrapper script that never answers, the file its child's pid lands in)."""
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hangpy.sh"
    script.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {shlex.quote(str(pidfile))}\nwait\n")
    script.chmod(0o755)
    return script, pidfile


def _kill(pidfile: Path) -> None:
    if pidfile.exists() and _alive(int(pidfile.read_text())):
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_probe_that_times_out_leaves_nothing_running(run_cli, tmp_path, monkeypatch):
    script, pidfile = _hanging_python(tmp_path)
    monkeypatch.setattr(sglang_env, "PROBE_TIMEOUT", 1.0)
    try:
        code, _, err = run_cli("status", "--python", script)
        assert code == 3 and f"--python {script}: did not answer within 1 s" in err, err
        assert _gone(int(pidfile.read_text())), "the wrapper's child outlived the probe"
    finally:
        _kill(pidfile)


def test_a_signal_during_the_probe_ends_what_the_wrapper_started(tmp_path):
    script, pidfile = _hanging_python(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "status", "--python", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM" in err, err
        assert _gone(int(pidfile.read_text())), "the wrapper's child outlived the signal"
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill(pidfile)


def test_the_probe_reports_sglangs_metadata_folder(fake_env):
    py, root = fake_env
    env = sglang_env.probe(str(py))
    assert Path(env.sglang_metadata) == root / "sglang-0.5.23.dist-info"
