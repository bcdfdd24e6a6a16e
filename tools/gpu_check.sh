#!/usr/bin/env bash
# The GPU acceptance run on a GPU machine that has the kit installed (../shared/gpu/README.md): the end-to-end GPU
# tests, then tools/bench/e2e_gpu.py, each stage under its own time limit, logs in DIR (default /tmp/mrl_gpu).
# Stages run in the order that finds defects soonest; a failing stage does not stop the next.
# Usage: bash tools/gpu_check.sh [DIR] [STAGE ...]   (stages: sleep learn bench05 peak async bench15 engine;
# also, when named: genlayers, the generation gap layer by layer at the 1.5B shape, tools/bench/gen_overhead.py;
# corr and lora, tools/bench/variants_gpu.py's presets; moe, R3 with vLLM; onecopy, weight_sync.one_copy's tests
# and its 7B bench; chain, learning at model scale: tools/bench/learn_gpu.py's warm-up, then three GRPO runs and the
# lr-0 control side by side, then the GPU learning test from the same task, docs/learning.md; fp8,
# rollout.quantization=fp8: its sync read-back test, then tools/bench/e2e_gpu.py at 1.5B with and without it in one
# run, docs/fp8.md; each of the next fits one device call: rm, the reward-model and teacher stages at 0.5B;
# moe26 then moe26r3, the MoE step at 2.6B without and with R3 (moe26both: both in one call, two steps each);
# moeprof, the MoE update alone at both MoE shapes, its speed-ups switched off one at a time, and its kernel profile
# (tools/bench/engine.py); moeupd, the MoE update's whole step, its optimizer step included, at 2.9B (the same
# bench); moe29 then moe29r3, the MoE step at the 2.9B shape of Qwen3-30B-A3B's layer widths, without and with R3;
# fp8fp32, the read-back test's fp32 scale format; fp8cut, the fused quantiser against torch's, then the read-back
# on the CUTLASS block GEMM; fp8kv, FP8 weights and KV cache at 1.5B against bench15's JSON of the same lease
# (ARGS_fp8kv="--variants fp8kvc": on CUTLASS); fp8pair, BF16 then FP8 weights and KV cache on CUTLASS at 1.5B in
# one run, two steps each (one device call); fp8disk, the same pair through the disk transport; chaintask then
# fp8learn, FP8 rollout with token TIS beside BF16 and the lr-0 control on the chain task; fp8prof, the 1.5B
# decode step's kernels in BF16 and FP8 and the quantise-on-send pass, tools/bench/fp8_profile.py; fp8prof7, the
# same at 7B; moe29seed, R3 at 2.9B with and
# without rollout.seed_requests, two steps each in one call; seedeng, tools/bench/seeded_sampling.py's whole-engine
# comparison at 0.5B on vLLM's V1 runner, then on the one vLLM picks).
# STAGE:SECONDS overrides a stage's time limit (a tight device lease);
# ARGS_<stage> in the environment is appended to the stage's command, e.g. ARGS_corr="--only off,decoupled".
# MIRROR=FOLDER copies what the stages write into FOLDER as they go (below).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-/tmp/mrl_gpu}"; shift || true
mkdir -p "$DIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_AUTH_MODE=disabled
T=tests/gpu
# Every Python process of a stage (the stage itself, Ray's workers, vLLM's engine cores) prints its threads' stacks
# on SIGUSR1 and when terminated: a stage that hits its limit is signalled before it is killed, so its logs say
# where each process waited.
mkdir -p "$DIR/diag"
printf '%s\n' 'import faulthandler, signal' 'faulthandler.register(signal.SIGUSR1, all_threads=True)' \
  'faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)' > "$DIR/diag/sitecustomize.py"
