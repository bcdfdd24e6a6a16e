"""Shared pieces of the trainer-mode integration tests: a tiny model and prompt file, a reward that varies inside a
group, a trainer of a given class built from a recipe, a run of a few steps that also returns the replica's
control-call log, and the sample-path checks (records carry no token data; a step's tensors as the workers left
them in the store)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from mrl.config.startup.loader import load_config
from mrl.data.batch import Batch
from mrl.data.datasets import write_rows
from mrl.data.samples import fetch, put_sequences
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer import batching
from mrl.trainer.build import build_trainer, shutdown


def odd_length_reward(solution_str, ground_truth, extra_info=None) -> float:
    """Rewards that differ inside a group (so GRPO advantages are non-zero) without a trained model."""
    return float(len(solution_str) % 2)


def prompt_file(path: Path, words: list[str], length: int, count: int = 8, seed: int = 0) -> str:
    rng = random.Random(seed)
    rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(length))}],
             "data_source": "test", "reward_model": {"ground_truth": "x"}, "extra_info": {"index": i}}
            for i in range(count)]
    return write_rows(rows, path)


@contextmanager
def stepped(trainer: Any, steps: int) -> Iterator[tuple[Any, list[dict[str, Any]], list[str]]]:
    """`steps` trainer steps: (trainer, their metrics, the first replica server's events in order); then shutdown."""
    try:
        metrics = [trainer.step() for _ in range(steps)]
        server = next(iter(trainer.parts.rollout.replicas.values())).server
        yield trainer, metrics, ray.get(server.events.remote())
    finally:
        shutdown(trainer)


def tiny_trainer(cls: type, recipe: str, root: Path, overrides: list[str], words: list[str], prompts: int = 8,
                 family: str = "qwen2", **model_kwargs: Any):
    """A `cls` trainer (a PPOTrainer subclass) over `recipe` on a tiny random model of `family` (Qwen2) and
    `prompts` prompts of 4 `words`."""
    model = make_tiny_hf_model(family, root / "model", seed=0, **model_kwargs)
    built = build_trainer(load_config(recipe, [
        f"model.path={model}", f"data.train_files=[{prompt_file(root / 'train.jsonl', words, 4, count=prompts)}]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "actor.optim.lr=1e-3",
        f"trainer.default_local_dir={root / 'run'}", f"reward.reward_fn='{__name__}:odd_length_reward'", *overrides,
    ]))
    return cls(built.config, built.parts, built.logger)


LORA_PROBE = [11, 57, 203, 88, 141, 9, 300, 42]


def varied_reward(solution_str, ground_truth, extra_info=None) -> float:
    """A reward that differs between almost any two responses, so GRPO's advantages (and a LoRA actor's first
    gradients: B starts at zero, and so does the KL term's gradient) are non-zero."""
    return float(sum(map(ord, solution_str)) % 7)


def lora_vllm_run(root: Path, overrides: list[str]) -> Iterator[dict[str, Any]]:
    """Two GRPO steps of a TP=2 LoRA actor (rank 4, alpha 16) with one hybrid vLLM-CPU replica of TP 2, then a
    sequence the replica samples and its trainer-vs-engine log-prob gap, then one more sync's per-rank report;
    then shutdown."""
    model = make_tiny_hf_model("qwen2", root / "model", seed=0)
    built = build_trainer(load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{prompt_file(root / 'train.jsonl', list('abcd'), 4)}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=8",
        "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2", "rollout.name=vllm",
        "rollout.num_replicas=1", "rollout.tensor_model_parallel_size=2",
        "+rollout.engine_kwargs.distributed_executor_backend=mp", "trainer.total_training_steps=2",
        "actor.lora.enable=true", "actor.lora.rank=4", "actor.lora.alpha=16", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "actor.optim.lr=5e-2", f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{__name__}:varied_reward'", *overrides,
    ]))
    from mrl.trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(built.config, built.parts, built.logger)
    try:
        metrics = [trainer.step() for _ in range(2)]
        (replica,) = trainer.parts.rollout.replicas.values()
        sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "ignore_eos": True}
        out = ray.get(replica.generate("probe", LORA_PROBE, sampling))
        gap = trainer_gap(trainer, "probe", LORA_PROBE, out)
        per_rank = trainer.parts.actor_rollout.update_weights(3)  # what each trainer rank sent, and to whom
        yield {"metrics": metrics, "version": out.version, "gap": gap, "per_rank": per_rank,
               "server_id": replica.server_id, "model": model}
    finally:
        shutdown(trainer)


