"""Advantage estimators on the padded [batch, response_len] layout.

Every estimator takes token-level rewards (a trajectory's scalar reward sits on its last response token, KL
penalties may add per-token terms), the response mask (1 = model token, 0 = tool/observation token or padding)
and, where needed, per-sample group ids (`index`, the prompt uid: the `n` samples of one prompt share it) or
critic values. It returns `(advantages, returns)`, both exactly zero where the mask is zero.

Multi-turn responses interleave model tokens with tool tokens. The temporal estimators (GAE, REINFORCE++)
treat masked tokens as absent: the successor of a model token is the next *model* token, so an observation
in between neither resets nor discounts the return. Rewards sitting on masked positions are ignored.

The trainer selects an estimator by `algorithm.adv_estimator` through `ADV_ESTIMATORS` (verl's names).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from mrl.algo.masked import masked_sum, masked_whiten
from mrl.reward.placement import place_on_last_token
from mrl.utils.registry import Registry

GroupIndex = Tensor | np.ndarray | Sequence[object]


@dataclass(frozen=True)
class AdvantageConfig:
    """Knobs of the estimators, named as in verl's `algorithm.*` config."""

    gamma: float = 1.0
    lam: float = 1.0
    # GRPO: divide by the group std (True) or only subtract the group mean (False, "Dr. GRPO").
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    # GAE: whiten advantages over the whole batch (verl always does; off is useful for tests and value-only use).
    whiten_gae: bool = True

    def __post_init__(self) -> None:
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {self.gamma}, {self.lam}")


class AdvantageOutput(NamedTuple):
    advantages: Tensor
    returns: Tensor


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        token_level_rewards: Tensor,
        response_mask: Tensor,
        *,
        index: GroupIndex | None = None,
        values: Tensor | None = None,
        config: AdvantageConfig = ...,
    ) -> AdvantageOutput: ...


ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator (algorithm.adv_estimator)")


