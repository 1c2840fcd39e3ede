#!/usr/bin/env bash
# Creates or reuses .venv and installs torchtitan_seq into it; sourced by
# run_train.sh and run_tests.sh. torch==2.13.0 goes in first so that
# torchtitan's requirements find it satisfied and never pull another build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.torchtitan_seq-installed"

if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
# Install again only when the project's requirements changed.
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
