#!/usr/bin/env bash
# Sets up .venv like run_train.sh, checks the style (ruff, configured in pyproject.toml), then runs the
# test suite: ./run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh
ruff check --quiet .
ruff format --check --quiet .
exec python -m pytest -q "$@"
