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
`algorithm.rollout_correction`. The old log-prob pass removes rejected tokens from the stored response mask (so
they leave every loss term and the denominators, as in verl), and the actor loss applies `apply_rollout_correction`
per micro-batch for the weights (every unit is a token or a whole sequence, and micro-batches keep sequences
whole; rejection on an already rejected mask keeps it as it is; mrl/algo/actor_loss.py). The
step's metrics come from `correction_stats` on each rank's rows where π_old is computed, reduced exactly on the
driver (`correction_metrics`), also per staleness level.

Decoupled PPO (Hilton et al. 2022; AReaL) keeps three log-probs: behaviour (rollout), proximal (old) and current;
the PPO ratio uses the proximal policy and the behaviour correction multiplies the loss (`decoupled_ppo_loss`).

Metric `logprob_mismatch = mean_t exp(|log π_old − log π_rollout|)` is ≥ 1 and equals 1 iff the two agree.
"""

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mrl.algo.masked import LOG_RATIO_CLAMP, masked_count, masked_mean, masked_sum
from mrl.algo.policy_loss import PolicyLossConfig, PolicyLossOutput, compute_policy_loss
from mrl.config.schema import RolloutCorrectionSettings

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass
class RolloutCorrectionConfig(RolloutCorrectionSettings):
    """`algorithm.rollout_correction` (fields and their meaning: mrl/config/schema.py) with its rules checked.
    `rollout_rs_threshold` defaults to `rollout_is_threshold`, `rollout_rs_threshold_lower` to 1 / upper.
    `use_decoupled_loss`: decoupled PPO (`decoupled_ppo_loss`), tokens whose behaviour weight exceeds
    `behav_imp_weight_cap` dropped; it is itself a token-level importance weight, so not with `rollout_is`."""

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
        for name in ("rollout_token_veto_threshold", "behav_imp_weight_cap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"rollout_correction.{name} must be > 0 or null, got {value}")
        if self.use_decoupled_loss and self.rollout_is is not None:
            raise ValueError("rollout_correction.use_decoupled_loss already weights each token by π_old / π_rollout: "
                             "set rollout_is to null (or use rollout_is without the decoupled loss)")
        if self.behav_imp_weight_cap is not None and not self.use_decoupled_loss:
            raise ValueError("rollout_correction.behav_imp_weight_cap caps the decoupled loss's weight: it needs "
                             "use_decoupled_loss=true")

    @property
    def rs_bounds(self) -> tuple[float, float]:
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper

    @property
    def enabled(self) -> bool:
        """Whether the loss needs the rollout's log-probs (some correction is on)."""
        return (self.rollout_is is not None or self.rollout_rs is not None or self.use_decoupled_loss
                or self.rollout_token_veto_threshold is not None)

    @property
    def rejects(self) -> bool:
        return self.rollout_rs is not None or self.rollout_token_veto_threshold is not None


def correction_config(settings: Any) -> RolloutCorrectionConfig:
    """The algorithm's config from `algorithm.rollout_correction` (the schema's dataclass or its DictConfig)."""
    return RolloutCorrectionConfig(**{f.name: getattr(settings, f.name) for f in fields(RolloutCorrectionConfig)})


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


def apply_rollout_correction(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, config: RolloutCorrectionConfig
) -> tuple[Tensor | None, Tensor]:
    """(IS weights or None, the bool mask after rejection): rejection sampling (if `rollout_rs` or the veto) then
    truncated IS (if `rollout_is`) on the surviving tokens. No metrics, no host synchronisation: loss-side."""
    mask = response_mask.bool()
    if config.rejects:
        level, (lower, upper) = (config.rollout_rs, config.rs_bounds) if config.rollout_rs else ("token", (None, None))
        mask = rollout_rejection_mask(
            old_log_prob, rollout_log_prob, mask, level, lower, upper, config.rollout_token_veto_threshold
        )
    weights = None
    if config.rollout_is is not None:
        weights = rollout_is_weights(
            old_log_prob, rollout_log_prob, mask, config.rollout_is, config.rollout_is_threshold
        )
    return weights, mask


def compute_rollout_correction(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, config: RolloutCorrectionConfig
) -> RolloutCorrection:
    """`apply_rollout_correction` with this batch's metrics: the mismatch always, the rejected fractions and the
    weight statistics when those corrections are on, prefixed `rollout_corr/`."""
    before = response_mask.bool()
    metrics = mismatch_metrics(old_log_prob, rollout_log_prob, before)
    weights, mask = apply_rollout_correction(old_log_prob, rollout_log_prob, before, config)
    if config.rejects:
        n_tokens = max(float(before.sum()), 1.0)
        n_seqs = max(float(before.any(dim=-1).sum()), 1.0)
        metrics["rollout_rs_masked_frac"] = float((before & ~mask).sum()) / n_tokens
        metrics["rollout_rs_seq_masked_frac"] = float((before.any(-1) & ~mask.any(-1)).sum()) / n_seqs
    if weights is not None:
        assert config.rollout_is is not None
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


# ---- step metrics: exact sums per rank, reduced on the driver ----------------------------------------------------
# Each rank sums over its rows per group (the rows' oldest weight version), the driver adds the ranks' sums (min /
# max for the `_min` / `_max` keys) and divides once: the step's means are exact whatever the DP split.


