#!/usr/bin/env bash
# The README's main job: set up .venv (tools/setup/install.sh, a no-op when current), then run the tiny CPU demo.
# Runs GRPO and the learning-rate-0 control run; further arguments go to `mrl demo` (see `mrl demo --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup/install.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1
exec mrl demo --control "$@"
