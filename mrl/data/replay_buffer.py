"""Replay buffer of complete prompt groups (the n trajectories of one prompt), with DAPO dynamic sampling.

Groups enter whole and leave whole, so GRPO's group statistics are never computed on a partial group. With
`filter_equal_rewards`, a group whose rewards are all equal is evicted on arrival (its advantages would be 0: no
gradient, only cost); the trainer asks for more prompts until `num_groups` are ready or its refill budget is
spent. `staleness` uses the weight versions recorded on the trajectories.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

Group = list[dict[str, Any]]


@dataclass
class ReplayBuffer:
    filter_equal_rewards: bool = False
    groups: deque[Group] = field(default_factory=deque)
    evicted: int = 0
    added: int = 0

    def add(self, trajectories: list[dict[str, Any]], n: int) -> int:
        """Add trajectories laid out as consecutive groups of `n` (one uid each); returns the groups kept."""
        if len(trajectories) % n:
            raise ValueError(f"{len(trajectories)} trajectories do not form groups of {n}")
        kept = 0
        for i in range(0, len(trajectories), n):
            group = trajectories[i : i + n]
            if len({t["uid"] for t in group}) != 1:
                raise ValueError("a group must hold the trajectories of one prompt (one uid)")
            self.added += 1
            if self.filter_equal_rewards and len({t["score"] for t in group}) == 1:
                self.evicted += 1
                continue
            self.groups.append(group)
            kept += 1
        return kept

    def ready(self, num_groups: int) -> bool:
        return len(self.groups) >= num_groups

    def sample(self, num_groups: int) -> list[dict[str, Any]]:
        """Take the `num_groups` oldest groups (FIFO: the freshest policy data stays for later steps only when
        more arrived than a step uses), flattened."""
        if not self.ready(num_groups):
            raise ValueError(f"the buffer holds {len(self.groups)} groups, {num_groups} requested")
        return [t for _ in range(num_groups) for t in self.groups.popleft()]

    def __len__(self) -> int:
        return len(self.groups)

    def staleness(self, current_version: int) -> list[int]:
        return [current_version - t["min_version"] for g in self.groups for t in g]


def noop_like(trajectory: dict[str, Any], uid: str) -> dict[str, Any]:
    """A synthetic sample that trains nothing: the same tokens with an all-zero response mask and no reward, so
    it makes sample counts divisible (DP size, mini-batches) without moving any loss denominator."""
    return {
        **trajectory,
        "uid": uid,
        "response_mask": [0] * len(trajectory["response_mask"]),
        "score": 0.0,
        "is_noop": True,
    }


def pad_with_noops(trajectories: list[dict[str, Any]], multiple: int) -> list[dict[str, Any]]:
    """Append no-op copies of the shortest trajectory until the count divides `multiple`."""
    missing = -len(trajectories) % multiple
    if not missing:
        return trajectories
    shortest = min(trajectories, key=lambda t: len(t["prompt_ids"]) + len(t["response_ids"]))
    return trajectories + [noop_like(shortest, f"noop-{i}") for i in range(missing)]
