"""`LLMServerManager`: creates the replicas of one rollout pool, owns the global load balancer, hands out clients,
and fans control calls (sleep, wake, abort, resume, weight updates) out to every replica.

Replica count = device slots / footprint (TP×DP×PP); a remainder is a configuration error, not idle devices.
Replicas can be added and removed at run time (e.g. trainer devices lent to rollout between steps); removing one
unregisters it from the balancer first, so its sessions re-route on their next turn.

Failures: a health monitor (a driver thread, every `health_check_interval_s`) probes every replica. One that is
dead, reports its engine dead or does not answer within `health_check_timeout_s` is unregistered, killed and
replaced on the same slots (at most `max_replica_restarts` times per rank); the replacement is re-synced to the
newest recorded weights and put in the pool's sleep/pause state before it is registered again. Clients retry the
calls the failed replica dropped (client.py). Control fan-outs reach the registered replicas only and skip one that
dies on the way (the monitor replaces it); a replica that does not answer within `control_timeout_s` is an error
naming the call, the replica and the knob.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from mrl.config.placement import replica_count  # the start-up rules and mrl plan place replicas the same way
from mrl.rollout.client import (
    FaultPolicy,
    FullyAsyncLLMServerClient,
    LLMServerClient,
    replica_failed,
    wait_within,
)
from mrl.rollout.load_balancer import LoadBalancer
from mrl.rollout.pd import PDSpec
from mrl.rollout.replica import ReplicaSpec, RolloutMode, RolloutReplica
from mrl.rollout.server import restore_niceness
from mrl.weight_sync import WeightSender, make_sender
from mrl.weight_sync.base import TIMEOUT_KNOB
from rollout_adapters.base import WAKE_ORDER
from rollout_adapters.buckets import DEFAULT_BUCKET_BYTES, pack_buckets

log = logging.getLogger(__name__)


class _BalancerActor(LoadBalancer):
    """The balancer as a Ray actor: every burst of calls is reported to it, so it must not run deprioritised."""

    def __init__(self) -> None:
        restore_niceness()
        super().__init__()


class LLMServerManager:
    def __init__(
        self, spec: ReplicaSpec, mode: RolloutMode | str, start_timeout_s: float = 900.0,
        policy: FaultPolicy | None = None, pd: PDSpec | None = None, pd_base_port: int = 5600,
    ) -> None:
        self.spec = spec
        self.pd, self.pd_base_port = pd, pd_base_port  # prefill/decode replicas (mrl/rollout/pd_members.py)
        self.start_timeout_s = start_timeout_s
        self.mode = RolloutMode(mode)
        self.policy = policy or FaultPolicy()
        self.replicas: dict[int, RolloutReplica] = {}
        self.balancer = ray.remote(_BalancerActor).options(num_cpus=0).remote()
        self._next_rank = 0
        self._pools: dict[int, Any] = {}  # where each rank was placed (hybrid/colocated), for its replacement
        self.restarts: dict[int, int] = {}
        self.failures: list[str] = []  # one line per replica failure seen by the monitor, for logs and tests
        # The pool state a replacement must copy before it serves: sleep level and tags still asleep, paused.
        self._asleep: tuple[int, frozenset[str]] = (0, frozenset())
        self._paused = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        # The last transport sync's sender when it kept its group (weight_sync.keep_group), with what it serves.
        self._kept_sender: tuple[tuple, WeightSender] | None = None
        self._starting: tuple[list[RolloutReplica], list[ray.ObjectRef], Any] | None = None  # create(wait=False)

    def __getstate__(self) -> dict[str, Any]:
        # Workers receive a copy (set_rollout) to push weights; the monitor and its lock stay on the driver, and a
        # kept sync group stays with the process that built it.
        state = dict(self.__dict__)
        state.update(_lock=None, _stop=None, _monitor=None, _kept_sender=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._stop = threading.RLock(), threading.Event()

    @classmethod
    def create(
        cls,
        spec: ReplicaSpec,
        mode: RolloutMode | str,
        *,
        num_devices: int | None = None,
        pool: Any = None,
        start_timeout_s: float = 900.0,
        policy: FaultPolicy | None = None,
        pd: PDSpec | None = None,
        pd_base_port: int = 5600,
        wait: bool = True,
    ) -> LLMServerManager:
        """Start every replica in parallel, register them with the balancer and start the health monitor.

        hybrid / colocated: `pool` is the RayResourcePool to place on (the trainer's for hybrid) and the replica
        count follows from its size. standalone: `num_devices` slots, each replica in its own new pool.
        `wait=False` returns once the engines are launching (the balancer exists, no replica is registered yet):
        the caller starts other parts meanwhile and calls `wait_started()` before any request or control call.
        """
        manager = cls(spec, mode, start_timeout_s, policy, pd, pd_base_port)
        if manager.mode is RolloutMode.STANDALONE:
            if num_devices is None:
                raise ValueError("a standalone rollout pool needs num_devices (rollout.nnodes × n_gpus_per_node)")
        elif pool is None:
            raise ValueError(f"a {manager.mode.value} rollout needs the resource pool to place its replicas on")
        else:
            num_devices = pool.world_size if num_devices is None else num_devices
        count = replica_count(num_devices, manager.replica_devices)
        manager._starting = manager._launch_new(count, pool)
        if wait:
            manager.wait_started()
        return manager

    def wait_started(self) -> None:
        """Finish `create(wait=False)`: wait for the replicas' engines, register them, start the health monitor."""
        starting, self._starting = self._starting, None
        if starting is not None:
            self._register(*starting)
            self.start_monitor()

    @property
    def replica_devices(self) -> int:
        """Device slots of one replica: its footprint, or a PD replica's members' slots."""
        return self.pd.devices if self.pd is not None else self.spec.footprint.devices

    def _new_replica(self, rank: int) -> Any:
        if self.pd is None:
            return RolloutReplica(rank, self.spec, self.mode)
        from mrl.rollout.pd_members import PDReplica

        return PDReplica(rank, self.spec, self.pd, base_port=self.pd_base_port + 16 * rank)

    def _launch(self, replica: RolloutReplica, pool: Any) -> ray.ObjectRef:
        if self.mode is RolloutMode.STANDALONE:
            return replica.init_standalone()
        if self.mode is RolloutMode.HYBRID:
            return replica.init_hybrid(pool)
        return replica.init_colocated(pool)

    def _start(self, new: list[RolloutReplica], pool: Any) -> None:
        """Start replicas in parallel; on failure or timeout stop them all and raise."""
        self._wait_for(new, [self._launch(replica, pool) for replica in new])

    def _wait_for(self, new: list[RolloutReplica], starts: list[ray.ObjectRef]) -> None:
        try:
            ray.get(starts, timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            for replica in new:
                replica.shutdown(timeout_s=5)
            raise TimeoutError(
                f"{len(new)} rollout replica(s) did not start within {self.start_timeout_s:g} s: either the engine "
                f"is slow to load or its slot's resources ({self.mode.value} mode) are taken; cluster free: "
                f"{ray.available_resources()}"
            ) from error
        except Exception:
            for replica in new:
                replica.shutdown()
            raise

    def add_replicas(self, count: int, pool: Any = None) -> list[int]:
        """Start `count` more replicas (in parallel) and put them behind the balancer; returns their ranks."""
        return self._register(*self._launch_new(count, pool))

    def _launch_new(self, count: int, pool: Any) -> tuple[list[RolloutReplica], list[ray.ObjectRef], Any]:
        """Launch `count` more replicas without waiting: (replicas, refs to their start times, pool)."""
        new = [self._new_replica(self._next_rank + i) for i in range(count)]
        self._next_rank += count
        return new, [self._launch(replica, pool) for replica in new], pool

    def _register(self, new: list[RolloutReplica], starts: list[ray.ObjectRef], pool: Any) -> list[int]:
        """Wait for launched replicas to serve, then put them behind the balancer; returns their ranks."""
        self._wait_for(new, starts)
        with self._lock:
            for replica in new:
                self._call(self.balancer.add_server.remote(replica.server_id, replica.server))
                self.replicas[replica.replica_rank] = replica
                self._pools[replica.replica_rank] = pool
                self.restarts[replica.replica_rank] = 0
        return [r.replica_rank for r in new]

    def remove_replica(self, rank: int) -> list[str]:
        """Unregister (so no new call reaches it), then stop it; returns the sessions that will re-route."""
        with self._lock:
            replica = self.replicas.pop(rank)
            self._pools.pop(rank, None)
        orphans = self._call(self.balancer.remove_server.remote(replica.server_id))
        replica.shutdown()
        return orphans

    # ---- health: detect, replace, re-sync ----------------------------------------------------------------
    def start_monitor(self) -> None:
        """Probe the replicas every `health_check_interval_s` in a driver thread (0 or less: no monitor)."""
        if self.policy.health_check_interval_s <= 0 or self._monitor is not None:
            return
        self._stop.clear()
        self._monitor = threading.Thread(target=self._watch, name="mrl-rollout-health", daemon=True)
        self._monitor.start()

    def stop_monitor(self) -> None:
        if self._monitor is not None:
            self._stop.set()
            self._monitor.join()
            self._monitor = None

    def _watch(self) -> None:
        while not self._stop.wait(self.policy.health_check_interval_s):
            try:
                self.check_replicas()
            except Exception:  # the next round tries again; a broken pool shows in the failed calls themselves
                log.exception("rollout health check failed")

    def check_replicas(self) -> list[int]:
        """One health round: replace the replicas that are dead, report a dead engine or hang; let healthy but
        unregistered ones (a client saw a transient failure, a replacement that lost a race with a weight sync)
        re-join once they hold the newest weights. Returns the ranks replaced."""
        with self._lock:
            replicas = dict(self.replicas)
        probes = {rank: replica.health() for rank, replica in replicas.items()}
        if not probes:
            return []
        timeout = self.policy.health_check_timeout_s
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout)
        serving = set(self._call(self.balancer.servers.remote()))
        replaced = []
        for rank, probe in probes.items():
            if self._stop.is_set():
                break
            problem = None
            if probe not in ready:
                problem = f"health check not answered within rollout.health_check_timeout_s={timeout:g} s"
            else:
                try:
                    health = ray.get(probe)
                except Exception as error:
                    cause = getattr(error, "cause", None) or error  # a task error's own header names no reason
                    problem = f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause) else ''}"
            if problem is not None:
                self._replace(rank, replicas[rank], problem)
                replaced.append(rank)
            elif replicas[rank].server_id not in serving:
                self._join(replicas[rank], health)
        return replaced

    def _replace(self, rank: int, old: RolloutReplica, problem: str) -> None:
        self.failures.append(f"replica {rank} ({old.server_id}): {problem}")
        log.warning("rollout replica %d (%s) failed: %s", rank, old.server_id, problem)
        self._call(self.balancer.remove_server.remote(old.server_id))
        old.shutdown(timeout_s=5)
        with self._lock:
            if self.replicas.get(rank) is not old:  # removed meanwhile
                return
            if self.restarts[rank] >= self.policy.max_replica_restarts:
                del self.replicas[rank]
                log.error("rollout replica %d dropped: rollout.max_replica_restarts=%d reached", rank,
                          self.policy.max_replica_restarts)
                return
        new, started = self._new_replica(rank), False
        try:
            self._start([new], self._pools.get(rank))
            started = True
        finally:  # a failed start counts too, so a replica that cannot start is dropped after the limit
            with self._lock:
                self.restarts[rank] += 1
                if started:
                    self.replicas[rank] = new
        self._join(new, self._call(new.health()))

    def _join(self, replica: RolloutReplica, health: dict[str, Any]) -> None:
        """Re-sync `replica` to the newest recorded weights, give it the pool's state and register it. A weight
        sync that records newer weights meanwhile makes the registration fail; then sync again."""
        if health.get("asleep"):
            self._call(replica.wake_up(None))
        version = health["version"]
        for _ in range(3):
            latest, weights = self._call(self.balancer.latest_weights.remote())
            if latest is not None and version != latest:
                if weights is None:  # a transport sent them and kept no copy: take the next push, then join
                    self._call(self.balancer.add_pending.remote(replica.server_id, replica.server))
                    return
                self._call(replica.update_weights(weights, latest))
                version = latest
            with self._lock:
                if self.replicas.get(replica.replica_rank) is not replica:  # removed or replaced meanwhile
                    return
                self._copy_state(replica)
                if self._call(self.balancer.add_server_at.remote(replica.server_id, replica.server, version)):
                    log.warning("rollout replica %d (%s) serves again at weights version %s",
                                replica.replica_rank, replica.server_id, version)
                    return
        log.warning("rollout replica %d not re-joined: weights kept changing; next health round", replica.replica_rank)

    def _copy_state(self, replica: RolloutReplica) -> None:
        level, asleep = self._asleep
        if level:
            self._call(replica.sleep(level))
            awake = [tag for tag in WAKE_ORDER if tag not in asleep]
            if awake:
                self._call(replica.wake_up(awake))
        elif asleep:
            self._call(replica.release_kv_cache())
        self._call(replica.abort_all() if self._paused else replica.resume_generation())

    def _call(self, ref: ray.ObjectRef) -> Any:
        return ray.get(ref, timeout=self.policy.control_timeout_s)

    def client(self, fully_async: bool = False) -> LLMServerClient:
        return (FullyAsyncLLMServerClient if fully_async else LLMServerClient)(self.balancer, self.policy)

    # ---- fan-out control ------------------------------------------------------------------------------
    def _fan_out(self, method: str, handles: dict[str, Any], *args: Any) -> dict[str, Any]:
        """Call `method` on every server of `handles`; skip (and unregister) servers that died meanwhile, raise
        if one hangs past control_timeout_s or none answered."""
        refs = {sid: getattr(h, method).remote(*args) for sid, h in handles.items()}
        if not refs:  # every replica is restarting; each re-syncs and copies the pool state before it serves
            return {}
        wait_within(refs, self.policy.control_timeout_s, f"rollout {method} on replicas", "rollout.control_timeout_s")
        results, dead = {}, []
        for sid, ref in refs.items():
            try:
                results[sid] = ray.get(ref)
            except Exception as error:
                if not replica_failed(error):
                    raise
                dead.append(sid)
                self._call(self.balancer.remove_server.remote(sid))
        if dead and not results:
            raise RuntimeError(f"rollout {method}: every replica failed ({dead}); the health monitor restarts them")
        return results

    def _all(self, method: str, *args: Any) -> list[Any]:
        with self._lock:  # a replica re-joining copies the pool state under the same lock
            handles = self._call(self.balancer.handles.remote())
            return list(self._fan_out(method, handles, *args).values())

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        transport: str | None = None,
        timeout_s: float = 600.0,
        **sender_kwargs: Any,
    ) -> list[int]:
        """Load the HF-named stream into every registered replica, stamped `version`; returns tensors loaded per
        replica.

        `transport` (ipc | nccl | disk, mrl/weight_sync): this process becomes rank 0 of a sync group with every
        rollout worker and sends the stream once; each wait is bounded by `timeout_s` (weight_sync.timeout_s).
        None: pack safetensors buckets into Ray's object store once and let every replica pull them; the balancer
        keeps those refs (one copy of the weights) to re-sync restarted replicas, which a transport cannot.
        """
        if transport is None:
            refs = [ray.put(blob) for blob in pack_buckets(named_tensors, bucket_bytes)]
            handles = self._call(self.balancer.record_weights.remote(version, refs))
            return list(self._fan_out("update_weights", handles, refs, version).values())
        fp = self.spec.footprint
        if fp.dp > 1:
            raise ValueError(f"weight_sync.transport={transport} with rollout.data_parallel_size={fp.dp}: the "
                             "transports reach TP×PP workers of one engine; use more replicas instead of DP")
        per = self.replica_devices  # receivers per replica (a PD replica's members in slot order): the full stream
        handles = self.servers_for_transport_sync(version)
        serves = (transport, tuple(handles), per, bucket_bytes, timeout_s, tuple(sorted(sender_kwargs.items())))
        sender = self._sync_sender(serves, lambda: make_sender(
            transport, 1 + per * len(handles), bucket_bytes, timeout_s, **sender_kwargs))
        spec = sender.prepare()
        try:
            refs = {sid: h.receive_weights.remote(spec, 1 + i * per, version)
                    for i, (sid, h) in enumerate(handles.items())}
            sender.init_process_group()
            sender.send_weights(named_tensors)
            wait_within(refs, timeout_s, f"weight sync ({transport}) receive and load on replicas", TIMEOUT_KNOB)
            counts = ray.get(list(refs.values()))
            sender.finalize()
        except BaseException:
            self._kept_sender = None
            sender.finalize(wait=False)  # tears the group down on both sides: the next sync builds a new one
            raise
        return counts

    def load_lora_adapter(self, path: str, version: int) -> list[int]:
        """Every registered replica serves the PEFT adapter folder `path` (on one node's disk) from now on, stamped
        `version`; no copy is kept: a restarted replica waits for the next sync, as after a transport sync."""
        handles = self.servers_for_transport_sync(version)
        return list(self._fan_out("load_lora_adapter", handles, path, version).values())

    def servers_for_transport_sync(self, version: int) -> dict[str, Any]:
        """Record `version` as the newest weights, with no copy kept (a transport sends them once), and return the
        servers to push them to (registered and pending)."""
        return self._call(self.balancer.record_weights.remote(version, None))

    def _sync_sender(self, serves: tuple, make: Callable[[], WeightSender]) -> WeightSender:
        """The last sync's sender if it kept its group for the same replicas and settings (`serves`; a restarted
        replica has a new server id); otherwise a new one, the kept one torn down."""
        if self._kept_sender is not None and self._kept_sender[0] == serves:
            return self._kept_sender[1]
        self.release_sync_group()
        sender = make()
        if sender.keeps_group:
            self._kept_sender = (serves, sender)
        return sender

    def read_weights(self) -> list[dict[str, torch.Tensor]]:
        """Every replica's parameters in the engine's names (checks that a sync delivered the export exactly)."""
        from safetensors.torch import load

        return [load(packed) for packed in self._all("read_weights")]

    def load_stats(self) -> list[dict[str, Any]]:
        """How the last transport sync loaded, per engine (a PD replica's members each): vLLM says whether it went
        straight into the parameters (`direct`) or layer by layer, and why."""
        return [s for each in self._all("load_stats") for s in (each if isinstance(each, list) else [each])]

    def abort_all(self) -> list[int]:
        with self._lock:
            self._paused = True
            return self._all("abort_all")

    def resume_generation(self) -> None:
        with self._lock:
            self._paused = False
            self._all("resume_generation")

    def sleep(self, level: int = 2) -> None:
        with self._lock:
            self._asleep = (level, frozenset(WAKE_ORDER))
            self._all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        with self._lock:
            level, asleep = self._asleep
            remaining = asleep - set(WAKE_ORDER if tags is None else tags)
            self._asleep = (level if remaining else 0, frozenset(remaining))
            self._all("wake_up", tags)

    def release_kv_cache(self) -> None:
        with self._lock:
            level, asleep = self._asleep
            self._asleep = (level, asleep | {"kv_cache"})
            self._all("release_kv_cache")

    def resume_kv_cache(self) -> None:
        self.wake_up(["kv_cache"])

    def clear_kv_cache(self) -> None:
        self._all("clear_kv_cache")

    def health(self) -> dict[str, dict[str, Any]]:
        handles = self._call(self.balancer.handles.remote())
        return self._fan_out("health", handles)

    @property
    def kept_sync_group(self) -> str | None:
        """The id of the sync group kept for the next transport sync (weight_sync.keep_group), if any."""
        return getattr(self._kept_sender[1], "group_id", None) if self._kept_sender is not None else None

    def release_sync_group(self) -> None:
        """Tear down a kept sync group (the replicas drop theirs when the next sync names another)."""
        if self._kept_sender is not None:
            self._kept_sender[1].finalize(wait=False)
            self._kept_sender = None

    def shutdown(self) -> None:
        self.stop_monitor()
        starting, self._starting = self._starting, None
        for replica in starting[0] if starting is not None else []:  # start-up failed before wait_started
            replica.shutdown(timeout_s=5)
        self.release_sync_group()
        ranks = list(self.replicas)
        if ranks:  # each engine's shutdown waits on its own processes: stop them all at once
            with ThreadPoolExecutor(max_workers=len(ranks), thread_name_prefix="mrl-replica-stop") as pool:
                list(pool.map(self.remove_replica, ranks))
        ray.kill(self.balancer)
