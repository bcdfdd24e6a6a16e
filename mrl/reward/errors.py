"""Reward failures counted per data source, so a broken reward function stops the run instead of training on zeros.

The evaluator never raises on one item's failure (an exception, a timeout, a non-finite score: the item scores 0
and `RewardResult.error` says why). `RewardErrors` sees every scored batch, prints each source's first error text
once, and at each step's report gives `reward/<data_source>/error_rate` over the calls since the previous report;
a rate past `reward.max_error_rate` raises `RewardErrorRateExceeded` naming the source, the share and that first
error. Thread-safe: the async modes score from their producer thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from mrl.reward.evaluator import RewardItem, RewardResult


class RewardErrorRateExceeded(RuntimeError):
    """More of a step's reward calls failed than reward.max_error_rate allows."""


@dataclass
class _Count:
    calls: int = 0
    errors: int = 0


def source_name(item: RewardItem) -> str:
    """The metric's source name: the row's data_source; rows without one are scored as "default"."""
    return item.data_source or "default"


class RewardErrors:
    def __init__(self, max_error_rate: float) -> None:
        self.max_error_rate = max_error_rate
        self._window: dict[str, _Count] = {}
        self.first_error: dict[str, str] = {}  # per source, for the whole run
        self._lock = threading.Lock()

    def record(self, items: Sequence[RewardItem], results: Sequence[RewardResult]) -> None:
        with self._lock:
            for item, result in zip(items, results, strict=True):
                source = source_name(item)
                count = self._window.setdefault(source, _Count())
                count.calls += 1
                if result.error is None:
                    continue
                count.errors += 1
                if source not in self.first_error:
                    self.first_error[source] = result.error
                    # Once per source: the text a user needs to fix the function, without a line per sample.
                    print(f"[mrl] reward: first error for data_source {source!r}: {result.error}", flush=True)

    def take(self) -> dict[str, float]:
        """`reward/<source>/error_rate` of the calls since the last take; raises past reward.max_error_rate."""
        with self._lock:
            window, self._window = self._window, {}
        metrics = {f"reward/{source}/error_rate": c.errors / c.calls for source, c in window.items() if c.calls}
        over = [(s, c) for s, c in window.items() if c.calls and c.errors / c.calls > self.max_error_rate]
        if over:
            source, count = over[0]
            raise RewardErrorRateExceeded(
                f"reward.max_error_rate={self.max_error_rate:g}: {count.errors} of {count.calls} reward calls for "
                f"data_source {source!r} failed ({count.errors / count.calls:.0%}); first error: "
                f"{self.first_error[source]}")
        return metrics
