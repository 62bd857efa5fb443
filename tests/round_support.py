"""A small tiny-model round for the tests that need a finished one (about 10 s on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = "engine:model=tiny,mode=ar,threads=1"


def small_round(out_dir: Path, *extra: str) -> Path:
    """``specpilot round`` of the tiny model with one candidate (chain) into ``out_dir``."""
    from specpilot.cli import main

    # a budget well above what the round takes on a quiet machine (its runs are of a fixed shape and at most
    # 16 pairs, so it runs no longer): on a loaded one a tight budget skipped the candidate the tests read
    with pytest.raises(SystemExit) as e:
        main(["round", TINY, "--budget", "2", "--candidates", "chain", "--n-prompts", "2", "--max-new-tokens", "8",
              "--out-dir", str(out_dir), *extra])
    assert e.value.code == 0
    return out_dir
