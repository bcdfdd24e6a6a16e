"""GRPO with actor.lora.sync=adapter on a TP=2 Megatron actor and one vLLM-CPU replica of TP 2 started with LoRA:
each sync gathers only the adapters' A and B, writes them as an HF PEFT folder per version (fused QKV / gate-up
split into the per-projection names) and has vLLM load it as a new LoRA request on its unchanged base weights.
After two steps the log-probs of a sequence the replica samples with the current adapter equal the trainer's LoRA
model's within 1e-4 (vLLM scales by lora_alpha / r, as the trainer), the sync moved only the adapters' bytes, the
previous version's folder is gone, and the step reports the optimizer state's bytes.
"""

from __future__ import annotations

import os

import pytest
import ray
from test_trainer_lora_syncs_merged_weights_to_vllm import PROMPT, varied_reward  # noqa: F401
from trainer_fixtures import prompt_file, trainer_gap

from mrl.config.loader import load_config
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

RANK = 4


@pytest.fixture(scope="module")
def adapter_run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapter_vllm")
    model = make_tiny_hf_model("qwen2", root / "model", seed=0)
    built = build_trainer(load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{prompt_file(root / 'train.jsonl', list('abcd'), 4)}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=8",
        "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2", "rollout.name=vllm",
        "rollout.num_replicas=1", "rollout.tensor_model_parallel_size=2", "rollout.sleep_level=1",
        "+rollout.engine_kwargs.distributed_executor_backend=mp", "trainer.total_training_steps=2",
        "actor.lora.enable=true", f"actor.lora.rank={RANK}", "actor.lora.alpha=16", "actor.lora.sync=adapter",
        f"actor.lora.adapter_dir={root / 'adapters'}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "actor.optim.lr=5e-2", f"trainer.default_local_dir={root / 'run'}",
        "reward.reward_fn='test_trainer_lora_syncs_merged_weights_to_vllm:varied_reward'",
    ]))
    trainer = PPOTrainer(built.config, built.parts, built.logger)
    try:
        metrics = [trainer.step() for _ in range(2)]
        (replica,) = trainer.parts.rollout.replicas.values()
        sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "ignore_eos": True}
        out = ray.get(replica.generate("probe", PROMPT, sampling))
        yield {"metrics": metrics, "version": out.version, "gap": trainer_gap(trainer, "probe", PROMPT, out),
               "folders": sorted(os.listdir(root / "adapters"))}
    finally:
        shutdown(trainer)


def test_engine_serves_the_trainers_lora_model_after_each_adapter_sync(adapter_run):
    assert adapter_run["version"] == 2
    assert adapter_run["gap"]["rollout/logprob_abs_diff_max"] <= 1e-4, adapter_run["gap"]
    second = adapter_run["metrics"][1]
    assert second["rollout/logprob_abs_diff_max"] <= 1e-4  # step 2's samples came from the step-1 adapter
    assert second["actor/grad_norm"] > 0


def test_sync_moves_only_the_adapters_and_keeps_one_folder(adapter_run):
    # Tiny Qwen2 (4 layers, hidden 128, 4 heads / 2 KV heads of 32, MLP 256), rank 4, fp32: per layer
    # q/k/v (A 4x128 each; B 128/64/64 x 4), o (A 4x128, B 128x4), gate/up (A 4x128 each, B 256x4 each), down
    # (A 4x256, B 128x4).
    per_layer = 3 * 4 * 128 + (128 + 64 + 64) * 4 + 2 * 4 * 128 + 2 * (4 * 128 + 256 * 4) + 4 * 256 + 128 * 4
    second = adapter_run["metrics"][1]
    assert second["weight_sync/bytes_total"] == 4 * per_layer * 4
    assert second["weight_sync/tensors"] == 4 * 7 * 2
    assert adapter_run["folders"] == ["v2"]


def test_step_reports_the_optimizer_state_of_the_adapters_only(adapter_run):
    first = adapter_run["metrics"][0]
    trainable = first["actor/trainable_params"]
    assert 0 < trainable < 100_000  # the adapters, not the 700k-parameter base
    # Adam: fp32 exp_avg and exp_avg_sq per trainable parameter (+ fp32 master copies under the distributed
    # optimizer), on each of the 2 TP ranks' shards
    assert first["memory/optimizer_state_gib"] * 2**30 >= 2 * 4 * trainable / 2
