#!/usr/bin/env bash
# Pure-Python packages the GPU kit (../shared/gpu) lacks, copied from this machine's .venv into .gpu_extra/ (git
# ignores it) so a device call can carry them. vLLM 0.25 imports compressed_tensors whenever an engine is started
# with any `quantization` (its quantization registry loads every method's module), so rollout.quantization=fp8
# cannot start on the kit alone (2026-12-06, H100: ModuleNotFoundError: No module named 'compressed_tensors').
# Usage: bash tools/setup/gpu_extras.sh; then carry [".gpu_extra"] and put $PWD/.gpu_extra on PYTHONPATH after
# /tmp/gpusite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE="$(ls -d "$ROOT"/.venv/lib/python3*/site-packages)"
rm -rf "$ROOT/.gpu_extra" && mkdir -p "$ROOT/.gpu_extra"
for pkg in compressed_tensors loguru; do
  cp -r "$SITE/$pkg" "$ROOT/.gpu_extra/"
done
find "$ROOT/.gpu_extra" -name __pycache__ -prune -exec rm -rf {} +
echo "mrl: $(du -sh "$ROOT/.gpu_extra" | cut -f1) in .gpu_extra (compressed_tensors, loguru)"
