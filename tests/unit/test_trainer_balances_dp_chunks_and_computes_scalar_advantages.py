"""Driver-side shaping: trajectories become a batch whose prompt tokens are masked out; DP chunks get equal
counts and near-equal token totals; GRPO advantages are one number per sample, spread on model tokens only."""

import torch

from mrl.algo.advantages import AdvantageConfig
from mrl.trainer.batching import balance_order, scalar_advantages, trajectories_to_batch
from mrl.workers.actor_rollout_ref import token_advantages


def traj(uid, score, prompt, response, mask=None):
    return {"uid": uid, "score": score, "prompt_ids": prompt, "response_ids": response,
            "response_mask": mask or [1] * len(response), "rollout_log_probs": [-0.5] * len(response)}


def test_batch_masks_prompt_tokens_and_keeps_ids_verbatim():
    batch = trajectories_to_batch([traj("a", 1.0, [5, 6, 7], [8, 9], [1, 0]), traj("a", 0.0, [5], [4])])
    assert batch.as_list("input_ids")[0].tolist() == [5, 6, 7, 8, 9]
    assert batch.as_list("response_mask")[0].tolist() == [0, 0, 0, 1, 0]
    assert batch.as_list("rollout_log_probs")[1].tolist() == [0.0, -0.5]
    assert batch["prompt_len"].tolist() == [3, 1]


def test_balance_gives_equal_counts_and_close_token_totals():
    lengths = [100, 90, 80, 60, 10, 10, 5, 45]
    order = balance_order(lengths, 2)
    assert sorted(order) == list(range(8))
    chunks = [order[:4], order[4:]]
    totals = [sum(lengths[i] for i in c) for c in chunks]
    assert abs(totals[0] - totals[1]) <= 20  # in arrival order the halves hold 330 and 70 tokens


def test_grpo_scalar_advantages_are_group_normalised_and_placed_on_model_tokens():
    trajectories = [traj("a", 1.0, [1], [2, 3]), traj("a", 0.0, [1], [2]), traj("b", 1.0, [1], [2, 3, 4], [1, 0, 1]),
                    traj("b", 1.0, [1], [2])]
    batch = trajectories_to_batch(trajectories)
    adv = scalar_advantages(batch, "grpo", AdvantageConfig())
    std = torch.tensor([1.0, 0.0]).std()
    assert torch.allclose(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0]), atol=1e-5)
    batch["advantage"] = adv
    spread = token_advantages(batch)
    assert spread[0].tolist() == [0.0, float(adv[0]), float(adv[0])]  # prompt token gets none
    assert spread[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards: zero advantage
