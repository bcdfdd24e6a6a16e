"""On one GPU with the real vLLM (hybrid, sleep/wake), `weight_sync.one_copy=true`: every step's sync goes by one
copy (the sender shared its own memory: weight_sync/bytes_one_copy is every byte it sent) and the engine's
parameters, read back, equal the trainer's export bit for bit."""

from __future__ import annotations

import pytest
from gpu_fixtures import demo_task, demo_trainer, engine_matches_export

pytestmark = pytest.mark.gpu


def test_hybrid_steps_sync_by_one_copy_and_the_engine_holds_the_trainers_weights(gpu_ray, tmp_path):
    from mrl.trainer.build import shutdown

    paths = demo_task(tmp_path / "task", warmup_steps=0)
    trainer = demo_trainer(paths, tmp_path, "weight_sync.one_copy=true", "trainer.total_training_steps=3")
    try:
        trainer.give_devices_to_rollout()
        for _ in range(3):
            metrics = trainer.step()
            print({k: v for k, v in metrics.items() if k.startswith("weight_sync/")})
            sent = metrics["weight_sync/bytes_sliced"] + metrics["weight_sync/bytes_whole"]
            assert sent > 0 and metrics["weight_sync/bytes_one_copy"] == sent
            assert engine_matches_export(trainer) == [], f"step {trainer.global_steps}"
    finally:
        shutdown(trainer)
