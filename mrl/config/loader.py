"""Compose a run's configuration from a recipe YAML and command-line overrides, with Hydra.

`load_config("tiny/grpo", ["rollout.n=4"])` reads `recipes/tiny/grpo.yaml`, whose defaults list starts from the
typed root `mrl_config`; unknown keys and wrong types fail on composition, cross-field rules in `validate`.
"""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from mrl.config.schema import register_configs
from mrl.config.validate import validate

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def _recipe_location(recipe: str) -> tuple[Path, str]:
    """(config dir, config name) for a recipe given as `family/name` under recipes/ or as a YAML path."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve().parent, path.stem
    candidate = RECIPES_DIR / f"{recipe}.yaml"
    if not candidate.is_file():
        known = sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.rglob("*.yaml"))
        raise FileNotFoundError(f"recipe {recipe!r} not found under {RECIPES_DIR}; known recipes: {known}")
    return candidate.parent, candidate.stem


def load_config(recipe: str, overrides: list[str] | None = None, *, check: bool = True,
                check_paths: bool = True) -> DictConfig:
    register_configs()
    config_dir, name = _recipe_location(recipe)
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides or []))
    OmegaConf.resolve(cfg)
    if check:
        validate(cfg, check_paths=check_paths)
    return cfg
