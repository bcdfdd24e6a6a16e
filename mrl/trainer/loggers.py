"""Run loggers, selected by `trainer.logger`: console (one rich progress line per step), jsonl
(`<run>/metrics.jsonl`, what `mrl report` reads), tensorboard (`<run>/tensorboard/`) and wandb (`<run>/wandb/`;
project and run names from `trainer.project_name` / `trainer.experiment_name`; `WANDB_MODE=offline` keeps it local).

Each logger receives the whole flat metric dict of a step; tensorboard and wandb keep its finite numbers only.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Protocol

from mrl.config.schema import LOGGERS


class StepLogger(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metric dict (not bools, strings or NaN), as floats."""
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class JsonlLogger:
    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / "metrics.jsonl"

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        return None


class TensorboardLogger:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a step takes seconds to minutes: flushing each one costs nothing and loses nothing

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, out_dir: Path, project: str, experiment: str, config: dict[str, Any] | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, dir=str(out_dir), config=config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service process has written the run file (seen with offline runs:
        # an empty .wandb file right after finish, complete 0.3 s later); teardown waits for that process to exit.
        self.wandb.teardown()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ConsoleLogger:
    """One line per step: progress (step/total, bar, ETA from the mean time of the steps after the first),
    reward, response length, validation accuracy when the step validated, log-prob mismatch, the main stage
    timings and throughput. The full metric set goes to the file loggers; the console shows what a person
    watches."""

    FIELDS = (
        ("reward/mean", "reward", "{:.3f}"),
        ("response_length/mean", "len", "{:.1f}"),
        ("val/greedy_acc", "val_acc", "{:.3f}"),
        ("rollout/logprob_mismatch", "mismatch", "{:.5f}"),
        ("distill/kl", "distill_kl", "{:.4f}"),
        ("perf/tokens_per_s", "tok/s", "{:.0f}"),
        ("perf/mfu", "mfu", "{:.2%}"),
    )
    STAGES = (
        ("gen", "gen"), ("old_log_prob", "old_lp"), ("ref", "ref"), ("teacher", "teacher"), ("values", "values"),
        ("adv", "adv"), ("update_critic", "critic"), ("update_actor", "actor"), ("update_weights", "sync"),
        ("handover/sleep", "sleep"), ("handover/onload", "onload"), ("validate", "val"),
    )
    BAR_WIDTH = 20

    def __init__(self, total_steps: int | None = None, console: Any = None) -> None:
        from rich.console import Console

        self.console = console or Console(highlight=False)
        self.total = total_steps
        self.step_seconds: list[float] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.console.print(self.line(step, metrics), soft_wrap=True)

    def line(self, step: int, metrics: dict[str, Any]) -> Any:
        from rich.text import Text

        if "timing_s/step" in metrics:
            self.step_seconds.append(float(metrics["timing_s/step"]))
        text = Text()
        if self.total:
            done = min(step / self.total, 1.0)
            filled = round(done * self.BAR_WIDTH)
            text.append(f"step {step}/{self.total} ", style="bold")
            text.append("━" * filled, style="green")
            text.append("─" * (self.BAR_WIDTH - filled), style="grey37")  # distinct without colour (log files)
        else:
            text.append(f"step {step}", style="bold")
        parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in self.FIELDS if key in metrics]
        stages = [f"{label} {metrics[f'timing_s/{key}']:.2f}s" for key, label in self.STAGES
                  if f"timing_s/{key}" in metrics]
        if stages:
            parts.append(" ".join(stages))
        if self.total and self.step_seconds and step < self.total:
            # The first step also compiles and warms caches (often twice a later step): leave it out once there
            # is another to go by, or the ETA starts at double and shrinks for the whole run.
            steady = self.step_seconds[1:] or self.step_seconds
            mean = sum(steady) / len(steady)
            parts.append(f"ETA {_duration(mean * (self.total - step))}")
        if parts:
            text.append(" │ " + " │ ".join(parts))
        return text

    @classmethod
    def parse(cls, line: str) -> tuple[int, dict[str, float]] | None:
        """(step, metrics) of a line `line()` printed, as far as it shows them (at its rounding; no ETA), or None
        for any other line: a run whose metrics.jsonl was lost still plots from its console log (`mrl report`)."""
        head = re.match(r"step (\d+)(?:/\d+)? ", line)
        if head is None:
            return None
        fields = {label: (key, fmt) for key, label, fmt in cls.FIELDS}
        stages = {label: key for key, label in cls.STAGES}
        metrics: dict[str, float] = {}
        for part in line.split("│")[1:]:
            words = part.split()
            if len(words) == 2 and words[0] in fields:
                key, fmt = fields[words[0]]
                percent = fmt.endswith("%}")
                metrics[key] = float(words[1].rstrip("%")) / 100 if percent else float(words[1])
            elif words and words[0] in stages:  # "gen 6.89s old_lp 2.40s ..."
                for label, value in zip(words[::2], words[1::2]):
                    metrics[f"timing_s/{stages[label]}"] = float(value.removesuffix("s"))
        return int(head.group(1)), metrics

    def close(self) -> None:
        return None


def make_loggers(
    names: list[str] | tuple[str, ...],
    out_dir: Path | None,
    *,
    total_steps: int | None = None,
    project: str = "mrl",
    experiment: str = "run",
    config: dict[str, Any] | None = None,
) -> list[StepLogger]:
    """The loggers named in `names`. Without a run folder only the console can log (file loggers are skipped)."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"trainer.logger={list(names)!r}: unknown {unknown}; known: {', '.join(LOGGERS)}")
    loggers: list[StepLogger] = []
    for name in names:
        if name == "console":
            loggers.append(ConsoleLogger(total_steps))
        elif out_dir is None:
            continue
        elif name == "jsonl":
            loggers.append(JsonlLogger(out_dir))
        elif name == "tensorboard":
            loggers.append(TensorboardLogger(out_dir / "tensorboard"))
        elif name == "wandb":
            loggers.append(WandbLogger(out_dir, project, experiment, config))
    return loggers
