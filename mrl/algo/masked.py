"""Reductions over the valid entries of a padded [batch, response_len] tensor.

Padded positions may hold anything (including inf/nan from a padded log-prob), so values are selected with
`torch.where` rather than multiplied by the mask: 0 · inf would poison every sum.
"""

import torch
from torch import Tensor

# Log-ratios are clamped to ±LOG_RATIO_CLAMP before exp(): e^20 ≈ 5e8 is finite in fp32 and bf16, and a token
# that far off-policy carries no useful gradient through its ratio anyway.
LOG_RATIO_CLAMP = 20.0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x over entries where mask is true (over `dim`, or over everything when dim is None)."""
    selected = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    m = mask.bool().to(torch.float32)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ_mask x / Σ mask; 0 where nothing is valid (an all-padding row has no mean to report)."""
    return masked_sum(x, mask, dim) / masked_count(mask, dim).clamp_min(1.0).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all valid entries: Σ (x − mean)² / (n − 1) (or / n); 0 when n ≤ 1 with the unbiased form."""
    mean = masked_mean(x, mask)
    n = masked_count(mask).to(x.dtype)
    sq = masked_sum((x - mean) ** 2, mask)
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp_min(1.0), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) with mean and unbiased var taken over all valid entries; 0 outside the mask.

    With shift_mean=False the mean is added back (scale-only whitening).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
