"""Driver-side shaping between the stages, on scalar columns only (the light batch of mrl/data/samples.py): DP
balance by sequence length, outcome advantages per sample, and the step's token-weighted metrics (log-prob
mismatch, distillation KL) from every rank's.
Per-token work runs on the workers (mrl/workers/token_level.py).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from mrl.algo.advantages import ADV_ESTIMATORS, AdvantageConfig
from mrl.data.batch import Batch

# Estimators whose advantages differ along a response (discounting, token-level whitening): a worker computes them
# on the model tokens of the whole step; the others give one number per sample on the driver.
TOKEN_LEVEL_ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


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
    """Outcome advantages as one number per sample (the estimator on one token per sample: the score); no-op
    samples hold no token, so they enter no statistic. Estimators that vary along a response are token-level
    (`PPOTrainer.compute_advantage` sends them to a worker)."""
    if estimator in TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(f"adv_estimator {estimator!r} is token-level: it has no one-number-per-sample form")
    scores = batch["score"].float()[:, None]
    real = (~batch["is_noop"]).float()[:, None] if "is_noop" in batch else torch.ones_like(scores)
    out = ADV_ESTIMATORS.get(estimator)(scores, real, index=list(batch["uid"]), config=config)
    return out.advantages[:, 0]


def mismatch_over_ranks(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The step's `rollout/*` mismatch metrics from every DP rank's `rank_mismatch` (mrl/workers/token_level.py):
    token-weighted means, the max of the maxima."""
    out = token_weighted_mean(per_rank, ["logprob_mismatch", "mismatch_kl"])
    if not out:
        return {}
    out["logprob_abs_diff_max"] = max(r["logprob_abs_diff_max"] for r in per_rank if r["tokens"] > 0)
    return {f"rollout/{k}": v for k, v in out.items()}


def token_weighted_mean(per_rank: list[dict[str, Any]], keys: list[str]) -> dict[str, float]:
    """The step's value of each of `keys`, per-rank means over model tokens weighed by each rank's `tokens`; {} when
    no rank had a model token (a rank of no-op rows only has no mean)."""
    ranks = [r for r in per_rank if r["tokens"] > 0]
    tokens = sum(r["tokens"] for r in ranks)
    return {k: sum(r[k] * r["tokens"] for r in ranks) / tokens for k in keys} if ranks else {}


def routing_over_ranks(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The step's MoE routing metrics (`actor/routing_agreement`, per-layer agreement and expert load, from
    mrl/engine/megatron/routing.py `routing_metrics`): the mean over the DP ranks that measured them."""
    keys = sorted({k for r in per_rank for k in r.get("routing", {})})
    return {k: sum(r["routing"][k] for r in per_rank if k in r.get("routing", {}))
            / sum(1 for r in per_rank if k in r.get("routing", {})) for k in keys}
