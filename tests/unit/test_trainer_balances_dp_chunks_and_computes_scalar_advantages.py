"""Shaping on both sides of the sample path: a trajectory's payload masks its prompt tokens and keeps the ids
verbatim, the driver's light batch holds scalar columns only; DP chunks get equal counts and near-equal token
totals; GRPO advantages are one number per sample, spread by the worker on model tokens only; the step's mismatch
is the token-weighted mean of the ranks'."""

import pytest
import torch

from mrl.algo.advantages import AdvantageConfig
from mrl.data.batch import Batch
from mrl.data.samples import light_batch, payload
from mrl.trainer.batching import balance_order, mismatch_over_ranks, scalar_advantages
from mrl.workers.token_level import token_advantages


def record(uid, score, prompt, response):
    return {"key": f"{uid}{len(response)}", "uid": uid, "score": score, "prompt_len": len(prompt),
            "response_len": len(response)}


def test_payload_masks_prompt_tokens_and_the_light_batch_has_no_token_fields():
    p = payload([5, 6, 7], [8, 9], [1, 0], [-0.5, 0.0])
    assert p["input_ids"].tolist() == [5, 6, 7, 8, 9]
    assert p["response_mask"].tolist() == [0, 0, 0, 1, 0]
    assert p["rollout_log_probs"].tolist() == [0.0, 0.0, 0.0, -0.5, 0.0]
    light = light_batch([record("a", 1.0, [5, 6, 7], [8, 9]), {**record("a", 0.0, [5], [4]), "is_noop": True}])
    assert light.jagged == {} and light["length"].tolist() == [5, 2] and light["is_noop"].tolist() == [False, True]
    assert list(light["key"]) == ["a2", "a1"]


def test_balance_gives_equal_counts_and_close_token_totals():
    lengths = [100, 90, 80, 60, 10, 10, 5, 45]
    order = balance_order(lengths, 2)
    assert sorted(order) == list(range(8))
    chunks = [order[:4], order[4:]]
    totals = [sum(lengths[i] for i in c) for c in chunks]
    assert abs(totals[0] - totals[1]) <= 20  # in arrival order the halves hold 330 and 70 tokens


def test_grpo_scalar_advantages_are_group_normalised_and_placed_on_model_tokens():
    rows = [("a", 1.0, [1], [2, 3], [1, 1]), ("a", 0.0, [1], [2], [1]), ("b", 1.0, [1], [2, 3, 4], [1, 0, 1]),
            ("b", 1.0, [1], [2], [1])]
    light = light_batch([record(uid, score, p, r) for uid, score, p, r, _ in rows])
    adv = scalar_advantages(light, "grpo", AdvantageConfig())
    std = torch.tensor([1.0, 0.0]).std()
    assert torch.allclose(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0]), atol=1e-5)
    # the worker's side: the fetched response mask with the light batch's `advantage` column
    fetched = Batch.from_dict({"response_mask": [payload(p, r, m, [0.0] * len(r))["response_mask"]
                                                 for _, _, p, r, m in rows], "advantage": adv})
    spread = token_advantages(fetched)
    assert spread[0].tolist() == [0.0, float(adv[0]), float(adv[0])]  # prompt token gets none
    assert spread[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards: zero advantage


def test_mismatch_of_the_step_weighs_ranks_by_their_model_tokens():
    ranks = [{"logprob_mismatch": 1.1, "mismatch_kl": 0.2, "logprob_abs_diff_max": 0.3, "tokens": 3.0},
             {"logprob_mismatch": 1.0, "mismatch_kl": 0.0, "logprob_abs_diff_max": 0.1, "tokens": 1.0},
             {"logprob_mismatch": float("nan"), "mismatch_kl": float("nan"), "logprob_abs_diff_max": 0.0,
              "tokens": 0.0}]  # a rank of no-op rows only
    out = mismatch_over_ranks(ranks)
    assert out["rollout/logprob_mismatch"] == pytest.approx(1.075) and out["rollout/mismatch_kl"] == pytest.approx(0.15)
    assert out["rollout/logprob_abs_diff_max"] == 0.3
