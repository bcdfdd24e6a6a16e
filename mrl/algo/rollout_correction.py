"""Rollout correction: importance sampling between the inference engine's policy and the trainer's.

Tokens are sampled by the rollout engine (π_rollout: another kernel, dtype, maybe an older weight version), while
the PPO ratio is taken against π_old, the trainer's recompute. With ρ_t = π_old(y_t) / π_rollout(y_t), i.e.
log ρ_t = old_log_prob − rollout_log_prob:

  truncated IS (TIS), `rollout_is`:
    token      w_t = min(ρ_t, C)
    sequence   w_t = min(Π_{t'} ρ_{t'}, C)   for every token of the sequence
  masked IS / rejection sampling, `rollout_rs` (drops tokens or sequences, i.e. edits the response mask):
    token      keep t     iff  L ≤ ρ_t ≤ U
    sequence   keep seq   iff  L ≤ Π_t ρ_t ≤ U
    geometric  keep seq   iff  L ≤ exp(mean_t log ρ_t) ≤ U
  veto: drop a sequence if any valid token has ρ_t < `rollout_token_veto_threshold`.

Weights are constants (no gradient): π_old and π_rollout are both fixed in a step. Everything is computed in log
space, so sequence products of thousands of tokens neither overflow nor turn into nan. Names follow verl's
`algorithm.rollout_correction`. The trainer computes this once per step on the driver, then derives the loss
normalizer (`LossNormalizer`) from the corrected mask, then multiplies the per-token policy loss by the weights.

Decoupled PPO (Hilton et al. 2022; AReaL) keeps three log-probs: behaviour (rollout), proximal (old) and current;
the PPO ratio uses the proximal policy and the behaviour correction multiplies the loss (`decoupled_ppo_loss`).

Metric `logprob_mismatch = mean_t exp(|log π_old − log π_rollout|)` is ≥ 1 and equals 1 iff the two agree.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from mrl.algo.masked import LOG_RATIO_CLAMP, masked_count, masked_mean, masked_sum
from mrl.algo.policy_loss import PolicyLossConfig, PolicyLossOutput, compute_policy_loss

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """`rollout_rs_threshold` defaults to `rollout_is_threshold`, `rollout_rs_threshold_lower` to 1 / upper."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_correction.rollout_is must be one of {IS_LEVELS} or null, got {self.rollout_is}")
        if self.rollout_rs is not None and self.rollout_rs not in RS_LEVELS:
            raise ValueError(f"rollout_correction.rollout_rs must be one of {RS_LEVELS} or null, got {self.rollout_rs}")
        if self.rollout_is_threshold <= 0:
            raise ValueError("rollout_correction.rollout_is_threshold must be > 0")
        lower, upper = self.rs_bounds
        if not 0 < lower <= upper:
            raise ValueError(f"rollout_correction: need 0 < rollout_rs_threshold_lower ≤ upper, got {lower}, {upper}")

    @property
    def rs_bounds(self) -> tuple[float, float]:
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper


def _log_ratio(numerator_log_prob: Tensor, denominator_log_prob: Tensor, mask: Tensor) -> Tensor:
    diff = (numerator_log_prob - denominator_log_prob).detach()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """log of the per-sequence ratio: Σ_t log ρ_t ('sequence') or mean_t log ρ_t ('geometric'), shape [batch]."""
    total = masked_sum(log_ratio, mask, dim=-1)
    if level == "geometric":
        return total / masked_count(mask, dim=-1).clamp_min(1.0)
    return total


def rollout_is_weights(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, level: str, threshold: float
) -> Tensor:
    """Truncated IS weights min(ρ, C) at `level` ('token' or 'sequence'), 0 on masked positions."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is level must be one of {IS_LEVELS}, got {level}")
    mask = response_mask.bool()
    log_rho = _log_ratio(old_log_prob, rollout_log_prob, mask)
    if level == "sequence":
        log_rho = _sequence_log_ratio(log_rho, mask, level).unsqueeze(-1).expand_as(log_rho)
    weights = torch.exp(log_rho.clamp(max=math.log(threshold)))
    return torch.where(mask, weights, torch.zeros_like(weights))


def rollout_rejection_mask(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    level: str,
    lower: float | None,
    upper: float | None,
    veto_threshold: float | None = None,
) -> Tensor:
    """The response mask with rejected tokens/sequences removed: keep iff lower ≤ ρ ≤ upper at `level`
    ('token', 'sequence', 'geometric'; a None bound is open), and drop whole sequences holding a token with
    ρ_t < veto_threshold."""
    if level not in RS_LEVELS:
        raise ValueError(f"rollout_rs level must be one of {RS_LEVELS}, got {level}")
    mask = response_mask.bool()
    log_rho = _log_ratio(old_log_prob, rollout_log_prob, mask)
    log_lo = -math.inf if lower is None else math.log(lower)
    log_hi = math.inf if upper is None else math.log(upper)
    if level == "token":
        keep = (log_rho >= log_lo) & (log_rho <= log_hi)
    else:
        seq = _sequence_log_ratio(log_rho, mask, level)
        keep = ((seq >= log_lo) & (seq <= log_hi)).unsqueeze(-1).expand_as(mask)
    if veto_threshold is not None:
        vetoed = (mask & (log_rho < math.log(veto_threshold))).any(dim=-1, keepdim=True)
        keep = keep & ~vetoed
    return mask & keep


def mismatch_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Training-vs-inference disagreement over valid tokens, with Δ = log π_old − log π_rollout:
    logprob_mismatch = mean exp(|Δ|), logprob_abs_diff_max = max |Δ|,
    mismatch_kl = mean k3 estimate of KL(π_rollout ‖ π_old) = mean (e^{Δ} − 1 − Δ) (tokens come from π_rollout)."""
    mask = response_mask.bool()
    delta = _log_ratio(old_log_prob, rollout_log_prob, mask)
    # An engine may report −inf for a sampled token (e.g. processed log-probs under top-p); clamping keeps the
    # averages finite while the max still shows the outlier.
    bounded = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "logprob_mismatch": float(masked_mean(torch.exp(bounded.abs()), mask)),
        "logprob_abs_diff_max": float(delta.abs().max()) if mask.any() else 0.0,
        "mismatch_kl": float(masked_mean(torch.expm1(bounded) - bounded, mask)),
    }


