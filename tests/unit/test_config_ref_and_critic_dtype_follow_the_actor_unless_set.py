"""`ref.megatron.params_dtype` (the reference, a distillation teacher, colocated reward models) and
`critic.megatron.params_dtype` follow `actor.megatron.params_dtype` unless set: a float32 frozen engine beside a bf16
actor took 6x the bf16 time on an H100 (docs/reward_models.md)."""

from __future__ import annotations

import pytest

from mrl.config.startup.loader import load_config


@pytest.mark.parametrize("actor", ["float32", "bfloat16"])
def test_ref_and_critic_follow_the_actor(actor):
    cfg = load_config("tiny/grpo", [f"actor.megatron.params_dtype={actor}"], check_paths=False)
    assert cfg.ref.megatron.params_dtype == actor
    assert cfg.critic.megatron.params_dtype == actor


def test_an_explicit_setting_wins():
    cfg = load_config("tiny/grpo", ["actor.megatron.params_dtype=bfloat16", "ref.megatron.params_dtype=float32",
                                    "critic.megatron.params_dtype=float32"], check_paths=False)
    assert (cfg.actor.megatron.params_dtype, cfg.ref.megatron.params_dtype, cfg.critic.megatron.params_dtype) == (
        "bfloat16", "float32", "float32")
