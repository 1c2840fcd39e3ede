#!/usr/bin/env bash
# Wheels for the GPU machine, which has torch 2.11 (CPython 3.12, /opt/torch/.venv), pyarrow,
# tokenizers and tensorboard, but no network: torchtitan 0.2.2 and what it needs beyond those,
# at the versions the CPU suite runs, into .whl/ (ignored by git). benchmarks/gpu_check.sh
# installs from there the ones the machine lacks. Run here, with network:
#   ./benchmarks/gpu_wheels.sh            # PYTHON_VERSION=3.12 by default (binary wheels: pandas, xxhash)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELS=(
    torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 tyro==1.0.17 einops==0.8.2 tomli==2.5.0
    # datasets'
    dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 xxhash==4.1.0
    requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
    # tyro's
    docstring-parser==0.18.0 typeguard==4.6.1
)
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
du -sh .whl
