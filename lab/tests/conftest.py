"""Lab tests: ``pytest lab/tests`` from the repository root (not part of the default suite).

The repository root goes on ``sys.path`` (for ``import lab``) and so does ``tests/`` (its helpers,
e.g. ``gluon_ptx``); without CUDA the kernels run in Triton's interpreter and GPU tests are skipped,
as in ``tests/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():   # before any test module imports Triton: kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
