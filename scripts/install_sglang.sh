#!/usr/bin/env bash
# Install the real SGLang wheel SpecPilot's bundles are checked against, without its dependencies,
# into cache/sglang/<version>/ (a plain folder, not the project venv). The bundle tests read the
# installed files (AST only, no import of SGLang's heavy dependencies) and point a throw-away test
# environment at this folder.
#
#   bash scripts/install_sglang.sh            # 0.5.23, the version the bundles pin
#   SGLANG_VERSION=0.5.23 bash scripts/install_sglang.sh
#
# Idempotent and fast when already installed (one directory check). If the wheel cannot be
# fetched (no network, no index) it prints a warning and exits 0: the tests that need SGLang then
# skip with a reason that names this script. Set SPECPILOT_SGLANG_STRICT=1 to fail instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${SGLANG_VERSION:-0.5.23}
DEST=cache/sglang/$VERSION
WHEELS=cache/sglang/wheels
PY=${PYTHON:-.venv/bin/python}

if [ -d "$DEST/sglang-$VERSION.dist-info" ] && [ -f "$DEST/sglang/srt/plugins/hook_registry.py" ]; then
    exit 0
fi
fail() {
    echo "install_sglang.sh: warning: $1; SGLang bundle tests will be skipped" >&2
    [ "${SPECPILOT_SGLANG_STRICT:-0}" = "1" ] && exit 1
    exit 0
}
mkdir -p "$WHEELS"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
wheel=$(ls "$WHEELS"/sglang-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
    pip download "sglang==$VERSION" --no-deps --only-binary=:all: -d "$WHEELS" >&2 \
        || fail "could not download sglang==$VERSION"
    wheel=$(ls "$WHEELS"/sglang-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
    [ -n "$wheel" ] || fail "no sglang-$VERSION wheel in $WHEELS"
fi
tmp="$DEST.part.$$"
rm -rf "$tmp"
pip install --no-deps --no-compile --target "$tmp" "$wheel" >&2 || { rm -rf "$tmp"; fail "pip could not install $wheel"; }
rm -rf "$DEST"
mv "$tmp" "$DEST"
echo "installed sglang $VERSION (no dependencies) in $DEST" >&2
