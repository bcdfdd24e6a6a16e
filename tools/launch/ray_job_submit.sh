#!/usr/bin/env bash
# Submit `mrl train RECIPE [overrides]` to a running Ray cluster as a Ray job (docs/launch.md).
#
#   RAY_ADDRESS=http://HEAD_IP:8265 tools/launch/ray_job_submit.sh qwen3/8b_grpo model.path=/models/Qwen3-8B \
#       data.train_files=[/data/math/train.parquet] trainer.total_training_steps=100
#
# The job's driver runs on the head node and joins the cluster (--ray-address auto); the working directory (this
# checkout, without .venv, runs/ and tmp/) is uploaded, so recipes edited locally are the ones that run. `mrl plan`
# runs first and refuses a recipe that cannot start. RAY_ADDRESS defaults to the loopback head of ray_cluster.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
recipe="${1:?usage: ray_job_submit.sh RECIPE [key=value ...]}"
shift
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

# Exit 1: the recipe cannot start (refuse); 2: the model's shape is unknown on this machine (submit anyway).
plan_rc=0
plan_out="$(python -m mrl.cli plan "$recipe" "$@" 2>&1)" || plan_rc=$?
if [[ $plan_rc == 1 ]]; then
  echo "$plan_out"
  echo "mrl plan: this recipe cannot start; not submitted" >&2
  exit 1
elif [[ $plan_rc != 0 ]]; then
  echo "mrl plan did not run here ($plan_out); submitting without it" >&2
fi

runtime_env='{"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
              "excludes": [".venv", "runs", "tmp", ".git"]}'
ray job submit --working-dir . --runtime-env-json "$runtime_env" -- \
  python -m mrl.trainer.main "$recipe" "$@" --ray-address auto
