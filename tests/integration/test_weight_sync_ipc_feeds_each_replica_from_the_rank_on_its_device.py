"""Per-device `ipc` weight sync on a 2-slot hybrid pool: a TP=2 Megatron actor (trainer ranks 0 and 1 on slots 0
and 1) and vLLM-CPU replicas on the same slots (mrl/rollout/device_sync.py); PP=2 and DP=2 actors into two TP-1
replicas as well (each device still receives the whole model: the owning stage broadcasts, or every DP rank
holds it; the DP=2 actor is the MoE one below, TP 1 × DP 2 with its experts split EP 2).

- Two replicas of TP 1: trainer rank r feeds the replica on slot r (and only it), whole tensors, since the engine's
  TP (1) does not pair with the trainer's (2).
- A Qwen3-MoE actor at EP 2 into two replicas of TP 1: each rank gathers the other's experts, each device receives
  the whole model.
- One replica of TP 2 (engine workers on slots 0 and 1), where each rank sends only its own TP slices: the LoRA
  trainer test's (test_trainer_lora_syncs_merged_weights_to_vllm.py), whose export takes the same path.
After a training step every replica's sampled tokens' log-probs equal the trainer's within 1e-4. A replica that
cannot load (asleep) fails the sync with an error naming the trainer rank on its slot and keeps its old version,
while the other replica serves the new one.
"""

from __future__ import annotations

import pytest
import ray
from trainer_fixtures import prompt_file, trainer_gap

from mrl.config.startup.loader import load_config
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [11, 57, 203, 88, 141, 9, 300, 42]


def hybrid_trainer(root, layout: str = "tensor_model_parallel_size=2", family: str = "qwen2") -> PPOTrainer:
    """Two TP-1 vLLM-CPU replicas on the two slots of an actor of `layout`."""
    model = make_tiny_hf_model(family, root / "model", seed=0)
    built = build_trainer(load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{prompt_file(root / 'train.jsonl', list('abcd'), 4)}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=8",
        "resources.n_gpus_per_node=2", f"actor.megatron.{layout}", "rollout.name=vllm",
        "rollout.num_replicas=2", "rollout.tensor_model_parallel_size=1",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "actor.optim.lr=1e-2", f"trainer.default_local_dir={root / 'run'}",
        "reward.reward_fn='trainer_fixtures:odd_length_reward'",
    ]))
    return PPOTrainer(built.config, built.parts, built.logger)


def replica_gaps(trainer: PPOTrainer, tag: str) -> dict[int, dict[str, float]]:
    """Per replica rank: its version and the log-prob gap of a sequence it samples against the trainer's."""
    sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "ignore_eos": True}
    gaps = {}
    for rank, replica in trainer.parts.rollout.replicas.items():
        out = ray.get(replica.generate(f"{tag}-{rank}", PROMPT, sampling))
        gaps[rank] = {"version": out.version, **trainer_gap(trainer, f"{tag}-{rank}", PROMPT, out)}
    return gaps


def sleeping_replica_sync(trainer: PPOTrainer, version: int) -> dict:
    """Sync while replica 1 sleeps (it cannot load): the error, then every replica's version."""
    second = trainer.parts.rollout.replicas[1]
    ray.get(second.sleep(1))
    try:
        trainer.parts.actor_rollout.update_weights(version)
        error = None
    except Exception as failure:
        error = str(failure)
    finally:
        ray.get(second.wake_up(None))
    return {"error": error, "versions": {r: ray.get(x.health())["version"]
                                         for r, x in trainer.parts.rollout.replicas.items()}}


def run(trainer: PPOTrainer, failing: bool) -> dict:
    """One step, a sync stamped 2, each replica's gap to the trainer, (`failing`) a sync that fails; shut down."""
    try:
        metrics = trainer.step()
        per_rank = trainer.parts.actor_rollout.update_weights(2)
        record = {"metrics": metrics, "per_rank": per_rank, "gaps": replica_gaps(trainer, "probe"),
                  "ids": {r: x.server_id for r, x in trainer.parts.rollout.replicas.items()}}
        return {**record, **({"failed": sleeping_replica_sync(trainer, 3)} if failing else {})}
    finally:
        shutdown(trainer)


@pytest.fixture(scope="module")
def two_tp1_replicas(ray_cluster, tmp_path_factory):
    return run(hybrid_trainer(tmp_path_factory.mktemp("per_device_tp1")), True)


