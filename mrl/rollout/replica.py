"""`RolloutReplica`: one inference instance (one `vllm serve`-equivalent) = one RolloutServer actor on TP×DP×PP devices.

Replica modes (DESIGN.md glossary), which differ in where the server runs and who may put it to sleep:
- hybrid: on the trainer's own device slots (the trainer's resource pool, replica r on the slots of trainer ranks
  r·F … r·F+F−1, F = footprint); phases alternate, so the trainer sleeps and wakes it (sync / colocate_async).
- colocated: own process on the slots of a shared pool (e.g. a judge model beside the policy); never slept by the
  trainer.
- standalone: its own resource pool (own devices), created here; weights arrive over a cross-pool transport.
On a CPU machine a device slot is a CPU bundle (or a logical GPU), so every mode runs in CI.

Every control method returns a Ray ObjectRef: `ray.get` it from a driver, `await` it from a coroutine, or fan
out over replicas and wait once (LLMServerManager does).
"""

from __future__ import annotations

import contextlib
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from mrl.rollout.server import SERVER_ENV, RolloutServer
from mrl.utils.network import LOOPBACK, require_loopback
from rollout_adapters.base import adapter_class


class RolloutMode(enum.StrEnum):
    HYBRID = "hybrid"
    COLOCATED = "colocated"
    STANDALONE = "standalone"


@dataclass(frozen=True)
class Footprint:
    """Devices of one replica: tensor × data × pipeline parallel."""

    tp: int = 1
    dp: int = 1
    pp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.dp * self.pp

    def check(self, backend: str) -> None:
        """Reject layouts the backend cannot run, naming the setting."""
        for name, size in (("tensor", self.tp), ("data", self.dp), ("pipeline", self.pp)):
            if size < 1:
                raise ValueError(f"rollout.{name}_model_parallel_size must be >= 1, got {size}")
        cls = adapter_class(backend)
        if self.pp > 1 and not cls.supports_pipeline_parallel:
            raise ValueError(
                f"rollout.pipeline_model_parallel_size={self.pp}: the {backend!r} rollout backend does not support "
                "pipeline parallelism; set it to 1 (use tensor parallelism or more replicas instead)"
            )
        if (self.tp > 1 or self.dp > 1) and not cls.supports_tensor_parallel:
            raise ValueError(
                f"rollout tensor/data parallel size {self.tp}/{self.dp}: the {backend!r} backend runs one device per "
                "replica; set both to 1 and scale with more replicas"
            )


