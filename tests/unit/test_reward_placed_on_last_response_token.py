"""A trajectory's scalar reward lands on its last model token; tool tokens after it and padding stay 0."""

import torch

from mrl.reward.placement import place_on_last_token


def test_reward_on_last_model_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    rewards = place_on_last_token(torch.tensor([1, 2, 3, 4, 5]), mask)
    expected = torch.zeros(5, 4)
    expected[0, 2], expected[1, 1], expected[2, 2], expected[4, 3] = 1, 2, 3, 5  # row 3 has no model token
    assert rewards.dtype == torch.float32
    torch.testing.assert_close(rewards, expected)


def test_tool_tokens_after_the_last_model_token_get_nothing():
    mask = torch.tensor([[1, 1, 0, 0, 0]])  # a trailing tool observation is masked out
    rewards = place_on_last_token(torch.tensor([0.5], dtype=torch.float64), mask)
    assert rewards.dtype == torch.float64
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0]]
