"""Replica modes on Ray (hf backend: cheap engines): hybrid replicas land on the trainer pool's slots (refused when the
pool leaves no share for them) and follow the sleep -> wake(weights) -> update -> wake(kv_cache) protocol (requests
wait meanwhile; the wrong wake-up order is refused); colocated replicas share a pool's slots; standalone replicas
get placement groups of their own; the replica count is devices / footprint."""

from __future__ import annotations

import asyncio

import pytest
import ray
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import PROMPT, next_version, replica_spec, wait_for

from mrl.controller.resource_pool import RayResourcePool
from mrl.rollout.manager import LLMServerManager

pytestmark = pytest.mark.integration


def placement_groups(manager: LLMServerManager) -> list[str]:
    return [h["placement_group"] for h in manager.health().values()]


def test_hybrid_replicas_sleep_update_wake_in_order(rollout_managers, tiny_model_dir, hf_models):
    with pytest.raises(ValueError, match="max_colocate_count must be >= 2"):
        LLMServerManager.create(replica_spec("hf", tiny_model_dir), "hybrid", pool=RayResourcePool([2], use_gpu=False))
    trainer_pool = RayResourcePool([2], use_gpu=False, max_colocate_count=2, cpus_per_slot=1)
    manager = LLMServerManager.create(replica_spec("hf", tiny_model_dir), "hybrid", pool=trainer_pool)
    try:
        assert len(manager.replicas) == 2
        assert set(placement_groups(manager)) == {trainer_pool.get_placement_groups()[0].id.hex()}
        client = manager.client()
        replica = manager.replicas[0]
        version = next_version()

        async def scenario():
            await replica.sleep(2)
            parked = asyncio.create_task(client.generate("hybrid-1", PROMPT, {"max_tokens": 8, "seed": 0}))
            await wait_for(replica, "waiting", 1)
            with pytest.raises(RuntimeError, match="weights -> update_weights -> kv_cache"):
                await replica.wake_up(["kv_cache"])
            await replica.wake_up(["weights"])
            await replica.update_weights([], version)
            assert not parked.done(), "generation must wait for the KV cache"
            await replica.wake_up(["kv_cache"])
            return await parked

        out = asyncio.run(scenario())
        assert out.version == version and len(out.token_ids) == 8
        events = ray.get(replica.server.events.remote())
        assert events == [
            "sleep:2",
            "wake_up:weights",
            f"update_weights:{version}",
            "clear_kv_cache",
            "wake_up:kv_cache",
        ]
    finally:
        manager.shutdown()
        trainer_pool.remove()


def test_colocated_share_a_pool_and_standalone_own_pools(rollout_managers, tiny_model_dir):
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=4, cpus_per_slot=1)
    colocated = LLMServerManager.create(replica_spec("hf", tiny_model_dir), "colocated", pool=pool)
    standalone = LLMServerManager.create(replica_spec("hf", tiny_model_dir), "standalone", num_devices=2)
    try:
        assert set(placement_groups(colocated)) == {pool.get_placement_groups()[0].id.hex()}
        own = placement_groups(standalone)
        assert len(set(own)) == 2 and pool.get_placement_groups()[0].id.hex() not in own
        with pytest.raises(ValueError, match="multiple of the replica footprint"):
            LLMServerManager.create(replica_spec("hf", tiny_model_dir), "standalone", num_devices=0)
    finally:
        colocated.shutdown()
        standalone.shutdown()
        pool.remove()
