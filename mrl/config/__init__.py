"""Typed configuration: the schema, what engines accept and can do, model shapes read from config.json.

This package sits below everything that reads a configuration and imports nothing of mrl above it. Loading a
recipe and the start-up rules, which know every component's names, are one layer up: `mrl.config.startup`
(`load_config`, `validate`).
"""

from pathlib import Path

from mrl.config.errors import ConfigError, Violation
from mrl.config.schema import MrlConfig, register_configs

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"

__all__ = ["RECIPES_DIR", "ConfigError", "MrlConfig", "Violation", "register_configs"]
