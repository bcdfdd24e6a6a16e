"""`mrl` command line: one entry point, one module per subcommand.

Each subcommand lives beside the code it drives and exposes `add_arguments(parser)` and `run(args) -> int`;
this table is the only place that lists them. A subcommand whose module is not part of this install is left
out of `mrl --help` rather than failing every other command.
"""

import argparse
import importlib
import sys
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("mrl.config.cli", "compose a recipe with overrides, validate it, print the YAML"),
    "train": ("mrl.trainer.main", "train with a recipe (Hydra overrides)"),
    "demo": ("mrl.demo", "the tiny CPU run of the README"),
    "plan": ("mrl.tools.plan", "per-step accounting and memory estimate of a recipe"),
    "convert": ("mrl.tools.convert", "HF <-> Megatron checkpoint conversion"),
    "report": ("mrl.tools.report", "render a run's curves to PNG"),
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            return None  # this subcommand's module is not in this install
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="mrl", description="Megatron-native RL post-training")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Import only the chosen subcommand's module: several of them import torch or megatron.core.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, summary) in COMMANDS.items():
        module = _load(module_name) if name == chosen else None
        if name == chosen and module is None:
            parser.error(f"subcommand {name!r} is not available in this install ({module_name} is missing)")
        p = sub.add_parser(name, help=summary, description=summary)
        if module is not None:
            module.add_arguments(p)
            p.set_defaults(_mrl_run=module.run)
    args = parser.parse_args(argv)
    return args._mrl_run(args)


if __name__ == "__main__":
    sys.exit(main())
