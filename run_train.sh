#!/usr/bin/env bash
# Train with torchtitan_seq, as torchtitan's run_train.sh does:
#   ./run_train.sh [torchtitan overrides, e.g. --training.steps 20]
#   CONFIG_FILE=train_configs/llama3_8b_32k.toml NGPU=8 ./run_train.sh
# With TORCHTITAN=0.3 (and TORCH_VERSION 2.14 or later, tools/setup_env.sh) the job is a config
# function instead, CONFIG (default llama3_debugmodel_seq1f1b) of MODULE (default
# torchtitan_seq.recipes), and the overrides are torchtitan 0.3's:
#   TORCHTITAN=0.3 TORCH_VERSION=2.15.0 ./run_train.sh --training.steps 20
# Creates or reuses .venv on first use. Without CUDA it runs on the CPU with
# gloo and NGPU ranks (default 2); with CUDA it uses NCCL and the GPUs.
# TORCHTITAN_SEQ_SKIP_CHECK=1 skips the start-up check below (one process
# importing torchtitan, ~7 s on a CPU): every rank runs the same check anyway,
# so a bad job still fails, only with a traceback per rank instead of one line.
# For callers that launch many jobs known to be valid (the test suite).
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh

if [ "$TORCHTITAN" = 0.2.2 ]; then
    CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
    if [ ! -f "$CONFIG_FILE" ]; then
        echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE does not exist" >&2
        exit 2
    fi
    JOB=(--job.config_file "$CONFIG_FILE")
else
    JOB=(--module "${MODULE:-torchtitan_seq.recipes}" --config "${CONFIG:-llama3_debugmodel_seq1f1b}")
fi
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    NGPU=${NGPU:-8}
else
    NGPU=${NGPU:-2}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# The last pipeline stage owns the loss, but every rank logs it: rank 0 is enough.
export LOG_RANK=${LOG_RANK:-0}

# Check the job first: a bad setting gets one line, not a traceback per rank.
if [ "${TORCHTITAN_SEQ_SKIP_CHECK:-0}" != 1 ]; then
    WORLD_SIZE="$NGPU" python -m torchtitan_seq.train --check "${JOB[@]}" "$@"
fi

exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan_seq.train "${JOB[@]}" "$@"
