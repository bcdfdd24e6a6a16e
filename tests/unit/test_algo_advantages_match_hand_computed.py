"""Advantage estimators against values computed by hand (GRPO, RLOO, REINFORCE++) or by a plain reference loop (GAE)."""

import math
import statistics

import numpy as np
import pytest
import torch

from mrl.algo.advantages import ADV_ESTIMATORS, AdvantageConfig, compute_advantage
from mrl.reward.placement import place_on_last_token

EPS = 1e-6


def _outcome_batch(scores: list[float], lengths: list[int], width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.int64)
    return place_on_last_token(torch.tensor(scores, dtype=torch.float64), mask), mask


def test_grpo_uses_bessel_std_and_single_sample_groups_pass_through():
    # group a: scores 1, 2, 4 → mean 7/3, Σ(dev²) = 14/3, unbiased var = 7/3 (the biased one would be 14/9)
    # group b: a single sample → mean 0, std 1; group c: equal scores → 0
    rewards, mask = _outcome_batch([1.0, 2.0, 4.0, 0.5, 3.0, 3.0], [2, 1, 4, 3, 2, 2])
    adv, returns = compute_advantage("grpo", rewards, mask, index=["a", "a", "a", "b", "c", "c"])
    std_a = math.sqrt(7 / 3)
    expected = [(-4 / 3) / (std_a + EPS), (-1 / 3) / (std_a + EPS), (5 / 3) / (std_a + EPS), 0.5 / (1 + EPS), 0.0, 0.0]
    for row, value in enumerate(expected):
        valid = mask[row].bool()
        torch.testing.assert_close(adv[row, valid], torch.full((int(valid.sum()),), value, dtype=torch.float64))
        assert torch.all(adv[row, ~valid] == 0)
    torch.testing.assert_close(returns, adv)


def test_dr_grpo_only_subtracts_the_group_mean():
    rewards, mask = _outcome_batch([1.0, 2.0, 4.0, 0.5], [2, 1, 4, 3])
    config = AdvantageConfig(norm_adv_by_std_in_grpo=False)
    adv, _ = compute_advantage("grpo", rewards, mask, index=torch.tensor([7, 7, 7, 9]), config=config)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-4 / 3, -1 / 3, 5 / 3, 0.5], dtype=torch.float64))


def test_group_index_forms_agree():
    """uids arrive as strings, as a numpy object array (the Batch's non-tensor field) or as an integer tensor."""
    rewards, mask = _outcome_batch([1.0, 2.0, 4.0, 0.5, 3.0], [2, 1, 4, 3, 2])
    forms = [
        ["p1", "p1", "p2", "p2", "p3"],
        np.array(["p1", "p1", "p2", "p2", "p3"], dtype=object),
        torch.tensor([5, 5, 2, 2, 9]),
    ]
    results = [compute_advantage("grpo", rewards, mask, index=form).advantages for form in forms]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0])
    assert results[0][4, 0].item() == pytest.approx(3.0 / (1 + EPS))  # lone sample


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    rewards, mask = _outcome_batch([1.0, 2.0, 4.0, 0.5], [2, 1, 4, 3])
    adv, _ = compute_advantage("rloo", rewards, mask, index=["a", "a", "a", "b"])
    # 1 − (2+4)/2, 2 − (1+4)/2, 4 − (1+2)/2, and a lone sample keeps its score
    torch.testing.assert_close(adv[:, 0], torch.tensor([-2.0, -0.5, 2.5, 0.5], dtype=torch.float64))
    assert torch.all(adv[mask == 0] == 0)


