"""Rollout: replicas of an inference backend, the manager that creates them, the global load balancer and the
clients agent loops call (token in, token out). Backends live in `rollout_adapters/`."""

from mrl.rollout.client import FullyAsyncLLMServerClient, LLMServerClient, TrajectoryOutput
from mrl.rollout.load_balancer import LoadBalancer
from mrl.rollout.manager import LLMServerManager, replica_count
from mrl.rollout.replica import Footprint, ReplicaSpec, RolloutMode, RolloutReplica
from rollout_adapters.base import TokenOutput

__all__ = [
    "Footprint",
    "FullyAsyncLLMServerClient",
    "LLMServerClient",
    "LLMServerManager",
    "LoadBalancer",
    "ReplicaSpec",
    "RolloutMode",
    "RolloutReplica",
    "TokenOutput",
    "TrajectoryOutput",
    "replica_count",
]