def assert_no_token_data(records: list[dict[str, Any]]) -> None:
    """What the driver holds of a trajectory: scalars and text (the prompt's messages, the decoded response),
    never tensors nor sequences of numbers (token ids, masks, log-probs)."""
    for record in records:
        for name, value in record.items():
            assert not isinstance(value, torch.Tensor | np.ndarray), name
            if isinstance(value, list | tuple):
                assert not any(isinstance(v, int | float) for v in value), name


class KeepsStepTensors:
    """Trainer mixin: just before a step's samples leave the store, fetch the fields the agent loop and the workers
    left under every row into `self.step_tensors` (one Batch per step) and each key's whole value into
    `self.step_payloads` (tests only; the driver itself never does)."""

    def release_samples(self, batch: Batch) -> None:
        values = self.store.get(list(batch["key"]))
        fields = sorted(set.intersection(*(set(v) for v in values)))  # what every row has
        self.step_tensors = [*getattr(self, "step_tensors", []), fetch(self.store, batch, fields)]
        self.step_payloads = [*getattr(self, "step_payloads", []), dict(zip(batch["key"], values))]
        super().release_samples(batch)


def trainer_gap(trainer: Any, key: str, prompt_ids: list[int], out: Any) -> dict[str, float]:
    """The rollout-vs-trainer log-prob mismatch metrics of one generated sequence (`out`: a TokenOutput), the
    trainer's log-probs recomputed by its workers through the sample store (two copies: one per DP rank at DP 2,
    whose dispatch cannot pad per-rank metrics)."""
    keys = [f"{key}/{i}" for i in range(2)]
    sequence = {"prompt_ids": prompt_ids, "response_ids": out.token_ids, "rollout_log_probs": out.log_probs}
    batch = put_sequences(trainer.store, keys, [sequence, sequence])
    try:
        return batching.mismatch_over_ranks(trainer.parts.actor_rollout.compute_log_prob(batch))
    finally:
        trainer.store.delete(keys)


TEACHER_SFT_STEPS = 150  # on top of the student's 75: the teacher reaches 100 % held-out (plain HF, seed 1)


def demo_student_and_teacher(root: Path) -> dict[str, Any]:
    """The demo's student (2 layers after its 75-step warm-up) and a teacher that knows the task (the same start with
    more supervised steps, plain HF, seconds): their folders and data files, the teacher model and its held-out
    greedy accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl.data.synthetic import greedy_accuracy, reverse_rows, supervised_warmup
    from mrl.demo import prepare

    torch.manual_seed(1)
    paths = prepare(root, length=4, warmup_steps=75, seed=1, report_start=False)  # the demo's start: the student
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    teacher = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    train_rows, val_rows = reverse_rows(4, n_train=2000, n_val=64, seed=1)  # the rows `prepare` wrote
    supervised_warmup(teacher, tokenizer, train_rows, TEACHER_SFT_STEPS, seed=2)
    teacher.save_pretrained(str(root / "teacher"))
    tokenizer.save_pretrained(str(root / "teacher"))
    return {**paths, "teacher": str(root / "teacher"), "teacher_model": teacher,
            "teacher_acc": greedy_accuracy(teacher, tokenizer, val_rows)}


def distill_overrides(made: dict[str, Any], root: Path, steps: int, temperature: float) -> list[str]:
    """The distillation runs' settings (mode alone, one update of 128 samples a step: with two of 64, or lr 2e-3,
    the student's accuracy swings, see docs/reward_models.md)."""
    from mrl.demo import REWARD_FN

    return [
        f"model.path={made['model']}", f"data.train_files=[{made['train']}]", f"data.val_files=[{made['val']}]",
        "data.max_response_length=8", "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "rollout.name=vllm",
        "rollout.n=4", f"rollout.temperature={temperature}", f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps // 2}", "trainer.seed=1", f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{REWARD_FN}'", "actor.optim.lr=1e-3", "algorithm.distill.enable=true",
        f"algorithm.distill.teacher_path={made['teacher']}", "algorithm.distill.mode=alone",
    ]
