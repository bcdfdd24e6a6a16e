"""Score each distinct request once: a GRPO group's identical samples, and the no-op padding rows that copy real ones,
would otherwise repeat a model's work (a pool teacher's prompt log-probs, a greedy judge's answer)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


async def once_per_distinct(keys: Sequence[K], score: Callable[[list[K]], Awaitable[list[V]]]) -> list[V]:
    """`score` over the distinct keys (first-seen order), its results handed back to every key in `keys`' order."""
    distinct = list(dict.fromkeys(keys))
    by_key = dict(zip(distinct, await score(distinct), strict=True))
    return [by_key[key] for key in keys]
