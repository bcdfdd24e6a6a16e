"""Every model-family recipe composes, passes the start-up rules (model folders need not exist here) and plans to a
configuration that can start on 80 GB devices; the families the product promises are all there."""

from pathlib import Path

import pytest

from mrl.config.model_shape import builtin_configs
from mrl.config.startup.loader import RECIPES_DIR, load_config
from mrl.tools.plan import make_plan

FAMILY_RECIPES = sorted(
    str(p.relative_to(RECIPES_DIR).with_suffix(""))
    for p in RECIPES_DIR.glob("*/*.yaml")
    if p.parent.name != "tiny"
)


def test_every_promised_model_has_a_grpo_recipe():
    models = {Path(load_config(r, check=False).model.path).name for r in FAMILY_RECIPES if r.endswith("_grpo")}
    assert models == {"Llama-3.1-8B", "Qwen2.5-7B", "Qwen3-8B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3"}


@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_recipe_composes_validates_and_plans(recipe):
    cfg = load_config(recipe, check_paths=False)
    assert Path(cfg.model.path).name.lower() in builtin_configs()  # plans without the weights
    plan = make_plan(recipe)
    assert plan.can_start, plan.problems
    if cfg.trainer.mode == "separate_async":
        assert plan.accounting.weight_sync_crosses_pools and plan.accounting.extra_rollout_devices > 0
    else:
        assert plan.accounting.extra_rollout_devices == 0


def test_moe_recipes_shard_experts():
    for recipe in FAMILY_RECIPES:
        cfg = load_config(recipe, check=False)
        if any(k in recipe for k in ("moe", "deepseek")):
            assert cfg.actor.megatron.expert_model_parallel_size > 1, recipe
        if cfg.resources.nnodes > 2:  # the multi-node ones pipeline too
            assert cfg.actor.megatron.pipeline_model_parallel_size > 1, recipe


TINY_RECIPES = sorted(f"tiny/{p.stem}" for p in (RECIPES_DIR / "tiny").glob("*.yaml"))


@pytest.mark.parametrize("recipe", TINY_RECIPES)
def test_tiny_recipe_passes_the_start_up_rules_and_places_its_replicas(recipe):
    from mrl.config.placement import rollout_placement

    cfg = load_config(recipe, check_paths=False)  # the rules the trainer's build relies on, paths aside
    placement = rollout_placement(cfg)
    assert placement.problem() is None and placement.replicas >= 1
    if cfg.rollout.pd.enabled:
        assert placement.footprint == cfg.rollout.pd.prefill_tp + cfg.rollout.pd.decode_tp * cfg.rollout.pd.n_decode