def _weight_units(
    old_log_prob: Tensor, rollout_log_prob: Tensor, weights: Tensor | None, kept: Tensor,
    config: RolloutCorrectionConfig,
) -> tuple[Tensor, Tensor, float] | None:
    """The weights the loss applies, one per unit (kept token, or sequence with a kept token), the row of each
    unit, and the threshold a weight counts as clipped at (TIS: truncated to it; decoupled: dropped above it)."""
    if config.use_decoupled_loss:
        log_w = _log_ratio(old_log_prob, rollout_log_prob, kept).clamp(max=LOG_RATIO_CLAMP)
        cap = config.behav_imp_weight_cap if config.behav_imp_weight_cap is not None else math.inf
        rows = kept.nonzero()[:, 0]
        return torch.exp(log_w)[kept], rows, cap
    if weights is None:
        return None
    if config.rollout_is == "sequence":
        has = kept.any(dim=-1)
        return weights.max(dim=-1).values[has], has.nonzero()[:, 0], config.rollout_is_threshold
    return weights[kept], kept.nonzero()[:, 0], config.rollout_is_threshold


def correction_stats(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, config: RolloutCorrectionConfig,
    groups: Tensor,
) -> dict[int, dict[str, float]]:
    """Per group of rows (`groups[i]`, e.g. row i's oldest weight version): the sums behind the step's correction
    metrics (`correction_metrics`). Groups without a valid token are left out."""
    mask = response_mask.bool()
    delta = _log_ratio(old_log_prob, rollout_log_prob, mask)
    bounded = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # as in mismatch_metrics
    weights, kept = apply_rollout_correction(old_log_prob, rollout_log_prob, mask, config)
    per_row = {
        "tokens": masked_count(mask, dim=-1).double(),
        "seqs": mask.any(dim=-1).double(),
        "exp_abs_sum": masked_sum(torch.exp(bounded.abs()), mask, dim=-1).double(),
        "k3_sum": masked_sum(torch.expm1(bounded) - bounded, mask, dim=-1).double(),
        "delta_sum": masked_sum(bounded, mask, dim=-1).double(),
    }
    if config.rejects:
        per_row["rs_masked_tokens"] = (mask & ~kept).sum(dim=-1).double()
        per_row["rs_masked_seqs"] = (mask.any(dim=-1) & ~kept.any(dim=-1)).double()
    abs_max = torch.where(mask, delta.abs(), torch.zeros_like(delta)).amax(dim=-1) if mask.shape[-1] else None
    units = _weight_units(old_log_prob, rollout_log_prob, weights, kept, config)
    out: dict[int, dict[str, float]] = {}
    for g in sorted(set(groups.tolist())):
        rows = groups == g
        if not bool(mask[rows].any()):
            continue
        stats = {k: float(v[rows].sum()) for k, v in per_row.items()}
        stats["abs_diff_max"] = float(abs_max[rows].max()) if abs_max is not None else 0.0
        if units is not None:
            values, unit_rows, threshold = units
            w = values[rows[unit_rows]].double()
            stats.update(w_units=float(w.numel()), w_sum=float(w.sum()), w_sq_sum=float((w * w).sum()),
                         w_clipped=float((w >= threshold).sum()))
            if w.numel():
                stats.update(w_min=float(w.min()), w_max=float(w.max()))
        out[int(g)] = stats
    return out


def merge_correction_stats(per_rank: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """The ranks' `correction_stats` added up per group (min and max for the `_min` / `_max` keys)."""
    merged: dict[int, dict[str, float]] = {}
    for rank in per_rank:
        for g, stats in rank.items():
            into = merged.setdefault(g, {})
            for k, v in stats.items():
                pick = min if k.endswith("_min") else max if k.endswith("_max") else None
                into[k] = v if k not in into else pick(into[k], v) if pick else into[k] + v
    return merged


def _metrics_of(stats: dict[str, float]) -> dict[str, float]:
    tokens = max(stats["tokens"], 1.0)
    out = {
        "logprob_mismatch": stats["exp_abs_sum"] / tokens,
        "mismatch_kl": stats["k3_sum"] / tokens,
        # PPL_trainer / PPL_rollout on the sampled tokens = exp(mean(−log π_old) − mean(−log π_rollout))
        "ppl_ratio": math.exp(-stats["delta_sum"] / tokens),
        "logprob_abs_diff_max": stats["abs_diff_max"],
        "tokens": stats["tokens"],
    }
    if "rs_masked_tokens" in stats:
        out["rs_masked_frac"] = stats["rs_masked_tokens"] / tokens
        out["rs_seq_masked_frac"] = stats["rs_masked_seqs"] / max(stats["seqs"], 1.0)
    if stats.get("w_units"):
        n = stats["w_units"]
        mean = stats["w_sum"] / n
        out.update(is_weight_mean=mean, is_weight_std=math.sqrt(max(stats["w_sq_sum"] / n - mean * mean, 0.0)),
                   is_weight_min=stats["w_min"], is_weight_max=stats["w_max"], is_clip_frac=stats["w_clipped"] / n)
    return out


def correction_metrics(per_rank: list[dict[int, dict[str, float]]], trainer_version: int) -> dict[str, float]:
    """The step's `rollout_corr/*` metrics from every rank's `correction_stats` grouped by the rows' oldest
    weight version: over all rows, and per staleness level k = trainer_version − version as
    `rollout_corr/staleness_{k}/*` (k > 0 only in the async modes)."""
    merged = merge_correction_stats(per_rank)
    if not merged:
        return {}
    overall = merge_correction_stats([{0: s} for s in merged.values()])[0]
    out = {f"rollout_corr/{k}": v for k, v in _metrics_of(overall).items()}
    for version, stats in merged.items():
        if version >= 0:
            lag = trainer_version - version
            out.update({f"rollout_corr/staleness_{lag}/{k}": v for k, v in _metrics_of(stats).items()})
    return out
