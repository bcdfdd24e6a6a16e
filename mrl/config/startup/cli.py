"""`mrl config RECIPE [key=value ...]`: compose, validate and print a recipe."""

import argparse

from omegaconf import OmegaConf

from mrl.config.startup.loader import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipes/<family>/<name> without .yaml, or a path to a YAML file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rollout.n=8")
    parser.add_argument("--no-path-check", action="store_true", help="do not require model.path to exist")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides, check_paths=not args.no_path_check)  # errors: mrl/cli.py
    print(OmegaConf.to_yaml(cfg), end="")
    return 0
