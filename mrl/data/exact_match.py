"""Reward of the demo's task (mrl/data/synthetic.py): 1.0 iff the response is exactly the answer.

Beside its task, not in mrl/reward/, so the task needs nothing above the data layer; mrl/reward/registry.py
registers it as `exact_match` and under the task's data source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def exact_match_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the response is exactly the answer (surrounding whitespace ignored), else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
