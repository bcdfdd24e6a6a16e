"""`LLMServerManager`: creates the replicas of one rollout pool, owns the global load balancer, hands out clients,
and fans control calls (sleep, wake, abort, resume, weight updates) out to every replica.

Replica count = device slots / footprint (TP×DP×PP); a remainder is a configuration error, not idle devices.
Replicas can be added and removed at run time (e.g. trainer devices lent to rollout between steps); removing one
unregisters it from the balancer first, so its sessions re-route on their next turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray
import torch

from mrl.rollout.client import FullyAsyncLLMServerClient, LLMServerClient
from mrl.rollout.load_balancer import LoadBalancer
from mrl.rollout.replica import ReplicaSpec, RolloutMode, RolloutReplica
from mrl.rollout.server import restore_niceness
from rollout_adapters.buckets import DEFAULT_BUCKET_BYTES, pack_buckets


def replica_count(num_devices: int, footprint_devices: int) -> int:
    if num_devices < footprint_devices or num_devices % footprint_devices:
        raise ValueError(
            f"rollout devices ({num_devices}) must be a positive multiple of the replica footprint "
            f"TP×DP×PP = {footprint_devices}"
        )
    return num_devices // footprint_devices


class _BalancerActor(LoadBalancer):
    """The balancer as a Ray actor: every request passes through it twice, so it must not run deprioritised."""

    def __init__(self) -> None:
        restore_niceness()
        super().__init__()


class LLMServerManager:
    def __init__(self, spec: ReplicaSpec, mode: RolloutMode | str, start_timeout_s: float = 900.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.mode = RolloutMode(mode)
        self.replicas: dict[int, RolloutReplica] = {}
        self.balancer = ray.remote(_BalancerActor).options(num_cpus=0).remote()
        self._next_rank = 0

    @classmethod
    def create(
        cls,
        spec: ReplicaSpec,
        mode: RolloutMode | str,
        *,
        num_devices: int | None = None,
        pool: Any = None,
        start_timeout_s: float = 900.0,
    ) -> LLMServerManager:
        """Start every replica in parallel and register them with the balancer.

        hybrid / colocated: `pool` is the RayResourcePool to place on (the trainer's for hybrid) and the replica
        count follows from its size. standalone: `num_devices` slots, each replica in its own new pool.
        """
        manager = cls(spec, mode, start_timeout_s)
        if manager.mode is RolloutMode.STANDALONE:
            if num_devices is None:
                raise ValueError("a standalone rollout pool needs num_devices (rollout.nnodes × n_gpus_per_node)")
        elif pool is None:
            raise ValueError(f"a {manager.mode.value} rollout needs the resource pool to place its replicas on")
        else:
            num_devices = pool.world_size if num_devices is None else num_devices
        count = replica_count(num_devices, spec.footprint.devices)
        manager.add_replicas(count, pool=pool)
        return manager

    def add_replicas(self, count: int, pool: Any = None) -> list[int]:
        """Start `count` more replicas (in parallel) and put them behind the balancer; returns their ranks."""
        new = [RolloutReplica(self._next_rank + i, self.spec, self.mode) for i in range(count)]
        self._next_rank += count
        starts = []
        for replica in new:
            if self.mode is RolloutMode.STANDALONE:
                starts.append(replica.init_standalone())
            elif self.mode is RolloutMode.HYBRID:
                starts.append(replica.init_hybrid(pool))
            else:
                starts.append(replica.init_colocated(pool))
        try:
            ray.get(starts, timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            for replica in new:
                replica.shutdown(timeout_s=5)
            raise TimeoutError(
                f"{count} rollout replica(s) did not start within {self.start_timeout_s:g} s: either the engine is "
                f"slow to load or its slot's resources ({self.mode.value} mode) are taken; cluster free: "
                f"{ray.available_resources()}"
            ) from error
        except Exception:
            for replica in new:
                replica.shutdown()
            raise
        for replica in new:
            ray.get(self.balancer.add_server.remote(replica.server_id, replica.server))
            self.replicas[replica.replica_rank] = replica
        return [r.replica_rank for r in new]

    def remove_replica(self, rank: int) -> list[str]:
        """Unregister (so no new call reaches it), then stop it; returns the sessions that will re-route."""
        replica = self.replicas.pop(rank)
        orphans = ray.get(self.balancer.remove_server.remote(replica.server_id))
        replica.shutdown()
        return orphans

    def client(self, fully_async: bool = False) -> LLMServerClient:
        return (FullyAsyncLLMServerClient if fully_async else LLMServerClient)(self.balancer)

    # ---- fan-out control ------------------------------------------------------------------------------
    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(r, method)(*args) for r in self.replicas.values()])

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> list[int]:
        """Pack the HF-named stream into buckets once, put them in the object store, and let every replica pull
        them (the generic `disk`-like path; same-device `ipc` and cross-pool `nccl` transports live in weight_sync)."""
        refs = [ray.put(blob) for blob in pack_buckets(named_tensors, bucket_bytes)]
        return self._all("update_weights", refs, version)

    def abort_all(self) -> list[int]:
        return self._all("abort_all")

    def resume_generation(self) -> None:
        self._all("resume_generation")

    def sleep(self, level: int = 2) -> None:
        self._all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._all("wake_up", tags)

    def release_kv_cache(self) -> None:
        self._all("release_kv_cache")

    def resume_kv_cache(self) -> None:
        self._all("resume_kv_cache")

    def clear_kv_cache(self) -> None:
        self._all("clear_kv_cache")

    def health(self) -> dict[str, dict[str, Any]]:
        return dict(zip((r.server_id for r in self.replicas.values()), self._all("health")))

    def shutdown(self) -> None:
        for rank in list(self.replicas):
            self.remove_replica(rank)
        ray.kill(self.balancer)
