#!/usr/bin/env bash
# A regression gate: a candidate engine configuration must stay lossless against stock (token
# forcing) and must not be slower (paired timing). Exit 1 when a verb says no; when a verb cannot
# run (exit 2 bad input, 3 missing environment, 4 a bug, 128+N a signal) the gate exits with that
# code and says so.
#
#   bash examples/ci_gate.sh [CANDIDATE_SPEC] [STOCK_SPEC]
set -uo pipefail
cd "$(dirname "$0")/.."
SP=${SPECPILOT:-.venv/bin/specpilot}
CAND=${1:-engine:model=smollm2,mode=tree,nodes=32}
STOCK=${2:-engine:model=smollm2,mode=chain}
OUT=${OUT_DIR:-gate-results}
mkdir -p "$OUT" || exit 2

# verdict VERB CODE NO: exit 1 with NO on a negative verdict, the verb's own code when it failed
verdict() {
    case "$2" in
        0) ;;
        1) echo "ci_gate: $3" >&2; exit 1 ;;
        2) echo "ci_gate: $1 failed on bad input (exit 2; its error line is above)" >&2; exit 2 ;;
        3) echo "ci_gate: $1 failed: missing environment (exit 3; its error line is above)" >&2; exit 3 ;;
        *) echo "ci_gate: $1 failed (exit $2; its error line is above)" >&2; exit "$2" ;;
    esac
}

"$SP" audit "$CAND" --against "$STOCK" --scorer smollm2 --prompts examples/prompts.jsonl \
    --max-new-tokens 48 --save-outputs "$OUT/outputs" --format json --out "$OUT/audit.json"
verdict audit $? "not lossless against stock (see $OUT/audit.json)"
"$SP" compare --base "$STOCK" --candidate "$CAND" --prompts examples/prompts.jsonl \
    --max-new-tokens 48 --runs "${RUNS:-8}" --format json --out "$OUT/timing.json"
verdict compare $? "not approved as faster (see $OUT/timing.json)"
echo "ci_gate: lossless and approved as faster" >&2
