#!/usr/bin/env bash
# The prepared GPU check with the repo's .venv (set up on first use): ./benchmarks/gpu_check.sh --out benchmarks/gpu/$(date +%F)
cd "$(dirname "$0")/.." && source tools/setup_env.sh && exec python benchmarks/gpu_check.py "$@"
