#!/usr/bin/env bash
# A regression gate: a candidate engine configuration must stay lossless against stock (token
# forcing) and must not be slower (paired timing). Exit 1 from either verb fails the job.
#
#   bash examples/ci_gate.sh [CANDIDATE_SPEC] [STOCK_SPEC]
set -euo pipefail
cd "$(dirname "$0")/.."
SP=${SPECPILOT:-.venv/bin/specpilot}
CAND=${1:-engine:model=smollm2,mode=tree,nodes=32}
STOCK=${2:-engine:model=smollm2,mode=chain}
OUT=${OUT_DIR:-gate-results}
mkdir -p "$OUT"
"$SP" audit "$CAND" --against "$STOCK" --scorer smollm2 --prompts examples/prompts.jsonl \
    --max-new-tokens 48 --save-outputs "$OUT/outputs" --format json --out "$OUT/audit.json"
"$SP" compare --base "$STOCK" --candidate "$CAND" --prompts examples/prompts.jsonl \
    --max-new-tokens 48 --runs "${RUNS:-8}" --format json --out "$OUT/timing.json" || {
    echo "not approved as faster (see $OUT/timing.json)" >&2; exit 1; }
