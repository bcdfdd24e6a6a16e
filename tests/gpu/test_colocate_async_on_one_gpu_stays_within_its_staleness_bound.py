"""On one GPU with the real vLLM: `colocate_async` (partial rollout: aborted requests resume on the new weights
after each sync) runs its steps to the end, and no step trains on tokens older than weight_sync.staleness_threshold
versions."""

from __future__ import annotations

import pytest
from gpu_fixtures import demo_task, demo_trainer

pytestmark = pytest.mark.gpu


def test_colocate_async_completes_within_staleness_one(gpu_ray, tmp_path):
    from mrl.trainer.build import shutdown
    from mrl.trainer.modes import ColocateAsyncTrainer

    paths = demo_task(tmp_path / "task", warmup_steps=0)
    trainer = demo_trainer(paths, tmp_path, "trainer.mode=colocate_async", "weight_sync.staleness_threshold=1",
                           "trainer.total_training_steps=5", "data.max_response_length=64", cls=ColocateAsyncTrainer)
    try:
        history = trainer.fit()
    finally:
        shutdown(trainer)
    print([(h["staleness/max"], h.get("staleness/spanning_frac"), h.get("partial_rollout/aborted_requests"))
           for h in history])
    assert len(history) == 5
    assert all(h["staleness/max"] <= 1 for h in history)
    assert any(h["staleness/max"] >= 1 for h in history[1:])  # generation really ran ahead of training
