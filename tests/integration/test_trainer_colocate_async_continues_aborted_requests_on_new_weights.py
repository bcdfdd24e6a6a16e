"""colocate_async end to end on one slot: a Megatron actor and a hybrid `hf` replica share it; the rollout producer
keeps one step's worth of extra groups generating.

Response lengths are made heterogeneous on purpose (every other group stops after one token, the rest run to the
length limit), so when a step's groups are ready the long ones are still generating. Proves: those are aborted
before the replica sleeps (partial rollout), continue after the sync on the new weights, and train in the next step
with min_version < max_version; the server sees abort → sleep → wake weights → update → wake KV → resume; no
trained sample is staler than the threshold.
"""

from __future__ import annotations

import random

import pytest
import ray

from mrl.config.loader import load_config
from mrl.data.datasets import write_rows
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.modes import ColocateAsyncTrainer

pytestmark = pytest.mark.integration

B, M, N, STEPS, VOCAB, LONG = 2, 1, 2, 2, 512, 160


def odd_length_reward(solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str) % 2)


class RecordingTrainer(ColocateAsyncTrainer):
    taken: list[list[dict]]

    def submit_group(self, prompt, index):
        self.sampling_overrides = (
            {"stop_token_ids": list(range(VOCAB))} if index % 2 == 0 else {"ignore_eos": True}
        )
        return super().submit_group(prompt, index)

    def sampling(self, train: bool) -> dict:
        return {**super().sampling(train), **getattr(self, "sampling_overrides", {})}

    def sample(self):
        trajectories = super().sample()
        self.taken.append(trajectories)
        return trajectories


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("colocate_async")
    model = make_tiny_hf_model("qwen2", root / "model", seed=0, vocab_size=VOCAB)
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(["a", "b", "c"]) for _ in range(3))}],
             "data_source": "test", "reward_model": {"ground_truth": "x"}, "extra_info": {"index": i}}
            for i in range(8)]
    cfg = load_config("tiny/grpo_colocate_async", [
        f"model.path={model}", f"data.train_files=[{write_rows(rows, root / 'train.jsonl')}]",
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"rollout.n={N}", "rollout.name=hf",
        f"data.max_response_length={LONG}", f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "actor.optim.lr=1e-3", f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{__name__}:odd_length_reward'",
    ])
    built = build_trainer(cfg)
    trainer = RecordingTrainer(built.config, built.parts, built.logger)
    trainer.taken = []
    try:
        metrics = [trainer.step() for _ in range(STEPS)]
        server = next(iter(trainer.parts.rollout.replicas.values())).server
        yield trainer, metrics, ray.get(server.events.remote())
    finally:
        shutdown(trainer)


def test_long_groups_are_aborted_and_continue_on_the_new_weights(run):
    trainer, metrics, _ = run
    assert metrics[0]["partial_rollout/aborted_requests"] > 0
    first, second = trainer.taken
    assert all(len(t["response_ids"]) == 1 and t["max_version"] == 0 for t in first)  # the short groups
    spanning = [t for t in second if t["min_version"] < t["max_version"]]
    assert spanning and all((t["min_version"], t["max_version"]) == (0, 1) for t in spanning)
    assert all(len(t["response_ids"]) == LONG for t in spanning)  # nothing lost across the abort
    assert all(m["staleness/max"] <= trainer.config.weight_sync.staleness_threshold for m in metrics)


def test_server_sees_abort_sleep_update_wake_resume(run):
    _, _, events = run
    i = events.index("update_weights:1")
    assert events[:i][-3:] == ["abort_all", "sleep:2", "wake_up:weights"], events
    assert events[i:].index("wake_up:kv_cache") < events[i:].index("resume_generation"), events
