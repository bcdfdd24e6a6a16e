"""KL between the policy and the reference: per-token estimators, controllers, reward penalty, entropy.

Estimators of KL(π ‖ π_ref) from a token sampled from π, with Δ = log π(x) − log π_ref(x) (Schulman, "Approximating
KL divergence", 2020):

    k1 = Δ                        unbiased, high variance, can be negative
    k2 = ½ Δ²                     biased, low variance, ≥ 0
    k3 = e^{−Δ} − 1 + Δ           unbiased (E_π[e^{−Δ}] = 1), low variance, ≥ 0
    abs = |Δ|

Names accepted (verl's `kl_loss_type` / `kl_penalty`): "k1" = "kl", "k2" = "mse", "k3", "low_var_kl" (k3 with Δ
clamped to ±20 and the value to ≤ 10 so one outlier token cannot blow up the loss), "abs". A "+" suffix ("k3+",
"low_var_kl+") keeps that estimator's value but takes the gradient of k2, whose gradient is unbiased for the KL's.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from mrl.algo.masked import LOG_RATIO_CLAMP, masked_mean

_LOW_VAR_KL_MAX = 10.0


def _k1(delta: Tensor) -> Tensor:
    return delta


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


def _k3(delta: Tensor) -> Tensor:
    return torch.expm1(-delta) + delta


def _low_var_kl(delta: Tensor) -> Tensor:
    return _k3(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=_LOW_VAR_KL_MAX)


_ESTIMATORS = {
    "k1": _k1,
    "kl": _k1,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
    "abs": torch.abs,
}

KL_ESTIMATORS = tuple(sorted(_ESTIMATORS)) + tuple(f"{n}+" for n in sorted(_ESTIMATORS))


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_type: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of `kl_type` (see the module docstring) for Δ = log_prob − ref_log_prob."""
    straight_through = kl_type.endswith("+")
    base = kl_type[:-1] if straight_through else kl_type
    if base not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{kl_type}'; known: {', '.join(KL_ESTIMATORS)}")
    delta = log_prob - ref_log_prob
    value = _ESTIMATORS[base](delta)
    if straight_through:
        grad_carrier = _k2(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        value = grad_carrier - grad_carrier.detach() + value.detach()
    return value


class FixedKLController:
    """β stays at `kl_coef`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019): e = clip(KL / target − 1, −0.2, 0.2),
    β ← β · (1 + e · n_steps / horizon), with n_steps the number of samples the KL was measured on."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("kl_ctrl: adaptive needs target_kl > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


@dataclass(frozen=True)
class KLControlConfig:
    """verl's `algorithm.kl_ctrl`."""

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


def make_kl_controller(config: KLControlConfig) -> KLController:
    if config.type == "fixed":
        return FixedKLController(config.kl_coef)
    if config.type == "adaptive":
        return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive', got '{config.type}'")


class KLPenaltyOutput(NamedTuple):
    token_level_rewards: Tensor
    metrics: dict[str, float]


def apply_kl_penalty(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: KLController,
    kl_type: str = "kl",
) -> KLPenaltyOutput:
    """KL as a reward penalty: r_t = score_t − β · kl_t on valid tokens (0 elsewhere), β = kl_ctrl.value.

    The measured KL, mean over sequences of each sequence's token-mean kl (sequences with no valid token
    excluded), then updates the controller with n_steps = batch size; metrics report the KL and the β used.
    """
    mask = response_mask.bool()
    kld = torch.where(mask, kl_penalty(log_prob, ref_log_prob, kl_type), torch.zeros_like(log_prob))
    beta = kl_ctrl.value
    rewards = torch.where(mask, token_level_scores - beta * kld, torch.zeros_like(token_level_scores))
    has_tokens = mask.any(dim=-1)
    current_kl = float(masked_mean(kld, mask, dim=-1)[has_tokens].mean()) if has_tokens.any() else 0.0
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return KLPenaltyOutput(rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta})


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ_v softmax(z)_v · z_v over the last (vocabulary) dimension, computed in float32."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
