"""`mrl report RUN_DIR`: render a run's curves to one PNG (reward, response length, timing breakdown, mismatch,
throughput and MFU, peak memory per phase).

Input: `RUN_DIR/metrics.jsonl` (or a .jsonl path), as the trainer's `RunLogger` (mrl/trainer/metrics.py) writes it:
one JSON object per line with `step` and flat metric keys; or a console log (`.log`), whose step lines give what
they show (ConsoleLogger.parse), when a run's metrics.jsonl was lost. The keys drawn:

| panel | keys |
| --- | --- |
| reward | `reward/mean`; validation keys `val/*` (e.g. `val/greedy_acc`, `val/pass@4`) dashed, on their own steps |
| response length | `response_length/mean` (and `response_length/max`, `response_length/min` when present) |
| time per step | every `timing_s/<stage>` but `timing_s/step`, stacked; `timing_s/step` as the total line |
| rollout vs training | `rollout/logprob_mismatch` (mean exp(abs(Δ log p)), DESIGN.md's bf16 bound 1.05 drawn) |
| throughput | `perf/tokens_per_s_per_gpu` |
| MFU | `perf/mfu` (its own panel: on a twin axis one curve hid the other) |
| peak memory | every `memory/<kind>_gib/<phase>` (CUDA peak allocated or CPU peak RSS per worker phase) |

`reward` is timed inside `gen` (the trainer scores while it samples), so the stacked gen bar leaves it out. The
first step also compiles and warms caches: when it is far longer than the others, the time axis is scaled to the
later steps and the first step's total is written on its clipped bar, so it does not flatten the stage bars.
A record without a key is skipped for that key (validation-only records carry no reward, for example); a panel
with no data says which key it looked for. Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MISMATCH_BOUND = 1.05  # DESIGN.md: logprob_mismatch stays <= 1.05 in bf16
REWARD, LENGTH, MISMATCH, STEP_TIME = "reward/mean", "response_length/mean", "rollout/logprob_mismatch", "timing_s/step"
THROUGHPUT, MFU = "perf/tokens_per_s_per_gpu", "perf/mfu"
# Stages timed inside another stage (the trainer scores rewards while it samples): their parent's bar excludes them.
NESTED_STAGES = {"timing_s/reward": "timing_s/gen",
                 **{f"timing_s/sync/{part}": "timing_s/update_weights"
                    for part in ("wake_weights", "update", "offload", "wake_kv_cache")},
                 **{f"timing_s/sync/{part}": "timing_s/sync/update" for part in ("setup", "send", "replica_wait")},
                 **{f"timing_s/sync/{part}": "timing_s/sync/send" for part in ("produce", "ack_wait")},
                 "timing_s/sync/quantize": "timing_s/sync/produce"}


def metrics_file(run: str | Path) -> Path:
    path = Path(run)
    return path if path.suffix in (".jsonl", ".log") else path / "metrics.jsonl"


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, or of a console log (`.log`: the steps' console lines, what they show)."""
    with open(path, errors="replace") as f:
        if path.suffix != ".log":
            return [json.loads(line) for line in f if line.strip()]
        from mrl.trainer.loggers import ConsoleLogger

        return [{"step": step, **metrics} for step, metrics in filter(None, map(ConsoleLogger.parse, f))]


def series(records: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that carry a finite number for `key`, in file order."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r.get("step", len(steps)))
            values.append(float(v))
    return steps, values


def _keys(records: list[dict[str, Any]], prefix: str) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        seen.update((k, None) for k in r if k.startswith(prefix))
    return list(seen)


def _empty(ax: Any, key: str) -> None:
    ax.text(0.5, 0.5, f"no {key} in metrics", ha="center", va="center", transform=ax.transAxes, color="gray")


def _reward(ax: Any, records: list[dict[str, Any]]) -> bool:
    drew = False
    for key in [REWARD, *_keys(records, "val/")]:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, "-" if key == REWARD else "--", marker="." if key != REWARD else None, label=key)
            drew = True
    if drew:
        ax.legend(fontsize=8)
    return drew


def _lines(ax: Any, records: list[dict[str, Any]], keys: list[str]) -> bool:
    drew = False
    for key in keys:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, label=key)
            drew = True
    if drew:
        ax.legend(fontsize=8)
    return drew


