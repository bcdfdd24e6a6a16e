"""Observability of a run: named stage timers, the per-step rollout dump (jsonl) and the console/jsonl logger."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class StageTimer:
    """Wall seconds per named stage of one step (a stage entered twice, e.g. a refill round, accumulates)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


class RunLogger:
    """Prints one line per step and appends every metric to `metrics.jsonl`; `dump_rollouts` writes sampled
    trajectories (prompt, response, reward, version) of each step to `rollouts.jsonl`."""

    CONSOLE_KEYS = (
        ("reward/mean", "reward", "{:.3f}"),
        ("val/greedy_acc", "val_acc", "{:.3f}"),
        ("actor/pg_loss", "pg_loss", "{:+.4f}"),
        ("rollout/logprob_mismatch", "mismatch", "{:.5f}"),
        ("perf/gen_tokens_per_s", "gen_tok/s", "{:.0f}"),
        ("perf/tokens_per_s", "tok/s", "{:.0f}"),
        ("timing_s/step", "step_s", "{:.2f}"),
    )

    def __init__(self, out_dir: str | Path | None, console: bool = True, dump_per_step: int = 8) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        self.dump_per_step = dump_per_step
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        self.history.append(record)
        if self.out_dir:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.console:
            print(self.format(step, metrics), flush=True)

    def format(self, step: int, metrics: dict[str, Any]) -> str:
        parts = [f"step {step:>3}"]
        parts += [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in self.CONSOLE_KEYS if k in metrics]
        stages = [f"{k[9:]} {v:.2f}" for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"]
        return " | ".join(parts) + ("  [" + ", ".join(stages) + "]" if stages else "")

    def dump_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not self.out_dir or self.dump_per_step == 0:
            return
        with open(self.out_dir / "rollouts.jsonl", "a") as f:
            for row in rows[: self.dump_per_step]:
                f.write(json.dumps({"step": step, **row}) + "\n")
