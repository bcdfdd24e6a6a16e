#!/usr/bin/env bash
# Run a Megatron-only job (no Ray) on one or more nodes with torchrun, e.g. converting a checkpoint too large for
# one node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 tools/launch/torchrun_megatron.sh \
#       -m mrl.tools.convert to-megatron /models/Qwen3-235B-A22B /ckpt/qwen3_235b --tp 4 --pp 4 --ep 4
#   (the same on the second node with NODE_RANK=1)
#
# Arguments after the script name go to torchrun as the program (`-m module ...` or `script.py ...`). Each rank
# gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, which mrl's init_distributed() reads; NCCL on GPUs,
# gloo on CPU. Environment: NNODES (1), NPROC_PER_NODE (GPUs on this node, else 1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1), MASTER_PORT (29500).
set -euo pipefail
[[ $# -ge 1 ]] || { sed -n '2,13p' "$0"; exit 2; }

gpus="$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)"
nproc="${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

exec torchrun \
  --nnodes "${NNODES:-1}" \
  --nproc-per-node "$nproc" \
  --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  "$@"