def group_ids(index: GroupIndex, device: torch.device | None = None) -> tuple[Tensor, int]:
    """Map per-sample group keys (uid strings or ints in a list/array, or a tensor) to dense ids 0..G−1."""
    if isinstance(index, Tensor):
        _, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device=device, dtype=torch.long), int(inverse.max().item()) + 1 if inverse.numel() else 0
    seen: dict[object, int] = {}
    ids = [seen.setdefault(key.item() if isinstance(key, np.generic) else key, len(seen)) for key in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(seen)


class GroupStats(NamedTuple):
    """Per-sample statistics of the sample's group: sum, count, mean, unbiased std (N − 1)."""

    total: Tensor
    count: Tensor
    mean: Tensor
    std: Tensor


def group_stats(scores: Tensor, index: GroupIndex) -> GroupStats:
    """Group sum, size, mean and std with Bessel's correction, gathered back to each sample; std = 0 when N = 1."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} entries but the batch has {scores.shape[0]} samples")
    gid, num_groups = group_ids(index, scores.device)
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    total = zeros.index_add(0, gid, scores)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = total / count
    sq_dev = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
    std = torch.where(count > 1, (sq_dev / (count - 1).clamp_min(1.0)).sqrt(), torch.zeros_like(count))
    return GroupStats(total[gid], count[gid], mean[gid], std[gid])


def _broadcast(per_sample: Tensor, response_mask: Tensor) -> Tensor:
    """Place one scalar per sample on every valid response token; exactly 0 elsewhere."""
    expanded = per_sample.unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros_like(expanded))


def _sequence_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def discounted_gae(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> Tensor:
    """Un-whitened GAE over the valid tokens of each row.

    With t_1 < … < t_K the valid positions of a row and V_{t_{K+1}} = 0:
        δ_k = r_{t_k} + γ·V_{t_{k+1}} − V_{t_k},   A_k = δ_k + γ·λ·A_{k+1},   A_{K+1} = 0.
    REINFORCE++'s discounted return is the special case V = 0, λ = 1.
    """
    valid = response_mask.bool()
    zero = torch.zeros_like(values[:, 0])
    next_value, next_adv = zero, zero
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        keep = valid[:, t]
        advantages[:, t] = torch.where(keep, adv_t, zero)
        # A masked token is skipped: the value and advantage of the next model token pass through it unchanged.
        next_value = torch.where(keep, values[:, t], next_value)
        next_adv = torch.where(keep, adv_t, next_adv)
    return advantages


@ADV_ESTIMATORS.register("gae")
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> AdvantageOutput:
    """GAE (Schulman et al. 2016): returns = A + V on valid tokens; advantages whitened over the batch when
    `config.whiten_gae` (mean 0, unbiased std 1 over all valid tokens)."""
    if values is None:
        raise ValueError("adv_estimator 'gae' needs critic values (enable the critic)")
    mask = response_mask.bool()
    raw = discounted_gae(token_level_rewards, values, mask, config.gamma, config.lam)
    returns = torch.where(mask, raw + values, torch.zeros_like(raw))
    advantages = masked_whiten(raw, mask) if config.whiten_gae else raw
    return AdvantageOutput(advantages, returns)


@ADV_ESTIMATORS.register("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> AdvantageOutput:
    """GRPO outcome advantage (Shao et al. 2024): with s_i = Σ_t r_{i,t} over valid tokens and G(i) its group,

        A_i = (s_i − mean_G) / (std_G + ε)      std with Bessel's correction (N − 1),
        A_i = s_i − mean_G                      when norm_adv_by_std_in_grpo is False (Dr. GRPO),

    a group of one sample uses mean 0, std 1 (its score passes through, scaled by 1/(1 + ε)).
    A group whose scores are all equal gets A = 0. The same A_i is placed on every valid token.
    """
    if index is None:
        raise ValueError("adv_estimator 'grpo' needs the per-sample group index (prompt uid)")
    scores = _sequence_scores(token_level_rewards, response_mask)
    stats = group_stats(scores, index)
    single = stats.count == 1
    mean = torch.where(single, torch.zeros_like(scores), stats.mean)
    centred = scores - mean
    if config.norm_adv_by_std_in_grpo:
        std = torch.where(single, torch.ones_like(scores), stats.std)
        centred = centred / (std + config.epsilon)
    adv = _broadcast(centred, response_mask)
    return AdvantageOutput(adv, adv)


@ADV_ESTIMATORS.register("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> AdvantageOutput:
    """RLOO (Ahmadian et al. 2024): A_i = s_i − (Σ_{j∈G, j≠i} s_j) / (N − 1) = N/(N−1) · (s_i − mean_G);
    a group of one sample has no other member, so its baseline is 0."""
    if index is None:
        raise ValueError("adv_estimator 'rloo' needs the per-sample group index (prompt uid)")
    scores = _sequence_scores(token_level_rewards, response_mask)
    stats = group_stats(scores, index)
    baseline = torch.where(
        stats.count > 1, (stats.total - scores) / (stats.count - 1).clamp_min(1.0), torch.zeros_like(scores)
    )
    adv = _broadcast(scores - baseline, response_mask)
    return AdvantageOutput(adv, adv)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025): G_k = r_{t_k} + γ·G_{k+1} over the valid tokens of a row (the return-to-go),
    advantages = G whitened over all valid tokens of the batch."""
    mask = response_mask.bool()
    returns = discounted_gae(token_level_rewards, torch.zeros_like(token_level_rewards), mask, config.gamma, 1.0)
    return AdvantageOutput(masked_whiten(returns, mask), returns)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> AdvantageOutput:
    """REINFORCE++-baseline: the group mean of the sequence scores s_i = Σ_t r_{i,t} (0 for a group of one) is
    subtracted at each row's last valid token, then the return-to-go G_k = r'_{t_k} + γ·G_{k+1} over the valid
    tokens, whitened over all valid tokens of the batch (a batch-level std instead of GRPO's group std). With
    γ = 1 and the reward on the last token, every token of row i carries s_i − mean_G before whitening."""
    if index is None:
        raise ValueError("adv_estimator 'reinforce_plus_plus_baseline' needs the per-sample group index")
    mask = response_mask.bool()
    scores = _sequence_scores(token_level_rewards, mask)
    stats = group_stats(scores, index)
    baseline = torch.where(stats.count > 1, stats.mean, torch.zeros_like(scores))
    centred = token_level_rewards - place_on_last_token(baseline, mask)
    returns = discounted_gae(centred, torch.zeros_like(centred), mask, config.gamma, 1.0)
    return AdvantageOutput(masked_whiten(returns, mask), returns)


def compute_advantage(
    name: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> AdvantageOutput:
    """Run the estimator registered as `name` (the value of `algorithm.adv_estimator`)."""
    estimator = ADV_ESTIMATORS.get(name)
    return estimator(token_level_rewards, response_mask, index=index, values=values, config=config)
