"""Router replay R3 on a tiny Qwen3-MoE: the trainer routes every token exactly as the rollout engine did, and the
old-log-prob vs rollout mismatch drops.

The rollout engine is the hf backend in bf16, returning each request's routed experts; the trainer is Megatron in
fp32 (one process, gloo). Routers are built near ties (routing_fixtures.py), so without replay the two pick other
experts for many tokens.
"""

from __future__ import annotations

import pytest
import torch
from routing_fixtures import make_near_tie_moe, mismatch, replay_passes, rollouts

from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    path = make_near_tie_moe(tmp_path_factory.mktemp("near_tie_moe"))
    data = rollouts(path)
    return data, launch(replay_passes, 1, path, data, {}, timeout_s=600)[0]


def test_r3_trainer_routes_every_token_to_the_engine_experts(replayed):
    from mrl.engine.megatron.routing import same_experts

    data, out = replayed
    engine = torch.cat([s["routed_experts"] for s in data])
    routed = (engine >= 0).all(dim=-1)  # every token but each sample's last (never fed back to the engine)
    assert int((~routed).any(dim=-1).sum()) == len(data)
    assert bool(same_experts(out["r3/routed_experts"], engine)[routed].all())
    # the near ties are real: the trainer's own top-k differs from the engine's for a share of (token, layer)
    disagree = float((~same_experts(out["free/own_experts"], engine))[routed].float().mean())
    print(f"(token, layer) pairs where the fp32 trainer's own top-k differs from the bf16 engine's: {disagree:.3f}")
    assert disagree > 0.05, disagree
    # under replay the routers still report their own choice: at the first MoE layer (same inputs) the free pass's
    assert torch.equal(out["r3/own_experts"][:, 0].sort(-1).values, out["free/own_experts"][:, 0].sort(-1).values)


def test_r3_lowers_the_step0_logprob_mismatch(replayed):
    data, out = replayed
    without, with_r3 = mismatch(out["free/log_probs"], data), mismatch(out["r3/log_probs"], data)
    print(f"logprob_mismatch without R3 {without:.6f}, with R3 {with_r3:.6f}")
    assert with_r3 < without


def test_r2_replaying_the_trainers_own_routing_changes_nothing(replayed):
    _, out = replayed
    assert torch.equal(out["r2/log_probs"], out["free/log_probs"])
    assert torch.equal(out["r2/routed_experts"], out["free/routed_experts"])


def test_the_update_pass_replays_the_engine_routing(replayed):
    data, out = replayed
    mask = torch.cat([s["response_mask"] for s in data]).bool()
    want = -float(out["r3/log_probs"][mask].mean())
    assert abs(float(out["update_loss"]) - want) < 1e-5, (float(out["update_loss"]), want)
    free = -float(out["free/log_probs"][mask].mean())
    assert abs(free - want) > 1e-3  # the routing really changes the loss
