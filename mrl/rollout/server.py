"""`RolloutServer`: one replica's inference engine in its own process, as a Ray async actor.

The actor hosts a backend adapter (rollout_adapters/) and exposes the adapter protocol over Ray RPC; with one
event loop per actor, many concurrent `generate` calls share the engine. The same class serves every backend:
the adapter is chosen by name, so the vLLM server is `RolloutServer("vllm", ...)`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray

from mrl.config.passthrough import require_engine_kwargs
from mrl.rollout.bursts import serve_many
from mrl.utils.process_logs import own_log_tail
from mrl.weight_sync import report_failure
from rollout_adapters.base import RolloutAdapter, TokenOutput, adapter_class

# Set in the server process before the engine starts. KV cache in GiB on CPU: vLLM's default would take a
# large share of a small shared machine. Loopback keeps vLLM's sockets and NIXL's side channel off the network
# (ReplicaSpec.server_env sets both from rollout.server_host).
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def restore_niceness() -> None:
    """Reset every thread of this process to niceness 0 where permitted (root or CAP_SYS_NICE).

    Ray starts worker processes at niceness 15. On a shared CPU host that starves an inference engine and the
    RPC threads that carry its requests (measured: the same vLLM engine gave 0.45-0.8x the tokens/s inside a Ray
    actor). Linux niceness is per thread, and new threads and processes inherit it from their creator.
    """
    tasks = "/proc/self/task"
    tids = [int(t) for t in os.listdir(tasks)] if os.path.isdir(tasks) else [0]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 0)


class RolloutServer:
    def __init__(self, backend: str, model_path: str, adapter_kwargs: dict[str, Any] | None = None) -> None:
        restore_niceness()
        for key, value in SERVER_ENV.items():
            os.environ.setdefault(key, value)
        self.backend = backend
        self.model_path = model_path
        self.adapter_kwargs = dict(adapter_kwargs or {})
        self.adapter: RolloutAdapter | None = None

    async def start(self) -> float:
        """Create the engine; returns seconds taken (vLLM on 2 CPU cores: 30-75 s)."""
        start = time.monotonic()
        restore_niceness()  # this thread spawns the engine's processes, which inherit its niceness
        # Checked at start-up where the engine is installed; here it is (a GPU node's engine, say).
        require_engine_kwargs(self.backend, self.adapter_kwargs.get("engine_kwargs") or {})
        self.adapter = adapter_class(self.backend)(self.model_path, **self.adapter_kwargs)
        try:
            await self.adapter.start()
        except Exception as error:
            # The root cause is often only in the engine's own processes' output (vLLM: "Engine core
            # initialization failed. See root cause above"), which Ray keeps in this worker's log file.
            tail = own_log_tail()
            raise RuntimeError(f"the {self.backend} engine did not start: {error}\n{tail}") from error
        return time.monotonic() - start

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        out = await self.adapter.generate(request_id, prompt_ids, sampling_params)
        out.extra["server_pid"] = os.getpid()  # which replica served it: routing is observable end to end
        return out

    async def generate_many(self, calls: list[tuple[str, list[int], dict[str, Any]]]) -> AsyncIterator[list]:
        """Many `generate` calls in one RPC; call with `.options(num_returns="streaming")` (mrl/rollout/bursts.py)."""
        async for done in serve_many(self.generate, calls):
            yield done

    async def update_weights(self, bucket_refs: list[ray.ObjectRef], version: int) -> int:
        """Load weights from safetensors buckets in the object store, fetched one at a time (so the server holds
        one bucket, not the model), with the adapter's abort -> load -> reset-prefix-cache -> version sequence."""

        async def buckets():
            for ref in bucket_refs:
                yield await ref

        return await self.adapter.update_weights_from_buckets(buckets(), version)

    async def receive_weights(self, spec: dict[str, Any] | list, rank: int, version: int) -> int:
        """Load weights arriving through a weight-sync transport (mrl/weight_sync), as group ranks `rank`…, or
        (a list: per-device sync) as one (spec, group rank) per engine worker."""
        try:
            return await self.adapter.receive_weights(spec, rank, version)
        except Exception as error:
            # The senders stop at once instead of waiting out their deadline.
            for each, each_rank in spec if isinstance(spec, list) else [(spec, rank)]:
                report_failure(each, each_rank, error)
            raise

    async def load_lora_adapter(self, path: str, version: int) -> int:
        """Serve the PEFT adapter folder `path` on the base weights from now on, stamped `version`."""
        return await self.adapter.load_lora_adapter(path, version)

    async def abort_all(self) -> int:
        return await self.adapter.abort_all()

    async def resume_generation(self) -> None:
        await self.adapter.resume_generation()

    async def sleep(self, level: int = 2) -> None:
        await self.adapter.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> list[str]:
        return await self.adapter.wake_up(tags)

    async def release_kv_cache(self) -> None:
        await self.adapter.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self.adapter.resume_kv_cache()

    async def clear_kv_cache(self) -> None:
        await self.adapter.clear_kv_cache()

    async def health(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {**await self.adapter.health(), "pid": os.getpid(), "placement_group": context.get_placement_group_id()}

    async def read_weights(self) -> bytes:
        """The engine's parameters as safetensors bytes. Ray would pickle the tensors through torch's legacy
        storage format, which megatron.core's safe unpickler (weights_only) cannot read for float8 storages:
        an FP8 engine's read-back failed on the caller's side."""
        from safetensors.torch import save

        return save(await self.adapter.read_weights())

    async def load_stats(self) -> dict[str, Any]:
        """How the last transport sync loaded into the engine (rollout_adapters' load_stats)."""
        return await self.adapter.load_stats()

    async def events(self) -> list[str]:
        return list(self.adapter.events)

    async def shutdown(self) -> None:
        if self.adapter is not None:
            await self.adapter.shutdown()
            self.adapter = None
