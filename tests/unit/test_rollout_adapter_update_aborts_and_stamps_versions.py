"""The adapter contract shared by all backends, on the hf adapter in one process: an update aborts what runs
(returned with stop_reason "aborted", its tokens and the version that produced them), requests submitted while
admission is closed wait and then run on the new weights with the new version, and release_kv_cache holds
requests until resume_kv_cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mrl.models.tiny import build_tiny_hf_model, make_tiny_hf_model
from rollout_adapters.hf.adapter import HFAdapter

PROMPT = [5, 6, 7, 8, 9]
LONG = {"max_tokens": 900, "ignore_eos": True, "seed": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("adapter") / "qwen2", seed=0))


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_update_aborts_running_and_parks_new_requests(model_dir):
    new_weights = build_tiny_hf_model("qwen2", seed=1).state_dict()

    async def scenario():
        adapter = HFAdapter(model_dir, max_model_len=1024)
        await adapter.start()
        running = asyncio.create_task(adapter.generate("r", PROMPT, LONG))
        await until(lambda: adapter._running)
        await asyncio.sleep(0.2)
        # Tasks start in creation order: the update closes admission before the new request reaches the gate.
        update = asyncio.create_task(adapter.update_weights(new_weights.items(), 7))
        parked = asyncio.create_task(adapter.generate("p", PROMPT, {"max_tokens": 4, "seed": 0}))
        assert await update == len(new_weights)
        return await running, await parked, await adapter.health()

    aborted, after, health = asyncio.run(scenario())
    assert aborted.stop_reason == "aborted" and 0 < len(aborted.token_ids) < 900 and aborted.version == 0
    assert len(aborted.log_probs) == len(aborted.token_ids)
    assert after.stop_reason == "length" and after.version == 7
    assert health == {"backend": "hf", "version": 7, "in_flight": 0, "waiting": 0, "paused": False, "asleep": []}


def test_release_kv_cache_holds_requests_until_resumed(model_dir):
    async def scenario():
        adapter = HFAdapter(model_dir, max_model_len=1024)
        await adapter.release_kv_cache()
        held = asyncio.create_task(adapter.generate("h", PROMPT, {"max_tokens": 3, "logprobs": False}))
        await until(lambda: adapter._waiting == 1)
        assert (await adapter.health())["asleep"] == ["kv_cache"]
        await adapter.resume_kv_cache()
        return await held, list(adapter.events)

    out, events = asyncio.run(scenario())
    assert len(out.token_ids) == 3 and out.log_probs is None
    assert events == ["release_kv_cache", "wake_up:kv_cache"]
