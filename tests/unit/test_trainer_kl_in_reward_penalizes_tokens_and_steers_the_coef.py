"""`algorithm.use_kl_in_reward`: the trainer's token rewards are the score on the last model token minus
β·KL(π_old ‖ π_ref) on every model token, advantages are computed from them, the controller then updates β, and the
step reports `actor/reward_kl_penalty` and `actor/reward_kl_coef`. Numbers by hand (k1 estimator: KL_t = Δ_t).
The per-token part runs on a worker (`token_level_advantages` on the fetched batch) and updates the controller it
is given."""

from types import SimpleNamespace

import pytest
import torch

from mrl.algo.advantages import AdvantageConfig
from mrl.config.startup import load_config
from mrl.data.batch import Batch
from mrl.data.datasets import RLDataset
from mrl.data.jagged import JaggedTensor
from mrl.data.samples import light_batch, payload
from mrl.trainer.metrics import RunLogger
from mrl.trainer.ppo_trainer import PPOTrainer
from mrl.workers.token_level import kl_penalized_rewards, token_level_advantages

# One prompt token, then responses of 2 and 3 model tokens; both score 1, so without KL GRPO sees no difference.
DELTAS = [[0.5, 0.1], [0.2, 0.0, 0.2]]  # log π_old − log π_ref per response token


def trainer(*overrides: str) -> PPOTrainer:
    cfg = load_config("tiny/grpo", ["model.path=unused", "algorithm.use_kl_in_reward=true",
                                    "algorithm.kl_penalty=kl", "algorithm.kl_coef=0.1", *overrides],
                      check_paths=False)
    return PPOTrainer(cfg, parts(), RunLogger(None, []))  # type: ignore[arg-type]


def parts():
    """The trainer's data only: these tests call the advantage stage, which needs no worker or replica."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(16)]
    return SimpleNamespace(train_data=RLDataset(rows))


def batch():
    payloads = [payload([7], [1] * len(d), [1] * len(d), [-1.0] * len(d)) for d in DELTAS]
    b = Batch.from_dict({"response_mask": [p["response_mask"] for p in payloads], "score": torch.ones(len(DELTAS)),
                         "uid": ["g"] * len(DELTAS)})
    old = [torch.tensor([0.0] + [-1.0] * len(d)) for d in DELTAS]
    ref = [torch.tensor([0.0] + [-1.0 - x for x in d]) for d in DELTAS]
    b["old_log_probs"] = JaggedTensor.from_list(old)
    b["ref_log_prob"] = JaggedTensor.from_list(ref)
    return b


def test_token_rewards_are_score_minus_beta_kl_by_hand():
    t = trainer()
    rewards, metrics = kl_penalized_rewards(batch(), t.kl_ctrl, "kl")
    expected = torch.tensor([[0.0, -0.05, 1.0 - 0.01, 0.0],  # prompt position, two model tokens, padding
                             [0.0, -0.02, 0.0, 1.0 - 0.02]])
    assert torch.allclose(rewards, expected, atol=1e-6)
    # KL: mean over sequences of each one's token mean: (0.6 / 2 + 0.4 / 3) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.3 + 0.4 / 3) / 2)
    assert metrics["actor/reward_kl_coef"] == 0.1


def test_grpo_advantages_come_from_the_penalized_returns():
    t = trainer()
    out, metrics = token_level_advantages(batch(), "grpo", AdvantageConfig(), t.kl_ctrl, "kl")
    adv = out["advantages"].to_list()
    # Sequence returns 1 − 0.06 = 0.94 and 1 − 0.04 = 0.96: mean 0.95, std (N − 1) = 0.01·√2.
    z = 0.01 / (0.01 * 2**0.5)
    assert torch.allclose(adv[0], torch.tensor([0.0, -z, -z]), atol=1e-4)
    assert torch.allclose(adv[1], torch.tensor([0.0, z, z, z]), atol=1e-4)
    assert metrics["actor/reward_kl_coef"] == 0.1


def test_adaptive_controller_moves_beta_after_each_step():
    t = trainer("algorithm.kl_ctrl_type=adaptive", "algorithm.kl_target=0.5", "algorithm.kl_horizon=10")
    token_level_advantages(batch(), "grpo", AdvantageConfig(), t.kl_ctrl, "kl")
    # KL 0.2167 vs target 0.5: error clip(0.2167 / 0.5 − 1, ±0.2) = −0.2; β ← 0.1 · (1 − 0.2 · 2 / 10)
    assert t.kl_ctrl.value == pytest.approx(0.096)
    _, metrics = token_level_advantages(batch(), "grpo", AdvantageConfig(), t.kl_ctrl, "kl")
    assert metrics["actor/reward_kl_coef"] == pytest.approx(0.096)  # the β this step applied
    assert t.kl_ctrl.value == pytest.approx(0.096 * 0.96)


def test_without_kl_in_reward_equal_scores_give_zero_advantages():
    cfg = load_config("tiny/grpo", ["model.path=unused"], check_paths=False)
    t = PPOTrainer(cfg, parts(), RunLogger(None, []))  # type: ignore[arg-type]
    assert t.kl_ctrl is None and not t.use_reference
    light = light_batch([{"key": f"k{i}", "uid": "g", "score": 1.0, "prompt_len": 1, "response_len": len(d)}
                         for i, d in enumerate(DELTAS)])
    assert torch.equal(t.compute_advantage(light)["advantage"], torch.zeros(2))  # on the driver: no worker call
