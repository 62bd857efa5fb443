"""What a measured figure names beside it (``specpilot.machine.run_facts``): the benchmarks' results
and ``audit selftest`` take the same facts, and the code revision is this checkout's or "unknown",
never that of a repository the package merely sits in."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = {"git_sha", "date", "python", "torch", "triton", "driver", "gpu"}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.check_output(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                                   text=True).strip()


def _machine_copy(where: Path):
    where.mkdir(parents=True)
    shutil.copy(REPO / "specpilot_cli" / "machine.py", where / "machine.py")
    spec = importlib.util.spec_from_file_location(f"machine_copy_{abs(hash(where))}", where / "machine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    _git(r, "commit", "-q", "--allow-empty", "-m", "one")
    return r


def test_a_checkout_names_its_head_and_the_variable_overrides_it(repo, monkeypatch):
    monkeypatch.delenv("SPECPILOT_GIT_SHA", raising=False)
    mod = _machine_copy(repo / "specpilot_cli")   # the package's folder at the top of its checkout
    head = _git(repo, "rev-parse", "HEAD")
    assert mod.source_revision() == head
    assert mod.source_revision(repo) == head
    monkeypatch.setenv("SPECPILOT_GIT_SHA", "abc123")
    assert mod.source_revision() == "abc123"


def test_an_installed_copy_inside_another_repository_says_unknown(repo, monkeypatch):
    monkeypatch.delenv("SPECPILOT_GIT_SHA", raising=False)
    mod = _machine_copy(repo / "venv" / "site-packages" / "specpilot")
    assert mod.source_revision() == "unknown"
    outside = _machine_copy(repo.parent / "plain" / "specpilot")
    assert outside.source_revision() == "unknown"


def test_benchmarks_and_the_selftest_name_the_same_facts(monkeypatch):
    from specpilot.commands import audit  # noqa: F401  (the self-test's module is imported through it)
    from specpilot.commands._audit_selftest import _environment
    from specpilot.machine import run_facts

    monkeypatch.setenv("SPECPILOT_GIT_SHA", "feedbeef")
    facts = run_facts()
    assert KEYS <= set(facts) and facts["git_sha"] == "feedbeef"
    env = _environment()
    assert env["benchmark"] == "audit_selftest" and env["git_sha"] == "feedbeef"
    assert {k: env[k] for k in KEYS - {"date"}} == {k: facts[k] for k in KEYS - {"date"}}
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import common
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    bench = common.environment()
    assert {k: bench[k] for k in KEYS - {"date"}} == {k: facts[k] for k in KEYS - {"date"}}
