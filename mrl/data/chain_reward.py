"""Reward of the arithmetic-chain task (mrl/data/chain_task.py): 1.0 for the exact final answer, else 0.0.

Standard library only, so `learn_gpu.py --write-task` copies this file as it is and any framework imports it
without mrl installed: `compute_score` has verl's signature, `score` mrl's (`reward.reward_fn`).

A response is one line per operation and a last line `answer N`; only that last line is scored, so there is no
format credit and no way to score without the right number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DATA_SOURCE = "mrl/arith_chain"
ANSWER_PREFIX = "answer "


def final_answer(solution_str: str) -> str | None:
    """The number on the response's last non-empty line when it reads `answer N`, else None."""
    lines = [line.strip() for line in solution_str.strip().splitlines() if line.strip()]
    if not lines or not lines[-1].startswith(ANSWER_PREFIX):
        return None
    value = lines[-1][len(ANSWER_PREFIX):].strip()
    return value if value.isdigit() else None


def score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """mrl's reward signature: 1.0 iff the final answer equals the ground truth."""
    answer = final_answer(solution_str)
    return 1.0 if answer is not None and int(answer) == int(ground_truth) else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Mapping[str, Any] | None = None) -> float:
    """verl's `custom_reward_function` signature."""
    return score(solution_str, ground_truth, extra_info)
