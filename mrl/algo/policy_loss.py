"""Per-token policy-gradient losses: PPO-clip with dual clip, GSPO, CISPO.

Each loss returns the per-token loss matrix (aggregate it with `mrl.algo.aggregation.agg_loss`, after multiplying
by any rollout-correction weights) and detached metrics averaged over this batch's valid tokens. Inputs share the
padded [batch, response_len] layout; `log_prob` carries the gradient, `old_log_prob` (π_old, the proximal policy)
and `advantages` are constants. Log-ratios are clamped before exponentiation so extreme differences give finite
losses (the clamped tokens then carry no gradient through the ratio).

Selected by `actor.policy_loss.loss_mode` through `POLICY_LOSSES`; clip knobs use verl's names.
"""

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from mrl.algo.masked import LOG_RATIO_CLAMP, masked_count, masked_mean, masked_sum
from mrl.utils.registry import Registry

# GSPO's sequence ratio is an average, so a smaller cap suffices and keeps exp() far from overflow in bf16.
_GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """`clip_ratio_low/high` default to `clip_ratio`; `clip_ratio_c` is the dual-clip bound (> 1)."""

    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0

    def __post_init__(self) -> None:
        if self.loss_mode not in POLICY_LOSSES:
            raise ValueError(f"actor.policy_loss.loss_mode '{self.loss_mode}' unknown; known: {POLICY_LOSSES.names()}")
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(f"actor.clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0, got {self}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1 for dual-clip PPO, got {self.clip_ratio_c}")

    @property
    def eps_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


class PolicyLossOutput(NamedTuple):
    loss_mat: Tensor
    metrics: dict[str, Tensor]


class PolicyLoss(Protocol):
    def __call__(
        self,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        config: PolicyLossConfig,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss (actor.policy_loss.loss_mode)")


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def _valid_only(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Zero the padded positions first: a padded −inf log-prob must not turn into nan values or gradients."""
    return tuple(_zero_outside(t, mask) for t in tensors)


def _ppo_kl(log_ratio: Tensor, response_mask: Tensor) -> Tensor:
    """k1 estimate of KL(π_old ‖ π) on tokens sampled from π_old: mean of −log(π/π_old)."""
    return masked_mean(-log_ratio, response_mask).detach()


@POLICY_LOSSES.register("vanilla", "ppo", "ppo_clip")
def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
) -> PolicyLossOutput:
    """PPO-clip (Schulman et al. 2017) with dual clip (Ye et al. 2020), per token, r = π/π_old:

        ℓ_clip = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))
        ℓ      = min(ℓ_clip, −A·c)   if A < 0      (dual clip: bounds the loss of very large ratios)
        ℓ      = ℓ_clip              otherwise

    Metrics: pg_clipfrac (tokens where the clipped branch is taken), pg_clipfrac_lower (A < 0 tokens where the dual
    clip binds), ppo_kl.
    """
    log_prob, old_log_prob, advantages = _valid_only(response_mask, log_prob, old_log_prob, advantages)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    loss_clip = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * config.clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss_clip, dual_bound), loss_clip)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean((negative & (loss_clip > dual_bound)).float(), response_mask).detach(),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return PolicyLossOutput(_zero_outside(loss, response_mask), metrics)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025), token form. The sequence ratio is the geometric mean of token ratios,

        s_i = exp( (1/|y_i|) Σ_t (log π − log π_old) ),     s_{i,t} = sg[s_i] · π_t / sg[π_t],
        ℓ_{i,t} = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1 − ε_low, 1 + ε_high)),

    so every token of a sequence shares one value and one clipping decision, and with seq-mean-token-mean the
    gradient equals that of the sequence-level objective. The paper's ε are ~3e-4/4e-4, far below PPO's.
    """
    log_prob, old_log_prob, advantages = _valid_only(response_mask, log_prob, old_log_prob, advantages)
    mask = response_mask.bool()
    token_log_ratio = _zero_outside(log_prob - old_log_prob, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_ratio = masked_sum(token_log_ratio, mask, dim=-1) / masked_count(mask, dim=-1).clamp_min(1.0)
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
        "ppo_kl": _ppo_kl(token_log_ratio, mask),
    }
    return PolicyLossOutput(_zero_outside(loss, mask), metrics)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the objective, and stop its gradient:

        ℓ_t = −sg[clip(r_t, 1 − ε_low, 1 + ε_high)] · A_t · log π_t,

    so every token keeps a gradient (−w·A·∇log π) even when its ratio is outside the band.
    pg_clipfrac counts tokens whose weight was clipped.
    """
    log_prob, old_log_prob, advantages = _valid_only(response_mask, log_prob, old_log_prob, advantages)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    loss = -weight * advantages * log_prob
    metrics = {
        "pg_clipfrac": masked_mean((weight != ratio).float(), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean((ratio < 1.0 - config.eps_low).float(), response_mask).detach(),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return PolicyLossOutput(_zero_outside(loss, response_mask), metrics)


def compute_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PolicyLossConfig,
) -> PolicyLossOutput:
    """Run the loss registered as `config.loss_mode`."""
    return POLICY_LOSSES.get(config.loss_mode)(log_prob, old_log_prob, advantages, response_mask, config)
