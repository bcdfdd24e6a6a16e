"""Loss aggregation that stays exact when a step is split into micro-batches and DP ranks.

Modes (verl's `loss_agg_mode` names), for a per-token loss ℓ_{s,t}, mask m_{s,t}, over the *whole* step
(one optimizer update: every micro-batch on every DP rank):

    token-mean               L = Σ_{s,t} m·ℓ / N_tok                       N_tok = Σ_{s,t} m
    seq-mean-token-sum       L = Σ_s (Σ_t m·ℓ) / N_seq                      N_seq = #sequences with Σ_t m > 0
    seq-mean-token-mean      L = Σ_s (Σ_t m·ℓ / Σ_t m) / N_seq
    seq-mean-token-sum-norm  L = Σ_s (Σ_t m·ℓ) / (N_seq · C)                C = loss_scale_factor (Dr. GRPO's constant,
                                                                            normally the max response length)

Every mode is a sum of per-sequence terms divided by a step-global denominator. So the contract with the engine:

1. Before the step, count (N_tok, N_seq) over the whole step: `loss_counts(mask)` per micro-batch, summed over
   micro-batches and all-reduced (SUM) over the DP group, then `LossNormalizer.from_counts(...)`. Sequences with
   an all-zero mask (the trainer's synthetic no-op samples) count in neither.
2. Each micro-batch returns `agg_loss(ℓ, m, mode, normalizer)`: its own sum of terms over the global denominator.
3. The step loss is the SUM of those returns over micro-batches and DP ranks, and so is the gradient. An engine
   whose framework averages instead (Megatron's schedule divides the loss by the number of micro-batches unless
   `calculate_per_token_loss`; DDP averages gradients over DP ranks) must multiply by that count to undo it.

A sequence must not be split between micro-batches in `seq-mean-token-mean` (its own token count is local);
THD packing keeps sequences whole. TP ranks hold the same tokens, so they count once (all-reduce over DP, not TP).
Context parallelism splits every sequence across CP ranks: N_tok is then summed over DP × CP, N_seq over DP
only, and seq-mean-token-mean would need each sequence's whole token count, which this function does not take.
Without a normalizer the denominators come from the given batch, i.e. the single-process full-batch loss.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mrl.algo.masked import masked_count, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_counts(response_mask: Tensor) -> Tensor:
    """[N_tok, N_seq] of this (micro-)batch in float64, to be summed over micro-batches and DP ranks."""
    per_seq = masked_count(response_mask, dim=-1)
    return torch.stack([per_seq.sum(), (per_seq > 0).sum()]).to(torch.float64)


@dataclass(frozen=True)
class LossNormalizer:
    """Step-global denominators of the aggregation modes (see the module docstring)."""

    num_tokens: float
    num_seqs: float

    @classmethod
    def from_counts(cls, counts: Tensor) -> "LossNormalizer":
        tokens, seqs = (float(c) for c in counts.tolist())
        return cls(num_tokens=tokens, num_seqs=seqs)

    @classmethod
    def from_mask(cls, response_mask: Tensor) -> "LossNormalizer":
        """Denominators of a batch held whole in one place (e.g. the driver, before dispatch)."""
        return cls.from_counts(loss_counts(response_mask))


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """This batch's share of the step loss in `loss_agg_mode` (formulas in the module docstring).

    `loss_scale_factor` is C of seq-mean-token-sum-norm; it defaults to the padded width of the given batch, which
    differs between micro-batches, so split steps pass the run's constant (the workers: `actor.loss_scale_factor`
    or data.max_response_length, mrl/workers/training_worker.py `loss_scale_factor`).
    A denominator of 0 (a step of only no-op samples) gives a loss of exactly 0, not nan.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; known: {', '.join(LOSS_AGG_MODES)}")
    norm = normalizer if normalizer is not None else LossNormalizer.from_mask(loss_mask)
    seq_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "token-mean":
        numerator, denom = seq_sums.sum(), norm.num_tokens
    elif loss_agg_mode == "seq-mean-token-sum":
        numerator, denom = seq_sums.sum(), norm.num_seqs
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_len = masked_count(loss_mask, dim=-1).clamp_min(1.0).to(loss_mat.dtype)
        numerator, denom = (seq_sums / seq_len).sum(), norm.num_seqs
    else:
        scale = float(loss_scale_factor) if loss_scale_factor is not None else float(loss_mask.shape[-1])
        numerator, denom = seq_sums.sum(), norm.num_seqs * scale
    return numerator / max(denom, 1.0)