export PYTHONPATH="$DIR/diag:${PYTHONPATH:-}"
# Three steps, no warm second start; each run's metrics.jsonl stays under DIR/runs, so a stage cut at its limit
# still leaves the steps it made.
QUICK="--steps 3 --no-warm-start --work-dir $DIR/runs"
MOE="--offload optimizer --gpu-memory-utilization 0.4"  # an H100 holds neither the Adam state nor a 0.5 engine beside it
declare -A CMD=(
  [sleep]="python3 -m pytest $T/test_vllm_sleep_frees_its_reservation_and_wake_restores_it.py -q -s --timeout=300"
  [learn]="python3 -m pytest $T/test_hybrid_grpo_learns_on_gpu_and_every_sync_lands_bit_for_bit.py -q -s --timeout=600"
  [bench05]="python3 tools/bench/e2e_gpu.py --shapes 0.5b --json $DIR/e2e_0.5b.json"
  [peak]="python3 -m pytest $T/test_hybrid_run_with_a_large_training_peak_completes_beside_the_engine.py -q -s --timeout=600"
  [async]="python3 -m pytest $T/test_colocate_async_on_one_gpu_stays_within_its_staleness_bound.py -q -s --timeout=400"
  [bench15]="python3 tools/bench/e2e_gpu.py --shapes 1.5b --json $DIR/e2e_1.5b.json"
  [genlayers]="python3 tools/bench/gen_overhead.py --shape 1.5b --dtype bfloat16 --response-length 1024 --agent-workers 1 4 --num-cpus 16"
  [corr]="python3 tools/bench/variants_gpu.py --preset correction --enforce-eager --json $DIR/corr.json"
  [lora]="python3 tools/bench/variants_gpu.py --preset lora --enforce-eager --json $DIR/lora.json"
  [moe]="python3 -m pytest $T/test_moe_r3_with_vllm_routes_like_the_engine.py -q -s --timeout=480"
  [onecopy]="python3 -m pytest $T/test_weight_sync_one_copy_lands_bit_for_bit_in_vllm.py $T/test_hybrid_one_copy_sync_lands_bit_for_bit.py -q -s --timeout=300; python3 tools/bench/weight_sync.py --one-copy --buckets-mb 2048,4096 --variants one,two --repeats 3 --vllm-bucket-mb 4096 --out $DIR/ws_one_copy.json"
  [chain]="python3 tools/bench/learn_gpu.py --shape 0.1b --out $DIR/learn --stages warmup && python3 tools/bench/learn_gpu.py --shape 0.1b --out $DIR/learn --stages grpo control --grpo-runs 1:1 2:1 1:0.7 --side-by-side --grpo-seconds 900 --control-seconds 900; MRL_LEARN_TASK=$DIR/learn/task MRL_LEARN_OUT=$DIR/learn_test python3 -m pytest $T/test_grpo_learns_the_chain_task_beyond_its_control_on_gpu.py -q -s --timeout=900"
  [fp8]="python3 -m pytest $T/test_fp8_rollout_engine_holds_the_quantised_export_after_every_sync.py -q -s --timeout=400; python3 tools/bench/e2e_gpu.py --shapes 1.5b --variants none fp8 --no-warm-start --json $DIR/e2e_fp8.json"
  [rm]="python3 tools/bench/e2e_gpu.py --shapes 0.5b --variants rm distill --direct none $QUICK --json $DIR/e2e_rm.json"
  [moe26]="python3 tools/bench/e2e_gpu.py --shapes moe2.6b --variants none --direct-rounds 1 $QUICK $MOE --json $DIR/e2e_moe.json"
  [moe26both]="python3 tools/bench/e2e_gpu.py --shapes moe2.6b --variants none r3 --direct first --direct-rounds 1 --steps 2 --no-warm-start --work-dir $DIR/runs $MOE --json $DIR/e2e_moe.json"
  [moeprof]="python3 tools/bench/engine.py --shapes moe2.6b,moe2.9b --workloads 32x1024,32x1024-32k --variant-workload 32x1024 --variants moe2.6b,moe2.9b --profile moe2.6b,moe2.9b --logprob-tokens '' --iters 3 --warmup 1 --out $DIR/engine_moe.json"
  [moeupd]="python3 tools/bench/engine.py --shapes moe2.9b --workloads 32x1024-8k,32x1024 --with-optimizer --logprob-tokens '' --iters 3 --warmup 1 --out $DIR/engine_moeupd.json"
  [moe29]="python3 tools/bench/e2e_gpu.py --shapes moe2.9b --variants none --direct first --direct-rounds 2 $QUICK $MOE --json $DIR/e2e_moe29.json"
  [moe29r3]="python3 tools/bench/e2e_gpu.py --shapes moe2.9b --variants r3 --direct none $QUICK $MOE --baseline-json $DIR/e2e_moe29.json --json $DIR/e2e_moe29_r3.json"
  [moe29seed]="python3 tools/bench/e2e_gpu.py --shapes moe2.9b --variants r3 r3u --direct none $QUICK --steps 2 $MOE --json $DIR/e2e_moe29_seed.json"
  [seedeng]="cd tools/bench && VLLM_USE_V2_MODEL_RUNNER=0 python3 seeded_sampling.py --engine 0.5b --rows 256 && python3 seeded_sampling.py --engine 0.5b --rows 256"
  [moe26r3]="python3 tools/bench/e2e_gpu.py --shapes moe2.6b --variants r3 --direct none $QUICK $MOE --baseline-json $DIR/e2e_moe.json --json $DIR/e2e_moe_r3.json"
  [fp8fp32]="python3 -m pytest $T/test_fp8_rollout_engine_holds_the_quantised_export_after_every_sync.py -k fp32 -q -s --timeout=480"
  [fp8pair]="python3 tools/bench/e2e_gpu.py --shapes 1.5b --variants none fp8kvc --direct none --steps 2 --no-warm-start --work-dir $DIR/runs --json $DIR/e2e_fp8pair.json"
  [fp8disk]="python3 tools/bench/e2e_gpu.py --shapes 1.5b --variants disk fp8kvcdisk --direct none --steps 2 --no-warm-start --work-dir $DIR/runs --json $DIR/e2e_fp8disk.json"
  [fp8cut]="python3 -m pytest $T/test_fp8_fused_quantiser_matches_torch_bit_for_bit.py -q; python3 -m pytest $T/test_fp8_rollout_engine_holds_the_quantised_export_after_every_sync.py -k cutlass -q -s --timeout=300"
  [fp8kv]="python3 tools/bench/e2e_gpu.py --shapes 1.5b --variants fp8kv --direct none $QUICK --baseline-json $DIR/e2e_1.5b.json --json $DIR/e2e_fp8kv.json"
  [fp8prof]="python3 tools/bench/fp8_profile.py --shape 1.5b --variants bf16 fp8kvc --batch 256 512 --gpu-memory-utilization 0.8 --json $DIR/fp8prof.json"
  [fp8prof7]="python3 tools/bench/fp8_profile.py --shape 7b --variants bf16 fp8kvc --batch 256 --gpu-memory-utilization 0.8 --repeats 3 --json $DIR/fp8prof7.json"
  [chaintask]="python3 tools/bench/learn_gpu.py --shape 0.1b --write-task $DIR/chain --warmup-seconds 240"
  [fp8learn]="python3 tools/bench/learn_gpu.py --shape 0.1b --task $DIR/chain/task --out $DIR/fp8learn --stages grpo control --grpo-runs 1:1:5e-6 1:1:5e-6:fp8 --side-by-side --grpo-seconds 300 --control-seconds 300"
  [engine]="python3 -m pytest $T/test_bridge_export_matches_hf_on_cuda.py $T/test_engine_sdpa_attention_loss_matches_local_spec_on_cuda.py $T/test_engine_tp1_on_gpu_matches_hf.py $T/test_weight_sync_cuda_ipc_delivers_bit_identical_stream.py -q --timeout=300"
)
declare -A LIMIT=([sleep]=300 [learn]=600 [bench05]=480 [peak]=600 [async]=400 [bench15]=600 [engine]=300 [genlayers]=600 [corr]=600 [lora]=600 [moe]=480 [onecopy]=600 [chain]=2400 [fp8]=1800 [rm]=480 [moe26]=540 [moe26r3]=480 [moe26both]=570 [moeprof]=360 [moeupd]=240 [moe29]=540 [moe29r3]=420 [fp8fp32]=480 [fp8cut]=300 [fp8pair]=580 [fp8disk]=590 [fp8kv]=560 [fp8prof]=540 [fp8prof7]=590 [chaintask]=420 [fp8learn]=560 [moe29seed]=590 [seedeng]=500)
STAGES=("$@"); [[ ${#STAGES[@]} == 0 ]] && STAGES=(sleep learn bench05 peak async bench15 engine)
# MIRROR=FOLDER (a device call's $OUT): copy the summary there, and pack the logs, the JSON figures, the plots and
# every run's metrics.jsonl into one archive there (stage_files.tar.gz), every 15 s and at the end, so a call the lease
# cuts short still brings back what the stages wrote. One archive: the device tool brings back at most 8 files of a
# call, and learn_gpu.py's side-by-side runs alone write 7 (the seventeenth lease lost two runs' metrics that way).
mirror() {
  cp "$DIR"/summary.txt "$MIRROR"/ 2>/dev/null
  (cd "$DIR" && { find . -maxdepth 1 \( -name '*.log' -o -name '*.json' \); find . -name metrics.jsonl
                  find . -mindepth 2 -maxdepth 2 \( -name '*.log' -o -name '*.json' -o -name '*.png' \); } 2>/dev/null |
     tar czf "$MIRROR/stage_files.partial" -T - 2>/dev/null) && mv "$MIRROR/stage_files.partial" "$MIRROR/stage_files.tar.gz"
}
if [[ -n "${MIRROR:-}" ]]; then
  mkdir -p "$MIRROR"; (while sleep 15; do mirror; done) & MIRROR_LOOP=$!
  trap 'kill $MIRROR_LOOP 2>/dev/null; mirror' EXIT
fi
# Kill what a stage left (its engines, Ray's processes), but none of this script's callers: a device call's own
# command line names /tmp/gpusite/vllm, and a plain `pkill -f vllm` ended the call before the last mirror.
kill_leftovers() {
  local callers=" " pid=$$ p
  while [[ -n $pid && $pid != 0 ]]; do callers+="$pid "; pid=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' '); done
  for p in $(pgrep -f "vllm|ray::|raylet|gcs_server|EngineCore"); do
    [[ $callers == *" $p "* ]] || kill -9 "$p" 2>/dev/null
  done
}
for named in "${STAGES[@]}"; do
  stage=${named%%:*}; limit=${LIMIT[$stage]}; [[ $named == *:* ]] && limit=${named##*:}
  start=$(date +%s)
  echo "=== $stage ($(date -u +%H:%M:%S))" | tee -a "$DIR/summary.txt"
  touch "$DIR/.stage_start"
  extra="ARGS_$stage"
  timeout "$limit" bash -c "${CMD[$stage]} ${!extra:-}" > "$DIR/$stage.log" 2>&1
  rc=$?
  lines=60
  if [[ $rc == 124 ]]; then pkill -USR1 -f "ray::|EngineCore" > /dev/null 2>&1; sleep 3; lines=400; fi
  # The engines and workers log into Ray's session folder, not the stage's log: keep the tails of this stage's
  # (vLLM's own log, its throughput lines included, goes to the workers' stdout, the .out files).
  # Every Ray session's, not only the latest: learn_gpu.py's side-by-side runs each start a cluster of their own.
  find /tmp/ray -path '*/logs/*' \( -name '*.err' -o -name '*.out' \) -newer "$DIR/.stage_start" -size +0 \
    -exec tail -n "$lines" {} + > "$DIR/$stage.ray.log" 2>/dev/null
  kill_leftovers; sleep 3  # a stage killed at its limit leaves its engine
  echo "=== $stage rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$DIR/summary.txt"
  grep -E "passed|failed|error|ratios|^== |Error|assert|direct/path|direct \\||client \\||agent x|^engine [0-9a-z.]+, " "$DIR/$stage.log" | tail -n 8 >> "$DIR/summary.txt"
done
echo "=== done" >> "$DIR/summary.txt"
