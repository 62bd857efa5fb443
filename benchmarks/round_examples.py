#!/usr/bin/env python3
"""The committed example rounds' verdicts as results files, for docs/round.md's figures table.

    python benchmarks/round_examples.py          # examples/rounds/*/ -> benchmarks/results/round_<name>.json

Each round folder holds what ``specpilot round`` wrote (``round.json``, ``approve/decisions.json``);
this reads them back through the round's own readers and writes one results file per round: the
machine and versions the round ran on (its facts), and per judged candidate the gain, its 95%
interval, the threshold, the noise and the audit. Nothing is measured here: the rounds did that.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def subject(folder: Path) -> str:
    """The results subject of a round folder: ``smollm2-cpu`` -> ``smollm2_cpu``."""
    return re.sub(r"[^a-z0-9]+", "_", folder.name.lower())


def rows_of(folder: Path) -> dict:
    from specpilot.auditors.round import load_round

    res = load_round(folder)
    st = res.state
    facts, versions = st["facts"], st.get("versions") or {}
    rows = []
    for d in res.decisions:
        t, a = d.timing or {}, d.audit or {}
        system = next((s for s in a.get("systems") or [] if s.get("role") == "system"), {})
        rows.append({"id": d.id, "base": d.base, "verdict": d.verdict, "gain": t.get("gain"),
                     "ci_low": t.get("ci_low"), "ci_high": t.get("ci_high"),
                     "threshold": 1 + t["threshold"] if t.get("threshold") is not None else None,
                     "noise": t.get("noise"), "audit": a.get("verdict"), "mismatches": system.get("mismatches")})
    return {"benchmark": f"round_{subject(folder)}", "date": st.get("started_at"),
            "round": str(folder.relative_to(REPO)), "gpu": facts.get("gpu") or "cpu", "cpu": facts.get("cpu"), "torch": versions.get("torch"),
            "triton": versions.get("triton"), "deployment": st.get("deployment"), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", default=str(REPO / "examples" / "rounds"), help="folder of round folders")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    from specpilot.fileio import write_json_atomic

    for folder in sorted(p for p in Path(args.rounds).iterdir() if (p / "round.json").is_file()):
        doc = rows_of(folder)
        write_json_atomic(Path(args.out_dir) / f"{doc['benchmark']}.json", doc)
        print(f"{doc['benchmark']}: {len(doc['rows'])} decisions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
