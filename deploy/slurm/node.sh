#!/usr/bin/env bash
# One elasticrun agent per Slurm node: `srun` starts this once on every node of the allocation.
#
#   node.sh SCRIPT [SCRIPT ARGS...]
#
# Every node must meet in the same etcd: the endpoint is the FIRST node of the allocation
# (the first line of `scontrol show hostnames "$SLURM_JOB_NODELIST"`), the same name on every node. A
# per-node value such as `localhost`, `$(hostname)` or `--standalone` gives each node its own
# etcd, and each node forms a world of one. With ELASTICRUN_ETCD_ENDPOINTS set (a replicated
# etcd, "a:2379,b:2379,c:2379"), the agents meet there instead and no node hosts etcd.
#
# Settings (environment): NPROC_PER_NODE (default: gpu), MIN_NODES (default: all nodes of the
# allocation), RDZV_PORT (default 29400), MAX_RESTARTS (default 3), SHUTDOWN_TIMEOUT (default 60:
# keep it below the --signal notice), ELASTICRUN (the command, default `elasticrun`), and
# ELASTICRUN_EXTRA_ARGS (more launcher flags, split on spaces).
set -euo pipefail

: "${SLURM_JOB_ID:?run this under srun (SLURM_JOB_ID is not set)}"
: "${SLURM_JOB_NODELIST:?run this under srun (SLURM_JOB_NODELIST is not set)}"
: "${SLURM_NODEID:?run this under srun (SLURM_NODEID is not set)}"

nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
# The whole list, then its first line: `scontrol ... | head -n 1` would close the pipe while scontrol
# still writes (any allocation whose list outgrows one write), scontrol would die of SIGPIPE, and
# with pipefail this script would exit 141 without a word.
hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST")" || {
    echo "node.sh: 'scontrol show hostnames $SLURM_JOB_NODELIST' failed" >&2
    exit 2
}
head_node="${hosts%%$'\n'*}"
if [[ -z "$head_node" ]]; then
    echo "node.sh: scontrol returned no host for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2
    exit 2
fi

if [[ -n "${ELASTICRUN_ETCD_ENDPOINTS:-}" ]]; then
    rdzv=(--rdzv-backend etcd-v3 --rdzv-endpoint "$ELASTICRUN_ETCD_ENDPOINTS")
else
    # The first node hosts the job's etcd (decided by SLURM_NODEID, not by resolving names).
    is_host=0
    [[ "$SLURM_NODEID" == 0 ]] && is_host=1
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "$head_node:${RDZV_PORT:-29400}" --rdzv-conf "is_host=$is_host")
fi

read -r -a extra <<< "${ELASTICRUN_EXTRA_ARGS:-}"
# exec: the agent IS the srun task, so Slurm's signals (the --signal notice, scancel) reach it directly.
exec ${ELASTICRUN:-elasticrun} \
    --nnodes "${MIN_NODES:-$nodes}:$nodes" \
    --nproc-per-node "${NPROC_PER_NODE:-gpu}" \
    --rdzv-id "slurm-$SLURM_JOB_ID" \
    --node-id "${SLURMD_NODENAME:-$(hostname)}" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-60}" \
    "${rdzv[@]}" ${extra[@]+"${extra[@]}"} "$@"
