#!/usr/bin/env bash
# Creates or reuses a virtual environment and installs torchtitan_seq into it; sourced by
# run_train.sh and run_tests.sh.
#   TORCH_VERSION   the torch release (default 2.13.0, the CPU build on this machine's disk; 2.14.1 and
#                   2.15.0 are CUDA builds that also run on a CPU). Tested: 2.13.0, 2.14.1, 2.15.0.
#   TORCHTITAN      the torchtitan release: 0.2.2 (default; TOML configs) or 0.3 (0.3.0: config
#                   functions, --module torchtitan_seq.recipes), which needs torch 2.14 or later.
#                   Tested: torch 2.13.0, 2.14.1 and 2.15.0 with 0.2.2; torch 2.15.0 with 0.3.
#   VENV            where the environment lives (default .venv for 2.13.0 with 0.2.2,
#                   .venv-torch<version> for another torch with 0.2.2, .venv-torch<version>-titan0.3.0 with 0.3).
# torch goes in first, pinned, so that torchtitan's requirements find it satisfied and never pull
# another build; then torchtitan, pinned, before the project (whose requirement is the tested range).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCHTITAN="${TORCHTITAN:-0.2.2}"
case "$TORCHTITAN" in
    0.2.2) TITAN_SUFFIX="" ;;
    0.3 | 0.3.0)
        TORCHTITAN=0.3.0
        TITAN_SUFFIX="-titan$TORCHTITAN"
        case "$TORCH_VERSION" in
            2.1[4-9]* | 2.[2-9]* | [3-9]*) ;;
            *)
                echo "setup_env.sh: TORCHTITAN=0.3 needs torch 2.14 or later, not TORCH_VERSION=$TORCH_VERSION (e.g. TORCH_VERSION=2.15.0)" >&2
                return 2 2>/dev/null || exit 2
                ;;
        esac
        ;;
    *)
        echo "setup_env.sh: TORCHTITAN=$TORCHTITAN is not supported: use 0.2.2 (the default) or 0.3" >&2
        return 2 2>/dev/null || exit 2
        ;;
esac
if [ "$TORCH_VERSION" = 2.13.0 ] && [ -z "$TITAN_SUFFIX" ]; then
    VENV="${VENV:-$ROOT/.venv}"
else
    VENV="${VENV:-$ROOT/.venv-torch$TORCH_VERSION$TITAN_SUFFIX}"
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
    "$VENV/bin/python" -m pip install -q "torchtitan==$TORCHTITAN"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TORCHTITAN_SEQ_VENV="$VENV"
export TORCHTITAN
