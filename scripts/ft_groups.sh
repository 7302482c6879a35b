#!/usr/bin/env bash
# Fault-tolerant replica groups on one machine (docs/fault_tolerance.md): a lighthouse and NUM_GROUPS torchrun jobs of
# NPROC_PER_GROUP ranks each, every group with its own rendezvous, dump folder and --fault_tolerance.replica_id; a
# group whose rank dies is restarted by torchrun (MAX_RESTARTS) and rejoins from a healthy group's live state.
#   NUM_GROUPS=2 NPROC_PER_GROUP=4 CONFIG_FILE=configs/debug_model.toml ./scripts/ft_groups.sh --training.steps 100
# Extra arguments go to train.py (the same for every group: the groups must have the same layout). Output:
# $DUMP_FOLDER/group<g>/ (console.log, metrics.jsonl, checkpoints). On a cluster, one job per group instead:
# scripts/ft_slurm.sbatch.
set -uo pipefail
cd "$(dirname "$0")/.."
NUM_GROUPS=${NUM_GROUPS:-2}
NPROC_PER_GROUP=${NPROC_PER_GROUP:-1}
CONFIG_FILE=${CONFIG_FILE:-configs/debug_model.toml}
DUMP_FOLDER=${DUMP_FOLDER:-./outputs/ft}
MAX_RESTARTS=${MAX_RESTARTS:-3}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
BASE_PORT=${BASE_PORT:-29600}   # group g's rendezvous: BASE_PORT + g
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

mkdir -p "$DUMP_FOLDER"
PORT=$LIGHTHOUSE_PORT BIND=127.0.0.1 JOIN_TIMEOUT_MS=${JOIN_TIMEOUT_MS:-2000} ./scripts/ft_lighthouse.sh \
    > "$DUMP_FOLDER/lighthouse.log" 2>&1 &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null' EXIT
pids=()
for ((g = 0; g < NUM_GROUPS; g++)); do
    mkdir -p "$DUMP_FOLDER/group$g"
    torchrun --nproc_per_node="$NPROC_PER_GROUP" --rdzv_backend=c10d --rdzv_endpoint="127.0.0.1:$((BASE_PORT + g))" \
        --max-restarts "$MAX_RESTARTS" \
        train.py --job.config_file "$CONFIG_FILE" --job.dump_folder "$DUMP_FOLDER/group$g" \
        --fault_tolerance.enable --fault_tolerance.group_size "$NUM_GROUPS" --fault_tolerance.replica_id "$g" \
        --fault_tolerance.lighthouse "http://127.0.0.1:$LIGHTHOUSE_PORT" "$@" \
        > "$DUMP_FOLDER/group$g/console.log" 2>&1 &
    pids+=($!)
    echo "group $g: pid $!, log $DUMP_FOLDER/group$g/console.log"
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit "$rc"
