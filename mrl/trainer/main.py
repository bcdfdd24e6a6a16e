"""`mrl train RECIPE [overrides...]` / `python -m mrl.trainer.main`: compose, validate, build, fit."""

from __future__ import annotations

import argparse
import os
import sys

RAY_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default="tiny/grpo", help="recipes/<family>/<name> or a YAML path")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rollout.n=8 actor.optim.lr=1e-3")
    parser.add_argument("--ray-address", default=None, help="join a running Ray cluster (default: start one)")
    parser.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a locally started Ray")


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    env = {**RAY_ENV, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env})


def run(args: argparse.Namespace) -> int:
    from mrl.config.loader import load_config
    from mrl.trainer.build import build_trainer, shutdown

    cfg = load_config(args.recipe, list(args.overrides))
    init_ray(args.ray_address, args.num_cpus)
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
    finally:
        shutdown(trainer)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mrl.trainer.main")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
