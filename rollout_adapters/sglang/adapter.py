"""The `sglang` backend: the adapter protocol on one SGLang HTTP server per replica (GPU only).

The adapter starts `python -m sglang.launch_server` as a child process of the replica's server actor and speaks
its HTTP API with aiohttp; every body and response goes through the pure functions of `protocol.py`, which the
unit tests cover. SGLang's kernels ship as CUDA builds, so nothing here has run against a live engine on the CPU
machines (docs/rollout_backends.md keeps the record). The server is also reachable by URL when it was started
elsewhere (`base_url=`), e.g. one member of a prefill/decode-disaggregated replica (mrl/rollout/pd.py).

Weight paths: `_load_weights` (the protocol's update) sends each bucket's tensors as serialized handles to
/update_weights_from_tensor (colocated: same host, CUDA IPC on GPU); `_receive_weights` (the trainer's
weight_sync transports) receives in this process, one receiver per TP rank, and posts the same endpoint per
bucket with each rank's own entry. `init_weight_update_group` + `update_weights_from_distributed` speak SGLang's
own group protocol for a caller that broadcasts per tensor (the trainer does not). The delta-sharded path (only
changed shards per rank) is not built.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import torch

from mrl.config.engine_fields import ADAPTER_ENGINE_KWARGS, refuse_shadowing
from mrl.utils.network import LOOPBACK, require_loopback, url_host
from rollout_adapters.base import RolloutAdapter, StopReason
from rollout_adapters.buckets import unpack_bucket
from rollout_adapters.sglang import protocol


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class SGLangAdapter(RolloutAdapter):
    backend = "sglang"
    supports_pipeline_parallel = False  # SGLang has PP, but weight updates from tensors assume one stage
    supports_tensor_parallel = True
    serves_prompt_logprobs = True  # input_token_logprobs, untempered at temperature 0 or 1 (protocol.generate_request)

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
        base_url: str | None = None,
        weights_cpu_backup: bool = False,
        start_timeout_s: float = 900.0,
        host: str = LOOPBACK,
        allow_remote_access: bool = False,
        enforce_eager: bool | None = None,
    ) -> None:
        if pipeline_parallel_size != 1:
            raise ValueError(f"rollout.pipeline_model_parallel_size={pipeline_parallel_size}: the sglang adapter "
                             "runs PP=1 (its tensor weight update addresses TP ranks only)")
        super().__init__(max_model_len)
        self.model_path = model_path
        self.tp_size = tensor_parallel_size
        self.weights_cpu_backup = weights_cpu_backup
        extra = dict(engine_kwargs or {})
        refuse_shadowing(self.backend, extra)
        self.extra_args: list[str] = list(extra.pop("extra_args", ()))
        require_loopback(host, "rollout.server_host", allow_remote_access)
        if base_url is not None:
            require_loopback(url_host(base_url), "the sglang server's base_url host", allow_remote_access)
        self.host = host
        self.launch = dict(
            tp_size=tensor_parallel_size,
            dp_size=data_parallel_size,
            dtype=dtype,
            context_length=max_model_len,
            seed=seed,
            mem_fraction_static=gpu_memory_utilization,
            weights_cpu_backup=weights_cpu_backup,
            disable_cuda_graph=bool(enforce_eager),
            disable_radix_cache=not enable_prefix_caching,
            # The memory saver is what sleep/wake release; a replica that never sleeps can go without it.
            enable_memory_saver=enable_sleep_mode is not False,
            max_running_requests=max_num_seqs,
            chunked_prefill_size=max_num_batched_tokens,
        )
        if extra:
            raise ValueError(f"unknown sglang engine_kwargs {sorted(extra)} (known: {ADAPTER_ENGINE_KWARGS['sglang']}):"
                             " pass other server flags as engine_kwargs.extra_args")
        self.base_url = base_url
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.session: Any = None
        self._group_name: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        if self.base_url is None:
            port = free_port()
            argv = protocol.server_command(self.model_path, port=port, host=self.host, **self.launch,
                                           extra_args=self.extra_args)
            env = {**os.environ, **protocol.SERVER_ENV}
            self.process = subprocess.Popen([sys.executable, *argv], env=env)
            # The server shares this process's host: talk to it over loopback whatever address it listens on.
            self.base_url = f"http://{LOOPBACK}:{port}"
        await self._wait_healthy()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"sglang server exited with code {self.process.returncode} while starting")
            with contextlib.suppress(OSError):
                async with self.session.get(f"{self.base_url}/health") as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang server at {self.base_url} not healthy after {self.start_timeout_s} s")
            await asyncio.sleep(1.0)

    async def shutdown(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self.process = None

    # ---- HTTP ---------------------------------------------------------------------------------------
    async def _post(self, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        try:
            async with self.session.post(f"{self.base_url}{endpoint}", json=body or {}) as response:
                payload = await _json_or_text(response)
                return protocol.check_control_response(endpoint, response.status, payload)
        except OSError as exc:  # aiohttp's connection errors derive from OSError
            raise ConnectionError(f"sglang server at {self.base_url} unreachable on {endpoint}: {exc}") from exc

    # ---- generation ---------------------------------------------------------------------------------
    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], budget: int
    ) -> tuple[list[int], list[float], StopReason] | tuple[list[int], list[float], StopReason, dict[str, Any]]:
        body = protocol.generate_request(request_id, prompt_ids, params, budget, **self._routing_fields())
        response = await self._post("/generate", body)
        ids, lps, reason = protocol.parse_generate_response(response, params["logprobs"], budget)
        if not params["prompt_logprobs"]:
            return ids, lps, reason
        return ids, lps, reason, {"prompt_log_probs": protocol.parse_prompt_log_probs(response, prompt_ids)}

    def _routing_fields(self) -> dict[str, Any]:
        """Extra /generate fields of this request (a disaggregated member's bootstrap, mrl/rollout/pd_members.py)."""
        return {}

    async def _abort_running(self) -> None:
        await self._post("/abort_request", protocol.abort_all_payload())

    # ---- weights ------------------------------------------------------------------------------------
    async def _load_weights(self, buckets: AsyncIterator[bytes]) -> int:
        """Colocated path: each bucket's tensors go to the server as serialized handles (torch shared memory /
        CUDA IPC), loaded by every TP rank; the tensors stay alive here until the call returns."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        count = 0
        async for blob in buckets:
            named = unpack_bucket(blob)
            if device is not None:
                named = [(name, tensor.to(device)) for name, tensor in named]
            await self._post("/update_weights_from_tensor", protocol.tensor_update_payload(named, self.tp_size))
            count += len(named)
        return count

    async def _receive_weights(self, spec: dict[str, Any] | list, rank: int) -> int:
        """Transport path (ipc, nccl, disk): this process is the group member of every TP rank (one receiver each,
        rollout_adapters/forwarding.py) and posts each bucket to /update_weights_from_tensor with rank j's own
        tensors in entry j. SGLang's /update_weights_from_distributed cannot take mrl's nccl stream (it joins a
        group of its own rendezvous and receives per-tensor broadcasts), so nccl arrives here too."""
        from rollout_adapters.forwarding import owned_copy, receive_and_forward, worker_pairs

        loop = asyncio.get_running_loop()
        patch_cuda_reductions()

        def forward(per_rank: list[list[tuple[str, torch.Tensor]]]) -> None:
            body = protocol.per_rank_tensor_update_payload(per_rank)
            asyncio.run_coroutine_threadsafe(self._post("/update_weights_from_tensor", body), loop).result()

        pairs = worker_pairs(spec, rank, self.tp_size)
        return await asyncio.to_thread(receive_and_forward, pairs, forward, owned_copy)

    async def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "mrl_weight_update", backend: str = "nccl",
    ) -> None:
        """Standalone path, step 1: join the trainer's temporary group (the trainer calls init_process_group with
        rank 0 concurrently)."""
        body = protocol.init_group_payload(master_address, master_port, rank_offset, world_size, group_name, backend)
        await self._post("/init_weights_update_group", body)
        self._group_name = group_name

    async def update_weights_from_distributed(
        self, metas: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: int
    ) -> int:
        """Standalone path, step 2: announce the tensors the trainer broadcasts next (rank 0 of the group), with the
        protocol's abort -> load -> flush -> version sequence around it."""
        if self._group_name is None:
            raise RuntimeError("update_weights_from_distributed before init_weight_update_group")
        self.sleep_state.require_awake("weights", "update weights")
        self.events.append(f"update_weights_from_distributed:{version}")
        try:
            await self._close_admission()
            await self._post("/update_weights_from_distributed",
                             protocol.distributed_update_payload(metas, self._group_name))
            await self.clear_kv_cache()
            self.version = int(version)
        finally:
            await self._maybe_reopen()
        return len(metas)

    async def destroy_weight_update_group(self) -> None:
        if self._group_name is not None:
            await self._post("/destroy_weights_update_group", {"group_name": self._group_name})
            self._group_name = None

    # ---- memory -------------------------------------------------------------------------------------
    async def _sleep(self, level: int) -> None:
        if level == 1 and not self.weights_cpu_backup:
            raise NotImplementedError("sglang sleep level 1 (offload weights and keep them) needs the server started "
                                      "with weights_cpu_backup=True (--enable-weights-cpu-backup)")
        await self._post("/release_memory_occupation", protocol.memory_payload(protocol.MEMORY_TAGS))

    async def _wake_up(self, tags: list[str]) -> None:
        await self._post("/resume_memory_occupation", protocol.memory_payload(tags))

    async def _release_kv_cache(self) -> None:
        await self._post("/release_memory_occupation", protocol.memory_payload(["kv_cache"]))

    async def _clear_prefix_cache(self) -> None:
        await self._post("/flush_cache")

    async def _check_health(self) -> None:
        async with self.session.get(f"{self.base_url}/health") as response:
            if response.status != 200:
                raise ConnectionError(f"sglang server at {self.base_url} unhealthy ({response.status})")

    async def engine_weight_version(self) -> str:
        """The version string the server itself holds (GET /get_weight_version); ours is `self.version`."""
        async with self.session.get(f"{self.base_url}/get_weight_version") as response:
            return str((await _json_or_text(response)).get("weight_version"))


async def _json_or_text(response: Any) -> Any:
    with contextlib.suppress(Exception):
        return await response.json(content_type=None)
    return await response.text()


def patch_cuda_reductions() -> None:
    """Where SGLang is installed and CUDA present, pickle CUDA tensors the way its TP workers rebuild them (device by
    UUID, not by this process's index: sglang srt/utils/patch_torch.py). Its patch handles CUDA tensors only."""
    if not torch.cuda.is_available():
        return
    with contextlib.suppress(ImportError):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()


def named_metas(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of a stream, for `update_weights_from_distributed` before the broadcasts."""
    return [(name, tensor.dtype, list(tensor.shape)) for name, tensor in named_tensors]