@pytest.fixture(scope="module")
def pp2(ray_cluster, tmp_path_factory, two_tp1_replicas):  # one trainer at a time
    root = tmp_path_factory.mktemp("per_device_pp2")
    return run(hybrid_trainer(root, layout="pipeline_model_parallel_size=2"), False)


@pytest.fixture(scope="module")
def moe_ep2(ray_cluster, tmp_path_factory, two_tp1_replicas):  # one trainer at a time; DP is what TP × PP leave: 2
    from bridges.hf_io import HFCheckpoint

    root = tmp_path_factory.mktemp("per_device_ep2")
    result = run(hybrid_trainer(root, layout="expert_model_parallel_size=2",
                                family="qwen3_moe"), False)
    with HFCheckpoint(str(root / "model")) as checkpoint:
        result["hf_bytes"] = sum(checkpoint(name)[...].nbytes for name in checkpoint.names())
    return result


def test_each_rank_feeds_the_replica_on_its_slot_whole_tensors(two_tp1_replicas):
    per_rank, ids, metrics = two_tp1_replicas["per_rank"], two_tp1_replicas["ids"], two_tp1_replicas["metrics"]
    assert [r["receivers"] for r in per_rank] == [[f"{ids[0]}/0"], [f"{ids[1]}/0"]]
    assert all(r["bytes_sliced"] == 0 and r["bytes_whole"] > 0 for r in per_rank)
    assert per_rank[0]["bytes_whole"] == per_rank[1]["bytes_whole"]  # each device received the whole model
    assert metrics["weight_sync/senders"] == 2 and metrics["weight_sync/bytes_sliced"] == 0
    # where each rank's sync spent its host time: setting up, then sending (inside it: making the stream, i.e. the
    # export, and waiting for its worker); rank 0 then waits for every replica's last load
    assert all(r["setup_s"] > 0 and r["send_s"] >= r["produce_s"] + r["ack_wait_s"] for r in per_rank)
    assert all(r["produce_s"] > 0 and r["ack_wait_s"] >= 0 for r in per_rank)
    assert per_rank[0]["replica_wait_s"] > 0 and per_rank[1]["replica_wait_s"] == 0
    assert metrics["timing_s/sync/produce"] > 0 and metrics["timing_s/sync/ack_wait"] >= 0  # the step's sync
    assert metrics["timing_s/sync/send"] >= metrics["timing_s/sync/produce"]
    parts = [metrics[f"timing_s/sync/{part}"] for part in ("setup", "send", "replica_wait")]
    assert max(parts) <= metrics["timing_s/sync/update"]
    for rank, gap in two_tp1_replicas["gaps"].items():
        assert gap["version"] == 2, rank
        assert gap["rollout/logprob_abs_diff_max"] <= 1e-4, (rank, gap)


def test_a_replica_that_cannot_load_fails_the_sync_naming_the_rank_on_its_slot(two_tp1_replicas):
    failed = two_tp1_replicas["failed"]
    assert failed["error"] is not None and "trainer rank 1" in failed["error"], failed
    assert "keep their previous version" in failed["error"]
    assert failed["versions"] == {0: 3, 1: 2}


def test_pipeline_stages_feed_their_slots_the_whole_model(pp2, two_tp1_replicas):
    per_rank, ids = pp2["per_rank"], pp2["ids"]
    assert [r["receivers"] for r in per_rank] == [[f"{ids[0]}/0"], [f"{ids[1]}/0"]]
    whole_model = two_tp1_replicas["per_rank"][0]["bytes_whole"]
    assert [(r["bytes_sliced"], r["bytes_whole"]) for r in per_rank] == [(0, whole_model)] * 2
    for rank, gap in pp2["gaps"].items():
        assert gap["version"] == 2, rank
        assert gap["rollout/logprob_abs_diff_max"] <= 1e-4, (rank, gap)


def test_data_and_expert_parallel_ranks_gather_the_experts_and_feed_their_slots_the_whole_model(moe_ep2):
    per_rank, ids = moe_ep2["per_rank"], moe_ep2["ids"]
    assert [r["receivers"] for r in per_rank] == [[f"{ids[0]}/0"], [f"{ids[1]}/0"]]
    # each rank holds half the experts; the export's EP gather gives both devices every expert: the checkpoint
    assert [(r["bytes_sliced"], r["bytes_whole"]) for r in per_rank] == [(0, moe_ep2["hf_bytes"])] * 2
    for rank, gap in moe_ep2["gaps"].items():
        assert gap["version"] == 2, rank
        assert gap["rollout/logprob_abs_diff_max"] <= 1e-4, (rank, gap)
