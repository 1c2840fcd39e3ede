#!/usr/bin/env bash
# Sets up .venv like run_train.sh, then runs the test suite: ./run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh
exec python -m pytest -q "$@"
