"""Side by side on this CPU: TRL's GRPOTrainer vs mrl (Megatron actor + vLLM-CPU/HF rollout), same model, task,
prompts per step B, samples per prompt n, mini-batch M, completion length; median wall seconds per step, and the
median of each stage (mrl: the trainer's `timing_s/*`; TRL: `gen` = model.generate, `old_log_prob+adv` = the
rest of its generate-and-score, `train` = the optimizer steps' forward/backward).

One step = generate B·n completions, score them, B/M optimizer updates (TRL: steps_per_generation = B/M,
per_device_train_batch_size = M·n completions; its step time is the time of B/M optimizer steps). The first step
of each side is dropped (start-up, caches). The model is a random-weight Qwen2 (no warm-up: the task accuracy is
irrelevant to throughput), in the same precision on both sides (below).

Same algorithmic work on both sides: B/M = 2 updates share one generation, so both need π_old before the first
update; TRL recomputes it for every completion (whenever gradient_accumulation_steps is not a multiple of
steps_per_generation), mrl for the second update's rows only (the first update trains on the weights π_old is
computed with and takes it from its own forward: actor.on_policy_first_update; `--mrl-set
rollout.recompute_old_log_prob=false` would take it from vLLM instead, less work). Neither computes reference
log-probs (TRL beta=0, mrl no KL loss or KL reward), neither recomputes activations (TRL's default
gradient_checkpointing=True is turned off; `--trl-set gradient_checkpointing=true` measures it). Precision
(--dtype): bf16 on both sides by default, TRL's own default (autocast over fp32 weights); mrl runs bf16 Megatron
parameters with fp32 main weights and a bf16 vLLM engine. This CPU (avx512_bf16) runs bf16 GEMMs 2.2-2.4x faster
than fp32. Threads: TRL gets two; mrl's worker and its hybrid vLLM engine take turns on both cores
(mrl/workers/cpu_threads.py; the engine runs vLLM's in-process executor, rollout_adapters/vllm/adapter.py).

Measured on the 2-core development host (AMD EPYC, a VM; nothing else running), medians of steps 2-6. The host is
noisy: steps within a run spread by about 10%. The 11-30 07:32 lines are one TRL run and two mrl runs right after
it (`--only trl`, then `--only mrl` without and with the two compile switches):

    size, bf16, time (11-30)   | TRL s/step (gen / old_lp+adv / train) | mrl (gen / old_lp / update / sync) | mrl/TRL
    50m, 07:32                 | 50.3 (21.4 / 6.7 / 21.8)              | 35.1 (9.3 / 3.7 / 22.0 / 0.3)      | 1.43x
    50m, 07:32, mrl compiled*  |                                       | 33.3 (8.6 / 3.3 / 21.0 / 0.3)      | 1.51x
    50m, 04:42                 | 49.3 (21.5 / 6.5 / 21.4)              | 36.4 (9.0 / 3.5 / 23.6 / 0.3)      | 1.36x
    50m, TRL with its default gradient checkpointing: 55.9 s/step (22.0 / 6.5 / 26.8)             -> 1.58x
    tiny                       | 0.302 (0.075 / 0.039 / 0.185)         | 0.693 (0.288 / 0.052 / 0.277 / 0.064) | 0.44x

*`--mrl-set actor.megatron.compile_fusions=true --mrl-set rollout.enforce_eager=false`: Megatron's SwiGLU and
residual add and the RMSNorm compiled in the trainer (forward+backward 7% faster in an interleaved A/B), vLLM's
model compiled (inductor); both compile once per process in the first step (dropped), `logprob_mismatch` 1.005
as without. Neither is the CPU default (eager: no compile time for short runs and tests).

The same day, before the CPU changes behind these numbers: 1.05x at 50m bf16 (mrl 48.3 s: gen 13.5 /
old_lp 7.2 / update 26.9); fp32 with TRL's gradient checkpointing on, 1.08x. Why not 2x at 50m: the update is the
same forward, backward and Adam over about the same tokens on both sides (mrl packs, TRL pads: 17k vs 20k tokens)
and costs mrl as much per token as HF eager (1.3 vs 1.1 ms: the GEMMs run at the CPU's bf16 peak, ~390 GFLOP/s;
the rest is the flash-attention backward of short documents and elementwise ops). Its GEMM floor alone is ~13 s;
with vLLM generation at 9 s (a profile: 62% of it in GEMMs) the step cannot drop much below ~27 s, i.e. ~1.85x
against TRL's ~50 s. Generation does not dominate at 128 tokens on a CPU; on GPUs it does (HF generate is
latency-bound there), which this host cannot measure (no vLLM on the GPU machine).

    PYTHONPATH=/path/to/trl python tools/bench/e2e_vs_trl.py --size tiny
    PYTHONPATH=/path/to/trl python tools/bench/e2e_vs_trl.py --size 50m --completion-length 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # the demo's 2-layer, 128-wide model (≈0.6M parameters)
    "50m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=4),
}


def make_model(out: Path, size: str, length: int) -> tuple[str, list[dict], Any]:
    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import char_tokenizer, reverse_rows
    from mrl.models.tiny import build_tiny_hf_model

    tokenizer = char_tokenizer()
    model = build_tiny_hf_model("qwen2", seed=0, vocab_size=512, tokenizer=tokenizer, init_std=0.02, **SIZES[size])
    model.save_pretrained(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    train, _ = reverse_rows(length, n_train=512, n_val=0, seed=0)
    write_rows(train, out / "train.parquet")
    params = sum(p.numel() for p in model.parameters())
    return str(out / "model"), train, params


def run_mrl(model: str, data: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    from mrl.config.startup.loader import load_config
    from mrl.trainer.build import build_trainer, shutdown
    from mrl.trainer.main import init_ray

    init_ray(num_cpus=8)
    cfg = load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{data}]", f"data.train_batch_size={args.batch}",
        f"actor.ppo_mini_batch_size={args.mini_batch}", f"rollout.n={args.n}", f"rollout.name={args.rollout}",
        f"data.max_response_length={args.completion_length}", f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.rollout_dump_per_step=0",
        f"trainer.default_local_dir={data.parent / 'mrl_run'}",
        "reward.reward_fn='mrl.data.synthetic:exact_match_reward'",
        f"actor.megatron.params_dtype={args.dtype}",
        *args.mrl_set,
    ])
    trainer = build_trainer(cfg)
    try:
        # Per step: the whole step and each stage (timing_s/gen, old_log_prob, update_actor, update_weights, ...),
        # and how far the rollout's log-probs are from the trainer's (1.0: equal; a stale engine would show).
        return [{**{k.removeprefix("timing_s/"): v for k, v in m.items() if k.startswith("timing_s/")},
                 "logprob_mismatch": m.get("rollout/logprob_mismatch", float("nan"))} for m in trainer.fit()]
    finally:
        shutdown(trainer)


def run_trl(model: str, rows: list[dict], out: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mrl.data.synthetic import exact_match_reward

    torch.set_num_threads(2)
    updates = args.batch // args.mini_batch

    def reward(completions: list, ground_truth: list, **_: Any) -> list[float]:
        return [exact_match_reward(c[0]["content"], g) for c, g in zip(completions, ground_truth)]

    class StepClock(TrainerCallback):
        """Wall time of every optimizer step and of TRL's stages inside it (seconds accumulated since the last)."""

        def __init__(self) -> None:
            self.ends = [time.perf_counter()]
            self.stages: dict[str, float] = {}
            self.per_step: list[dict[str, float]] = []

        def timed(self, name: str, fn: Any) -> Any:
            def wrapper(*a: Any, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - start
            return wrapper

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())
            self.per_step.append(self.stages)
            self.stages = {}

    clock = StepClock()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in rows])
    overrides = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.trl_set)}
    config = GRPOConfig(**{
        "output_dir": str(out / "trl_run"), "per_device_train_batch_size": args.mini_batch * args.n,
        "num_generations": args.n, "steps_per_generation": updates, "max_completion_length": args.completion_length,
        "max_steps": args.steps * updates, "learning_rate": 1e-3, "beta": 0.0, "temperature": 1.0,
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True,
        "bf16": args.dtype == "bfloat16", "seed": 0, "dataloader_num_workers": 0,
        # Same work as mrl, which recomputes no activations (TRL's default is True: --trl-set to measure it).
        "gradient_checkpointing": False, **overrides,
    })
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model), reward_funcs=reward, args=config,
        train_dataset=dataset, callbacks=[clock],
    )
    # gen: model.generate; reward: the reward function; generate_and_score: both plus old log-probs (computed
    # since B/M > 1 updates share one generation), advantages and tokenisation.
    for method, name in [("_generate", "gen"), ("_calculate_rewards", "reward"),
                         ("_generate_and_score_completions", "generate_and_score")]:
        setattr(trainer, method, clock.timed(name, getattr(trainer, method)))
    trainer.train()
    # One mrl step = one generation round = `updates` optimizer steps.
    steps = []
    for k in range(args.steps):
        marks = clock.ends[k * updates : (k + 1) * updates + 1]
        stages: dict[str, float] = {}
        for s in clock.per_step[k * updates : (k + 1) * updates]:
            for name, v in s.items():
                stages[name] = stages.get(name, 0.0) + v
        step = marks[-1] - marks[0]
        score = stages.pop("generate_and_score", 0.0)
        stages["old_log_prob+adv"] = score - stages.get("gen", 0.0) - stages.get("reward", 0.0)
        stages["train"] = step - score
        steps.append({"step": step, **stages})
    return steps


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(s.get(k, 0.0) for s in steps), 3) for k in steps[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (B)")
    parser.add_argument("--mini-batch", type=int, default=8, help="prompts per optimizer update (M)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--completion-length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rollout", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="compute precision of both sides (TRL: bf16 autocast over fp32 weights, its default; "
                             "mrl: bf16 Megatron parameters with fp32 main weights, bf16 vLLM)")
    parser.add_argument("--only", choices=["mrl", "trl"], default=None)
    parser.add_argument("--mrl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra mrl config override (repeatable), e.g. rollout.recompute_old_log_prob=false")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="GRPOConfig field as JSON (repeatable), e.g. gradient_checkpointing=true (TRL's default)")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="e2e_vs_trl_"))
    model, rows, params = make_model(out, args.size, 4)
    result: dict[str, Any] = {"size": args.size, "parameters": params, **vars(args)}
    runs = {}
    if args.only in (None, "trl"):
        runs["trl"] = run_trl(model, rows, out, args)[1:]
    if args.only in (None, "mrl"):
        runs["mrl"] = run_mrl(model, out / "train.parquet", args)[1:]
    for side, steps in runs.items():
        result[f"{side}_step_s"] = [round(s["step"], 3) for s in steps]
        result[f"{side}_median_s"] = statistics.median(s["step"] for s in steps)
        result[f"{side}_stage_median_s"] = medians(steps)
    if "trl_median_s" in result and "mrl_median_s" in result:
        result["speedup_mrl_over_trl"] = result["trl_median_s"] / result["mrl_median_s"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