def _weight_stats(weights: Tensor, response_mask: Tensor, level: str, threshold: float) -> dict[str, float]:
    """Statistics over the units the weights live on: valid tokens, or sequences with ≥ 1 valid token."""
    mask = response_mask.bool()
    if level == "sequence":
        has_tokens = mask.any(dim=-1)
        values = weights.max(dim=-1).values[has_tokens]  # one weight per sequence, shared by its tokens
    else:
        values = weights[mask]
    if values.numel() == 0:
        return {}
    return {
        "rollout_is_mean": float(values.mean()),
        "rollout_is_std": float(values.std(unbiased=False)),
        "rollout_is_min": float(values.min()),
        "rollout_is_max": float(values.max()),
        "rollout_is_clip_frac": float((values >= threshold).float().mean()),
    }


class RolloutCorrection(NamedTuple):
    """`is_weights` is None when IS is off; `response_mask` is the mask after rejection sampling."""

    is_weights: Tensor | None
    response_mask: Tensor
    metrics: dict[str, float]


def compute_rollout_correction(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, config: RolloutCorrectionConfig
) -> RolloutCorrection:
    """Apply rejection sampling (if `rollout_rs`) then truncated IS (if `rollout_is`) on the surviving tokens;
    always report the mismatch metrics, prefixed `rollout_corr/`."""
    mask = response_mask.bool()
    metrics = mismatch_metrics(old_log_prob, rollout_log_prob, mask)
    if config.rollout_rs is not None or config.rollout_token_veto_threshold is not None:
        level, (lower, upper) = (config.rollout_rs, config.rs_bounds) if config.rollout_rs else ("token", (None, None))
        before = mask
        mask = rollout_rejection_mask(
            old_log_prob, rollout_log_prob, mask, level, lower, upper, config.rollout_token_veto_threshold
        )
        n_tokens = max(float(before.sum()), 1.0)
        n_seqs = max(float(before.any(dim=-1).sum()), 1.0)
        metrics["rollout_rs_masked_frac"] = float((before & ~mask).sum()) / n_tokens
        metrics["rollout_rs_seq_masked_frac"] = float((before.any(-1) & ~mask.any(-1)).sum()) / n_seqs
    weights = None
    if config.rollout_is is not None:
        weights = rollout_is_weights(
            old_log_prob, rollout_log_prob, mask, config.rollout_is, config.rollout_is_threshold
        )
        metrics.update(_weight_stats(weights, mask, config.rollout_is, config.rollout_is_threshold))
    return RolloutCorrection(
        weights, mask.to(response_mask.dtype), {f"rollout_corr/{k}": v for k, v in metrics.items()}
    )


def decoupled_ppo_loss(
    log_prob: Tensor,
    proximal_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig | None = None,
    behav_imp_weight_cap: float | None = None,
) -> PolicyLossOutput:
    """Decoupled PPO: ℓ_t = w_t · ℓ_PPO(π_θ / π_prox)_t with the behaviour weight w_t = π_prox(y_t) / π_behav(y_t)
    (no gradient); tokens with w_t > `behav_imp_weight_cap` get w_t = 0 (masked, not truncated, as in AReaL).
    The policy loss is `config.loss_mode` (vanilla PPO-clip by default)."""
    mask = response_mask.bool()
    if behav_imp_weight_cap is not None:
        mask = rollout_rejection_mask(proximal_log_prob, behaviour_log_prob, mask, "token", None, behav_imp_weight_cap)
    log_w = _log_ratio(proximal_log_prob, behaviour_log_prob, mask).clamp(max=LOG_RATIO_CLAMP)
    weights = torch.where(mask, torch.exp(log_w), torch.zeros_like(log_w))
    inner = compute_policy_loss(log_prob, proximal_log_prob, advantages, response_mask, config or PolicyLossConfig())
    metrics = dict(inner.metrics)
    metrics["behav_imp_weight"] = masked_mean(weights, mask).detach()
    metrics["behav_mask_frac"] = 1.0 - masked_count(mask) / masked_count(response_mask).clamp_min(1.0)
    return PolicyLossOutput(inner.loss_mat * weights, metrics)
