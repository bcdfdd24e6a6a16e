#!/usr/bin/env bash
# Start or join a Ray cluster for `mrl train` (docs/launch.md).
#
#   tools/launch/ray_cluster.sh head            # on the head node; prints the address workers and drivers use
#   tools/launch/ray_cluster.sh worker HEAD:PORT # on every other node
#   tools/launch/ray_cluster.sh status | stop    # stop ends every Ray process of this user on this node
#
# Environment: MRL_NODE_IP (this node's address; default 127.0.0.1 so a single machine never listens beyond
# loopback, set it to the node's cluster-network IP for multi-node), RAY_PORT (6379), RAY_DASHBOARD_PORT (8265,
# `ray job submit` talks to it), NUM_GPUS / NUM_CPUS (default: what Ray detects), RAY_TEMP_DIR, RAY_BLOCK=1 to stay
# in the foreground (Slurm steps need that). Every node needs the same Python environment with mrl installed
# (`pip install -e .`), and the model and data paths of the recipe visible at the same place.
set -euo pipefail

NODE_IP="${MRL_NODE_IP:-127.0.0.1}"
PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8265}"

common_args=(--node-ip-address "$NODE_IP")
[[ -n "${NUM_GPUS:-}" ]] && common_args+=(--num-gpus "$NUM_GPUS")
[[ -n "${NUM_CPUS:-}" ]] && common_args+=(--num-cpus "$NUM_CPUS")
[[ -n "${RAY_TEMP_DIR:-}" ]] && common_args+=(--temp-dir "$RAY_TEMP_DIR")
[[ "${RAY_BLOCK:-0}" == 1 ]] && common_args+=(--block)

# Workers run without a driver-side runtime_env when a job joins with --ray-address: set what every mrl process
# expects here, so the Ray workers inherit it. Ray >= 2.5x `ray start` turns token authentication on while its
# clients default to off: say "token" everywhere (drivers too: `export RAY_AUTH_MODE=token`); the token is
# ~/.ray/auth_token (or RAY_AUTH_TOKEN) and must be the same on every node.
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

case "${1:-}" in
  head)
    ray start --head --port "$PORT" --dashboard-host "$NODE_IP" --dashboard-port "$DASHBOARD_PORT" \
      "${common_args[@]}"
    echo "Ray head at $NODE_IP:$PORT"
    echo "  workers:  tools/launch/ray_cluster.sh worker $NODE_IP:$PORT"
    echo "  driver:   RAY_AUTH_MODE=$RAY_AUTH_MODE mrl train RECIPE ... --ray-address $NODE_IP:$PORT"
    echo "  jobs:     RAY_ADDRESS=http://$NODE_IP:$DASHBOARD_PORT tools/launch/ray_job_submit.sh RECIPE ..."
    ;;
  worker)
    address="${2:?usage: ray_cluster.sh worker HEAD_IP:PORT}"
    ray start --address "$address" "${common_args[@]}"
    ;;
  status)
    ray status --address "${2:-$NODE_IP:$PORT}"
    ;;
  stop)
    ray stop
    ;;
  *)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
