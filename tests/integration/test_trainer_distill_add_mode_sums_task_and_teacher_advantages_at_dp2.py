"""Distillation in `add` mode (the default) through the trainer at DP 2: a tiny random student and a teacher of
another shape (3 layers, wider MLP) with the same tokenizer, `hf` rollout, GRPO with two updates a step. Every
stored advantage is the row's GRPO advantage plus coef × (teacher − π_old) on model tokens, 0 elsewhere (each DP rank
writes its own rows, and the first update's on-policy shortcut leaves no row without π_old); distill/kl is the mean
of π_old − teacher over all the step's model tokens; the update reads those sums; the step times its teacher
stage and trains.

The same trainer build (CI time) carries a colocated reward model, the other frozen engine on ref.megatron's layout
in the actor workers: a tiny Qwen2 sequence classifier with the policy's tokenizer. Its stored score of every sample
is a plain fp32 HF forward's within 1e-4, and each sample's reward is rule_weight × rule + weight × that score."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import KeepsStepTensors, tiny_trainer
from transformers import AutoModelForSequenceClassification

from mrl.models.tiny import make_tiny_hf_model, make_tiny_reward_model, train_tiny_tokenizer
from mrl.trainer import batching
from mrl.trainer.build import shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

B, M, N, COEF = 4, 2, 2, 0.5  # prompts per step, prompts per update, samples per prompt, distillation weight
RULE_WEIGHT, RM_WEIGHT = 0.5, 2.0  # varied_reward's integers 0..6 stay apart from the model's part


class KeepsTaskAdvantages(KeepsStepTensors, PPOTrainer):
    """Also keeps each step's GRPO advantages, recomputed from the light batch's scores as the driver did, and
    whether the batch the update got still had a per-sample `advantage` (the update would read it instead of the
    stored per-token sums)."""

    def release_samples(self, batch):
        grpo = batching.scalar_advantages(batch, "grpo", self.adv_config)
        self.task_advantages = [*getattr(self, "task_advantages", []), grpo]
        self.scalar_column = "advantage" in batch
        super().release_samples(batch)


def test_add_mode_stores_grpo_plus_teacher_advantages_from_both_dp_ranks(ray_cluster, tmp_path):
    teacher = make_tiny_hf_model("qwen2", tmp_path / "teacher", seed=1, num_hidden_layers=3, intermediate_size=384)
    rm = make_tiny_reward_model("qwen2", tmp_path / "rm", train_tiny_tokenizer(), seed=2)  # the policy's tokenizer
    trainer = tiny_trainer(KeepsTaskAdvantages, "tiny/grpo", tmp_path, [
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}", "rollout.name=hf",
        "resources.n_gpus_per_node=2", "data.max_response_length=6",
        "reward.reward_fn='trainer_fixtures:varied_reward'",
        "algorithm.distill.enable=true", f"algorithm.distill.teacher_path={teacher}", f"algorithm.distill.coef={COEF}",
        f"reward.rule_weight={RULE_WEIGHT}", f"reward.models=[{{name:rm,path:'{rm}',weight:{RM_WEIGHT},"
                                             "placement:colocated}]",
    ], list("abcd"), prompts=8)
    try:
        assert trainer.dp_size == 2
        metrics = trainer.step()
    finally:
        shutdown(trainer)
    step, task = trainer.step_tensors[0], trainer.task_advantages[0]
    teacher_lp, old, mask, advantages = (step.jagged_field(k) for k in
                                         ("teacher_log_prob", "old_log_probs", "response_mask", "advantages"))
    gaps = []
    for k in range(len(step)):
        on = mask[k].bool()
        want = torch.where(on, task[k] + COEF * (teacher_lp[k] - old[k]), 0.0)
        torch.testing.assert_close(advantages[k], want, atol=1e-6, rtol=0)
        gaps += (old[k] - teacher_lp[k])[on].tolist()
    assert len(step) == B * N and task.abs().max() > 0  # the task's part is not trivially 0
    assert not trainer.scalar_column
    assert metrics["distill/kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
    assert abs(metrics["distill/kl"]) > 1e-2  # two different models
    assert metrics["timing_s/teacher"] > 0 and metrics["actor/updates"] == B // M

    ids, scores = step.jagged_field("input_ids"), step.jagged_field("reward_score/rm").values
    hf = AutoModelForSequenceClassification.from_pretrained(str(rm), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.tensor([hf(input_ids=ids[k][None]).logits[0, 0].item() for k in range(len(step))])
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=0)
    rule = (step["score"] - RM_WEIGHT * scores) / RULE_WEIGHT  # varied_reward: an integer in 0..6
    torch.testing.assert_close(rule, rule.round().clamp(0, 6), atol=1e-4, rtol=0)
    assert metrics["reward/rm/mean"] == pytest.approx(float(want.mean()), abs=1e-4)
    assert metrics["reward/rule/mean"] == pytest.approx(float(rule.mean()), abs=1e-4)
    assert metrics["reward/mean"] == pytest.approx(RULE_WEIGHT * metrics["reward/rule/mean"]
                                                   + RM_WEIGHT * metrics["reward/rm/mean"], abs=1e-4)
    assert metrics["timing_s/reward_colocated"] > 0
