"""Kill-and-resume: a run resumed from a checkpoint by a NEW trainer (fresh workers, fresh rollout replica, as
after a crash) continues bit for bit as if never interrupted, and a NaN step keeps the last good weights.
PPO with a critic (GAE), so both engines are checkpointed and resumed.

Run A trains 3 steps, checkpointing every step. Run B starts in a folder holding A's checkpoints of steps 1 and 2
plus a step-3 folder without its COMPLETE marker (a save killed half-way) and a staging folder; `resume_mode=auto`
must pick step 2, load engines, optimizer, LR schedule, dataloader position, RNG and replay buffer, push the
weights to its replica and run step 3. With the `hf` rollout (seeded sampling per session) step 3's metrics equal
A's exactly, and the step-3 checkpoints of actor and critic (model, Adam moments, fp32 params) are identical
tensor for tensor.
Then B's step 4 gets NaN advantages: every actor update is skipped, the actor's weights and optimizer stay those
of step 3, and the rollout replica still answers greedy prompts with the same tokens and log-probs.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from trainer_fixtures import prompt_file

from mrl.config.startup.loader import load_config
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer import checkpointing
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B, M, N = 2, 1, 2  # prompts per step, prompts per update (2 updates per step), samples per prompt
NOT_REPRODUCIBLE = ("timing_s/", "perf/", "memory/")  # wall-clock and memory measurements


def length_reward(solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str) % 3) / 2


class PoisonableTrainer(PPOTrainer):
    poison = False

    def compute_advantage(self, batch):
        batch = super().compute_advantage(batch)
        if self.poison:  # NaN advantages (GAE's, in the store): every actor update's loss and gradients are NaN
            keys = sorted(set(batch["key"]))
            self.store.update({k: {"advantages": torch.full_like(v["advantages"], math.nan)}
                               for k, v in zip(keys, self.store.get(keys, ["advantages"]))})
        return batch


def config(root, run_dir: str):
    return load_config("tiny/grpo", [
        f"model.path={root / 'model'}",
        f"data.train_files=[{prompt_file(root / 'train.jsonl', list('abcd'), 4, count=6, seed=3)}]",
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}",
        "data.max_response_length=6", "rollout.name=hf", "actor.optim.lr=1e-2", "actor.optim.lr_decay_style=linear",
        "critic.enable=true", "algorithm.adv_estimator=gae", f"critic.ppo_mini_batch_size={M}",
        "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.resume_mode=auto",
        "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={run_dir}",
        f"reward.reward_fn='{__name__}:length_reward'",
    ])


def checkpoint_tensors(step_dir: str, role: str = "actor") -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(step_dir, "..", "flat.pt")
    dcp_to_torch_save(os.path.join(step_dir, role), out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def reproducible(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NOT_REPRODUCIBLE)}


def greedy(trainer) -> list[tuple[list[int], list[float]]]:
    prompts = trainer.parts.train_data.rows[:2]
    out = trainer.parts.agent_loops.generate(prompts, 1, {**trainer.sampling(train=False), "temperature": 0.0})
    keys = [t["key"] for t in out]
    stored = trainer.store.get(keys)
    trainer.store.delete(keys)
    return [(s["input_ids"][t["prompt_len"]:].tolist(), s["rollout_log_probs"][t["prompt_len"]:].tolist())
            for t, s in zip(out, stored)]


def test_resumed_run_matches_uninterrupted_and_nan_step_keeps_weights(ray_cluster, tmp_path):
    make_tiny_hf_model("qwen2", tmp_path / "model", seed=1)
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    a = build_trainer(config(tmp_path, run_a))
    try:
        history_a = a.fit()
    finally:
        shutdown(a)
    assert [r["step"] for r in history_a] == [1, 2, 3]

    os.makedirs(run_b)
    for step in (1, 2):
        shutil.copytree(checkpointing.step_dir(run_a, step), checkpointing.step_dir(run_b, step))
    partial = shutil.copytree(checkpointing.step_dir(run_a, 3), checkpointing.step_dir(run_b, 3))
    os.remove(os.path.join(partial, checkpointing.COMPLETE))
    os.makedirs(os.path.join(run_b, ".staging_global_step_4"))
    assert checkpointing.latest_checkpoint(run_b) == checkpointing.step_dir(run_b, 2)

    built = build_trainer(config(tmp_path, run_b))
    b = PoisonableTrainer(built.config, built.parts, built.logger)
    try:
        history_b = b.fit()
        assert [r["step"] for r in history_b] == [3]  # resumed after step 2, ran step 3 only
        assert reproducible(history_b[0]) == reproducible(history_a[2])
        assert history_b[0]["actor/updates"] == B // M and history_b[0]["actor/skipped_updates"] == 0
        assert history_b[0]["critic/updates"] == B // M
        for role in ("actor", "critic"):
            tensors_a = checkpoint_tensors(checkpointing.step_dir(run_a, 3), role)
            tensors_b = checkpoint_tensors(checkpointing.step_dir(run_b, 3), role)
            assert tensors_a.keys() == tensors_b.keys()
            assert "embedding.word_embeddings.weight" in tensors_a and any(".exp_avg_sq." in k for k in tensors_a)
            assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a), role

        replies = greedy(b)
        b.poison = True
        nan_step = b.step()
        assert nan_step["actor/skipped_updates"] == B // M
        assert greedy(b) == replies  # the replica serves the last good weights
        actor_before = checkpoint_tensors(checkpointing.step_dir(run_b, 3))
        after = checkpoint_tensors(b.save_checkpoint())
        assert all(torch.equal(after[k], actor_before[k]) for k in after)  # weights and Adam state untouched
    finally:
        shutdown(b)
