"""The actor objective a trainer's loss_fn evaluates on one micro-batch.

    L = agg(w ⊙ ℓ_pg) − entropy_coeff · agg(H) + kl_loss_coef · agg(k(π, π_ref))

with ℓ_pg from `actor.policy_loss.loss_mode`, w the rollout-correction weights (1 when off), H the per-token
entropy, k the `kl_loss_type` estimator, and every agg the same `loss_agg_mode` over the same step-global
`LossNormalizer` — so the returned value is this micro-batch's share and the engine sums shares (see
`mrl.algo.aggregation`). Metrics are this micro-batch's own values (pg_loss / entropy / kl_loss aggregated with
the micro-batch's own denominators, clip fractions and ppo_kl as its token means), so the engine's mean over
micro-batches reports them at the scale of the step.

Rollout correction (`algorithm.rollout_correction`, mrl/algo/rollout_correction.py) runs here, per micro-batch, on
the three log-probs kept apart: π_rollout (`rollout_log_prob`, the engine's), π_old (stored, or the forward's own
on rows trained on-policy) and π_θ. Every correction is per token or per whole sequence, and sequences are never
split between micro-batches, so the result does not depend on the split. Rejected tokens leave the loss entirely,
as in verl: the old log-prob pass removes them from the stored response mask (ActorRolloutRefWorker
.compute_log_prob), so `response_mask` here, every agg and the step-global denominators (counted from it before
any forward) exclude them. Rejection again on that mask keeps every token (it is idempotent), so the w = 0 it
gives here only matters to a caller that passes the uncorrected mask.
"""

from dataclasses import dataclass, field

from torch import Tensor

from mrl.algo.aggregation import LOSS_AGG_MODES, LossNormalizer, agg_loss
from mrl.algo.kl import KL_ESTIMATORS, kl_penalty
from mrl.algo.policy_loss import PolicyLossConfig, PolicyLossOutput, compute_policy_loss
from mrl.algo.rollout_correction import RolloutCorrectionConfig, apply_rollout_correction, decoupled_ppo_loss


@dataclass(frozen=True)
class ActorLossConfig:
    """verl's `actor.*` loss knobs."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode '{self.loss_agg_mode}' unknown; known: {', '.join(LOSS_AGG_MODES)}")
        if self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(f"actor.kl_loss_type '{self.kl_loss_type}' unknown; known: {', '.join(KL_ESTIMATORS)}")


def actor_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    normalizer: LossNormalizer | None,
    config: ActorLossConfig,
    *,
    entropy: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the actor loss (formula in the module docstring) and its metrics."""

    def agg(loss_mat: Tensor, scope: LossNormalizer | None = normalizer) -> Tensor:
        return agg_loss(loss_mat, response_mask, config.loss_agg_mode, scope, config.loss_scale_factor)

    def local(loss_mat: Tensor) -> Tensor:
        return agg(loss_mat.detach(), None)

    pg, pg_mat = policy_gradient_term(log_prob, old_log_prob, advantages, response_mask, config, rollout_log_prob)
    if rollout_is_weights is not None:  # weights a caller computed itself
        pg_mat = pg_mat * rollout_is_weights.detach()
    pg_loss = agg(pg_mat)
    total = pg_loss
    metrics = {f"actor/{k}": v for k, v in pg.metrics.items()}
    metrics["actor/pg_loss"] = local(pg_mat)
    if entropy is not None:
        entropy_share = agg(entropy)
        metrics["actor/entropy"] = local(entropy)
        if config.entropy_coeff != 0.0:
            total = total - config.entropy_coeff * entropy_share
    if config.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("actor.use_kl_loss is set but the batch has no ref_log_prob (enable the reference model)")
        # Padded positions may hold −inf log-probs; zeroing them first keeps nan out of the KL's gradient.
        valid = response_mask.bool()
        kl_mat = kl_penalty(log_prob.where(valid, 0.0), ref_log_prob.where(valid, 0.0), config.kl_loss_type)
        kl_share = agg(kl_mat)
        metrics["actor/kl_loss"] = local(kl_mat)
        metrics["actor/kl_coef"] = kl_share.new_tensor(config.kl_loss_coef)
        total = total + config.kl_loss_coef * kl_share
    return total, metrics


def policy_gradient_term(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, config: ActorLossConfig,
    rollout_log_prob: Tensor | None,
) -> tuple[PolicyLossOutput, Tensor]:
    """The policy loss and its per-token matrix w ⊙ ℓ_pg after `config.rollout_correction`: rejection (w = 0),
    then truncated IS (w = min(ρ, C)) with ℓ_pg against π_old, or decoupled PPO (clip around π_old, weight
    π_old / π_rollout, tokens above the cap dropped)."""
    correction = config.rollout_correction
    if not correction.enabled:
        pg = compute_policy_loss(log_prob, old_log_prob, advantages, response_mask, config.policy_loss)
        return pg, pg.loss_mat
    if rollout_log_prob is None:
        raise ValueError("algorithm.rollout_correction is on but the batch has no rollout_log_probs")
    weights, kept = apply_rollout_correction(old_log_prob, rollout_log_prob, response_mask, correction)
    if correction.use_decoupled_loss:
        pg = decoupled_ppo_loss(log_prob, old_log_prob, rollout_log_prob, advantages, kept, config.policy_loss,
                                correction.behav_imp_weight_cap)
        return pg, pg.loss_mat
    pg = compute_policy_loss(log_prob, old_log_prob, advantages, response_mask, config.policy_loss)
    return pg, pg.loss_mat * (weights if weights is not None else kept.to(pg.loss_mat.dtype))
