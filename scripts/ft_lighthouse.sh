#!/usr/bin/env bash
# Start torchft's lighthouse: the process the fault-tolerant replica groups ([fault_tolerance], docs/fault_tolerance.md)
# agree on each step's participants through. One per job, on a host every group reaches (a login or head node):
#   ./scripts/ft_lighthouse.sh                      # listens on [::]:29510
#   PORT=29600 ./scripts/ft_lighthouse.sh
# Then give the groups its address: --fault_tolerance.lighthouse http://<host>:29510 (or TORCHFT_LIGHTHOUSE).
#
# JOIN_TIMEOUT_MS: how long a quorum waits for a group that is heartbeating but not yet asking for it (a group that
#   just restarted joins this step instead of a later one). HEARTBEAT_TIMEOUT_MS: a group whose manager sent no
#   heartbeat for this long is dead and leaves at the next quorum (the lower, the sooner the others go on; the
#   heartbeat is a thread of torchft's manager, so a long step or checkpoint save does not interrupt it).
set -euo pipefail
command -v torchft_lighthouse >/dev/null || { echo "torchft_lighthouse not found: pip install 'titanlike[ft]'" >&2; exit 2; }
exec torchft_lighthouse \
    --bind "${BIND:-[::]}:${PORT:-29510}" \
    --min_replicas "${MIN_REPLICAS:-1}" \
    --join_timeout_ms "${JOIN_TIMEOUT_MS:-10000}" \
    --quorum_tick_ms "${QUORUM_TICK_MS:-100}" \
    --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-5000}"
