"""No-op padding with the first update on-policy (actor.on_policy_first_update, the default), at DP 2: 2 prompts ×
1 sample over 2 updates per step need 4 rows, so 2 no-op copies of the shorter sample pad the batch. Each rank's
first row trains on-policy and gets no π_old from the old log-prob pass; a no-op sharing its source's store key
would then find no `old_log_probs` for its later update (KeyError). No-ops own their keys: the step trains, and it
leaves nothing in the store."""

from __future__ import annotations

import pytest
from trainer_fixtures import tiny_trainer

from mrl.trainer.build import shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

B, M, N = 2, 1, 1  # prompts per step, prompts per update (2 updates per step), samples per prompt


class CountsNoops(PPOTrainer):
    def compute_old_log_prob(self, batch):
        self.noop_keys = [k for k, noop in zip(batch["key"], batch["is_noop"].tolist()) if noop]
        self.all_keys = list(batch["key"])
        return super().compute_old_log_prob(batch)


def test_noop_padding_trains_with_the_first_update_on_policy_at_dp2(ray_cluster, tmp_path):
    trainer = tiny_trainer(CountsNoops, "tiny/grpo", tmp_path, [
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}", "rollout.name=hf",
        "resources.n_gpus_per_node=2", "data.max_response_length=4",
    ], list("abcd"), prompts=4)
    try:
        assert trainer.dp_size == 2
        metrics = trainer.step()
        assert len(trainer.noop_keys) == 2 and len(set(trainer.all_keys)) == 4  # every row its own key
        assert metrics["actor/updates"] == B // M and metrics["actor/skipped_updates"] == 0
        assert trainer.store.size() == {"values": 0, "tags": 0}  # the no-ops' copies left with the step
    finally:
        shutdown(trainer)
