"""The members of a PD replica: adapters that carry the KV-transfer handshake, their server actor, and the replica
that places them (one prefill + N decode servers) with a PDRouter actor in front (mrl/rollout/pd.py).

The adapter protocol has no per-request transfer parameters, so each member adapter subclasses its backend's
adapter and reads them from `pd.TRANSFER` inside `_generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import replace
from typing import Any

import ray

from mrl.rollout.pd import (
    TRANSFER,
    ActorMember,
    PDRouter,
    PDSpec,
    generate_with_transfer,
    sglang_member_args,
    vllm_kv_transfer_config,
    vllm_member_env,
)
from mrl.rollout.replica import Footprint, ReplicaSpec
from mrl.rollout.server import RolloutServer, restore_niceness
from mrl.utils.network import require_loopback
from rollout_adapters.base import StopReason
from rollout_adapters.sglang.adapter import SGLangAdapter
from rollout_adapters.vllm.adapter import VLLMAdapter, sample_result, to_vllm_sampling


class VLLMPDAdapter(VLLMAdapter):
    """VLLMAdapter whose requests carry `kv_transfer_params` (vLLM's SamplingParams.extra_args) and report the ones
    the engine returns (RequestOutput.kv_transfer_params)."""

    serves_prompt_logprobs = False  # a decode member never sees the prompt's logits

    async def _generate(
        self, request_id: str, prompt_ids: list[int], params: dict[str, Any], budget: int
    ) -> tuple[list[int], list[float], StopReason]:
        transfer = TRANSFER.get()
        if transfer is None:
            return await super()._generate(request_id, prompt_ids, params, budget)
        sampling = to_vllm_sampling(params, budget)
        sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": transfer["send"]}
        out = await self._run(request_id, prompt_ids, sampling)
        transfer["received"] = out.kv_transfer_params
        return sample_result(out)


class SGLangPDAdapter(SGLangAdapter):
    """SGLangAdapter whose /generate bodies carry the disaggregation bootstrap fields."""

    serves_prompt_logprobs = False  # the prefill member holds the prompt's logits, and the router does not merge them

    def _routing_fields(self) -> dict[str, Any]:
        transfer = TRANSFER.get()
        return transfer["send"] if transfer is not None else {}


PD_ADAPTERS = {"vllm": VLLMPDAdapter, "sglang": SGLangPDAdapter}


class PDMemberServer(RolloutServer):
    """A RolloutServer hosting a PD member adapter, with `generate_transfer` for the router."""

    async def start(self) -> float:
        import time

        start = time.monotonic()
        restore_niceness()  # as RolloutServer.start: the engine's processes inherit this thread's niceness
        self.adapter = PD_ADAPTERS[self.backend](self.model_path, **self.adapter_kwargs)
        await self.adapter.start()
        return time.monotonic() - start

    async def generate_transfer(self, request_id: str, prompt_ids: list[int], sampling: dict[str, Any],
                                send: dict[str, Any] | None) -> tuple[Any, Any]:
        if send is None:
            return await self.adapter.generate(request_id, prompt_ids, sampling), None
        return await generate_with_transfer(self.adapter, request_id, prompt_ids, sampling, send)


def member_spec(spec: ReplicaSpec, pd: PDSpec, role: str, index: int, base_port: int, on_gpu: bool) -> ReplicaSpec:
    """The ReplicaSpec of one member: its TP, and the backend's disaggregation settings for its role."""
    tp = pd.prefill_tp if role == "prefill" else pd.decode_tp
    engine_kwargs = dict(spec.engine_kwargs)
    env = dict(spec.env)
    if spec.backend == "vllm":
        engine_kwargs["kv_transfer_config"] = vllm_kv_transfer_config(pd, role, "cuda" if on_gpu else "cpu")
        env.update(vllm_member_env(pd, index, base_port))
    else:
        engine_kwargs["extra_args"] = [*engine_kwargs.get("extra_args", ()), *sglang_member_args(pd, role, base_port)]
    # Everything else (address, eager mode, precision, seed) is the replica's own.
    return replace(spec, footprint=Footprint(tp=tp), engine_kwargs=engine_kwargs, env=env)


class PDReplica:
    """One PD replica on `pd.devices` consecutive slots of a pool: member server actors on their slots and a
    PDRouter actor (no device) that the load balancer sees as the replica's server. Control methods return Ray
    ObjectRefs like RolloutReplica's."""

    def __init__(self, replica_rank: int, spec: ReplicaSpec, pd: PDSpec, base_port: int = 5600) -> None:
        pd.check(spec.backend)
        require_loopback(spec.host, "rollout.server_host", spec.allow_remote_access)
        if spec.backend == "vllm" and pd.transfer_backend == "mooncake" and not spec.allow_remote_access:
            # vLLM 0.32 hard-codes 0.0.0.0 for the Mooncake connector's bootstrap server (mooncake_connector.py).
            raise ValueError("rollout.pd.transfer_backend='mooncake' with vLLM listens on every interface (its "
                             "bootstrap server binds 0.0.0.0): use 'nixl', or set rollout.allow_remote_access=true "
                             "on a trusted network")
        self.replica_rank = replica_rank
        self.spec = spec
        self.pd = pd
        self.base_port = base_port
        self.server_id = f"pd-{replica_rank}-{uuid.uuid4().hex[:6]}"
        self.members: dict[str, Any] = {}
        self.server: Any = None  # the router actor
        self._own_pool: Any = None

    # RolloutReplica's placement entry points, so a manager can hold either kind of replica.
    def init_hybrid(self, trainer_pool: Any) -> ray.ObjectRef:
        return self.launch(trainer_pool)

    def init_colocated(self, pool: Any) -> ray.ObjectRef:
        return self.launch(pool)

    def init_standalone(self, use_gpu: bool | None = None, cpus_per_slot: float = 1.0) -> ray.ObjectRef:
        from mrl.controller.resource_pool import RayResourcePool

        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        self._own_pool = RayResourcePool([self.pd.devices], use_gpu=use_gpu, cpus_per_slot=cpus_per_slot,
                                         name_prefix=self.server_id)
        return self.launch(self._own_pool, first_slot=0)

    def launch(self, pool: Any, first_slot: int | None = None) -> ray.ObjectRef:
        """Start every member on its slots, then the router; returns a ref that resolves once all have started."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slots = pool.slots()
        first = self.replica_rank * self.pd.devices if first_slot is None else first_slot
        if first + self.pd.devices > len(slots):
            raise ValueError(f"PD replica {self.replica_rank} needs slots {first}..{first + self.pd.devices - 1} but "
                             f"the pool has {len(slots)}: replicas = slots / (TP_prefill + TP_decode × N_decode = "
                             f"{self.pd.devices})")
        resources = pool.worker_resources()
        on_gpu = resources["num_gpus"] > 0
        starts = []
        for index, (role, offset, _) in enumerate(self.pd.member_slots()):
            mspec = member_spec(self.spec, self.pd, role, index, self.base_port, on_gpu)
            pg, bundle = slots[first + offset]
            actor = ray.remote(PDMemberServer).options(
                num_cpus=resources["num_cpus"], num_gpus=resources["num_gpus"], max_concurrency=4096,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=True),
                runtime_env={"env_vars": mspec.server_env()},
            ).remote(mspec.backend, mspec.model_path, mspec.adapter_kwargs())
            self.members[role] = actor
            starts.append(actor.start.remote())
        bootstrap = ("127.0.0.1", self.base_port) if self.spec.backend == "sglang" else None
        self.server = ray.remote(_PDRouterActor).options(num_cpus=0, max_concurrency=4096).remote(
            self.spec.backend, self.members["prefill"], [a for r, a in self.members.items() if r != "prefill"],
            bootstrap, [devices for *_, devices in self.pd.member_slots()])
        return self.server.wait_started.remote(starts)

    # ---- control (each returns an ObjectRef) ---------------------------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> ray.ObjectRef:
        return self.server.generate.remote(request_id, prompt_ids, sampling_params)

    def update_weights(self, bucket_refs: list[ray.ObjectRef], version: int) -> ray.ObjectRef:
        return self.server.update_weights.remote(bucket_refs, version)

    def __getattr__(self, name: str) -> Any:
        if name in ("abort_all", "resume_generation", "sleep", "wake_up", "release_kv_cache", "resume_kv_cache",
                    "clear_kv_cache", "health"):
            return getattr(self.server, name).remote
        raise AttributeError(name)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        for actor in self.members.values():
            with contextlib.suppress(Exception):  # a dead or stuck member is killed below either way
                ray.get(actor.shutdown.remote(), timeout=timeout_s)
            ray.kill(actor)
        self.members.clear()
        if self.server is not None:
            ray.kill(self.server)
            self.server = None
        if self._own_pool is not None:
            self._own_pool.remove()
            self._own_pool = None


class _PDRouterActor(PDRouter):
    """PDRouter over member server actors (the router's process only routes; it holds no engine)."""

    def __init__(self, backend: str, prefill: Any, decodes: list[Any], bootstrap: tuple[str, int] | None,
                 member_devices: list[int] | None = None) -> None:
        restore_niceness()  # every request passes through the router: it must not run deprioritised
        super().__init__(backend, ActorMember(prefill), [ActorMember(d) for d in decodes], bootstrap, member_devices)

    async def wait_started(self, starts: list[ray.ObjectRef]) -> list[float]:
        return list(await asyncio.gather(*starts))
