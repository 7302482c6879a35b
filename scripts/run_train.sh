#!/usr/bin/env bash
# Launch titanlike on one node the way cluster users expect:
#   NGPU=8 CONFIG_FILE=configs/llama3_8b.toml ./scripts/run_train.sh --training.steps 100
# Extra arguments are passed through to train.py (they override the TOML).
# Multi-node: see scripts/multinode_slurm.sbatch.
set -euo pipefail
NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-"./configs/debug_model.toml"}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/.."
exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NGPU" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --local-ranks-filter="${LOG_RANK:-0}" \
    --role rank --tee 3 \
    train.py --job.config_file "$CONFIG_FILE" "$@"
