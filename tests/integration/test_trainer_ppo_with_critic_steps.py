"""PPO with a critic and a KL loss to a reference policy: the Megatron critic (HF's token-classification score head
in place of the output layer) in its own worker group on the trainer's slot, the reference engine beside the actor
in the actor's workers, GAE on a worker (per-token values and returns never reach the driver), HF rollout replica
(hybrid).

Proves: the critic makes B/M updates per step and its values move; with γ = λ = 1 the GAE returns on every model
token equal the trajectory's score (less the reward's KL penalty, ~0 at step 1), and prompt tokens carry none; before
any update the reference log-probs equal the actor's (two engines of the same weights in one process), and the KL
term enters the actor loss; the adaptive KL-in-reward controller moves β; `fit()` writes metrics.jsonl and
tensorboard events with the same scalars, including throughput, MFU, memory per phase and staleness. Settings that
shape the run: total_training_steps=null runs total_epochs passes over the prompts (8 // B = 2 steps), validation
goes val_batch_size prompts at a time, and free_cache_engine=false keeps the replica awake through training. The
sample store is empty after the run (each step deletes its samples, validation its trajectories). Saved every step
with trainer.max_checkpoints_to_keep=1, the run folder keeps the final step's checkpoint only (actor and critic).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from trainer_fixtures import KeepsStepTensors

from mrl.config.startup.loader import load_config
from mrl.data.batch import Batch
from mrl.data.datasets import write_rows
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer import checkpointing
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

B, M, N = 4, 2, 2


def odd_length_reward(solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str) % 2)


class RecordingTrainer(KeepsStepTensors, PPOTrainer):
    def validate(self):
        self.scored_chunks = []
        return super().validate()

    def score(self, trajectories, prompts):
        if hasattr(self, "scored_chunks"):
            self.scored_chunks.append(len(prompts))
        super().score(trajectories, prompts)


@pytest.fixture(scope="module")
def trainer(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_ppo")
    model = make_tiny_hf_model("qwen2", root / "model", seed=1)
    rng = random.Random(1)
    rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(["a", "b", "c"]) for _ in range(3))}],
             "data_source": "test", "reward_model": {"ground_truth": "x"}, "extra_info": {"index": i}}
            for i in range(13)]
    cfg = load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{write_rows(rows[:8], root / 'train.jsonl')}]",
        f"data.val_files=[{write_rows(rows[8:], root / 'val.jsonl')}]", "data.val_batch_size=2",
        "trainer.test_freq=2", "rollout.free_cache_engine=false",
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"critic.ppo_mini_batch_size={M}",
        f"rollout.n={N}", "data.max_response_length=8", "rollout.name=hf", "critic.enable=true",
        "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=gae", "algorithm.gamma=1.0",
        "algorithm.lam=1.0", "critic.optim.lr=1e-2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "trainer.total_training_steps=null", "trainer.total_epochs=1", "trainer.logger=[console,jsonl,tensorboard]",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive", "algorithm.kl_horizon=100",
        "trainer.val_before_train=false", f"trainer.default_local_dir={root / 'run'}",
        "trainer.save_freq=1", "trainer.max_checkpoints_to_keep=1",
        f"reward.reward_fn='{__name__}:odd_length_reward'",
    ])
    built = build_trainer(cfg)
    t = RecordingTrainer(built.config, built.parts, built.logger)
    yield t
    shutdown(t)


@pytest.fixture(scope="module")
def history(trainer):
    return trainer.fit()


def test_ppo_steps_train_the_critic_and_gae_returns_equal_scores(trainer, history):
    first = history[0]
    batch = trainer.step_tensors[0]
    assert first["critic/updates"] == B // M and first["actor/updates"] == B // M
    # π_ref == π_old at step 0 wherever the old log-prob pass ran (the first update's rows train on-policy)
    pairs = [(p["ref_log_prob"], p["old_log_probs"]) for p in trainer.step_payloads[0].values() if "old_log_probs" in p]
    assert pairs and all(torch.allclose(ref, old, atol=1e-5) for ref, old in pairs) and "actor/kl_loss" in first
    assert torch.isfinite(torch.tensor(first["critic/vf_loss"]))
    mask = batch.as_list("response_mask")
    for i, returns in enumerate(batch.as_list("returns")):
        model = mask[i].bool()
        assert torch.allclose(returns[model], batch["score"][i].expand(int(model.sum())), atol=1e-5)
        assert torch.all(returns[~model] == 0) and torch.all(batch.as_list("advantages")[i][~model] == 0)
    values_before = batch.jagged_field("values").values.clone()
    probe = [f"probe-{i}" for i in range(len(batch))]
    trainer.store.put({k: {"input_ids": ids} for k, ids in zip(probe, batch.as_list("input_ids"))})
    trainer.parts.critic.compute_values(Batch.from_dict({"key": probe}))
    after = torch.cat([v["values"] for v in trainer.store.get(probe)])
    trainer.store.delete(probe)
    moved = (after - values_before)[batch.jagged_field("response_mask").values.bool()]
    assert moved.abs().max() > 1e-4  # two critic steps at lr 1e-2 change the values it predicts


def test_kl_in_reward_controller_moves_beta(history):
    first, second = history
    # KL(π_old ‖ π_ref) ≈ 0 at step 1 (same weights) is below the target: the adaptive controller lowers β.
    assert abs(first["actor/reward_kl_penalty"]) < 1e-4
    assert first["actor/reward_kl_coef"] == 0.001 and second["actor/reward_kl_coef"] < 0.001


def test_fit_writes_jsonl_and_tensorboard_with_the_step_metrics(trainer, history):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = trainer.config.trainer.default_local_dir
    # Both steps saved; keeping one, step 1's checkpoint went when step 2's was complete.
    assert [os.path.basename(p) for p in checkpointing.complete_checkpoints(run)] == ["global_step_2"]
    assert sorted(os.listdir(checkpointing.step_dir(run, 2))) == ["COMPLETE", "actor", "critic", "trainer_state.pt"]
    trainer.logger.close()
    rows = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["perf/tokens_per_s_per_gpu"] > 0 and 0 < row["perf/mfu/update_actor"] < 1
        assert row["memory/rss_peak_gib/update_actor"] > 0.1  # a Megatron worker process
        assert {"memory/rss_peak_gib/update_critic", "memory/rss_peak_gib/values", "memory/rss_peak_gib/ref",
                "memory/rss_peak_gib/old_log_prob", "memory/rss_peak_gib/update_weights"} <= set(row)
        assert row["staleness/max"] == 0  # sync mode: sampled by the weights it trains
        assert {f"timing_s/{s}" for s in ("gen", "old_log_prob", "ref", "values", "adv", "update_critic",
                                          "update_actor", "update_weights")} <= set(row)
    events = EventAccumulator(f"{run}/tensorboard")
    events.Reload()
    for key in ("reward/mean", "timing_s/update_actor", "perf/mfu", "actor/reward_kl_coef"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [1, 2]
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in rows], rel=1e-6)  # float32 in events


def test_epochs_set_the_run_length_and_validation_goes_in_val_batches(trainer, history):
    assert trainer.config.trainer.total_training_steps == 2 and [h["step"] for h in history] == [1, 2]
    assert trainer.scored_chunks == [2, 2, 1]  # 5 held-out prompts, val_batch_size 2
    assert "val/greedy_acc" in history[1] and "val/greedy_acc" not in history[0]
    assert history[1]["val/greedy_acc"] in {k / 5 for k in range(6)}


def test_store_is_empty_after_the_run(trainer, history):
    assert trainer.store.size() == {"values": 0, "tags": 0}


def test_free_cache_engine_false_keeps_the_replica_awake(trainer, history):
    import ray

    (replica,) = trainer.parts.rollout.replicas.values()
    events = ray.get(replica.server.events.remote())
    assert not any(e.startswith(("sleep", "wake_up")) for e in events)
    assert "update_weights:2" in events
    assert [h["asleep"] for h in trainer.parts.rollout.health().values()] == [[]]
