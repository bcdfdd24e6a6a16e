"""On one GPU: a vLLM replica at gpu_memory_utilization 0.5 frees at least 90% of its reservation when it sleeps
(level 2: weights and KV cache discarded; level 1: weights kept in host memory) and takes it back on wake-up; after
a level-1 cycle greedy outputs are unchanged (the weights came back), and the engine starts within a bound that a
first-time user would accept. Device memory is read through NVML, so this process holds no CUDA context."""

from __future__ import annotations

import asyncio
import time

import pytest
from gpu_fixtures import device_total_gib, device_used_gib

pytestmark = pytest.mark.gpu
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


async def cycle(model: str) -> dict[str, float]:
    from rollout_adapters.vllm.adapter import VLLMAdapter

    base = device_used_gib()
    adapter = VLLMAdapter(model, max_model_len=512, dtype="bfloat16", gpu_memory_utilization=0.5, enforce_eager=True)
    start = time.monotonic()
    await adapter.start()
    out = {"start_s": time.monotonic() - start, "base": base, "up": device_used_gib()}
    try:
        before = await adapter.generate("a", [5, 6, 7, 8], GREEDY)
        for level in (1, 2):
            await adapter.sleep(level)
            out[f"asleep{level}"] = device_used_gib()
            await adapter.wake_up(["weights"])
            await adapter.wake_up(["kv_cache"])
            out[f"awake{level}"] = device_used_gib()
            if level == 1:
                out["same_after_level1"] = float((await adapter.generate("b", [5, 6, 7, 8], GREEDY)).token_ids
                                                 == before.token_ids)
    finally:
        await adapter.shutdown()
    return out


def test_sleep_frees_at_least_90_percent_and_wake_restores(tmp_path):
    from mrl.models.tiny import make_tiny_hf_model

    model = str(make_tiny_hf_model("qwen2", tmp_path / "m", vocab_size=4096, hidden_size=512, num_hidden_layers=4))
    m = asyncio.run(cycle(model))
    reservation = m["up"] - m["base"]
    print({k: round(v, 2) for k, v in m.items()}, f"reservation {reservation:.1f} GiB")
    assert reservation >= 0.4 * device_total_gib()  # the memory fraction reached the engine
    assert m["start_s"] < 180
    for level in (1, 2):
        assert m["up"] - m[f"asleep{level}"] >= 0.9 * reservation, level
        assert m[f"awake{level}"] - m["base"] >= 0.9 * reservation, level
    assert m["same_after_level1"] == 1.0
