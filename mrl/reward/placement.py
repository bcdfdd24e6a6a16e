"""Token-level reward tensors from per-trajectory scalar rewards."""

import torch
from torch import Tensor


def place_on_last_token(scores: Tensor, response_mask: Tensor) -> Tensor:
    """[batch, response_len] rewards: scores[i] at the last position where response_mask[i] is 1 (the last model
    token, so tool/observation tokens after it never carry the reward), 0 everywhere else. A row with no model
    token gets no reward: under the mask there is nowhere to put it, and masked rewards are ignored downstream."""
    mask = response_mask.bool()
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    values = scores.to(device=mask.device, dtype=dtype)  # scores often come from CPU reward workers
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=-1).values
    hit = positions == last.unsqueeze(-1)  # never true on a row without model tokens (last = −1)
    return torch.where(hit, values.unsqueeze(-1), torch.zeros((), dtype=dtype, device=mask.device))
