"""On-policy distillation (`algorithm.distill`): a teacher scores the student's own sampled tokens, and each model
token's advantage is coef × (teacher − student log-prob of that token): the per-token reverse-KL signal, whose
expectation under the student is −KL(student ‖ teacher). Used alone or added to the task advantage.

Pure functions; the teacher's log-probs come from a frozen engine beside the actor (compute_teacher_log_prob in
mrl/workers/actor_rollout_ref.py), and the trainer applies these per rank (docs/reward_models.md).
"""

import torch
from torch import Tensor

from mrl.algo.masked import masked_mean


def sampled_token_log_probs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """[batch, T-1] log-probs of tokens 1..T-1 under the logits at positions 0..T-2 (of a causal LM), in fp32."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def distill_advantages(teacher_log_prob: Tensor, student_log_prob: Tensor, response_mask: Tensor,
                       coef: float = 1.0, task_advantages: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Per-token advantages coef × (teacher − student) on model tokens (0 elsewhere), plus `task_advantages`
    ([batch, T] per token or [batch] per sample) when given; `distill/kl`: the mean over model tokens of
    student − teacher, the sampled estimate of KL(student ‖ teacher)."""
    mask = response_mask.bool()
    gap = (teacher_log_prob - student_log_prob).float()
    advantages = torch.where(mask, coef * gap, torch.zeros_like(gap))
    if task_advantages is not None:
        task = task_advantages.unsqueeze(-1) if task_advantages.dim() == 1 else task_advantages
        advantages = advantages + torch.where(mask, task.expand_as(gap).float(), torch.zeros_like(gap))
    return advantages, {"distill/kl": float(masked_mean(-gap, response_mask.float()))}
