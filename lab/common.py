"""What lab scripts share: ``benchmarks/common.py``'s environment and GPU timing helpers, and
results written to ``lab/results/<name>.json`` (not committed) and to ``$OUT``.

A lab script starts with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from lab.common import bootstrap ...
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from common import (L2Flusher, bootstrap, capture_and_time, environment, parse_int_list,  # noqa: E402,F401
                    print_table, time_cuda_graph, time_interleaved)
from common import write_results as _write_results  # noqa: E402

RESULTS = ROOT / "lab" / "results"


def write_results(name: str, rows: list[dict], extra: dict | None = None, out_dir: str | None = None) -> Path:
    """``benchmarks/common.write_results`` into ``lab/results`` (and ``out_dir`` or ``$OUT``)."""
    return _write_results(name, rows, extra, out_dir=out_dir, results_dir=RESULTS)
