"""GPU end to end: mrl's hybrid GRPO step on one device, and vLLM driven directly on the same prompts.

For each shape (Qwen2.5-0.5B / 1.5B, or a Qwen3-MoE with 64 experts, top-8: `moe2.6b`, 2.6B parameters of which about
0.5B active, or `moe2.9b`, Qwen3-30B-A3B's layer widths in 8 layers; random bf16 weights, the demo's character
tokenizer), in one process:
1. mrl cold: `build_trainer` (Ray, Megatron actor, vLLM replica, agent loops) timed, then `--steps` steps of
   hybrid GRPO with responses of exactly `--response-length` tokens (ignore EOS), nothing of the training state
   offloaded (it fits beside the engine on an H200). Per step: gen, old log-prob, update, the sync's parts
   (wake weights / export+transfer+load / offload / wake KV cache), the hand-over's sleep and onload, tokens/s,
   MFU per phase and memory at each hand-over; medians over the steps after the first (warm-up).
2. vLLM direct: AsyncLLM in this process with the replica's own engine arguments (the adapter builds them from
   the same config: memory fraction, graphs, dtype, lengths, sleep mode, worker extension), the same B × n
   requests and sampling; median of `--direct-rounds` rounds after a warm-up round.
3. mrl warm: `build_trainer` again on the same machine (compile caches filled), timed, then shut down.
Prints one table per shape and the ratios the GPU issue asks for; `--json` writes everything. Where a gap in
generation lies (the server process and its RPC, or the agent loops): tools/bench/gen_overhead.py, same shapes.
`--variants none fp8 r3` repeats 1 and 2 per shape for each variant in the same run (same prompts, seeds and
lengths) and prints each against the first: generation tokens/s (through mrl and direct), bytes per sync, sync time
(export + quantise + transfer + load, `sync/update`) and `logprob_mismatch`. fp8 is rollout.quantization=fp8
(docs/fp8.md), fp8kv adds vLLM's FP8 KV cache; r3 is actor.megatron.router_replay=rollout, MoE shapes only
(docs/moe.md); rm adds a colocated reward model of the policy's shape (random weights) and distill a teacher of
its shape: each prints the share of the step its stage takes (`timing_s/reward_colocated`, `timing_s/teacher`;
docs/reward_models.md). `--direct first` drives vLLM directly for the first variant only (the others change the
trainer, not generation), `--baseline-json` compares the variants with the first variant of an earlier run on the
same machine instead.

    python tools/bench/e2e_gpu.py --shapes 0.5b 1.5b --response-length 1024 --batch 32 --n 8
    python tools/bench/e2e_gpu.py --shapes 1.5b --variants none fp8 --json /tmp/fp8.json
    python tools/bench/e2e_gpu.py --shapes moe2.6b --variants none r3 --direct first --json /tmp/moe.json
    python tools/bench/e2e_gpu.py --shapes 0.5b --variants rm distill --direct none --json /tmp/rm.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

REWARD_FN = "mrl.data.synthetic:exact_match_reward"
SYNC_PARTS = ("sync/wake_weights", "sync/update", "sync/offload", "sync/wake_kv_cache")
# inside sync/update: setting up, sending (inside it: the sender's stream, with its FP8 quantising, and its waits for
# acknowledgements), the wait for the replicas' last loads
SYNC_UPDATE_PARTS = ("sync/setup", "sync/send", "sync/produce", "sync/quantize", "sync/ack_wait", "sync/replica_wait")
HANDOVER = ("handover/sleep", "handover/onload")
COMPUTE = ("gen", "old_log_prob", "update_actor")
KEPT = ("timing_s/", "perf/", "memory/", "rollout/", "rollout_corr/", "weight_sync/", "actor/")
SMOKE = dict(vocab_size=512)  # `--shapes smoke`: the tiny default shape, to try the benchmark on a CPU
FP8_KV_CUTLASS = ["rollout.quantization=fp8", "rollout.fp8_gemm=cutlass", "+rollout.engine_kwargs.kv_cache_dtype=fp8"]
DISK = "weight_sync.transport=disk"
VARIANTS = {"none": [], "fp8": ["rollout.quantization=fp8"], "r3": ["actor.megatron.router_replay=rollout"],
            # FP8 weights and KV cache: at 1.5B, 256 sequences of 1k tokens, FP8 weights alone gave 1.05-1.12x
            "fp8kv": ["rollout.quantization=fp8", "+rollout.engine_kwargs.kv_cache_dtype=fp8"],
            # the same on vLLM's precompiled CUTLASS block GEMM instead of DeepGEMM (no JIT warm-up at the start)
            "fp8c": ["rollout.quantization=fp8", "rollout.fp8_gemm=cutlass"],
            "fp8kvc": FP8_KV_CUTLASS,
            # the pair none / fp8kvc through the `disk` transport, where a sync's time follows its bytes (on `ipc` it
            # follows its tensor count: docs/fp8.md)
            "disk": [DISK], "fp8kvcdisk": [*FP8_KV_CUTLASS, DISK],
            # no per-request seeds, alone and with R3: vLLM's V1 runner (which R3 needs) draws seeded requests' noise
            # one request at a time
            "unseeded": ["rollout.seed_requests=false"],
            "r3u": ["actor.megatron.router_replay=rollout", "rollout.seed_requests=false"],
            "rm": ["reward.models=[{{name:rm,path:'{rm}',placement:colocated}}]"],
            "distill": ["algorithm.distill.enable=true", "algorithm.distill.teacher_path={teacher}"]}
MODEL_STAGES = ("reward_colocated", "teacher")  # the stages of the rm and distill variants


def make_task(folder: Path, shape: str, seed: int, variants: list[str]) -> dict[str, str]:
    """The policy, the prompts, and the reward model / teacher (same shape, other seeds) the variants name."""
    import torch

    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import char_tokenizer, reverse_rows
    from mrl.models.tiny import QWEN2_5_SHAPES, QWEN3_MOE_SHAPES, make_tiny_hf_model, make_tiny_reward_model

    train, _ = reverse_rows(8, n_train=4096, n_val=8, seed=seed)
    family = "qwen3_moe" if shape in QWEN3_MOE_SHAPES else "qwen2"
    dims = QWEN3_MOE_SHAPES.get(shape) or QWEN2_5_SHAPES.get(shape, SMOKE)
    tokenizer = char_tokenizer()
    model = make_tiny_hf_model(family, folder / "model", seed=seed, tokenizer=tokenizer, init_std=0.02,
                               dtype=torch.bfloat16, **dims)
    paths = {"model": str(model), "train": str(write_rows(train, folder / "train.parquet"))}
    if "rm" in variants:
        # the policy's vocabulary, not the tokenizer's: a random policy samples any id of its own
        paths["rm"] = str(make_tiny_reward_model(family, folder / "rm", tokenizer, seed=seed + 1, init_std=0.02,
                                                 **dims))
    if "distill" in variants:
        paths["teacher"] = str(make_tiny_hf_model(family, folder / "teacher", seed=seed + 2, tokenizer=tokenizer,
                                                  init_std=0.02, dtype=torch.bfloat16, **dims))
    return paths


def overrides(paths: dict[str, str], args: argparse.Namespace, label: str, folder: Path) -> list[str]:
    tokens = args.response_length + 64
    return [
        f"model.path={paths['model']}", f"data.train_files=[{paths['train']}]", "data.val_files=[]",
        "data.max_prompt_length=64", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.batch}", f"rollout.n={args.n}", "rollout.ignore_eos=true",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"rollout.enforce_eager={str(args.enforce_eager).lower()}",
        "actor.megatron.params_dtype=bfloat16", "actor.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len_per_gpu={max(args.micro_batch_tokens, tokens)}",
        f"actor.ppo_mini_batch_size={args.batch // args.updates}",
        *(f"actor.megatron.{k}_offload={str(k in args.offload).lower()}" for k in ("param", "grad", "optimizer")),
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", f"trainer.experiment_name={label}", f"trainer.default_local_dir={folder / label}",
        "trainer.logger=[console,jsonl]", f"reward.reward_fn='{REWARD_FN}'", "actor.optim.lr=1e-6",
    ]


def median(history: list[dict[str, Any]], key: str) -> float:
    values = [h[key] for h in history[1:] if key in h] or [h[key] for h in history if key in h]
    return statistics.median(values) if values else float("nan")


def run_mrl(cfg: Any) -> dict[str, Any]:
    from mrl.trainer.build import train

    history, startup = train(cfg)
    keys = {k for h in history for k in h if k.startswith(KEPT)}
    return {"startup_s": startup, "median": {k: median(history, k) for k in sorted(keys)}, "history": history}


def startup_only(cfg: Any) -> float:
    from mrl.trainer.build import build_trainer, shutdown

    start = time.monotonic()
    trainer = build_trainer(cfg)
    seconds = time.monotonic() - start
    shutdown(trainer)
    return seconds


def prompt_ids(cfg: Any) -> list[list[int]]:
    """The token ids of one step's prompts as the single-turn agent loop renders them (chat template)."""
    from transformers import AutoTokenizer

    from mrl.data.datasets import RLDataset, templated_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = RLDataset.from_files(cfg.data.train_files, cfg.data.prompt_key).rows[: cfg.data.train_batch_size]
    return [templated_prompt_ids(tokenizer, r["messages"]) for r in rows]