@dataclass
class ReplicaSpec:
    """What one engine needs: backend, weights, layout, context length and backend-specific extras."""

    backend: str
    model_path: str
    footprint: Footprint = field(default_factory=Footprint)
    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # No CUDA graphs / compilation (rollout.enforce_eager); None leaves the backend's device default.
    enforce_eager: bool | None = None
    # The engine settings of rollout.* (schema.py says what each means and mrl/config/engine_fields.py which
    # engine argument it fills); None leaves the engine's default.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Extra environment of the server process. Ray sets OMP_NUM_THREADS to the actor's CPU share (1 here), which
    # caps a CPU engine's compute threads; set it to the device slot's cores where the engine should use them.
    env: dict[str, str] = field(default_factory=dict)
    # Address the engine's own endpoints listen on (rollout.server_host); loopback unless allow_remote_access.
    host: str = LOOPBACK
    allow_remote_access: bool = False
    # Return each request's routed experts (TokenOutput.extra["routed_experts"]): router replay R3.
    return_routed_experts: bool = False
    # Serve LoRA adapters up to this rank (actor.lora.sync=adapter); None: the engine starts without LoRA.
    lora_rank: int | None = None
    # Weights the engine generates with (rollout.quantization): None, or "fp8" (vllm only).
    quantization: str | None = None
    # Its block scales (rollout.fp8_scale_format): "fp32" or "ue8m0".
    fp8_scale_format: str = "fp32"
    # Its block-FP8 GEMM (rollout.fp8_gemm): "deepgemm" or "cutlass".
    fp8_gemm: str = "deepgemm"

    def server_env(self) -> dict[str, str]:
        """Environment of the server process: the defaults, the engine's listening address, then `env`."""
        return {**SERVER_ENV, "VLLM_HOST_IP": self.host, "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host, **self.env}

    def adapter_kwargs(self) -> dict[str, Any]:
        engine_kwargs = dict(self.engine_kwargs)
        if self.footprint.devices > 1 and self.backend == "vllm":
            # Multi-device engines start their workers as Ray tasks inside the replica's placement group.
            engine_kwargs.setdefault("distributed_executor_backend", "ray")
        return {
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "seed": self.seed,
            "tensor_parallel_size": self.footprint.tp,
            "pipeline_parallel_size": self.footprint.pp,
            "data_parallel_size": self.footprint.dp,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enable_sleep_mode": self.enable_sleep_mode,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "engine_kwargs": engine_kwargs,
            "enforce_eager": self.enforce_eager,
            "host": self.host,
            "allow_remote_access": self.allow_remote_access,
            # Only when asked: backends without the capability refuse the setting by name.
            **({"return_routed_experts": True} if self.return_routed_experts else {}),
            **({"lora_rank": self.lora_rank} if self.lora_rank is not None else {}),
            **({"quantization": self.quantization, "fp8_scale_format": self.fp8_scale_format,
                "fp8_gemm": self.fp8_gemm} if self.quantization is not None else {}),
        }


def server_rank(server_id: str) -> int:
    """The replica rank inside a server id (`RolloutReplica.server_id`): which slots the replica sits on."""
    return int(server_id.split("-")[-2])


class RolloutReplica:
    def __init__(self, replica_rank: int, spec: ReplicaSpec, mode: RolloutMode | str) -> None:
        spec.footprint.check(spec.backend)
        require_loopback(spec.host, "rollout.server_host", spec.allow_remote_access)
        self.replica_rank = replica_rank
        self.spec = spec
        self.mode = RolloutMode(mode)
        self.server_id = f"{self.mode.value}-{replica_rank}-{uuid.uuid4().hex[:6]}"
        self.server: Any = None
        self._own_pool: Any = None

    # ---- placement ----------------------------------------------------------------------------------
    def init_hybrid(self, trainer_pool: Any) -> ray.ObjectRef:
        """Place the server on the trainer's slots (the pool the trainer's worker group was built on)."""
        self._require(RolloutMode.HYBRID)
        if getattr(trainer_pool, "max_colocate_count", 2) < 2:
            # The trainer's workers already hold whole slots: the server would wait for resources forever.
            raise ValueError(
                "a hybrid rollout shares the trainer's device slots: resources.max_colocate_count must be >= 2 "
                f"(got {trainer_pool.max_colocate_count})"
            )
        return self._launch(trainer_pool)

    def init_colocated(self, pool: Any) -> ray.ObjectRef:
        self._require(RolloutMode.COLOCATED)
        return self._launch(pool)

    def init_standalone(self, use_gpu: bool | None = None, cpus_per_slot: float = 1.0) -> ray.ObjectRef:
        """Create this replica's own resource pool (one node, `footprint.devices` slots) and start there."""
        from mrl.controller.resource_pool import RayResourcePool

        self._require(RolloutMode.STANDALONE)
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        self._own_pool = RayResourcePool(
            [self.spec.footprint.devices], use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, name_prefix=self.server_id
        )
        return self._launch(self._own_pool, first_slot=0)

    def _require(self, mode: RolloutMode) -> None:
        if self.mode is not mode:
            raise ValueError(f"replica {self.replica_rank} is {self.mode.value}, not {mode.value}")

    def _launch(self, pool: Any, first_slot: int | None = None) -> ray.ObjectRef:
        """Start the server on the first of this replica's slots; returns a ref to the engine start time (s)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        footprint = self.spec.footprint.devices
        slots: Sequence = pool.slots()
        first = self.replica_rank * footprint if first_slot is None else first_slot
        if first + footprint > len(slots):
            raise ValueError(
                f"rollout replica {self.replica_rank} needs slots {first}..{first + footprint - 1} but the pool has "
                f"{len(slots)}: replicas = device slots / (TP×DP×PP = {footprint})"
            )
        pg, bundle = slots[first]
        resources = pool.worker_resources()
        self.server = (
            ray.remote(RolloutServer)
            .options(
                name=f"mrl_rollout_{self.server_id}",
                num_cpus=resources["num_cpus"],
                num_gpus=resources["num_gpus"],
                max_concurrency=4096,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=True
                ),
                runtime_env={"env_vars": self.spec.server_env()},
            )
            .remote(self.spec.backend, self.spec.model_path, self.spec.adapter_kwargs())
        )
        return self.server.start.remote()

    # ---- control (each returns an ObjectRef) ---------------------------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> ray.ObjectRef:
        return self.server.generate.remote(request_id, prompt_ids, sampling_params)

    def update_weights(self, bucket_refs: list[ray.ObjectRef], version: int) -> ray.ObjectRef:
        return self.server.update_weights.remote(bucket_refs, version)

    def load_lora_adapter(self, path: str, version: int) -> ray.ObjectRef:
        return self.server.load_lora_adapter.remote(path, version)

    def abort_all(self) -> ray.ObjectRef:
        return self.server.abort_all.remote()

    def resume_generation(self) -> ray.ObjectRef:
        return self.server.resume_generation.remote()

    def sleep(self, level: int = 2) -> ray.ObjectRef:
        return self.server.sleep.remote(level)

    def wake_up(self, tags: list[str] | None = None) -> ray.ObjectRef:
        return self.server.wake_up.remote(tags)

    def release_kv_cache(self) -> ray.ObjectRef:
        return self.server.release_kv_cache.remote()

    def resume_kv_cache(self) -> ray.ObjectRef:
        return self.server.resume_kv_cache.remote()

    def clear_kv_cache(self) -> ray.ObjectRef:
        return self.server.clear_kv_cache.remote()

    def health(self) -> ray.ObjectRef:
        return self.server.health.remote()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the engine (and its child processes) before killing the actor, then free an own pool."""
        if self.server is not None:
            with contextlib.suppress(Exception):  # a dead or stuck server is killed below either way
                ray.get(self.server.shutdown.remote(), timeout=timeout_s)
            ray.kill(self.server)
            self.server = None
        if self._own_pool is not None:
            self._own_pool.remove()
            self._own_pool = None