def test_reinforce_plus_plus_discounts_over_model_tokens_and_whitens():
    # row 0: a tool token at position 2 sits between model tokens; row 1 ends after 2 tokens
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    rewards = torch.tensor([[0.0, 0.0, 7.0, 4.0], [0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)  # 7.0 is masked: ignored
    adv, returns = compute_advantage("reinforce_plus_plus", rewards, mask, config=AdvantageConfig(gamma=0.5))
    # G = 4 at t=3; t=1 → 0 + 0.5·4 = 2 (the tool token neither resets nor discounts); t=0 → 1
    torch.testing.assert_close(returns, torch.tensor([[1.0, 2.0, 0.0, 4.0], [1.0, 2.0, 0.0, 0.0]], dtype=torch.float64))
    valid = [1.0, 2.0, 4.0, 1.0, 2.0]  # mean 2, unbiased var 6/4
    expected = torch.tensor([[-1.0, 0.0, 0.0, 2.0], [-1.0, 0.0, 0.0, 0.0]], dtype=torch.float64) / math.sqrt(1.5 + 1e-8)
    assert statistics.mean(valid) == 2.0 and statistics.variance(valid) == 1.5
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens_over_tokens():
    lengths = [2, 1, 3, 2]
    rewards, mask = _outcome_batch([1.0, 2.0, 4.0, 0.5], lengths)
    adv, _ = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index=["a", "a", "a", "b"])
    centred = [-4 / 3, -1 / 3, 5 / 3, 0.5]
    tokens = [c for c, n in zip(centred, lengths) for _ in range(n)]
    mean, std = statistics.mean(tokens), math.sqrt(statistics.variance(tokens) + 1e-8)
    for row, c in enumerate(centred):
        torch.testing.assert_close(adv[row, 0].item(), (c - mean) / std)
    assert torch.all(adv[mask == 0] == 0)


def _reference_gae(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """Textbook GAE over the model tokens of one row, written as plain Python lists."""
    positions = [t for t, m in enumerate(mask) if m]
    advantages, returns = [0.0] * len(mask), [0.0] * len(mask)
    next_value, next_adv = 0.0, 0.0
    for t in reversed(positions):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[t]
        advantages[t], returns[t] = next_adv, next_adv + values[t]
    return advantages, returns


def test_gae_small_case_by_hand():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25]])
    adv, returns = compute_advantage(
        "gae", rewards, torch.ones(1, 2), values=values, config=AdvantageConfig(whiten_gae=False)
    )
    # δ1 = 1 − 0.25 = 0.75; δ0 = 0 + 0.25 − 0.5 = −0.25; A0 = −0.25 + 0.75
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0]]))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_loop_with_tool_gaps(gamma: float, lam: float):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=gen) > 0.3).long()
    mask[4] = 0  # a no-op sample
    config = AdvantageConfig(gamma=gamma, lam=lam, whiten_gae=False)
    adv, returns = compute_advantage("gae", rewards, mask, values=values, config=config)
    for row in range(5):
        ref_adv, ref_ret = _reference_gae(rewards[row].tolist(), values[row].tolist(), mask[row].tolist(), gamma, lam)
        torch.testing.assert_close(adv[row], torch.tensor(ref_adv, dtype=torch.float64))
        torch.testing.assert_close(returns[row], torch.tensor(ref_ret, dtype=torch.float64))

    whitened, _ = compute_advantage("gae", rewards, mask, values=values, config=AdvantageConfig(gamma=gamma, lam=lam))
    valid = whitened[mask.bool()]
    assert abs(valid.mean().item()) < 1e-9 and abs(valid.std().item() - 1.0) < 1e-6
    assert torch.all(whitened[~mask.bool()] == 0)


def test_registry_names_and_config_errors():
    assert set(ADV_ESTIMATORS.names()) >= {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    rewards, mask = _outcome_batch([1.0, 0.0], [1, 1])
    with pytest.raises(KeyError, match=r"adv_estimator\) 'ppo2'; known: gae, grpo"):
        compute_advantage("ppo2", rewards, mask, index=[0, 0])
    with pytest.raises(ValueError, match="critic values"):
        compute_advantage("gae", rewards, mask)
    with pytest.raises(ValueError, match="group index"):
        compute_advantage("grpo", rewards, mask)
    with pytest.raises(ValueError, match="index has 3 entries"):
        compute_advantage("grpo", rewards, mask, index=[0, 0, 0])
    with pytest.raises(ValueError, match=r"algorithm\.gamma and algorithm\.lam"):
        AdvantageConfig(lam=1.5)
