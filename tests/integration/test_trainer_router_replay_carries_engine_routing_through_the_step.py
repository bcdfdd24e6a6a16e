"""Router replay through the trainer on a tiny Qwen3-MoE with the `hf` rollout backend: R3's routed experts go from
the engine through the agent loop into the sample store (int16, one row per token, -1 only where the engine never
fed the token), the old-log-prob pass replays them and logs the routing agreement and per-layer expert load, and
the step trains. R2 (`old_log_prob`): the old-log-prob pass writes the routing the update replays."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import KeepsStepTensors, stepped, tiny_trainer

from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

B, N = 2, 2


class Trainer(KeepsStepTensors, PPOTrainer):
    pass


def run(tmp_path_factory, mode: str):
    trainer = tiny_trainer(Trainer, "tiny/grpo", tmp_path_factory.mktemp(f"replay_{mode}"), [
        f"data.train_batch_size={B}", "actor.ppo_mini_batch_size=2", f"rollout.n={N}", "rollout.name=hf",
        "data.max_response_length=6", "trainer.total_training_steps=1", "data.max_prompt_length=64",
        f"actor.megatron.router_replay={mode}",
    ], list("abc"), family="qwen3_moe")
    with stepped(trainer, 1) as (done, metrics, _):
        return done.step_tensors[0], metrics[0]


def test_r3_routing_travels_with_the_sample_and_is_measured(tmp_path_factory):
    batch, metrics = run(tmp_path_factory, "rollout")
    routing, ids = batch.jagged_field("routed_experts"), batch.jagged_field("input_ids")
    assert routing.values.dtype == torch.int16 and routing.values.shape[1:] == (2, 2)  # 2 MoE layers, top-2
    assert torch.equal(routing.offsets, ids.offsets)
    unrouted = (routing.values < 0).all(dim=-1).all(dim=-1)
    last = ids.offsets[1:] - 1
    assert torch.equal(unrouted.nonzero().flatten(), last)  # only each sample's last token
    assert 0.0 < metrics["actor/routing_agreement"] <= 1.0
    assert metrics["actor/expert_load_max_over_mean/layer_1"] >= 1.0
    assert all(s["update_ok"] for s in metrics.get("actor/steps", [{"update_ok": True}]))


def test_r2_records_the_routing_in_the_old_log_prob_pass(tmp_path_factory):
    batch, metrics = run(tmp_path_factory, "old_log_prob")
    routing = batch.jagged_field("routed_experts")
    assert routing.values.dtype == torch.int16
    assert bool((routing.values >= 0).all())  # the trainer routed every token itself
    assert "actor/routing_agreement" not in metrics  # no engine routing to compare with
