"""Side by side on this CPU: TRL's GRPOTrainer vs mrl (Megatron actor + vLLM-CPU/HF rollout), same model, task,
prompts per step B, samples per prompt n, mini-batch M, completion length; median wall seconds per step.

One step = generate B·n completions, score them, B/M optimizer updates (TRL: steps_per_generation = B/M,
per_device_train_batch_size = M·n completions; its step time is the time of B/M optimizer steps). The first step
of each side is dropped (start-up, caches). Threads: mrl runs a worker and a rollout server with one thread each,
TRL gets two. The model is a random-weight Qwen2 (no warm-up: the task accuracy is irrelevant to throughput).

    PYTHONPATH=/path/to/trl python tools/bench/e2e_vs_trl.py --size tiny
    PYTHONPATH=/path/to/trl python tools/bench/e2e_vs_trl.py --size 50m --completion-length 128
"""

from __future__ import annotations

import argparse
import itertools
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


def run_mrl(model: str, data: Path, args: argparse.Namespace) -> list[float]:
    from mrl.config.loader import load_config
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
    ])
    trainer = build_trainer(cfg)
    try:
        return [m["timing_s/step"] for m in trainer.fit()]
    finally:
        shutdown(trainer)


def run_trl(model: str, rows: list[dict], out: Path, args: argparse.Namespace) -> list[float]:
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
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = StepClock()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in rows])
    config = GRPOConfig(
        output_dir=str(out / "trl_run"), per_device_train_batch_size=args.mini_batch * args.n,
        num_generations=args.n, steps_per_generation=updates, max_completion_length=args.completion_length,
        max_steps=args.steps * updates, learning_rate=1e-3, beta=0.0, temperature=1.0, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model), reward_funcs=reward, args=config,
        train_dataset=dataset, callbacks=[clock],
    )
    trainer.train()
    ends = clock.ends[1:]
    # One mrl step = one generation round = `updates` optimizer steps.
    marks = [clock.ends[0]] + ends[updates - 1 :: updates]
    return [b - a for a, b in itertools.pairwise(marks)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (B)")
    parser.add_argument("--mini-batch", type=int, default=8, help="prompts per optimizer update (M)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--completion-length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rollout", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--only", choices=["mrl", "trl"], default=None)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="e2e_vs_trl_"))
    model, rows, params = make_model(out, args.size, 4)
    result: dict[str, Any] = {"size": args.size, "parameters": params, **vars(args)}
    if args.only in (None, "trl"):
        result["trl_step_s"] = run_trl(model, rows, out, args)[1:]
    if args.only in (None, "mrl"):
        result["mrl_step_s"] = run_mrl(model, out / "train.parquet", args)[1:]
    for side in ("trl", "mrl"):
        if f"{side}_step_s" in result:
            result[f"{side}_median_s"] = statistics.median(result[f"{side}_step_s"])
    if "trl_median_s" in result and "mrl_median_s" in result:
        result["speedup_mrl_over_trl"] = result["trl_median_s"] / result["mrl_median_s"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
