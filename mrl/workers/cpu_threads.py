"""Compute threads of the trainer's workers on a device slot of a CPU-only host.

A CPU slot stands in for a device and its cores are shared by everything placed on it. With a hybrid rollout the
workers and the slot's engine take turns (generate, then old log-prob / update / weight export), so the workers
may use every core of the slot while the engine waits; with one thread each, one of two cores idled through the
whole training phase (measured: tools/bench/e2e_vs_trl.py). Standalone and colocated engines generate while the
workers train, so the workers keep one thread there. The rollout engine's server gets the same count
(OMP_NUM_THREADS, `engine_env`): a one-device vLLM engine runs its model in its engine-core process on CPU
(rollout_adapters/vllm/adapter.py), which computes with those threads and blocks while the trainer trains. On a
GPU host the device does the work and each worker keeps one thread.
"""

from __future__ import annotations

import os

from mrl.config.schema import MrlConfig


def host_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(c: MrlConfig, use_gpu: bool) -> int:
    """Intra-op threads of a trainer worker: 1 on GPU hosts; else `resources.cpu_threads_per_slot`, or (0) the
    node's cores divided by its device slots when the rollout is hybrid, 1 otherwise."""
    if use_gpu:
        return 1
    if c.resources.cpu_threads_per_slot > 0:
        return c.resources.cpu_threads_per_slot
    if c.rollout.mode != "hybrid":
        return 1
    return max(1, host_cores() // c.resources.n_gpus_per_node)


def engine_env(c: MrlConfig, use_gpu: bool) -> dict[str, str]:
    """Environment of a rollout server on a CPU host: the slot's compute threads (Ray would set 1) and, for a
    multi-rank vLLM-CPU engine, its ranks' cores (it refuses to guess them on a single NUMA node)."""
    if use_gpu:
        return {}
    env = {"OMP_NUM_THREADS": str(worker_threads(c, use_gpu))}
    ranks = c.rollout.tensor_model_parallel_size * c.rollout.pipeline_model_parallel_size
    if ranks > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores_per_rank(ranks)
    return env


def cores_per_rank(ranks: int) -> str:
    """vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND: this host's cores cut into `ranks` contiguous groups ("0|1",
    "0,1|2,3"); with fewer cores than ranks, ranks share them round robin."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    per = len(cores) // ranks
    groups = [cores[r * per:(r + 1) * per] for r in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)
