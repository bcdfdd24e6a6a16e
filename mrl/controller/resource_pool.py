"""`RayResourcePool`: device slots reserved as Ray placement groups.

One placement group per node (STRICT_PACK keeps its bundles on one machine), one bundle per device slot:
{"CPU": cpus_per_slot, "GPU": 1} on GPU clusters, {"CPU": cpus_per_slot} where CPU bundles stand in for devices.
Up to `max_colocate_count` workers share a slot, each asking 1 / max_colocate_count of its GPU and CPU.
Ray keeps an unschedulable placement group pending forever, so creation waits with a timeout and then fails
with the resources that are missing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class ResourcePoolUnschedulable(RuntimeError):
    pass


class RayResourcePool:
    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = True,
        max_colocate_count: int = 1,
        cpus_per_slot: float = 1.0,
        name_prefix: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """process_on_nodes[i]: device slots on node i (e.g. [8, 8] for two 8-GPU nodes)."""
        if not process_on_nodes or any(n < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes needs positive slot counts per node, got {list(process_on_nodes)}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.cpus_per_slot = cpus_per_slot
        self.name_prefix = name_prefix or f"mrl_pool_{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self._pgs: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_slot, "GPU": 1} if self.use_gpu else {"CPU": self.cpus_per_slot}

    def worker_resources(self) -> dict[str, float]:
        """Ray actor options of one worker: its 1 / max_colocate_count share of a slot."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.cpus_per_slot * share, "num_gpus": share if self.use_gpu else 0}

    def slots(self) -> list[tuple[PlacementGroup, int]]:
        """(placement group, bundle index) per rank, node by node."""
        pgs = self.get_placement_groups()
        return [(pg, i) for pg, n in zip(pgs, self.process_on_nodes) for i in range(n)]

    def get_placement_groups(self) -> list[PlacementGroup]:
        """Create (once) and wait for the placement groups; raise ResourcePoolUnschedulable after timeout_s."""
        if self._pgs is not None:
            return self._pgs
        pgs = [
            placement_group([self.bundle] * n, strategy="STRICT_PACK", name=f"{self.name_prefix}_node{i}")
            for i, n in enumerate(self.process_on_nodes)
        ]
        start = time.monotonic()
        refs = [pg.ready() for pg in pgs]
        _, pending = ray.wait(refs, num_returns=len(pgs), timeout=self.timeout_s)
        if pending:
            waited = time.monotonic() - start
            stuck = [(i, self.process_on_nodes[i]) for i, ref in enumerate(refs) if ref in pending]
            message = self._unschedulable_message(stuck, waited)
            for pg in pgs:
                remove_placement_group(pg)  # a pending group would keep asking for the resources forever
            raise ResourcePoolUnschedulable(message)
        self._pgs = pgs
        return pgs

    def _unschedulable_message(self, stuck: list[tuple[int, int]], waited: float) -> str:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        available = ray.available_resources()
        lines = []
        for i, n in stuck:
            demand = {k: v * n for k, v in self.bundle.items()}
            largest = {k: max((node.get(k, 0) for node in nodes), default=0) for k in demand}
            never = {
                k: f"needs {demand[k]:g}, largest node has {largest[k]:g}" for k in demand if demand[k] > largest[k]
            }
            busy = {
                k: f"needs {demand[k]:g}, {available.get(k, 0):g} free"
                for k in demand
                if demand[k] > available.get(k, 0)
            }
            shortage = never or busy or {"?": "resources exist but not together on one node"}
            reason = "; ".join(f"{k}: {why}" for k, why in shortage.items())
            lines.append(f"  node {i}: {n} bundles of {self.bundle} (STRICT_PACK, one node) — missing {reason}")
        return (
            f"resource pool {self.name_prefix!r} not schedulable within {waited:.1f} s "
            f"(timeout {self.timeout_s:g} s):\n" + "\n".join(lines)
        )

    def remove(self) -> None:
        """Release the placement groups (the pool's workers should be gone first)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None


def node_ip(pg: PlacementGroup, bundle_index: int) -> str:
    """IP address of the node that holds bundle `bundle_index` of a ready placement group."""
    from ray.util.placement_group import placement_group_table

    node_id = placement_group_table(pg)["bundles_to_node_id"][bundle_index]
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def placement_options(pool: RayResourcePool, pg: PlacementGroup, bundle_index: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        **pool.worker_resources(),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index
        ),
    }
