"""Typed configuration root, recipe loading and start-up validation."""

from mrl.config.loader import load_config
from mrl.config.schema import MrlConfig, register_configs
from mrl.config.validate import ConfigError, Violation, rule, validate

__all__ = ["ConfigError", "MrlConfig", "Violation", "load_config", "register_configs", "rule", "validate"]
