"""Loading a recipe and checking it at start-up: `load_config` composes a recipe with overrides and runs every
rule of `validate` (mrl/config/startup/validate.py lists the rule modules by domain).

Above the components whose names the rules check; below the trainer and the tools that load recipes.
"""

from mrl.config.errors import ConfigError, Violation
from mrl.config.startup.loader import load_config
from mrl.config.startup.validate import rule, validate

__all__ = ["ConfigError", "Violation", "load_config", "rule", "validate"]
