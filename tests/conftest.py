"""Shared test setup: markers, CLI runner helper, paths to the shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The repository root holds the package's folders (kernels/, engine/, ...) under their installed
# names specpilot.*; on sys.path (``python -m pytest`` puts the working directory there) its
# kernels/ would shadow Hugging Face's ``kernels`` package, which transformers imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
SHARED = Path(os.environ.get("SPECPILOT_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"
LOCAL_FIXTURES = REPO / "tests" / "fixtures"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_cli():
    """Run ``specpilot ARGS`` in-process the way a user does; returns (exit_code, stdout, stderr)."""
    from specpilot.cli import main

    def _run(*args, input=None):
        import io
        import sys

        out, err = io.StringIO(), io.StringIO()
        old = sys.stdout, sys.stderr, sys.stdin
        sys.stdout, sys.stderr = out, err
        if input is not None:
            sys.stdin = io.StringIO(input)
        code = 0
        try:
            main(list(map(str, args)))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.stdout, sys.stderr, sys.stdin = old
        return code, out.getvalue(), err.getvalue()

    return _run


@pytest.fixture
def fixtures_dir():
    if not FIXTURES.is_dir():
        pytest.skip(f"shared fixtures not found at {FIXTURES}")
    return FIXTURES


def one_error(err: str) -> str:
    """The one ``specpilot: error:`` line of a failed run's stderr (status lines such as
    ``specpilot: loading model ...`` may come before it; nothing else may)."""
    lines = err.splitlines()
    errors = [ln for ln in lines if ln.startswith("specpilot: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert all(ln.startswith("specpilot: ") for ln in lines) and "Traceback" not in err, err
    return errors[0]
