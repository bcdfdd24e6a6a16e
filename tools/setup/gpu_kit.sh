#!/usr/bin/env bash
# The GPU kit (../shared/gpu/build_kit.sh) in parts that fit a device call beside this repository: a call carries
# the tracked tree plus its carried paths, at most 64 MiB, and the tree (4.7 MB on 2026-12-06) no longer fits beside
# the kit's 60 MiB parts. This re-splits the same wheels into 55 MiB pieces in seven parts (part6: the last vLLM
# and Ray pieces and install_kit.sh, 41 MB; part7: the small wheels, 20 MB; on 2026-12-07 a 61.5 MB part6 beside the
# 5.3 MB tree was refused as over 64 MiB, so each part keeps 2 MiB spare). install_kit.sh joins the pieces in sorted
# order and installs every wheel under its folder as before. Usage: bash tools/setup/gpu_kit.sh; then send
# .gpu_kit/part1..part5 and part7, and part6 last with the install (docs/gpu.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SHARED="$ROOT/../shared/gpu"
cd "$ROOT"
mkdir -p .git/info && { grep -qx '/.gpu_kit/' .git/info/exclude || echo '/.gpu_kit/' >> .git/info/exclude; }
bash "$SHARED/build_kit.sh" .gpu_kit > /dev/null
cd .gpu_kit
rm -rf part[0-9]* split_*; for i in 1 2 3 4 5 6 7; do mkdir -p "part$i"; done
split -b 55M -d -a 2 wheels/vllm-0.25.0-*.whl split_vllm.
split -b 55M -d -a 2 wheels/ray-2.60.0-*.whl split_ray.
for i in 0 1 2 3; do mv "split_vllm.0$i" "part$((i + 1))/"; done
mv split_ray.00 part5/; mv split_vllm.04 split_ray.01 part6/
for f in wheels/*.whl; do case "$(basename "$f")" in vllm-*|ray-*) ;; *) cp "$f" part7/;; esac; done
cp "$SHARED/install_kit.sh" "$SHARED/wheels.sha256" part6/
ls split_* 2>/dev/null && { echo "pieces left over: the wheels grew; split finer" >&2; exit 1; }
tracked=$(cd "$ROOT" && git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for p in part*; do
  total=$(( $(du -sb "$p" | cut -f1) + tracked ))
  [ "$total" -le $(( (64 - 2) << 20 )) ] || { echo "$p with the tree is $total bytes, over 62 MiB" >&2; exit 1; }
done
du -sh part*
