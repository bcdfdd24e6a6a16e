"""Per-token algorithm steps that run where the tokens are (a worker, on batches fetched from the sample store):
spreading a per-sample advantage over model tokens, KL-in-reward, GAE and other token-level estimators, on-policy
distillation's advantages, and the rollout-vs-trainer log-prob mismatch of a rank's rows. The driver keeps the
per-sample scalars (outcome advantages).

Token fields are jagged and aligned with `input_ids` = prompt + response; prompt positions carry mask 0, so every
estimator treats them as absent.
"""

from __future__ import annotations

import torch

from mrl.algo.advantages import ADV_ESTIMATORS, AdvantageConfig
from mrl.algo.distill import distill_advantages
from mrl.algo.kl import KLController, apply_kl_penalty
from mrl.algo.rollout_correction import mismatch_metrics
from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor
from mrl.reward.placement import place_on_last_token


def token_advantages(batch: Batch) -> JaggedTensor:
    """The driver's per-sample `advantage` placed on every model token (0 on prompt and tool tokens)."""
    mask = batch.jagged_field("response_mask")
    per_token = torch.repeat_interleave(batch["advantage"].float(), mask.lengths())
    return JaggedTensor(per_token * mask.values, mask.offsets)


def token_advantages_and_returns(
    batch: Batch, estimator: str, config: AdvantageConfig, rewards: torch.Tensor | None = None
) -> dict[str, JaggedTensor]:
    """Any estimator on the padded full-sequence layout (GAE needs it; the others come here with token-level
    rewards): prompt positions are masked, and the estimators treat masked tokens as absent. Without `rewards`,
    the score sits on each sample's last model token."""
    mask, lengths = batch.as_padded("response_mask")
    values = batch.as_padded("values")[0] if "values" in batch else None
    if rewards is None:
        rewards = place_on_last_token(batch["score"].float(), mask)
    out = ADV_ESTIMATORS.get(estimator)(rewards, mask, index=list(batch["uid"]), values=values, config=config)
    return {
        "advantages": JaggedTensor.from_padded(out.advantages, lengths),
        "returns": JaggedTensor.from_padded(out.returns, lengths),
    }


def kl_penalized_rewards(batch: Batch, kl_ctrl: KLController, kl_type: str) -> tuple[torch.Tensor, dict[str, float]]:
    """[n, L] token rewards on the padded layout: the score on the last model token, minus β·kl_t on every model
    token, with kl_t the `kl_type` estimate of KL(π_old ‖ π_ref) and β the controller's value, which this call
    then updates from the measured KL. Metrics: the measured KL and the β applied."""
    mask, _ = batch.as_padded("response_mask")
    old, _ = batch.as_padded("old_log_probs")
    ref, _ = batch.as_padded("ref_log_prob")
    scores = place_on_last_token(batch["score"].float(), mask)
    out = apply_kl_penalty(scores, old, ref, mask, kl_ctrl, kl_type)
    return out.token_level_rewards, {"actor/reward_kl_penalty": out.metrics["actor/reward_kl_penalty"],
                                     "actor/reward_kl_coef": out.metrics["actor/reward_kl_penalty_coeff"]}


def token_level_advantages(batch: Batch, estimator: str, config: AdvantageConfig, kl_ctrl: KLController | None,
                           kl_type: str) -> tuple[dict[str, JaggedTensor], dict[str, float]]:
    """Per-token `advantages` and `returns` of the whole step's batch (group estimators need every group whole):
    with `kl_ctrl`, on score − β·KL rewards (β then updated in place), else on the score at the last token."""
    rewards, metrics = kl_penalized_rewards(batch, kl_ctrl, kl_type) if kl_ctrl is not None else (None, {})
    return token_advantages_and_returns(batch, estimator, config, rewards), metrics


def distill_token_advantages(batch: Batch, coef: float, add: bool) -> tuple[JaggedTensor, dict[str, float]]:
    """On-policy distillation's per-token advantages of a batch's rows (mrl/algo/distill.py): coef × (teacher −
    student log-prob) on model tokens, the student's being π_old (`old_log_probs`); with `add`, plus the task's
    advantage: the per-sample `advantage` column when the batch has one, else the token-level `advantages`. Also
    `distill/kl` and the model-token count, which weighs it across ranks."""
    mask, lengths = batch.as_padded("response_mask")
    teacher, _ = batch.as_padded("teacher_log_prob")
    student, _ = batch.as_padded("old_log_probs")
    task = None
    if add:
        task = batch["advantage"].float() if "advantage" in batch else batch.as_padded("advantages")[0]
    advantages, metrics = distill_advantages(teacher, student, mask, coef, task)
    return JaggedTensor.from_padded(advantages, lengths), {**metrics, "tokens": float(mask.sum())}


def rank_mismatch(batch: Batch) -> dict[str, float]:
    """`mismatch_metrics` of this rank's rows and their model-token count, which weighs them across ranks."""
    old, _ = batch.as_padded("old_log_probs")
    rollout, _ = batch.as_padded("rollout_log_probs")
    mask, _ = batch.as_padded("response_mask")
    return {**mismatch_metrics(old, rollout, mask), "tokens": float(mask.sum()), "rows": float(len(batch))}

