"""Compose a run's configuration from a recipe YAML and command-line overrides, with Hydra.

`load_config("tiny/grpo", ["rollout.n=4"])` reads `recipes/tiny/grpo.yaml`, whose defaults list starts from the
typed root `mrl_config`. Overrides are checked against the schema first (mrl/config/keys.py: unknown keys with
the nearest valid one, `+` only inside free-form dicts); a recipe's unknown key or a value of the wrong type
fails on composition and comes back as the same `ConfigError`; cross-field rules are in `validate`.
"""

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from mrl.config import RECIPES_DIR, ConfigError, Violation
from mrl.config.keys import check_overrides, composition_violation
from mrl.config.schema import register_configs
from mrl.config.startup.validate import validate


class RecipeNotFound(ConfigError, FileNotFoundError):
    """A recipe name or path that is not there (a ConfigError for the command line, a FileNotFoundError too)."""


def _recipe_location(recipe: str) -> tuple[Path, str]:
    """(config dir, config name) for a recipe given as `family/name` under recipes/ or as a YAML path."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve().parent, path.stem
    candidate = RECIPES_DIR / f"{recipe}.yaml"
    if not candidate.is_file():
        known = sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.rglob("*.yaml")
                       if p.parent.name != "models")
        raise RecipeNotFound([Violation("recipe", recipe, f"not found (a YAML path, or one of recipes/: "
                                                          f"{', '.join(known)})")])
    return candidate.parent, candidate.stem


_registered = False


def load_config(recipe: str, overrides: list[str] | None = None, *, check: bool = True,
                check_paths: bool = True) -> DictConfig:
    global _registered
    if not _registered:  # storing the typed root costs a third of a composition; once per process is enough
        register_configs()
        _registered = True
    config_dir, name = _recipe_location(recipe)
    given = list(overrides or [])
    composed, violations = check_overrides(given)  # the rest is still composed: every problem in one round
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        try:
            cfg = compose(config_name=name, overrides=composed)
        except ConfigCompositionException as err:
            violation = composition_violation(err, composed, OmegaConf.load(config_dir / f"{name}.yaml"))
            if violation is None:
                raise
            raise ConfigError([*violations, violation]) from err
    OmegaConf.resolve(cfg)
    if check:
        try:
            validate(cfg, check_paths=check_paths)
        except ConfigError as err:
            violations += err.violations
    if violations:
        raise ConfigError(violations)
    return cfg