def _timing(ax: Any, records: list[dict[str, Any]]) -> bool:
    stages = [k for k in _keys(records, "timing_s/") if k != STEP_TIME]
    rows = [r for r in records if any(k in r for k in stages)]
    if not rows:
        return False
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    bottom = [0.0] * len(rows)
    children = {parent: [c for c, p in NESTED_STAGES.items() if p == parent] for parent in NESTED_STAGES.values()}
    for key in stages:
        heights = [float(r.get(key, 0.0)) - sum(float(r.get(c, 0.0)) for c in children.get(key, [])) for r in rows]
        ax.bar(steps, heights, bottom=bottom, label=key.removeprefix("timing_s/"), width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    total_steps, totals = series(rows, STEP_TIME)
    if totals:
        ax.plot(total_steps, totals, "k-", linewidth=1, label="step")
    ax.legend(fontsize=7, ncol=2)
    _clip_warm_up(ax, steps, bottom)
    return True


def _clip_warm_up(ax: Any, steps: list[Any], heights: list[float], factor: float = 1.5) -> None:
    """Scale the axis to the steps after the first when the first (warm-up) is over `factor` × their peak."""
    if len(heights) < 3:
        return
    rest = max(heights[1:])
    if rest > 0 and heights[0] > factor * rest:
        ax.set_ylim(0, 1.15 * rest)
        ax.annotate(f"{heights[0]:.0f} s (warm-up, clipped)", (steps[0], 1.1 * rest), fontsize=7, ha="left")


def _mismatch(ax: Any, records: list[dict[str, Any]]) -> bool:
    steps, values = series(records, MISMATCH)
    if not steps:
        return False
    ax.plot(steps, values, label=MISMATCH)
    ax.axhline(MISMATCH_BOUND, color="red", linestyle=":", linewidth=1, label=f"bound {MISMATCH_BOUND}")
    ax.legend(fontsize=8)
    return True


def _percent(ax: Any, records: list[dict[str, Any]], key: str) -> bool:
    steps, values = series(records, key)
    if steps:
        ax.plot(steps, [100 * v for v in values], label=key)
        ax.legend(fontsize=8)
    return bool(steps)


def draw(records: list[dict[str, Any]], *, title: str = "", dpi: int = 120) -> tuple[Any, list[str]]:
    """The figure of the panels, and the keys of the panels that had no data."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 14), dpi=dpi, layout="constrained")
    axes = fig.subplots(4, 2)
    panels = [  # (axis, title, y label, key looked for, drawing)
        (axes[0][0], "reward", "score / accuracy", REWARD, lambda ax: _reward(ax, records)),
        (axes[0][1], "response length", "tokens", LENGTH,
         lambda ax: _lines(ax, records, [LENGTH, "response_length/max", "response_length/min"])),
        (axes[1][0], "time per step", "seconds", "timing_s/*", lambda ax: _timing(ax, records)),
        (axes[1][1], "log-prob mismatch, rollout vs training", "mean exp(|Δ log p|)", MISMATCH,
         lambda ax: _mismatch(ax, records)),
        (axes[2][0], "throughput", "tokens/s per device", THROUGHPUT, lambda ax: _lines(ax, records, [THROUGHPUT])),
        (axes[2][1], "model FLOPs utilisation", "MFU (%)", MFU, lambda ax: _percent(ax, records, MFU)),
        (axes[3][0], "peak memory per phase", "GiB", "memory/*",
         lambda ax: _lines(ax, records, _keys(records, "memory/"))),
    ]
    axes[3][1].set_axis_off()
    missing = []
    for ax, label, ylabel, key, draw in panels:
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        if not draw(ax):
            _empty(ax, key)
            missing.append(key)
    if title:
        fig.suptitle(title)
    return fig, missing


def render(records: list[dict[str, Any]], out: str | Path, *, title: str = "", dpi: int = 120) -> list[str]:
    """Write the PNG; return the keys of the panels that had no data."""
    fig, missing = draw(records, title=title, dpi=dpi)
    fig.savefig(out, format="png")
    return missing


# `mrl report RUN RUN ...`: one panel per key, one line per run (a learning run beside its lr-0 control).
COMPARED = (("val/greedy_acc", "held-out greedy accuracy"), (REWARD, "reward (sampled)"),
            (LENGTH, "response length (tokens)"), (MISMATCH, "log-prob mismatch"), ("actor/entropy", "entropy"),
            ("actor/grad_norm", "gradient norm"))


def render_comparison(runs: dict[str, list[dict[str, Any]]], out: str | Path, *, title: str = "",
                      dpi: int = 120) -> list[str]:
    """Write a PNG with a panel per key of COMPARED and a line per run; return the keys no run had."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 11), dpi=dpi, layout="constrained")
    missing = []
    for ax, (key, label) in zip(fig.subplots(3, 2).flat, COMPARED):
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        drew = False
        for name, records in runs.items():
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=name)
                drew = True
        if drew:
            ax.legend(fontsize=8)
        else:
            _empty(ax, key)
            missing.append(key)
    if title:
        fig.suptitle(title)
    fig.savefig(out, format="png")
    return missing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Not `run`: mrl/cli.py stores the subcommand's entry point under that name.
    parser.add_argument("run_dir", nargs="+",
                        help="a run folder with metrics.jsonl (trainer.default_local_dir), a .jsonl, or a console "
                             "log (.log: what its step lines show); several: their curves side by side (accuracy, "
                             "reward, length, mismatch, entropy, grad norm)")
    parser.add_argument("--out", default=None, help="PNG path (default: <first run folder>/report.png)")
    parser.add_argument("--dpi", type=int, default=120)


def run(args: argparse.Namespace) -> int:
    paths = [metrics_file(r) for r in args.run_dir]
    for path in paths:
        if not path.is_file():
            from mrl.config import ConfigError, Violation

            raise ConfigError([Violation("run_dir", str(path), "no metrics file there (the trainer's jsonl logger "
                                                               "writes <default_local_dir>/metrics.jsonl)")])
    path = paths[0]
    out = Path(args.out) if args.out else path.parent / "report.png"
    if len(paths) > 1:
        names = [p.parent.name if p.name == "metrics.jsonl" else p.stem for p in paths]
        missing = render_comparison({n: load_records(p) for n, p in zip(names, paths)}, out, dpi=args.dpi)
        print(f"wrote {out}" + (f" (no run had {', '.join(missing)})" if missing else ""))
        return 0
    records = load_records(path)
    steps = [r["step"] for r in records if "step" in r]
    title = f"{path.parent.name}: {len(records)} records" + (f", steps {min(steps)}-{max(steps)}" if steps else "")
    missing = render(records, out, title=title, dpi=args.dpi)
    print(f"wrote {out}" + (f" (no data for {', '.join(missing)})" if missing else ""))
    return 0
