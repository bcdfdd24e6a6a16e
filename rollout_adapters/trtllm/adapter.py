"""The `trtllm` backend: the adapter protocol on TensorRT-LLM's AsyncLLM (PyTorch backend, Ray orchestrator; GPU only).

TensorRT-LLM's RL surface is AsyncLLM: `release(tags)` / `resume(tags)` for tagged memory (`enable_sleep=True`),
`update_weights({device_uuid: handles})` through the RLHF worker extension (CUDA IPC handles only), and
`collective_rpc`. Every translation goes through `protocol.py` (unit-tested); nothing here has run against a live
engine on the CPU machines. What its API cannot do raises NotImplementedError naming the feature:
- joining a caller's NCCL group: no receive-from-group entry point exists (weight_sync.transport=nccl is
  received by this process, one receiver per worker, and forwarded over CUDA IPC: `_receive_weights`);
- weight updates from CPU tensors / safetensors bytes: the worker rebuilds CUDA IPC handles only;
- sleep level 1 (offload weights and restore them): released weights come back with undefined content, so a full
  update must follow (that is level 2);
- prefill/decode disaggregation inside an mrl replica (TensorRT-LLM's disaggregated serving is its own server).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import torch

from mrl.config.engine_fields import refuse_shadowing
from rollout_adapters.base import RolloutAdapter, StopReason
from rollout_adapters.buckets import unpack_bucket
from rollout_adapters.trtllm import protocol

CPU_TENSORS = "tensorrt-llm weight update from CPU tensors: its worker rebuilds CUDA IPC handles only"


class TRTLLMAdapter(RolloutAdapter):
    backend = "trtllm"
    supports_pipeline_parallel = True
    supports_tensor_parallel = True

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int = 2048,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        enforce_eager: bool | None = None,
        host: str = "127.0.0.1",
        allow_remote_access: bool = False,
    ) -> None:
        if data_parallel_size != 1:
            raise ValueError(f"rollout.data_parallel_size={data_parallel_size}: the trtllm adapter runs one engine "
                             "per replica (scale with more replicas)")
        super().__init__(max_model_len)
        extra = dict(engine_kwargs or {})
        refuse_shadowing(self.backend, extra)
        kv_cache = {"enable_block_reuse": enable_prefix_caching}
        if gpu_memory_utilization is not None:
            kv_cache["free_gpu_memory_fraction"] = gpu_memory_utilization
        settings = {k: v for k, v in {"max_batch_size": max_num_seqs, "max_num_tokens": max_num_batched_tokens}.items()
                    if v is not None}
        if enforce_eager:
            settings["cuda_graph_config"] = None  # TorchLlmArgs: None turns decode CUDA graphs off
        self.llm_kwargs = dict(
            model=model_path,
            backend="pytorch",
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            max_seq_len=max_model_len,
            kv_cache_config=kv_cache,
            # sleep/wake release tagged memory only when the engine was built for it
            enable_sleep=enable_sleep_mode is not False,
            **settings,
            **extra,
        )
        self.seed = seed
        self.workers = tensor_parallel_size * pipeline_parallel_size  # weight-sync receivers the trainer allots
        self.llm: Any = None
        self._outputs: dict[str, Any] = {}  # request id -> RequestOutput, for aborts

    async def start(self) -> None:
        from tensorrt_llm import AsyncLLM

        self.llm = await AsyncLLM(**self.llm_kwargs)

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], budget: int
    ) -> tuple[list[int], list[float], StopReason]:
        from tensorrt_llm import SamplingParams

        sampling = SamplingParams(**protocol.sampling_kwargs(params, budget))
        try:
            output = self.llm.generate_async(protocol.token_prompt(prompt_ids), sampling_params=sampling)
            self._outputs[request_id] = output
            result = await output.aresult()
        except (asyncio.CancelledError, NotImplementedError):
            raise
        except Exception as exc:
            raise protocol.map_error(exc) from exc
        finally:
            self._outputs.pop(request_id, None)
        sample = result.outputs[0]
        return protocol.parse_completion(sample.token_ids, sample.logprobs, sample.finish_reason,
                                         params["logprobs"], budget)

    async def _abort_running(self) -> None:
        for output in list(self._outputs.values()):
            output.abort()

    async def _load_weights(self, buckets: AsyncIterator[bytes]) -> int:
        """Colocated path: each bucket is moved to this process's GPU and shared as CUDA IPC handles with the
        worker on the same device; a final call with None finalises the load and resets the prefix cache."""
        if not torch.cuda.is_available():
            raise NotImplementedError(CPU_TENSORS)
        from tensorrt_llm._torch.utils import get_device_uuid

        device = torch.cuda.current_device()
        uuid = get_device_uuid(device)
        count = 0
        async for blob in buckets:
            named = [(name, tensor.to(device)) for name, tensor in unpack_bucket(blob)]
            await self.llm.update_weights(protocol.ipc_update_payload(named, uuid))
            torch.cuda.synchronize()
            count += len(named)
        await self.llm.update_weights(None)
        return count

    async def _receive_weights(self, spec: dict[str, Any] | list, rank: int) -> int:
        """Transport path (ipc, nccl, disk): this process is the group member of every engine worker (one receiver
        each, rollout_adapters/forwarding.py); each bucket is copied onto worker j's GPU and all workers' handles go
        in one update_weights call, then the finalising call. TensorRT-LLM has no receive-from-group entry point, so
        nccl arrives here too. Worker j is assumed on this process's visible GPU j unless the spec names the GPU."""
        from rollout_adapters.forwarding import owned_copy, receive_and_forward, worker_device, worker_pairs

        if not torch.cuda.is_available():
            raise NotImplementedError(CPU_TENSORS)
        from tensorrt_llm._torch.utils import get_device_uuid

        loop = asyncio.get_running_loop()
        pairs = worker_pairs(spec, rank, self.workers)
        uuids = [get_device_uuid(worker_device(s, w)) for w, (s, _) in enumerate(pairs)]

        async def update(payload: dict[str, str]) -> None:
            await self.llm.update_weights(payload)

        def forward(per_rank: list[list[tuple[str, torch.Tensor]]]) -> None:
            payload = protocol.per_device_ipc_payload(per_rank, uuids)
            asyncio.run_coroutine_threadsafe(update(payload), loop).result()

        count = await asyncio.to_thread(receive_and_forward, pairs, forward, owned_copy)
        await self.llm.update_weights(None)
        return count

    async def init_weight_update_group(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("tensorrt-llm joining a caller's NCCL group: its LLM API has no such entry point; "
                                  "weight_sync.transport=nccl is received by the adapter and forwarded over IPC")

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> int:
        raise NotImplementedError("tensorrt-llm joining a caller's NCCL group: its LLM API has no such entry point; "
                                  "weight_sync.transport=nccl is received by the adapter and forwarded over IPC")

    async def _sleep(self, level: int) -> None:
        if level == 1:
            raise NotImplementedError("tensorrt-llm sleep level 1 (offload weights and restore them): released "
                                      "weights return with undefined content; use level 2 and update weights")
        await self.llm.release(protocol.memory_tags(["weights", "kv_cache"]))

    async def _wake_up(self, tags: list[str]) -> None:
        await self.llm.resume(protocol.memory_tags(tags))

    async def _release_kv_cache(self) -> None:
        await self.llm.release(protocol.memory_tags(["kv_cache"]))

    async def _clear_prefix_cache(self) -> None:
        await self.llm.collective_rpc("reset_prefix_cache")
