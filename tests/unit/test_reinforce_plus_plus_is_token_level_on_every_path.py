"""REINFORCE++ and REINFORCE++-baseline are token-level on every path: discounted by γ over the model tokens,
whitened over valid tokens only, no-op padding samples entering no statistic, and the trainer's two routes (KL in
reward on or off) give the same advantages for the same estimator. Expected values are computed by hand."""

import math
import statistics

import pytest
import torch

from mrl.algo.advantages import AdvantageConfig
from mrl.algo.kl import FixedKLController
from mrl.data.batch import Batch
from mrl.data.samples import light_batch
from mrl.trainer.batching import TOKEN_LEVEL_ESTIMATORS, scalar_advantages
from mrl.workers.token_level import token_level_advantages

GAMMA = 0.5
# (uid, score, prompt length, response mask); the last row is a no-op (fetch zeroed its mask)
ROWS = [("a", 1.0, 1, [1, 1, 1]), ("a", 0.0, 2, [1, 1]), ("b", 0.5, 1, [1]), ("noop-0", 0.0, 1, [0])]


def _fetched(rows=ROWS) -> Batch:
    """A worker's fetched batch: the light batch's columns and the jagged full-sequence response mask."""
    masks = [torch.tensor([0.0] * p + [float(m) for m in mask]) for _, _, p, mask in rows]
    light = light_batch([{"key": f"k{i}", "uid": uid, "score": score, "prompt_len": p, "response_len": len(mask),
                          "is_noop": uid.startswith("noop")} for i, (uid, score, p, mask) in enumerate(rows)])
    return light.union(Batch.from_dict({"response_mask": masks}, batch_size=len(rows)))


def _advantages(estimator: str, rows=ROWS, kl_ctrl=None) -> list[list[float]]:
    batch = _fetched(rows)
    if kl_ctrl is not None:  # KL in reward reads π_old and π_ref; equal log-probs make the penalty exactly 0
        batch = batch.union(Batch.from_dict({k: [torch.full_like(m, -0.7) for m in batch.jagged_field(
            "response_mask").to_list()] for k in ("old_log_probs", "ref_log_prob")}, batch_size=len(batch)))
    out, _ = token_level_advantages(batch, estimator, AdvantageConfig(gamma=GAMMA), kl_ctrl, "kl")
    mask = batch.jagged_field("response_mask")
    return [[v for v, m in zip(a.tolist(), mk.tolist()) if m] for a, mk in zip(out["advantages"].to_list(),
                                                                                   mask.to_list())]


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def _whiten(returns: list[list[float]]) -> list[list[float]]:
    flat = _flat(returns)
    mean, std = statistics.mean(flat), math.sqrt(statistics.variance(flat) + 1e-8)
    return [[(g - mean) / std for g in row] for row in returns]


def test_reinforce_plus_plus_discounts_by_gamma_and_whitens_over_valid_tokens_without_noops():
    adv = _advantages("reinforce_plus_plus")
    # return-to-go with γ = 0.5 of the score on the last model token; the no-op row has no token
    returns = [[0.25, 0.5, 1.0], [0.0, 0.0], [0.5], []]
    expected = _whiten(returns)  # mean 2.25/6 = 0.375 over the 6 valid tokens
    for got, want in zip(adv, expected):
        assert got == pytest.approx(want, abs=1e-6)
    assert _flat(_advantages("reinforce_plus_plus", ROWS[:3])) == pytest.approx(_flat(adv), abs=1e-7)  # no-op: none


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_discounts_and_whitens():
    adv = _advantages("reinforce_plus_plus_baseline")
    # group a: mean 0.5 → row 0 ends with 1 − 0.5 = 0.5, row 1 with 0 − 0.5 = −0.5; b is alone (baseline 0)
    returns = [[0.125, 0.25, 0.5], [-0.25, -0.5], [0.5], []]
    for got, want in zip(adv, _whiten(returns)):
        assert got == pytest.approx(want, abs=1e-6)
    assert _flat(_advantages("reinforce_plus_plus_baseline", ROWS[:3])) == pytest.approx(_flat(adv), abs=1e-7)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_kl_in_reward_takes_the_same_token_level_path(estimator):
    assert estimator in TOKEN_LEVEL_ESTIMATORS  # the trainer sends both to the worker's token-level pass
    plain = _advantages(estimator)
    with_kl = _advantages(estimator, kl_ctrl=FixedKLController(0.2))  # π_old = π_ref: penalty 0
    for got, want in zip(with_kl, plain):
        assert got == pytest.approx(want, abs=1e-7)


def test_driver_refuses_a_per_sample_reinforce_plus_plus_and_keeps_noops_out_of_outcome_stats():
    light = _fetched()
    with pytest.raises(ValueError, match="token-level"):
        scalar_advantages(light, "reinforce_plus_plus", AdvantageConfig())
    rloo = scalar_advantages(light, "rloo", AdvantageConfig())
    assert rloo.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.0])
