"""KL estimators, controllers, the reward penalty and entropy against closed-form values."""

import math

import pytest
import torch

from mrl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    apply_kl_penalty,
    entropy_from_logits,
    kl_penalty,
    make_kl_controller,
)

LN2 = math.log(2.0)


def test_estimators_at_known_log_ratios():
    log_prob = torch.tensor([LN2, -LN2, 0.0], dtype=torch.float64)
    ref = torch.zeros(3, dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(log_prob, ref, "k1"), torch.tensor([LN2, -LN2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(kl_penalty(log_prob, ref, "k2"), torch.tensor([LN2**2 / 2, LN2**2 / 2, 0.0]).double())
    # k3 = e^{−Δ} − 1 + Δ: Δ = ln2 → ½ − 1 + ln2; Δ = −ln2 → 2 − 1 − ln2
    torch.testing.assert_close(kl_penalty(log_prob, ref, "k3"), torch.tensor([LN2 - 0.5, 1 - LN2, 0.0]).double())
    torch.testing.assert_close(kl_penalty(log_prob, ref, "abs"), torch.tensor([LN2, LN2, 0.0], dtype=torch.float64))
    for alias, name in [("kl", "k1"), ("mse", "k2")]:
        torch.testing.assert_close(kl_penalty(log_prob, ref, alias), kl_penalty(log_prob, ref, name))


@pytest.mark.parametrize(("name", "expected"), [("k1", 0.25 * LN2), ("k3", 0.25 * LN2), ("k2", 0.375 * LN2**2)])
def test_expectations_under_the_sampling_distribution(name: str, expected: float):
    """p = (½, ¼, ¼), q = (¼, ½, ¼): KL(p‖q) = ¼ ln 2; k1 and k3 are unbiased, E_p[k2] = ½ E_p[(ln p/q)²] = ⅜ ln² 2."""
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    exact_kl = (p * (p / q).log()).sum().item()
    assert exact_kl == pytest.approx(0.25 * LN2)
    assert (p * kl_penalty(p.log(), q.log(), name)).sum().item() == pytest.approx(expected)


def test_low_var_kl_is_clamped_and_straight_through_takes_k2_gradient():
    log_prob = torch.tensor([-30.0, 30.0, 5.0, 0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros(4, dtype=torch.float64)
    low_var = kl_penalty(log_prob, ref, "low_var_kl")
    # k3 = e^{−Δ} − 1 + Δ capped at 10: Δ = −30 → e^30 → 10; Δ = 30 → 29 → 10; Δ = 5 and 0.5 are below the cap
    expected = torch.tensor([10.0, 10.0, math.exp(-5) + 4, math.exp(-0.5) - 0.5], dtype=torch.float64)
    torch.testing.assert_close(low_var, expected)
    assert kl_penalty(log_prob, ref, "k3")[0].item() == pytest.approx(math.exp(30) - 31)
    st = kl_penalty(log_prob, ref, "k3+")
    torch.testing.assert_close(st[3], kl_penalty(log_prob, ref, "k3")[3])
    st[3].backward()
    assert log_prob.grad[3].item() == pytest.approx(0.5)  # ∂(½Δ²)/∂Δ = Δ
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(log_prob, ref, "k4")


def test_adaptive_controller_follows_the_proportional_rule():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    ctrl.update(current_kl=1.0, n_steps=10)  # error clipped to +0.2 → ×1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.45, n_steps=10)  # error −0.1 → ×0.99
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    fixed = make_kl_controller(KLControlConfig(type="fixed", kl_coef=0.3))
    fixed.update(5.0, 10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    assert isinstance(make_kl_controller(KLControlConfig(type="adaptive")), AdaptiveKLController)
    with pytest.raises(ValueError, match=r"kl_ctrl\.type"):
        make_kl_controller(KLControlConfig(type="pid"))


def test_kl_reward_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    log_prob = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, log_prob, ref, mask, ctrl, kl_type="k1")
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    # mean over sequences of per-sequence token means: (0.2 + 0.45) / 2; β used was 0.5, then updated with n = 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.325)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == pytest.approx(0.5 * (1 + (-0.2) * 2 / 10))


def test_entropy_from_logits():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([1.5 * LN2, math.log(3)]))
    # shift invariance: a constant added to the logits changes nothing
    torch.testing.assert_close(entropy_from_logits(logits + 7.0), entropy_from_logits(logits))
