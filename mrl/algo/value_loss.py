"""Critic loss with value clipping (PPO's clipped value objective)."""

from typing import NamedTuple

import torch
from torch import Tensor

from mrl.algo.masked import masked_mean


class ValueLossOutput(NamedTuple):
    loss_mat: Tensor
    metrics: dict[str, Tensor]


def clipped_value_loss(
    vpreds: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, cliprange_value: float
) -> ValueLossOutput:
    """Per-token ℓ = ½ · max((V − R)², (V_clip − R)²) with V_clip = V_old + clip(V − V_old, −c, c), c = cliprange_value
    (verl's `critic.cliprange_value`); 0 on masked positions. Aggregate with `agg_loss`.

    Metrics: vf_clipfrac (tokens where the clipped branch is larger) and vpred_mean.
    """
    mask = response_mask.bool()
    zero = torch.zeros_like(vpreds)
    vpreds, old_values, returns = (torch.where(mask, t, zero) for t in (vpreds, old_values, returns))
    v_clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (v_clipped - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {
        "vf_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "vpred_mean": masked_mean(vpreds, mask).detach(),
    }
    return ValueLossOutput(torch.where(mask, loss, zero), metrics)
