"""Megatron's per-stage layer split (num_layers_in_first/last_pipeline_stage, an even share for the middle stages)
as `mrl plan` reports it for the recipes whose layers PP does not divide, and the heaviest stage the memory
estimate counts."""

from __future__ import annotations

import pytest

from mrl.config.model_shape import stage_layers


@pytest.mark.parametrize(("args", "stages"), [
    ((61, 8, 7, 6), [7, 8, 8, 8, 8, 8, 8, 6]),
    ((94, 8, 11, 11), [11, 12, 12, 12, 12, 12, 12, 11]),
    ((3, 2, 1, None), [1, 2]),
    ((3, 2, None, 1), [2, 1]),
    ((4, 2, None, None), [2, 2]),
    ((5, 1, None, None), [5]),
])
def test_stage_layers_follow_megatrons_split(args, stages):
    assert stage_layers(*args) == stages and sum(stages) == args[0]


@pytest.mark.parametrize(("recipe", "line"), [
    ("deepseek_v3/671b_grpo", "7 + 8 + 8 + 8 + 8 + 8 + 8 + 6 (PP=8)"),
    ("qwen3_moe/235b_a22b_grpo", "11 + 12 + 12 + 12 + 12 + 12 + 12 + 11 (PP=8)"),
])
def test_plan_prints_the_split_of_an_uneven_recipe(recipe, line):
    from mrl.tools.plan import make_plan, render

    plan = make_plan(recipe)
    assert plan.can_start, plan.problems
    assert f"actor layers per pipeline stage   {line}" in render(plan)
