"""PPO dual clip, GSPO and CISPO on ratios built by hand, values and gradients."""

import math

import pytest
import torch

from mrl.algo.aggregation import agg_loss
from mrl.algo.policy_loss import POLICY_LOSSES, PolicyLossConfig, compute_policy_loss


def _log_probs(ratios: list[list[float]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_prob requiring grad, old_log_prob) whose exp-difference is exactly the given ratio matrix."""
    old = -torch.rand(len(ratios), len(ratios[0]), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    log_prob = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)
    return log_prob, old


def test_ppo_clip_and_dual_clip_values_gradients_and_clip_fractions():
    ratios = [[1.5, 0.5, 1.5, 5.0, 0.5]]
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    log_prob, old = _log_probs(ratios)
    out = compute_policy_loss(log_prob, old, advantages, torch.ones(1, 5), PolicyLossConfig(clip_ratio_c=3.0))
    # A>0,r=1.5 → clipped −1.2 | A>0,r=0.5 → −0.5 | A<0,r=1.5 → 1.5 | A<0,r=5 → dual bound 3 | A<0,r=0.5 → clipped 0.8
    torch.testing.assert_close(out.loss_mat, torch.tensor([[-1.2, -0.5, 1.5, 3.0, 0.8]], dtype=torch.float64))
    out.loss_mat.sum().backward()
    # d/dlogπ of −A·r is −A·r on unclipped tokens; clipped and dual-clipped tokens carry no gradient
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0, 0.0]], dtype=torch.float64))
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert out.metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    ppo_kl = -sum(math.log(r) for r in ratios[0]) / 5
    assert out.metrics["ppo_kl"].item() == pytest.approx(ppo_kl)


def test_ppo_asymmetric_clip_uses_clip_ratio_low_and_high():
    log_prob, old = _log_probs([[1.5, 0.5]])
    config = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28)
    out = compute_policy_loss(log_prob, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2), config)
    torch.testing.assert_close(out.loss_mat, torch.tensor([[-1.28, 0.9]], dtype=torch.float64))


def test_invalid_clip_settings_fail_at_construction():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PolicyLossConfig(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip_ratio_low must be in"):
        PolicyLossConfig(clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="loss_mode 'dpo' unknown"):
        PolicyLossConfig(loss_mode="dpo")


def test_gspo_clips_whole_sequences_by_the_geometric_mean_ratio():
    # row 0: token log-ratios 0.1, 0.3 (third token masked, its huge ratio ignored) → s = e^0.2 ≈ 1.221 > 1.2: clipped.
    # A per-token PPO would leave token 0 (ratio e^0.1 ≈ 1.105) unclipped.
    # row 1: log-ratios 0, 0.1, 0.05 → s = e^0.05, inside the band.
    log_ratio = torch.tensor([[0.1, 0.3, 50.0], [0.0, 0.1, 0.05]], dtype=torch.float64)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_prob = (old + log_ratio).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    out = compute_policy_loss(log_prob, old, advantages, mask, PolicyLossConfig(loss_mode="gspo"))
    s1 = math.exp(0.05)
    torch.testing.assert_close(out.loss_mat, torch.tensor([[-1.2, -1.2, 0.0], [s1, s1, s1]], dtype=torch.float64))
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    loss = agg_loss(out.loss_mat, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    loss.backward()
    # sequence-level objective: ∂(−A·s)/∂logπ_t = −A·s/|y|, then the mean over 2 sequences; clipped row → 0
    expected_grad = torch.tensor([[0.0, 0.0, 0.0], [s1 / 3 / 2] * 3], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected_grad)


def test_cispo_keeps_gradient_of_clipped_tokens_through_a_stopped_weight():
    log_prob, old = _log_probs([[1.5, 0.5, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    out = compute_policy_loss(log_prob, old, advantages, torch.ones(1, 3), PolicyLossConfig(loss_mode="cispo"))
    weights = torch.tensor([[1.2, 0.8, 1.0]], dtype=torch.float64)  # clip(r, 0.8, 1.2)
    torch.testing.assert_close(out.loss_mat, -weights * advantages * log_prob.detach())
    out.loss_mat.sum().backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.2, -0.8, 2.0]], dtype=torch.float64))
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)
    assert out.metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)


def test_masked_tokens_get_zero_loss_and_zero_gradient_even_with_inf_padding():
    log_prob = torch.tensor([[-0.5, float("-inf")]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.6, float("-inf")]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    for mode in POLICY_LOSSES.names():
        log_prob.grad = None
        out = compute_policy_loss(log_prob, old, torch.ones(1, 2, dtype=torch.float64), mask, PolicyLossConfig(mode))
        assert out.loss_mat[0, 1] == 0 and torch.isfinite(out.loss_mat).all(), mode
        agg_loss(out.loss_mat, mask).backward()
        assert log_prob.grad[0, 1] == 0 and torch.isfinite(log_prob.grad).all(), mode
