#!/usr/bin/env bash
# Container entry point.
#   entrypoint.sh [train] [overrides...]  `python -m train` under torchrun: one worker per GPU of this node, c10d
#                                         rendezvous, and up to MAX_RESTARTS restarts of all workers after a failure
#                                         (each restart resumes from the run's newest checkpoint)
#   entrypoint.sh COMMAND [ARGS...]       anything else runs as given: python -m data.prepare ..., bash
# Environment (all optional):
#   NNODES          nodes in the job, or MIN:MAX for an elastic job (1)
#   NPROC_PER_NODE  workers on this node (the GPUs torch sees, at least 1)
#   RDZV_ENDPOINT   host:port of the rendezvous, the same on every node: node 0's address on a cluster (127.0.0.1:29500)
#   RDZV_ID         the job's id, the same on every node (SLURM_JOB_ID under SLURM, else "train")
#   MAX_RESTARTS    restarts of the workers before the job fails (3)
#   NCCL_PRESET     ib | ethernet | none: NCCL settings for InfiniBand or for 10/25/100 Gb Ethernet nodes (none);
#                   NCCL_* variables set by the caller win over the preset's
set -euo pipefail

is_training_run() {
  [ "$#" -eq 0 ] || [ "$1" = train ] || [[ "$1" == *=* ]] || [[ "$1" == -* ]]
}

apply_nccl_preset() {
  case "${NCCL_PRESET:-none}" in
    ib)  # InfiniBand (DGX, HDR/NDR fabrics): GPUDirect RDMA over the mlx5 HCAs; sockets only for bootstrap
      export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"
      export NCCL_IB_HCA="${NCCL_IB_HCA:-mlx5}"
      export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
      ;;
    ethernet)  # TCP over 10/25/100 Gb Ethernet (AWS P3 without EFA): more sockets and threads per connection
      export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
      export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
      export NCCL_SOCKET_NTHREADS="${NCCL_SOCKET_NTHREADS:-4}"
      export NCCL_NSOCKS_PERTHREAD="${NCCL_NSOCKS_PERTHREAD:-4}"
      ;;
    none) ;;
    *)
      echo "error: NCCL_PRESET=${NCCL_PRESET} is not one of ib, ethernet, none" >&2
      exit 2
      ;;
  esac
}

if ! is_training_run "$@"; then
  exec "$@"
fi
if [ "${1:-}" = train ]; then
  shift
fi
apply_nccl_preset
nproc="${NPROC_PER_NODE:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
# Restarted workers must not share the rendezvous store with the failed attempt: they would read their peers'
# old addresses from it and fail to connect.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec python -m torch.distributed.run \
  --nnodes="${NNODES:-1}" --nproc-per-node="${nproc}" \
  --rdzv-backend=c10d --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29500}" \
  --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-train}}" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  -m train "$@"
