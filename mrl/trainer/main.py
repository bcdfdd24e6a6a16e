"""`mrl train RECIPE [overrides...]` / `python -m mrl.trainer.main`: compose, validate, build, fit.

Every start-up rule runs before Ray starts (a mistake is a `mrl:` line and exit 2, mrl/cli.py); then the start-up
reports its stages with their seconds, and the run ends with one line saying where its outputs went.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

RAY_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipes/<family>/<name> or a YAML path (mrl config lists them)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rollout.n=8 actor.optim.lr=1e-3")
    parser.add_argument("--ray-address", default=None, help="join a running Ray cluster (default: start one)")
    parser.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a locally started Ray")


def init_ray(address: str | None = None, num_cpus: int | None = None, verbose: bool = False) -> None:
    """Start (or join) Ray. `verbose` (`mrl train --verbose`): every worker's output is streamed to this console
    (Ray's log_to_driver); otherwise it stays in the files the start-up names (mrl/utils/process_logs.py)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=verbose)
        return
    from mrl.utils.noise import quiet

    env = {**RAY_ENV, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=verbose, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, logging_level=logging.ERROR if quiet() else logging.INFO)


def logs_line(verbose: bool) -> str:
    """Where the workers' output goes: streamed here (--verbose) or only to the Ray session's files."""
    from mrl.utils.process_logs import VERBOSE_HINT, ray_logs_dir

    where = ray_logs_dir() or "the Ray session's logs folder"
    return f"process logs in {where}; " + ("streamed to this console (--verbose)" if verbose else VERBOSE_HINT)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def closing_line(c: Any, steps: int, seconds: float) -> str:
    """Where the run's outputs are: the run folder and the files and checkpoints it holds."""
    from mrl.trainer.checkpointing import complete_checkpoints

    root = c.trainer.default_local_dir
    found = [name for name in ("metrics.jsonl", "rollouts.jsonl", "tensorboard", "wandb")
             if os.path.exists(os.path.join(root, name))]
    checkpoints = complete_checkpoints(root)
    saved = (f"checkpoints {', '.join(os.path.basename(p) for p in checkpoints)}" if checkpoints
             else "no checkpoint (trainer.save_freq=-1)")
    return (f"[mrl] done: {steps} steps in {_duration(seconds)}; run folder {root}: {', '.join(found) or 'no logs'}; "
            f"{saved}; plot it with `mrl report {root}`")


def run(args: argparse.Namespace) -> int:
    from mrl.config.startup.loader import load_config
    from mrl.trainer.build import build_trainer, shutdown

    cfg = load_config(args.recipe, list(args.overrides))
    start = time.monotonic()
    init_ray(args.ray_address, args.num_cpus, verbose=args.verbose)
    print(f"[mrl] Ray ready ({time.monotonic() - start:.1f} s); {logs_line(args.verbose)}", flush=True)
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        shutdown(trainer)
    print(closing_line(trainer.config, trainer.global_steps, time.monotonic() - start), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from mrl.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])  # the command line's error style


if __name__ == "__main__":
    sys.exit(main())
