"""`mrl` command line: one entry point, one module per subcommand.

Each subcommand lives beside the code it drives and exposes `add_arguments(parser)` and `run(args) -> int`;
this table is the only place that lists them. A subcommand whose module is not part of this install is left
out of `mrl --help` rather than failing every other command.

Errors speak one style in every command: a user's mistake (a `ConfigError`: a setting, a recipe, a path) prints
`mrl: <setting>=<value>: <rule>` lines and exits 2, without a traceback (`MRL_DEBUG=1` re-raises it). Third-party
warnings fold into one summary line unless `--verbose` is given, which also streams the Ray workers' and rollout
engines' output to the console (`args.verbose`, read by `mrl train` and `mrl demo`).
"""

import argparse
import importlib
import os
import sys
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("mrl.config.startup.cli", "compose a recipe with overrides, validate it, print the YAML"),
    "train": ("mrl.trainer.main", "train with a recipe (Hydra overrides)"),
    "demo": ("mrl.demo", "the tiny CPU run of the README"),
    "plan": ("mrl.tools.plan", "per-step accounting and memory estimate of a recipe"),
    "convert": ("mrl.tools.convert", "HF <-> Megatron checkpoint conversion"),
    "report": ("mrl.tools.report", "render a run's curves to PNG"),
}
VERBOSE_FLAGS = ("--verbose", "-v")
EXIT_USER_ERROR = 2


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            return None  # this subcommand's module is not in this install
        raise


def _user_error_lines(err: BaseException) -> list[str] | None:
    """One line per problem for a user's mistake, else None (a bug keeps its traceback)."""
    from mrl.config import ConfigError

    for e in (err, getattr(err, "cause", None)):  # a Ray task's error carries the worker's as `cause`
        if isinstance(e, ConfigError) and hasattr(e, "violations"):
            return e.lines()
    if isinstance(err, FileNotFoundError):  # a path given on the command line or in a recipe
        return [f"mrl: {err}"]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = any(a in VERBOSE_FLAGS for a in argv)
    argv = [a for a in argv if a not in VERBOSE_FLAGS]  # accepted anywhere on the line
    parser = argparse.ArgumentParser(prog="mrl", description="Megatron-native RL post-training")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show third-party warnings in full and stream every worker's output to the console")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Import only the chosen subcommand's module: several of them import torch or megatron.core.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    noise = None
    if not verbose:
        from mrl.utils.noise import ThirdPartyWarnings

        noise = ThirdPartyWarnings().install()
    for name, (module_name, summary) in COMMANDS.items():
        module = _load(module_name) if name == chosen else None
        if name == chosen and module is None:
            parser.error(f"subcommand {name!r} is not available in this install ({module_name} is missing)")
        p = sub.add_parser(name, help=summary, description=summary)
        if module is not None:
            module.add_arguments(p)
            p.set_defaults(_mrl_run=module.run)
    args = parser.parse_args(argv)
    args.verbose = verbose  # taken off argv above, so that it may stand anywhere on the line
    try:
        return args._mrl_run(args)
    except Exception as err:
        lines = _user_error_lines(err)
        if lines is None or os.environ.get("MRL_DEBUG") == "1":
            raise
        print("\n".join(lines), file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if noise is not None:
            noise.uninstall()
            if line := noise.summary():
                print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
