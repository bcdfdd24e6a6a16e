"""Off-policy correction on the demo task: `colocate_async` at several staleness thresholds, with and without a
rollout correction, a few seeds each; held-out greedy accuracy curves to a PNG and a table of the final values.

The task and the warmed-up model are the demo's (reverse a 4-digit string, exact-match reward; `mrl demo`), made
once and shared by every run; runs differ in `weight_sync.staleness_threshold`, `algorithm.rollout_correction`
and `trainer.seed` only. The correction is token-level truncated IS (rollout_is=token, C=2) unless
`--correction` names other `algorithm.rollout_correction.*` overrides. Results are written after every run, and a
sweep started again on the same --out skips the runs it already has.

    PYTHONPATH=$PWD .venv/bin/python tools/bench/offpolicy.py --out runs/offpolicy            # the full sweep
    PYTHONPATH=$PWD .venv/bin/python tools/bench/offpolicy.py --steps 3 --staleness 2 --seeds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

TIS = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
KEPT = ("val/greedy_acc", "reward/mean", "staleness/mean", "rollout_corr/mismatch_kl", "rollout_corr/is_weight_mean",
        "rollout_corr/is_weight_max", "rollout_corr/is_clip_frac", "timing_s/step")


def run_one(paths: dict[str, Any], staleness: int, corrected: bool, seed: int, args: argparse.Namespace,
            out: Path) -> list[dict[str, Any]]:
    from mrl.config.startup.loader import load_config
    from mrl.demo import REWARD_FN
    from mrl.trainer.build import build_trainer, shutdown

    label = f"s{staleness}_{'corr' if corrected else 'plain'}_seed{seed}"
    cfg = load_config("tiny/grpo_colocate_async", [
        f"model.path={paths['model']}", f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
        f"data.max_response_length={args.length + 4}", f"rollout.name={args.rollout}", "rollout.n=8",
        f"trainer.total_training_steps={args.steps}", f"trainer.seed={seed}", f"trainer.test_freq={args.test_freq}",
        f"trainer.experiment_name={label}", f"trainer.default_local_dir={out / label}", "trainer.logger=[jsonl]",
        "trainer.rollout_dump_per_step=0",
        f"reward.reward_fn='{REWARD_FN}'", f"actor.optim.lr={args.lr}", f"weight_sync.staleness_threshold={staleness}",
        *((args.correction or TIS) if corrected else []),
    ])
    trainer = build_trainer(cfg)
    try:
        history = trainer.fit()
    finally:
        shutdown(trainer)
    return [{"step": h["step"], **{k: h[k] for k in KEPT if k in h}} for h in history]


def final_accuracy(history: list[dict[str, Any]]) -> float:
    return [h["val/greedy_acc"] for h in history if "val/greedy_acc" in h][-1]


def mean_of(history: list[dict[str, Any]], key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return statistics.mean(values) if values else None


def table(results: dict[str, Any]) -> str:
    """Markdown: final held-out greedy accuracy per staleness and correction (mean and per seed), and the mean
    mismatch KL and IS weights the corrected runs saw."""
    lines = ["| staleness | correction | final greedy acc (mean) | per seed | mean mismatch KL | mean IS weight "
             "| max IS weight | s/step |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for staleness in sorted({r["staleness"] for r in results.values()}):
        for corrected in (False, True):
            runs = [r for r in results.values() if r["staleness"] == staleness and r["corrected"] == corrected]
            if not runs:
                continue
            accs = [final_accuracy(r["history"]) for r in runs]

            def avg(key: str, pick: Any = statistics.mean, runs: list = runs) -> str:
                values = [v for r in runs if (v := mean_of(r["history"], key)) is not None]
                return f"{pick(values):.3g}" if values else "–"

            lines.append(f"| {staleness} | {'token TIS' if corrected else 'off'} | {statistics.mean(accs):.3f} | "
                         f"{', '.join(f'{a:.3f}' for a in accs)} | {avg('rollout_corr/mismatch_kl')} | "
                         f"{avg('rollout_corr/is_weight_mean') if corrected else '–'} | "
                         f"{avg('rollout_corr/is_weight_max', max) if corrected else '–'} | {avg('timing_s/step')} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["staleness"] for r in results.values()})
    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 3.6), sharey=True, squeeze=False)
    for ax, staleness in zip(axes[0], levels):
        for corrected, color in ((False, "tab:gray"), (True, "tab:blue")):
            for r in results.values():
                if r["staleness"] == staleness and r["corrected"] == corrected:
                    curve = [(h["step"], h["val/greedy_acc"]) for h in r["history"] if "val/greedy_acc" in h]
                    ax.plot(*zip(*curve), color=color, alpha=0.8, marker="o", markersize=3,
                            label=f"{'token TIS' if corrected else 'no correction'}, seed {r['seed']}")
        ax.set_title(f"colocate_async, staleness_threshold={staleness}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out greedy accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    import torch

    from mrl.demo import prepare
    from mrl.trainer.main import init_ray

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/offpolicy")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--length", type=int, default=4, help="digits per string (the demo's task)")
    parser.add_argument("--warmup-steps", type=int, default=75, help="the demo's supervised warm-up")
    parser.add_argument("--rollout", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--correction", nargs="*", help="algorithm.rollout_correction overrides (default: TIS)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare(out, args.length, args.warmup_steps, seed=1)
    init_ray(num_cpus=8)
    results_path = out / "results.json"
    # Resume: runs already in results.json (same steps and learning rate) are kept and not run again.
    saved = json.loads(results_path.read_text()) if results_path.exists() else {}
    same = saved and all(saved["args"][k] == vars(args)[k] for k in ("steps", "lr", "test_freq", "rollout"))
    results: dict[str, Any] = saved["runs"] if same else {}
    start = time.monotonic()
    for seed in args.seeds:  # seed-major: a sweep cut short still has every setting once
        for staleness in args.staleness:
            for corrected in (False, True):
                key = f"s{staleness}_{'corr' if corrected else 'plain'}_seed{seed}"
                if key in results:
                    continue
                run_start = time.monotonic()
                history = run_one(paths, staleness, corrected, seed, args, out)
                results[key] = {"staleness": staleness, "corrected": corrected, "seed": seed, "history": history,
                                "seconds": round(time.monotonic() - run_start, 1)}
                results_path.write_text(json.dumps({"args": vars(args), "warmup": paths["warmup"],
                                                    "runs": results}, indent=1))
                print(f"[offpolicy] {key}: final acc {final_accuracy(history):.3f} in "
                      f"{results[key]['seconds']:.0f} s (total {time.monotonic() - start:.0f} s)", flush=True)
                plot(results, out / "offpolicy.png")
                (out / "table.md").write_text(table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
