"""Truncated and masked importance sampling, the veto, mismatch metrics and decoupled PPO, by hand."""

import math

import pytest
import torch

from mrl.algo.policy_loss import PolicyLossConfig
from mrl.algo.rollout_correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction,
    decoupled_ppo_loss,
    mismatch_metrics,
    rollout_is_weights,
    rollout_rejection_mask,
)

# ρ = π_old / π_rollout per token; row 1's third token is masked (its ρ = 100 must never matter)
RHO = [[3.0, 0.5, 1.5], [0.25, 1.2, 100.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = -torch.rand(2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return rollout + torch.tensor(RHO, dtype=torch.float64).log(), rollout


def test_token_and_sequence_truncation():
    old, rollout = _log_probs()
    token = rollout_is_weights(old, rollout, MASK, "token", threshold=2.0)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.5, 1.5], [0.25, 1.2, 0.0]], dtype=torch.float64))
    seq = rollout_is_weights(old, rollout, MASK, "sequence", threshold=2.0)
    # Π ρ: row 0 = 3·0.5·1.5 = 2.25 → truncated to 2; row 1 = 0.25·1.2 = 0.3
    torch.testing.assert_close(seq, torch.tensor([[2.0, 2.0, 2.0], [0.3, 0.3, 0.0]], dtype=torch.float64))


def test_rejection_thresholds_at_each_level():
    old, rollout = _log_probs()
    token = rollout_rejection_mask(old, rollout, MASK, "token", lower=0.4, upper=2.0)
    assert token.tolist() == [[False, True, True], [False, True, False]]
    seq = rollout_rejection_mask(old, rollout, MASK, "sequence", lower=0.5, upper=3.0)
    assert seq.tolist() == [[True, True, True], [False, False, False]]  # 2.25 kept, 0.3 rejected
    # geometric means: 2.25^(1/3) ≈ 1.31 and 0.3^(1/2) ≈ 0.548
    assert rollout_rejection_mask(old, rollout, MASK, "geometric", 0.5, 2.0).tolist() == MASK.bool().tolist()
    geo = rollout_rejection_mask(old, rollout, MASK, "geometric", 0.6, 2.0)
    assert geo.tolist() == [[True, True, True], [False, False, False]]
    vetoed = rollout_rejection_mask(old, rollout, MASK, "token", None, None, veto_threshold=0.3)
    assert vetoed.tolist() == [[True, True, True], [False, False, False]]  # row 1 holds ρ = 0.25 < 0.3


def test_mismatch_metrics():
    old, rollout = _log_probs()
    metrics = mismatch_metrics(old, rollout, MASK)
    assert metrics["logprob_mismatch"] == pytest.approx((3 + 2 + 1.5 + 4 + 1.2) / 5)  # mean exp|Δ|
    assert metrics["logprob_abs_diff_max"] == pytest.approx(math.log(4))
    k3 = [r - 1 - math.log(r) for r in (3.0, 0.5, 1.5, 0.25, 1.2)]
    assert metrics["mismatch_kl"] == pytest.approx(sum(k3) / 5)
    with_inf = rollout.clone()
    with_inf[0, 0] = float("-inf")  # an engine's −inf for a sampled token: averages stay finite, the max shows it
    outlier = mismatch_metrics(old, with_inf, MASK)
    assert math.isfinite(outlier["logprob_mismatch"]) and math.isfinite(outlier["mismatch_kl"])
    assert outlier["logprob_abs_diff_max"] == math.inf
    same = mismatch_metrics(rollout, rollout, MASK)
    assert same["logprob_mismatch"] == 1.0 and same["mismatch_kl"] == 0.0


def test_combined_correction_rejects_first_then_weights_and_reports():
    old, rollout = _log_probs()
    config = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token",
        rollout_rs_threshold=2.5,
        rollout_rs_threshold_lower=0.4,
    )
    result = compute_rollout_correction(old, rollout, MASK, config)
    assert result.response_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    torch.testing.assert_close(result.is_weights, torch.tensor([[0.0, 0.5, 1.5], [0.0, 1.2, 0.0]]).double())
    m = result.metrics
    assert m["rollout_corr/rollout_rs_masked_frac"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_frac"] == 0.0
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((0.5 + 1.5 + 1.2) / 3)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.5)
    assert m["rollout_corr/rollout_is_clip_frac"] == 0.0
    off = compute_rollout_correction(old, rollout, MASK, RolloutCorrectionConfig())
    assert off.is_weights is None and torch.equal(off.response_mask, MASK)
    assert off.metrics["rollout_corr/logprob_mismatch"] == pytest.approx(2.34)


def test_sequence_weights_of_long_sequences_stay_finite():
    rollout = torch.zeros(2, 5000, dtype=torch.float64)
    old = torch.stack([torch.ones(5000), -torch.ones(5000)]).double()  # Σ log ρ = ±5000
    weights = rollout_is_weights(old, rollout, torch.ones(2, 5000), "sequence", threshold=2.0)
    assert torch.all(weights[0] == 2.0) and torch.all(weights[1] == 0.0)
    result = compute_rollout_correction(
        old, rollout, torch.ones(2, 5000), RolloutCorrectionConfig(rollout_is="sequence")
    )
    assert result.metrics["rollout_corr/rollout_is_clip_frac"] == 0.5


def test_config_validation_names_the_setting():
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        RolloutCorrectionConfig(rollout_is="batch")
    with pytest.raises(ValueError, match="rollout_rs must be one of"):
        RolloutCorrectionConfig(rollout_rs="tokens")
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower"):
        RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.0, rollout_rs_threshold_lower=2.0)


def test_decoupled_ppo_weights_the_proximal_ratio_by_the_behaviour_ratio():
    behaviour = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    proximal = behaviour + torch.tensor([[1.5, 0.8, 3.0]], dtype=torch.float64).log()
    log_prob = (proximal + torch.tensor([[1.0, 1.5, 1.0]], dtype=torch.float64).log()).requires_grad_(True)
    advantages = torch.ones(1, 3, dtype=torch.float64)
    out = decoupled_ppo_loss(
        log_prob, proximal, behaviour, advantages, torch.ones(1, 3), PolicyLossConfig(), behav_imp_weight_cap=2.0
    )
    # token 0: π/π_prox = 1 → −1, weight 1.5; token 1: ratio 1.5 clipped to 1.2 → −1.2, weight 0.8;
    # token 2: behaviour weight 3 > cap → dropped
    torch.testing.assert_close(out.loss_mat, torch.tensor([[-1.5, -0.96, 0.0]], dtype=torch.float64))
    out.loss_mat.sum().backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.5, 0.0, 0.0]], dtype=torch.float64))
    assert out.metrics["behav_mask_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["behav_imp_weight"].item() == pytest.approx((1.5 + 0.8) / 2)
