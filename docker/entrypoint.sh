#!/usr/bin/env bash
# Container entry point: one process per GPU on this node via torchrun; multi-node when NNODES > 1.
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT describe the job; arguments are Hydra overrides.
set -euo pipefail
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec torchrun \
  --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}" \
  -m train "$@"
