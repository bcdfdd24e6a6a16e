"""SGLangAdapter's HTTP sequencing, against an in-process aiohttp server that answers with the recorded shapes of
sglang main @ 001067ff (srt/entrypoints/http_server.py) — SGLang itself cannot run on CPU, so this checks our side
only: which endpoints are called, in which order, with which bodies.

Proves: a weight update aborts what runs (the running request returns "aborted" with its tokens and the old
version), sends one /update_weights_from_tensor per bucket whose handles decode to the bucket's tensors, flushes the
cache after the last bucket and stamps the version; sleep releases both tags and wake resumes them in order;
generate sends token ids with return_logprob and maps the reply; server errors surface as our exceptions.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp import web

from rollout_adapters.buckets import pack_buckets
from rollout_adapters.sglang import protocol
from rollout_adapters.sglang.adapter import SGLangAdapter


class RecordedServer:
    """Answers like SGLang's HTTP server; /generate with max_new_tokens >= 100 runs until /abort_request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.aborted = asyncio.Event()
        self.running = 0
        app = web.Application()
        app.router.add_get("/health", self.health)
        for path in ("/generate", "/abort_request", "/update_weights_from_tensor", "/flush_cache",
                     "/release_memory_occupation", "/resume_memory_occupation", "/init_weights_update_group",
                     "/update_weights_from_distributed", "/destroy_weights_update_group"):
            app.router.add_post(path, self.handle)
        self.app = app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = request.path
        self.calls.append((path, body))
        if path == "/generate":
            return await self.generate(body)
        if path == "/abort_request":
            self.aborted.set()
        if path == "/update_weights_from_tensor":
            named = protocol.deserialize_named_tensors(body["serialized_named_tensors"][0])
            if any(not torch.isfinite(t).all() for _, t in named):
                return web.json_response({"success": False, "message": "non-finite weights"}, status=400)
            return web.json_response({"success": True, "message": "Succeeded to update model weights."})
        if "weights_update_group" in path or path == "/update_weights_from_distributed":
            return web.json_response({"success": True, "message": "ok"})
        return web.json_response({})

    async def generate(self, body: dict) -> web.Response:
        if len(body["input_ids"]) > 64:
            return web.json_response({"error": {"message": "input too long"}}, status=400)
        budget = body["sampling_params"]["max_new_tokens"]
        ids = [(body["input_ids"][-1] + i + 1) % 500 for i in range(budget)]
        finish = {"type": "length", "length": budget}
        if budget >= 100:  # a long request: runs until aborted, then returns what it has
            self.running += 1
            await self.aborted.wait()
            self.running -= 1
            ids, finish = ids[:3], {"type": "abort", "message": "Abort in waiting queue"}
        meta = {"id": body["rid"], "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids)}
        if body["return_logprob"]:
            meta["output_token_logprobs"] = [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]
        if body["logprob_start_len"] == 0:
            meta["input_token_logprobs"] = [[None if i == 0 else -float(t), t, None]
                                            for i, t in enumerate(body["input_ids"])]
        return web.json_response({"output_ids": ids, "meta_info": meta})


async def _serve(server: RecordedServer) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(server.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_update_aborts_loads_per_bucket_flushes_and_stamps_version():
    weights = [("a.weight", torch.randn(64, 64)), ("b.weight", torch.randn(64, 64)), ("c.bias", torch.randn(8))]

    async def scenario():
        server = RecordedServer()
        runner, url = await _serve(server)
        adapter = SGLangAdapter("/m", base_url=url, tensor_parallel_size=2, max_model_len=1024)
        await adapter.start()
        try:
            plain = await adapter.generate("p", [1, 2, 3], {"max_tokens": 4, "temperature": 0})
            running = asyncio.create_task(adapter.generate("r", [7], {"max_tokens": 200}))
            await _until(lambda: server.running == 1)
            # Small buckets: 3 tensors in 2 buckets (64×64 fp32 = 16 KiB each).
            loaded = await adapter.update_weights_from_buckets(list(pack_buckets(weights, 20_000)), 5)
            aborted = await running
            after = await adapter.generate("q", [9], {"max_tokens": 2})
            scored = await adapter.generate("s", [3, 4, 5], {"max_tokens": 1, "temperature": 0, "logprobs": False,
                                                              "prompt_logprobs": True})
            return server.calls, plain, aborted, after, loaded, scored
        finally:
            await adapter.shutdown()
            await runner.cleanup()

    calls, plain, aborted, after, loaded, scored = asyncio.run(scenario())
    assert scored.extra["prompt_log_probs"] == [0.0, -4.0, -5.0] and scored.log_probs is None
    assert plain.token_ids == [4, 5, 6, 7] and plain.log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert plain.stop_reason == "length" and plain.version == 0
    assert aborted.stop_reason == "aborted" and aborted.token_ids == [8, 9, 10] and aborted.version == 0
    assert after.version == 5 and loaded == 3
    paths = [p for p, _ in calls]
    assert paths == ["/generate", "/generate", "/abort_request", "/update_weights_from_tensor",
                     "/update_weights_from_tensor", "/flush_cache", "/generate", "/generate"]
    assert calls[-1][1]["logprob_start_len"] == 0 and calls[0][1]["logprob_start_len"] == -1
    first = calls[0][1]
    assert first["input_ids"] == [1, 2, 3] and first["return_logprob"] is True
    assert first["sampling_params"]["max_new_tokens"] == 4 and first["sampling_params"]["temperature"] == 0.0
    assert calls[2][1] == {"rid": "", "abort_all": True}
    sent = []
    for _, body in calls[3:5]:
        assert len(body["serialized_named_tensors"]) == 2 and body["flush_cache"] is False
        sent += protocol.deserialize_named_tensors(body["serialized_named_tensors"][1])
    sent_by_name = dict(sent)  # safetensors orders a bucket's tensors itself
    assert len(sent) == 3 and sorted(sent_by_name) == [n for n, _ in weights]
    assert all(torch.equal(sent_by_name[n], t) for n, t in weights)


def test_sleep_wake_tags_and_errors():
    async def scenario():
        server = RecordedServer()
        runner, url = await _serve(server)
        adapter = SGLangAdapter("/m", base_url=url, max_model_len=1024)
        await adapter.start()
        try:
            await adapter.sleep(2)
            await adapter.wake_up(["weights"])
            await adapter.wake_up(["kv_cache"])
            await adapter.release_kv_cache()
            await adapter.resume_kv_cache()
            with pytest.raises(ValueError, match="input too long"):
                await adapter.generate("long", list(range(100)), {"max_tokens": 2})
            with pytest.raises(RuntimeError, match="non-finite weights"):
                await adapter.update_weights([("w", torch.tensor([float("nan")]))], 9)
            return [(p, b) for p, b in server.calls if "memory" in p], adapter.version
        finally:
            await adapter.shutdown()
            await runner.cleanup()

    memory, version = asyncio.run(scenario())
    assert memory == [
        ("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("/release_memory_occupation", {"tags": ["kv_cache"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
    ]
    assert version == 0  # a failed update does not stamp its version


def test_distributed_update_joins_group_announces_tensors_and_stamps_version():
    metas = [("a.weight", torch.bfloat16, [4, 4]), ("b.bias", torch.float32, [4])]

    async def scenario():
        server = RecordedServer()
        runner, url = await _serve(server)
        adapter = SGLangAdapter("/m", base_url=url, max_model_len=1024)
        await adapter.start()
        try:
            with pytest.raises(RuntimeError, match="before init_weight_update_group"):
                await adapter.update_weights_from_distributed(metas, 2)
            await adapter.init_weight_update_group("10.1.2.3", 29555, 1, 2, group_name="g")
            count = await adapter.update_weights_from_distributed(metas, 2)
            await adapter.destroy_weight_update_group()
            return server.calls, count, adapter.version
        finally:
            await adapter.shutdown()
            await runner.cleanup()

    calls, count, version = asyncio.run(scenario())
    assert [p for p, _ in calls] == ["/init_weights_update_group", "/abort_request",
                                     "/update_weights_from_distributed", "/flush_cache",
                                     "/destroy_weights_update_group"]
    assert calls[0][1] == {"master_address": "10.1.2.3", "master_port": 29555, "rank_offset": 1, "world_size": 2,
                           "group_name": "g", "backend": "nccl"}
    announced = calls[2][1]
    assert announced["names"] == ["a.weight", "b.bias"] and announced["dtypes"] == ["bfloat16", "float32"]
    assert announced["shapes"] == [[4, 4], [4]] and announced["group_name"] == "g"
    assert calls[4][1] == {"group_name": "g"} and count == 2 and version == 2


def test_unreachable_server_is_a_connection_error():
    async def scenario():
        adapter = SGLangAdapter("/m", base_url="http://127.0.0.1:9", start_timeout_s=0.5)
        try:
            with pytest.raises(TimeoutError):
                await adapter.start()
            with pytest.raises(ConnectionError, match="unreachable"):
                await adapter._post("/flush_cache")
        finally:
            await adapter.shutdown()

    asyncio.run(scenario())
