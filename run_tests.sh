#!/usr/bin/env bash
# Sets up the virtual environment like run_train.sh (tools/setup_env.sh: TORCH_VERSION picks the torch
# release, default 2.13.0), checks the style (ruff, configured in pyproject.toml), then runs the test
# suite: [TORCH_VERSION=2.15.0] ./run_tests.sh [pytest args], on TEST_WORKERS pytest-xdist workers (default 2,
# one a core of CI's machine: a test's ranks leave about half of the cores idle; 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh
ruff check --quiet .
ruff format --check --quiet .
exec python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
