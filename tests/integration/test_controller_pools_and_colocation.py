"""Resource pools and colocation on Ray: two roles in one actor give two group views over the same processes,
each view with its own methods and meshes; workers of two groups share device slots through fractional GPU
shares; an unschedulable pool fails within its timeout naming the missing resources."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

from mrl.controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolUnschedulable,
    Worker,
    WorkerGroupStartTimeout,
    create_colocated_worker_cls,
    nd_compute,
    register,
)

pytestmark = pytest.mark.integration


def gpu_ids() -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


class ActorRole(Worker):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.register_mesh("train", {"dp": 2})

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple:
        return ("actor", os.getpid(), self.rank, self.lr, os.environ["MASTER_PORT"], gpu_ids())

    @register(nd_compute("train"))
    def update(self, rows: list) -> list:
        return [("actor", self.rank, r) for r in rows]


class CriticRole(Worker):
    def __init__(self) -> None:
        super().__init__()
        # Same mesh name as the actor role, different layout: a two-stage pipeline, one DP group.
        self.register_mesh("train", {"pp": 2})

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple:
        return ("critic", os.getpid(), self.rank, None, os.environ["MASTER_PORT"], gpu_ids())

    @register(nd_compute("train"))
    def update(self, rows: list) -> list:
        return [("critic", self.rank, r) for r in rows]


class SlotProbe(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def gpu_ids(self) -> list:
        return gpu_ids()

    @register(Dispatch.ONE_TO_ALL)
    def master_addr(self) -> str:
        return os.environ["MASTER_ADDR"]


@pytest.fixture(scope="module")
def shared_pool(ray_cluster):
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Logical GPUs (declared by the session fixture) make the fractional-share path real on a CPU machine.
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=2, cpus_per_slot=0.5, timeout_s=60)
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def colocated(shared_pool):
    cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(ActorRole, lr=0.5), "critic": CriticRole})
    wg = RayWorkerGroup(shared_pool, cls)
    yield wg
    wg.kill()


def test_colocated_spawn_gives_two_views_over_the_same_actors(colocated):
    views = colocated.spawn({"actor", "critic"})
    actor, critic = views["actor"].whoami(), views["critic"].whoami()
    assert [a[0] for a in actor] == ["actor"] * 2 and [c[0] for c in critic] == ["critic"] * 2
    assert [a[1] for a in actor] == [c[1] for c in critic]  # same PIDs
    assert len({a[1] for a in actor}) == 2
    assert [a[2] for a in actor] == [0, 1] and actor[0][3] == 0.5
    assert len({a[4] for a in actor + critic}) == 1  # rank 0 chose one port for every role
    assert colocated.actor_whoami() == actor  # the full group exposes the prefixed methods


def test_role_views_dispatch_with_their_own_meshes(colocated):
    views = colocated.spawn(["actor", "critic"])
    # actor: dp=2, one row per rank; critic: pp=2, one DP group, collected from the last stage (rank 1)
    assert views["actor"].update(["x", "y"]) == [("actor", 0, "x"), ("actor", 1, "y")]
    assert views["critic"].update(["x", "y"]) == [("critic", 1, "x"), ("critic", 1, "y")]
    with pytest.raises(KeyError, match="no role"):
        colocated.spawn(["reward"])


def test_second_group_shares_device_slots_through_fractional_gpus(shared_pool, colocated):
    # master_addr=None: the rendezvous address is the IP of the node holding rank 0
    probe = RayWorkerGroup(shared_pool, RayClassWithInitArgs(SlotProbe), master_addr=None)
    try:
        colocated_ids = [a[5] for a in colocated.actor_whoami()]
        probe_ids = probe.gpu_ids()
        assert probe_ids == colocated_ids  # rank r of both groups sits on the same (logical) GPU
        assert len({tuple(ids) for ids in probe_ids}) == 2
        node_ips = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert set(probe.master_addr()) <= node_ips and len(set(probe.master_addr())) == 1
    finally:
        probe.kill()


def test_group_beyond_max_colocate_count_fails_instead_of_hanging(shared_pool, colocated):
    extra = RayWorkerGroup(shared_pool, RayClassWithInitArgs(SlotProbe))  # fills the second half of each slot
    try:
        start = time.monotonic()
        with pytest.raises(WorkerGroupStartTimeout, match="max_colocate_count=2"):
            RayWorkerGroup(shared_pool, RayClassWithInitArgs(SlotProbe), start_timeout_s=2)
        assert time.monotonic() - start < 10
        assert len(extra.gpu_ids()) == 2  # the groups already there keep working
    finally:
        extra.kill()


class FailsOnRankOne(Worker):
    def __init__(self) -> None:
        super().__init__()
        if self.rank == 1:
            raise ValueError("bad init on rank 1")


def test_worker_constructor_error_is_raised_at_group_creation(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, cpus_per_slot=0.1, timeout_s=60)
    try:
        with pytest.raises(ray.exceptions.RayActorError, match="bad init on rank 1"):
            RayWorkerGroup(pool, RayClassWithInitArgs(FailsOnRankOne), name_prefix="fails_on_rank_one")
        time.sleep(1)  # ray.kill is asynchronous
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if "fails_on_rank_one" in str(a)]
        assert alive == []
    finally:
        pool.remove()


def test_unschedulable_pool_fails_within_timeout_naming_missing_resources(ray_cluster):
    gpus = int(ray_cluster.cluster_resources()["GPU"])
    pool = RayResourcePool([gpus + 1], use_gpu=True, cpus_per_slot=0.1, timeout_s=2)
    start = time.monotonic()
    with pytest.raises(ResourcePoolUnschedulable) as err:
        pool.get_placement_groups()
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert f"GPU: needs {gpus + 1}, largest node has {gpus}" in message
    assert "CPU" not in message.split("missing", 1)[1]  # CPU is not the missing resource