async def direct_vllm(cfg: Any, rounds: int) -> dict[str, Any]:
    """vLLM's AsyncLLM with the replica's engine arguments on the step's B × n requests."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from mrl.trainer.build import rollout_spec
    from rollout_adapters.vllm.adapter import VLLMAdapter

    spec = rollout_spec(cfg)
    adapter = VLLMAdapter(spec.model_path, **spec.adapter_kwargs())
    engine_args = adapter.engine_args
    adapter.prepare_quantized_model()  # with fp8: the block-FP8 copy the replica starts from, its scale format
    start = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    startup = time.monotonic() - start
    prompts = prompt_ids(cfg)

    async def one(rid: str, ids: list[int], seed: int) -> int:
        params = SamplingParams(temperature=cfg.rollout.temperature, max_tokens=cfg.data.max_response_length,
                                ignore_eos=True, logprobs=0, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY,
                                detokenize=False)
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
            final = out
        return len(final.outputs[0].token_ids)

    seconds, tokens = [], 0
    try:
        for r in range(rounds + 1):  # round 0 warms up (as mrl's first step, which the medians skip)
            t0 = time.monotonic()
            counts = await asyncio.gather(*(one(f"{r}-{i}-{k}", ids, i * 31 + k) for i, ids in enumerate(prompts)
                                            for k in range(cfg.rollout.n)))
            if r:
                seconds.append(time.monotonic() - t0)
                tokens = sum(counts)
    finally:
        engine.shutdown()
    gen = statistics.median(seconds)
    return {"startup_s": startup, "gen_s": gen, "tokens": tokens, "tokens_per_s": tokens / gen}


def report(shape: str, mrl: dict[str, Any], direct: dict[str, Any] | None, warm_s: float) -> dict[str, float]:
    m = mrl["median"]
    t = {k.removeprefix("timing_s/"): v for k, v in m.items() if k.startswith("timing_s/")}
    step = t["step"]
    overhead = sum(t.get(k, 0.0) for k in (*SYNC_PARTS, *HANDOVER, "balance", "adv"))
    gen_tokens = m.get("perf/gen_tokens_per_s", float("nan")) * t["gen"]
    direct_s = direct["gen_s"] if direct else float("nan")
    ratios = {
        "gen_vs_direct": direct_s / t["gen"],
        # The trainer's gen stage also scores the responses (timed inside it as "reward"); without that part:
        "gen_without_reward_vs_direct": direct_s / (t["gen"] - t.get("reward", 0.0)),
        "non_compute_share": overhead / step,
        "update_mfu": m.get("perf/mfu/update_actor", float("nan")),
        **{f"{k}_share": t[k] / step for k in MODEL_STAGES if k in t},
        "startup_cold_s": mrl["startup_s"], "startup_warm_s": warm_s,
    }
    print(f"\n== {shape}: step {step:.2f} s (median of steps 2..), {gen_tokens:.0f} generated tokens per step")
    for name in (*COMPUTE, *MODEL_STAGES, *HANDOVER, *SYNC_PARTS, *SYNC_UPDATE_PARTS, "update_weights", "reward",
                 "balance", "adv"):
        if name in t:
            print(f"  {name:<20} {t[name]:8.3f} s  {100 * t[name] / step:5.1f}%")
    for key in sorted(k for k in m if k.startswith(("perf/", "memory/", "rollout/logprob"))):
        print(f"  {key:<48} {m[key]:.4g}")
    if direct:
        print(f"  vLLM direct: gen {direct['gen_s']:.3f} s ({direct['tokens_per_s']:.0f} tok/s), "
              f"start {direct['startup_s']:.1f} s")
    print(f"  mrl start: cold {mrl['startup_s']:.1f} s, warm {warm_s:.1f} s")
    print("  ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ratios


def compare_variant(shape: str, base: dict[str, Any], variant: dict[str, Any], name: str) -> dict[str, float]:
    """Variant `name` against the baseline on one shape: generation speed, bytes per sync, sync time, mismatch."""
    m, b = variant["mrl"]["median"], base["mrl"]["median"]

    def ratio(key: str) -> float:
        return m.get(key, float("nan")) / b.get(key, float("nan"))

    ratios = {"gen_tokens_per_s": ratio("perf/gen_tokens_per_s"),
              "direct_tokens_per_s": ((variant["direct"] or {}).get("tokens_per_s", float("nan"))
                                      / (base["direct"] or {}).get("tokens_per_s", float("nan"))),
              "sync_bytes": ratio("weight_sync/bytes_total"), "sync_update_s": ratio("timing_s/sync/update"),
              "logprob_mismatch": m.get("rollout/logprob_mismatch", float("nan")),
              "mismatch_kl": m.get("rollout/mismatch_kl", float("nan"))}
    print(f"\n== {shape}: {name} vs the first variant (ratios; fp8: the issue asks gen >= 1.2, bytes ~0.5, sync time "
          "<= 1; r3: a lower logprob_mismatch)")
    for key in ("perf/gen_tokens_per_s", "weight_sync/bytes_total", "timing_s/sync/update", "rollout/logprob_mismatch"):
        print(f"  {key:<32} none {b.get(key, float('nan')):12.5g}   {name} {m.get(key, float('nan')):12.5g}")
    print("  ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="prompts per step (B)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--offload", nargs="*", default=[], choices=["param", "grad", "optimizer"])
    parser.add_argument("--direct-rounds", type=int, default=2)
    parser.add_argument("--direct", choices=["all", "first", "none"], default="all",
                        help="which variants also drive vLLM directly")
    parser.add_argument("--baseline-json", help="an earlier run's --json: the variants compare with its first variant")
    parser.add_argument("--no-warm-start", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs or compile in the engine")
    parser.add_argument("--variants", "--quantizations", nargs="+", default=["none"], choices=sorted(VARIANTS),
                        help="variants to run per shape, in this order (the first is the baseline): none, fp8 "
                             "(rollout.quantization=fp8), fp8kv (and an FP8 KV cache), fp8c / fp8kvc (the same on "
                             "the CUTLASS block GEMM), r3 (router replay, MoE "
                             "shapes), unseeded / r3u (rollout.seed_requests=false; with R3), rm (a colocated "
                             "reward model), distill (a teacher)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--work-dir", help="keep the task and each run's metrics.jsonl here (default: a temporary "
                                           "folder, removed at the end): a run cut short leaves the steps it made")
    args = parser.parse_args()

    import os

    from mrl.config.startup.loader import load_config
    from mrl.trainer.main import init_ray

    # The direct engine starts in this process, which has initialised CUDA by then: its engine core must spawn.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    init_ray(num_cpus=16)
    results: dict[str, Any] = {}
    earlier: dict[str, Any] = {}
    if args.baseline_json and Path(args.baseline_json).exists():
        earlier = json.loads(Path(args.baseline_json).read_text())
    elif args.baseline_json:  # the baseline's stage ran out of time in the same lease: this run still measures
        print(f"no baseline at {args.baseline_json}: the variants are reported without a ratio", flush=True)
    with contextlib.nullcontext(args.work_dir) if args.work_dir else tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            folder = Path(tmp) / shape
            paths = make_task(folder, shape, seed=1, variants=args.variants)
            base_key = None
            for i, variant in enumerate(args.variants):
                # results[shape] is the plain run, as before; others are "<shape>+<variant>"
                key = shape if variant == "none" else f"{shape}+{variant}"
                extra = [o.format(**paths) for o in VARIANTS[variant]]
                cfg = load_config("tiny/grpo", overrides(paths, args, f"e2e_{key}", folder) + extra)
                mrl = run_mrl(cfg)
                drive = args.direct == "all" or (args.direct == "first" and not i)
                direct = asyncio.run(direct_vllm(cfg, args.direct_rounds)) if drive else None
                warm = float("nan") if args.no_warm_start or i else startup_only(cfg)
                results[key] = {"mrl": mrl, "direct": direct, "warm_startup_s": warm,
                                "ratios": report(key, mrl, direct, warm)}
                base_key = base_key or next((k for k in earlier if k.split("+")[0] == shape), None) or key
                base = earlier.get(base_key) or results[base_key]
                if base_key != key:
                    name = base_key.partition("+")[2] or "none"
                    results[key]["vs_" + name] = compare_variant(shape, base, results[key], variant)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
