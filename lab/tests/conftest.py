"""Lab tests: ``pytest lab/tests`` from the repository root (not part of the default suite).

The repository root goes on ``sys.path`` (for ``import lab``) and so does ``tests/`` (its helpers,
e.g. ``gluon_ptx``); GPU tests are skipped without CUDA, as in ``tests/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        if torch.cuda.is_available():
            return
    except Exception:
        pass
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
