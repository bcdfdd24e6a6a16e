"""The workers' distillation step on a fetched batch (jagged rows of unequal length, prompt, tool and model tokens):
alone, coef × (teacher − π_old) on model tokens and 0 elsewhere; in `add` mode plus the task's advantage, whether it
is the driver's one number per sample or token-level ones from the store; distill/kl is the mean of π_old − teacher
over model tokens, and the driver weighs each rank's by its model tokens (a rank of no-op rows counts for nothing)."""

import pytest
import torch

from mrl.data.batch import Batch
from mrl.trainer.batching import token_weighted_mean
from mrl.workers.token_level import distill_token_advantages

MASKS = [[0, 0, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0]]  # row 1: a tool token; row 2: a no-op sample (no model token)


def rows(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, mask in enumerate(MASKS):
        n = len(mask)
        out.append({"response_mask": torch.tensor(mask, dtype=torch.float32),
                    "old_log_probs": -torch.rand(n, generator=g) * 3,
                    "teacher_log_prob": -torch.rand(n, generator=g) * 3,
                    "advantages": torch.randn(n, generator=g) * torch.tensor(mask), "advantage": float(k) - 0.5})
    return out


def test_alone_add_per_sample_and_add_per_token_match_a_hand_computation():
    samples = rows()
    per_token = Batch.from_lists([{k: v for k, v in r.items() if k != "advantage"} for r in samples])
    with_scalar = Batch.from_lists([{k: v for k, v in r.items() if k != "advantages"} for r in samples])
    alone, metrics = distill_token_advantages(with_scalar, 0.5, add=False)
    added_scalar, _ = distill_token_advantages(with_scalar, 0.5, add=True)
    added_tokens, _ = distill_token_advantages(per_token, 0.5, add=True)
    gaps = []
    for k, r in enumerate(samples):
        mask = r["response_mask"].bool()
        gap = r["teacher_log_prob"] - r["old_log_probs"]
        want = torch.where(mask, 0.5 * gap, 0.0)
        torch.testing.assert_close(alone[k], want)
        torch.testing.assert_close(added_scalar[k], want + torch.where(mask, r["advantage"], 0.0))
        torch.testing.assert_close(added_tokens[k], want + r["advantages"])
        gaps += gap[mask].tolist()
    assert metrics["tokens"] == 5
    assert metrics["distill/kl"] == pytest.approx(-sum(gaps) / len(gaps), abs=1e-6)
    assert abs(metrics["distill/kl"]) > 1e-3


def test_step_kl_weighs_each_rank_by_its_model_tokens():
    ranks = [{"distill/kl": 0.2, "tokens": 30.0}, {"distill/kl": 0.8, "tokens": 10.0},
             {"distill/kl": float("nan"), "tokens": 0.0}]
    assert token_weighted_mean(ranks, ["distill/kl"]) == {"distill/kl": pytest.approx((0.2 * 30 + 0.8 * 10) / 40)}
    assert token_weighted_mean(ranks[2:], ["distill/kl"]) == {}
