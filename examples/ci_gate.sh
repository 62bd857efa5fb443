#!/usr/bin/env bash
# A CI gate on a round's baseline: the current system re-runs the baseline's prompts and must not be
# slower than the baseline beyond the measured noise, and its outputs must pass the token-forcing
# audit against stock. Exit 1 when `specpilot check` says no; when it cannot run (exit 2 bad input,
# 3 missing environment, 4 a bug, 128+N a signal) the gate exits with that code and says so.
#
#   bash examples/ci_gate.sh [BASELINE] [TOLERANCE]
#
# BASELINE: a round's folder or its baseline.json (default: the SmolLM2 CPU round of this folder).
# TOLERANCE: extra slowdown allowed, a fraction; a shared CPU drifts between sessions (default 0.5),
# a dedicated GPU runner needs 0.
# BASELINE, OUT_DIR (default gate-results) and SPECPILOT are paths from where it is called; the
# defaults of BASELINE and SPECPILOT (.venv/bin/specpilot) are this repository's.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SP=${SPECPILOT:-$REPO/.venv/bin/specpilot}
BASELINE=${1:-$REPO/examples/rounds/smollm2-cpu/baseline.json}
OUT=${OUT_DIR:-gate-results}
mkdir -p "$OUT" || exit 2

"$SP" check --baseline "$BASELINE" --tolerance "${2:-0.5}" --runs "${RUNS:-6}" | tee "$OUT/check.txt"
code=${PIPESTATUS[0]}
case "$code" in
    0) echo "ci_gate: no regression, audit passed" >&2 ;;
    1) echo "ci_gate: a regression beyond the noise or a failed audit (see $OUT/check.txt)" >&2 ;;
    2) echo "ci_gate: check failed on bad input (exit 2; its error line is above)" >&2 ;;
    3) echo "ci_gate: check failed: missing environment (exit 3; its error line is above)" >&2 ;;
    *) echo "ci_gate: check failed (exit $code; its error line is above)" >&2 ;;
esac
exit "$code"
