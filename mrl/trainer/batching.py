"""Driver-side data shaping between the stages: trajectories → `Batch`, DP balance, scalar advantages, metrics.

Token fields of the batch are jagged and aligned with `input_ids` = prompt + response; prompt positions carry
mask 0 and log-prob 0.0, so every per-token field has one layout from the agent loop to the engine.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from mrl.algo.advantages import ADV_ESTIMATORS, AdvantageConfig
from mrl.algo.kl import KLController, apply_kl_penalty
from mrl.algo.rollout_correction import mismatch_metrics
from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor
from mrl.reward.placement import place_on_last_token


def trajectories_to_batch(trajectories: list[dict[str, Any]]) -> Batch:
    ids, mask, lps = [], [], []
    for t in trajectories:
        p = len(t["prompt_ids"])
        ids.append(torch.tensor(t["prompt_ids"] + t["response_ids"], dtype=torch.long))
        mask.append(torch.tensor([0] * p + t["response_mask"], dtype=torch.float32))
        lps.append(torch.tensor([0.0] * p + t["rollout_log_probs"], dtype=torch.float32))
    return Batch.from_dict(
        {
            "input_ids": JaggedTensor.from_list(ids),
            "response_mask": JaggedTensor.from_list(mask),
            "rollout_log_probs": JaggedTensor.from_list(lps),
            "score": torch.tensor([float(t["score"]) for t in trajectories]),
            "prompt_len": torch.tensor([len(t["prompt_ids"]) for t in trajectories]),
            "uid": [t["uid"] for t in trajectories],
        }
    )


def balance_order(lengths: list[int], chunks: int) -> list[int]:
    """A permutation putting samples into `chunks` equal-count contiguous chunks with near-equal token totals
    (longest first, each to the lightest chunk that still has room), so no DP rank waits on a heavier one."""
    if len(lengths) % chunks:
        raise ValueError(f"{len(lengths)} samples do not split into {chunks} equal chunks")
    room = len(lengths) // chunks
    heap = [(0, c) for c in range(chunks)]
    members: list[list[int]] = [[] for _ in range(chunks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        full = []
        load, c = heapq.heappop(heap)
        while len(members[c]) >= room:
            full.append((load, c))
            load, c = heapq.heappop(heap)
        members[c].append(i)
        heapq.heappush(heap, (load + lengths[i], c))
        for item in full:
            heapq.heappush(heap, item)
    return [i for m in members for i in sorted(m)]


def scalar_advantages(batch: Batch, estimator: str, config: AdvantageConfig) -> torch.Tensor:
    """Outcome advantages as one number per sample (the estimator on one token per sample: the score)."""
    scores = batch["score"].float()[:, None]
    ones = torch.ones_like(scores)
    out = ADV_ESTIMATORS.get(estimator)(scores, ones, index=list(batch["uid"]), config=config)
    return out.advantages[:, 0]


def token_advantages_and_returns(
    batch: Batch, estimator: str, config: AdvantageConfig, rewards: torch.Tensor | None = None
) -> dict[str, JaggedTensor]:
    """Any estimator on the padded full-sequence layout (GAE needs it; the others come here with token-level
    rewards): prompt positions are masked, and the estimators treat masked tokens as absent. Without `rewards`,
    the score sits on each sample's last model token."""
    mask, lengths = batch.as_padded("response_mask")
    values = batch.as_padded("values")[0] if "values" in batch else None
    if rewards is None:
        rewards = place_on_last_token(batch["score"].float(), mask)
    out = ADV_ESTIMATORS.get(estimator)(rewards, mask, index=list(batch["uid"]), values=values, config=config)
    return {
        "advantages": JaggedTensor.from_padded(out.advantages, lengths),
        "returns": JaggedTensor.from_padded(out.returns, lengths),
    }


def kl_penalized_rewards(batch: Batch, kl_ctrl: KLController, kl_type: str) -> tuple[torch.Tensor, dict[str, float]]:
    """[n, L] token rewards on the padded layout: the score on the last model token, minus β·kl_t on every model
    token, with kl_t the `kl_type` estimate of KL(π_old ‖ π_ref) and β the controller's value, which this call
    then updates from the measured KL. Metrics: the measured KL and the β applied."""
    mask, _ = batch.as_padded("response_mask")
    old, _ = batch.as_padded("old_log_probs")
    ref, _ = batch.as_padded("ref_log_prob")
    scores = place_on_last_token(batch["score"].float(), mask)
    out = apply_kl_penalty(scores, old, ref, mask, kl_ctrl, kl_type)
    return out.token_level_rewards, {"actor/reward_kl_penalty": out.metrics["actor/reward_kl_penalty"],
                                     "actor/reward_kl_coef": out.metrics["actor/reward_kl_penalty_coeff"]}


def response_tokens(batch: Batch) -> int:
    return int(batch.jagged_field("response_mask").values.sum())


def logprob_mismatch(batch: Batch) -> dict[str, float]:
    old, _ = batch.as_padded("old_log_probs")
    rollout, _ = batch.as_padded("rollout_log_probs")
    mask, _ = batch.as_padded("response_mask")
    return {f"rollout/{k}": v for k, v in mismatch_metrics(old, rollout, mask).items()}
