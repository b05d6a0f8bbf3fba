#!/bin/bash
# One batchrun job over the GPUs of this machine, one process per GPU, started by torchrun. Each
# process takes shard RANK/WORLD_SIZE (a contiguous run of whole row groups with about 1/N of the
# input's rows, which it alone reads) and the GPU cuda:LOCAL_RANK. All write their parts into the
# job's one output directory; the last to finish writes OUT/_SUCCESS. If a process fails,
# torchrun stops the others; running the script again resumes every shard where it stopped.
#
#   jobs/torchrun.sh                                   # jobs/example.toml on every GPU here
#   NPROC_PER_NODE=4 jobs/torchrun.sh my.toml --max-tokens 64   # more arguments: run flags
#
# Several machines: run it on each with NNODES and MASTER_ADDR (and MASTER_PORT) set; the ranks
# come from torchrun's c10d rendezvous. Without GPUs it starts one process (NPROC_PER_NODE sets it).
set -euo pipefail
JOB_FILE=${1:-jobs/example.toml}
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NPROC_PER_NODE=${NPROC_PER_NODE:-$(( GPUS > 0 ? GPUS : 1 ))}
if [ -n "${NNODES:-}" ]; then
    RENDEZVOUS=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-id="${RDZV_ID:-batchrun}"
                --rdzv-endpoint="${MASTER_ADDR:?set MASTER_ADDR with NNODES}:${MASTER_PORT:-29500}")
else
    RENDEZVOUS=(--standalone)
fi
exec torchrun "${RENDEZVOUS[@]}" --nproc-per-node="$NPROC_PER_NODE" \
    --no-python batchrun run "$JOB_FILE" "${@:2}"
