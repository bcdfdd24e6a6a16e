"""sync vs separate_async on this CPU: the tiny task, the same model, prompts, batch and lengths; median wall seconds
per step in one run, and their ratio.

Same total cores: both runs get the whole machine and the same processes and thread counts (a Megatron actor
worker with one compute thread, one vLLM-CPU replica, agent loops). `sync` puts the replica on the actor's slot
(hybrid: it generates, sleeps while the actor trains, gets the weights); `separate_async` gives it its own slot,
so generation of the next groups overlaps the actor's update, with samples at most `--staleness` versions old.
The first `--warmup` steps of each mode are dropped (start-up, caches). The model is the demo's random-weight
Qwen2 with a character tokenizer (throughput does not depend on accuracy).

    PYTHONPATH=$PWD .venv/bin/python tools/bench/async_vs_sync.py                  # 8 steps each, vLLM-CPU
    PYTHONPATH=$PWD .venv/bin/python tools/bench/async_vs_sync.py --response-length 128

Measured on the 2-core development machine while five other sessions ran their tests (load average 9-26), B=16,
n=4, M=8, 6 steps after 2 warm-up steps each (median s/step, sync / separate_async):
16 tokens 0.715 / 0.678 (1.05x) and, in a second run, 0.983 / 0.669 (1.47x); 128 tokens 2.26 / 2.46 (0.92x).
With every process at one compute thread, sync leaves one of the two cores idle in each phase while
separate_async keeps both busy; but on an oversubscribed host there is no idle core to win, and generating
beside the actor slows its update (actor 0.88 -> 1.75 s at 128 tokens). Re-measure on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

MODES = {
    "sync": ["trainer.mode=sync", "rollout.mode=hybrid"],
    "separate_async": ["trainer.mode=separate_async", "rollout.mode=standalone", "rollout.nnodes=1",
                       "rollout.n_gpus_per_node=1", "weight_sync.transport=nccl"],
}


def make_task(out: Path) -> tuple[str, Path]:
    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import char_tokenizer, reverse_rows
    from mrl.models.tiny import build_tiny_hf_model

    tokenizer = char_tokenizer()
    model = build_tiny_hf_model("qwen2", seed=0, vocab_size=512, tokenizer=tokenizer, init_std=0.02)
    model.save_pretrained(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    train, _ = reverse_rows(4, n_train=512, n_val=0, seed=0)
    return str(out / "model"), write_rows(train, out / "train.parquet")


def run_mode(mode: str, model: str, data: Path, out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from mrl.config.startup.loader import load_config
    from mrl.trainer.build import build_trainer, shutdown

    cfg = load_config("tiny/grpo", [
        *MODES[mode], f"model.path={model}", f"data.train_files=[{data}]", f"data.train_batch_size={args.batch}",
        f"actor.ppo_mini_batch_size={args.mini_batch}",
        f"weight_sync.parameter_sync_step={args.batch // args.mini_batch}",
        f"weight_sync.staleness_threshold={args.staleness}", f"rollout.n={args.n}", f"rollout.name={args.rollout}",
        f"data.max_response_length={args.response_length}", f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.rollout_dump_per_step=0",
        f"trainer.default_local_dir={out / mode}", "reward.reward_fn='mrl.data.synthetic:exact_match_reward'",
    ])
    trainer = build_trainer(cfg)
    try:
        return trainer.fit()
    finally:
        shutdown(trainer)


def main() -> int:
    from mrl.trainer.main import init_ray

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (B)")
    parser.add_argument("--mini-batch", type=int, default=8, help="prompts per optimizer update (M)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each mode left out of the median")
    parser.add_argument("--staleness", type=int, default=1, help="weight_sync.staleness_threshold (separate_async)")
    parser.add_argument("--rollout", choices=["vllm", "hf"], default="vllm")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="async_vs_sync_"))
    model, data = make_task(out)
    init_ray(num_cpus=8)
    result: dict[str, Any] = {**vars(args)}
    for mode in MODES:
        history = run_mode(mode, model, data, out, args)
        steps = [m["timing_s/step"] for m in history if m["step"] > args.warmup]
        result[f"{mode}_step_s"] = [round(s, 3) for s in steps]
        result[f"{mode}_median_s"] = statistics.median(steps)
        result[f"{mode}_gen_wait_median_s"] = statistics.median(
            m["timing_s/gen"] for m in history if m["step"] > args.warmup)
        if mode == "separate_async":
            result["separate_async_staleness_mean"] = statistics.mean(
                m.get("staleness/mean", 0.0) for m in history if m["step"] > args.warmup)
    result["speedup_separate_async_over_sync"] = result["sync_median_s"] / result["separate_async_median_s"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
