"""On-policy distillation: from two tiny HF models' logits, the per-token advantage is coef × (teacher − student
log-prob of the sampled token) on model tokens only, added to the task advantage in `add` mode, and distill/kl is
the mean of student − teacher over model tokens (all checked against a hand computation)."""

import math

import pytest
import torch

from mrl.algo.distill import distill_advantages, sampled_token_log_probs
from mrl.models.tiny import build_tiny_hf_model


def hand_log_prob(logits_row, token):
    """log softmax(logits_row)[token], in Python floats."""
    values = [float(v) for v in logits_row]
    top = max(values)
    return values[token] - top - math.log(sum(math.exp(v - top) for v in values))


def test_advantages_and_kl_match_a_hand_computation():
    student = build_tiny_hf_model("qwen2", seed=0, vocab_size=64)
    teacher = build_tiny_hf_model("qwen2", seed=1, vocab_size=64)
    ids = torch.randint(4, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        s_logits, t_logits = student(input_ids=ids).logits, teacher(input_ids=ids).logits
    s_lp, t_lp = sampled_token_log_probs(s_logits, ids), sampled_token_log_probs(t_logits, ids)
    # tokens 1..6 of each row: 3 prompt tokens (positions 0-1 of the shifted row), then the response; row 1 has
    # a tool token (mask 0) in the middle
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 1, 1]], dtype=torch.float32)
    task = torch.tensor([0.5, -1.0])

    advantages, metrics = distill_advantages(t_lp, s_lp, mask, coef=0.3, task_advantages=task)

    gaps = []
    for b in range(2):
        for t in range(6):
            token = int(ids[b, t + 1])
            gap = hand_log_prob(t_logits[b, t], token) - hand_log_prob(s_logits[b, t], token)
            want = 0.3 * gap + float(task[b]) if mask[b, t] else 0.0
            assert float(advantages[b, t]) == pytest.approx(want, abs=1e-5)
            if mask[b, t]:
                gaps.append(gap)
    assert metrics["distill/kl"] == pytest.approx(-sum(gaps) / len(gaps), abs=1e-5)
    assert abs(metrics["distill/kl"]) > 1e-3  # two different models: the signal is not trivially 0

    alone, _ = distill_advantages(t_lp, s_lp, mask)
    assert torch.allclose(alone, torch.where(mask.bool(), t_lp - s_lp, torch.zeros_like(s_lp)))
    same, same_metrics = distill_advantages(s_lp, s_lp, mask)
    assert same.abs().max() == 0 and same_metrics["distill/kl"] == 0
