#!/usr/bin/env bash
# A CI gate on a round's baseline: the current system re-runs the baseline's prompts and must not be
# slower than the baseline beyond the measured noise, and its outputs must pass the token-forcing
# audit against stock. Exit 1 from `specpilot check` fails the job.
#
#   bash examples/ci_gate.sh [BASELINE] [TOLERANCE]
#
# BASELINE: a round's folder or its baseline.json (default: the SmolLM2 CPU round of this folder).
# TOLERANCE: extra slowdown allowed, a fraction; a shared CPU drifts between sessions (default 0.5),
# a dedicated GPU runner needs 0.
set -euo pipefail
cd "$(dirname "$0")/.."
SP=${SPECPILOT:-.venv/bin/specpilot}
BASELINE=${1:-examples/rounds/smollm2-cpu/baseline.json}
OUT=${OUT_DIR:-gate-results}
mkdir -p "$OUT"
"$SP" check --baseline "$BASELINE" --tolerance "${2:-0.5}" --runs "${RUNS:-6}" | tee "$OUT/check.txt"
