#!/usr/bin/env bash
# Creates or reuses a virtual environment and installs torchtitan_seq into it; sourced by
# run_train.sh and run_tests.sh.
#   TORCH_VERSION   the torch release (default 2.13.0, the CPU build on this machine's disk; 2.14.1 and
#                   2.15.0 are CUDA builds that also run on a CPU). Tested: 2.13.0, 2.14.1, 2.15.0.
#   VENV            where the environment lives (default .venv for 2.13.0, .venv-torch<version> otherwise).
# torch goes in first, pinned, so that torchtitan's requirements find it satisfied and never pull
# another build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ "$TORCH_VERSION" = 2.13.0 ]; then
    VENV="${VENV:-$ROOT/.venv}"
else
    VENV="${VENV:-$ROOT/.venv-torch$TORCH_VERSION}"
fi
STAMP="$VENV/.torchtitan_seq-installed"

if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
# Install again only when the project's requirements changed.
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # tools/requirements/ pins each tested release (a file that asks for a release by name is also what
    # lifts a pip cap below it); another version is installed as asked, untested.
    REQ="$ROOT/tools/requirements/torch-$TORCH_VERSION.txt"
    if [ -f "$REQ" ]; then
        "$VENV/bin/python" -m pip install -q -r "$REQ"
    else
        echo "setup_env.sh: torch $TORCH_VERSION is not among the tested releases (tools/requirements/)" >&2
        "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    fi
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TORCHTITAN_SEQ_VENV="$VENV"
